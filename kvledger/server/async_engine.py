"""One engine loop for the whole server: continuous batching across clients.

The engine (:class:`kvledger.engine.llm_engine.LLMEngine`) is synchronous and owned by a
single asyncio task. Between steps that task applies what handlers asked for (new requests,
aborts); each ``step()`` runs on the process's one engine thread
(:mod:`kvledger.server.engine_thread`, where the server also loads the model) so the event loop
keeps serving sockets while the model computes. Every running request, from every client, advances in the same
step. Outputs go to one ``asyncio.Queue`` per request.

Requests leave the engine the moment they finish, or at the next step boundary once their
client is gone (``abort``), so their KV blocks return to the pool at once. Admission is
bounded: the engine runs up to ``max_num_seqs`` requests and ``max_waiting`` more may wait
behind them; beyond ``max_num_seqs + max_waiting`` requests in the server, ``add`` raises
:class:`QueueFullError` (the server answers 503 with ``Retry-After``).

A request whose own work fails in a step (the engine's output carries an ``error``) ends with
:class:`RequestFailedError`; the rest of the step carries on. A step that fails as a whole (the
model raised) ends the requests in flight with :class:`EngineDeadError`, and the loop goes on
serving. :meth:`AsyncEngine.drain` is the graceful shutdown: no new requests, those in flight
get up to a deadline to finish, the rest end with a 503 :class:`RequestFailedError`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable

from kvledger.errors import KVLedgerError
from kvledger.server.engine_thread import engine_thread

log = logging.getLogger("kvledger.server")

HISTORY_INTERVAL_S = 0.25  # dashboard samples at most this often (seconds)
HISTORY_LEN = 4800  # samples kept for the dashboard (20 min at one per 0.25 s)


class QueueFullError(Exception):
    """The waiting queue is full; try again later."""


class RequestFailedError(Exception):
    """The engine could not complete a request it had accepted. ``status`` is the HTTP status to
    answer with: 500 for a failure inside the engine, 503 when the server is shutting down."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class EngineDeadError(RequestFailedError):
    """The engine loop failed (or is not running); the request could not complete."""


@dataclass
class Delta:
    """What one engine step added to a request: its text, and whether it ended."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_output_tokens: int = 0  # total generated so far


@dataclass(eq=False)
class RequestStream:
    """The server side of one request: its queue of :class:`Delta` and its timings (perf_counter s)."""

    request_id: str
    num_prompt_tokens: int
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _PendingAdd:
    stream: RequestStream
    prompt_token_ids: list[int]
    sampling_params: Any
    done: asyncio.Future


class AsyncEngine:
    """Drives one synchronous engine from asyncio; see the module docstring."""

    def __init__(self, engine: Any, *, max_waiting: int = 1024) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_running = int(engine.config.max_num_seqs)
        self.accepting = True  # False once drain() began: new requests get 503
        self._drain_deadline = 0.0  # time.monotonic() at which drain() ends what is left
        self.metrics: Any = None  # a ServerMetrics, attached by the app
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: set[str] = set()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None
        self._snapshot: dict[str, Any] = {}
        self._added_since_snapshot = 0  # handed to the engine, not yet in a ledger snapshot (count as waiting)
        self._last_sample = 0.0
        self.history: collections.deque = collections.deque(maxlen=HISTORY_LEN)
        self.num_steps = 0
        self._take_snapshot(force_sample=True)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop on the running event loop (call from the server's startup)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvledger-engine-loop")
            self._ticker = asyncio.create_task(self._tick(), name="kvledger-ledger-ticker")

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def drain(self, timeout_s: float) -> int:
        """Graceful shutdown: refuse new requests, let those in flight finish for up to
        ``timeout_s`` seconds (0: not at all), then end the rest with a 503
        :class:`RequestFailedError`. Returns how many were ended that way."""
        self.accepting = False
        self._drain_deadline = time.monotonic() + max(0.0, timeout_s)
        while self.num_in_flight() and time.monotonic() < self._drain_deadline and self.is_running:
            await asyncio.sleep(0.05)
        async with self._lock:  # between steps
            ended = self.num_in_flight()
            self._fail_all("the server is shutting down; the request was ended before it finished",
                           RequestFailedError, 503)
            self._take_snapshot(force_sample=True)
        return ended

    def end_drain(self) -> None:
        """Cut a :meth:`drain` in progress short: what is still in flight ends now."""
        self._drain_deadline = 0.0

    async def stop(self) -> None:
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._task = self._ticker = None
        self._fail_all("the server is shutting down", RequestFailedError, 503)

    # --- what handlers call --------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests waiting for a place in the running batch, plus those not yet handed over."""
        return int(self._snapshot.get("num_waiting", 0)) + self._added_since_snapshot + len(self._pending_adds)

    def num_in_flight(self) -> int:
        """Requests in the server: in the engine (running or waiting) or not yet handed over."""
        return len(self._streams) + len(self._pending_adds)

    async def add(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                  arrival_time: float | None = None) -> RequestStream:
        """Queue a request for the next step; returns its stream once the engine accepted it.
        ``arrival_time``: when the server received it (``time.perf_counter()`` seconds; now if not
        given), the start of its TTFT and E2E latency and the engine's ``arrival_time``.

        Raises :class:`QueueFullError` when ``max_num_seqs + max_waiting`` requests are already in
        the server (a full batch and a full queue behind it), :class:`RequestFailedError` (503)
        once the server is shutting down, and the engine's :class:`KVLedgerError` (with the
        numbers) when the request can never fit.
        """
        if not self.accepting:
            raise RequestFailedError("the server is shutting down; send the request elsewhere", status=503)
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        in_flight = self.num_in_flight()
        if in_flight >= self.max_running + self.max_waiting:
            raise QueueFullError(f"{in_flight - self.max_running} requests are already waiting behind "
                                 f"{self.max_running} running (--max-num-seqs {self.max_running}, "
                                 f"--max-waiting-requests {self.max_waiting}); retry later")
        stream = RequestStream(request_id, len(prompt_token_ids),
                               time.perf_counter() if arrival_time is None else arrival_time)
        done = asyncio.get_running_loop().create_future()
        self._pending_adds.append(_PendingAdd(stream, prompt_token_ids, sampling_params, done))
        self._wake.set()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (no-op if the request already finished)."""
        if request_id in self._streams or any(p.stream.request_id == request_id for p in self._pending_adds):
            self._pending_aborts.add(request_id)
            self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """The ledger after the latest step (a dict of KVLedger fields, ``num_waiting`` included)."""
        snap = dict(self._snapshot)
        snap["num_waiting"] = self.num_waiting()
        return snap

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` between steps, when nothing else touches the engine."""
        async with self._lock:
            return fn(self.engine)

    def hold(self) -> asyncio.Lock:
        """``async with aengine.hold():`` no step runs inside the block (a consistent view)."""
        return self._lock

    # --- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            try:
                async with self._lock:
                    await self._iteration()
            except Exception as err:  # a bug: fail the requests in flight, keep serving the next ones
                log.exception("engine step failed")
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}")
                await asyncio.sleep(0.1)
            await asyncio.sleep(0)  # let handlers run between steps

    async def _iteration(self) -> None:
        """Apply adds and aborts, run one step on the engine thread, hand out its outputs."""
        self._apply_pending()
        if self.engine.has_unfinished_requests():
            outputs = await asyncio.get_running_loop().run_in_executor(engine_thread(), self.engine.step)
            self.num_steps += 1
            self._dispatch(outputs)
        self._take_snapshot()
        if not (self._pending_adds or self._pending_aborts or self.engine.has_unfinished_requests()):
            self._wake.clear()

    async def _tick(self) -> None:
        """Keep the dashboard's history moving while the engine is idle."""
        while True:
            await asyncio.sleep(HISTORY_INTERVAL_S)
            self._sample_if_due()

    def _apply_pending(self) -> None:
        """Aborts first, then adds. An add stays in ``_pending_adds`` until it is answered, so if
        anything here raises, :meth:`_fail_all` still answers every add not yet handled."""
        aborts, self._pending_aborts = self._pending_aborts, set()
        for rid in aborts:
            if rid in self._streams:
                self.engine.abort_request(rid)
                del self._streams[rid]
                if self.metrics is not None:
                    self.metrics.request_finished("abort")
        while self._pending_adds:
            self._add(self._pending_adds[0], aborts)
            self._pending_adds.pop(0)

    def _add(self, p: _PendingAdd, aborts: set[str]) -> None:
        rid = p.stream.request_id
        if rid in aborts or p.done.cancelled():
            if not p.done.done():
                p.done.cancel()
            return
        try:
            self.engine.add_request(rid, p.prompt_token_ids, p.sampling_params, arrival_time=p.stream.arrival)
        except KVLedgerError as err:
            p.done.set_exception(err)
            return
        except Exception as err:  # a bug: report it to this request only
            log.exception("add_request failed")
            p.done.set_exception(EngineDeadError(f"the engine could not take the request: {err}"))
            return
        self._streams[rid] = p.stream
        self._added_since_snapshot += 1
        p.done.set_result(None)

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            new_ids = list(out.new_token_ids)
            if not new_ids and not out.finished:
                continue  # a prefill chunk: nothing to send yet
            if new_ids:
                if stream.first_token is None:
                    stream.first_token = now
                    if m is not None:
                        m.ttft.observe(now - stream.arrival)
                        m.prompt_tokens.inc(stream.num_prompt_tokens)
                elif m is not None:
                    m.itl.observe(now - stream.last_token)
                stream.last_token = now
                stream.num_output_tokens += len(new_ids)
                if m is not None:
                    m.generation_tokens.inc(len(new_ids))
            if out.finished:
                del self._streams[out.request_id]
                if m is not None:
                    m.e2e.observe(now - stream.arrival)
                    m.request_finished(out.finish_reason or "stop")
            if out.error is not None:  # this request failed in the step; the others did not
                stream.queue.put_nowait(RequestFailedError(out.error))
                continue
            stream.queue.put_nowait(Delta(out.text_delta, out.finished, out.finish_reason if out.finished else None,
                                          stream.num_output_tokens))

    def _fail_all(self, message: str, kind: type[RequestFailedError] = EngineDeadError, status: int = 500) -> None:
        """End every request in flight and every add not yet answered with ``kind(message, status)``."""
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort after a failed step")
            stream.queue.put_nowait(kind(message, status))
        self._streams.clear()
        for p in self._pending_adds:
            if not p.done.done():
                p.done.set_exception(kind(message, status))
        self._pending_adds.clear()
        self._pending_aborts.clear()

    def _take_snapshot(self, force_sample: bool = False) -> None:
        self._snapshot = asdict(self.engine.ledger())  # num_waiting: the engine's; snapshot() adds the handlers'

        self._added_since_snapshot = 0
        self._sample_if_due(force_sample)

    def _sample_if_due(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_sample < HISTORY_INTERVAL_S:
            return
        s = self.snapshot()
        self.history.append({
            "t": round(now, 3),
            "blocks_allocated": s["blocks_allocated"],
            "blocks_cached_free": s["blocks_cached_free"],
            "tokens_used": s["tokens_used"],
            "waste_tokens": s["waste_tokens"],
            "prefix_cache_queries": s["prefix_cache_queries"],
            "prefix_cache_hits": s["prefix_cache_hits"],
            "num_running": s["num_running"],
            "num_waiting": s["num_waiting"],
            "num_preemptions": s["num_preemptions"],
            "prompt_tokens_by_source": s["prompt_tokens_by_source"],
            "offload_stored_blocks": s["offload"]["stored_blocks"] if s["offload"] else None,
            "offload_capacity_blocks": s["offload"]["capacity_blocks"] if s["offload"] else None,
        })
        self._last_sample = now
