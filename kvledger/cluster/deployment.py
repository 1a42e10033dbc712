"""Two Ray Serve deployments behind one OpenAI endpoint: an ingress and N engine replicas.

* :class:`EngineReplica` holds one :class:`LLMEngine` (itself possibly tensor-parallel) and the
  ordinary server app around it (:func:`kvledger.server.launcher.build_app`): every endpoint,
  the async engine loop, its metrics. It serves one HTTP exchange per call (:meth:`EngineReplica.http`),
  feeding the request to the app through ASGI in-process and streaming back the response's
  start (status, headers) and then its body chunks, so streamed completions stream.
* :class:`Ingress` is the HTTP face: it reads each request's body, turns a completion's prompt or
  a chat's messages into token ids as the replica will, and passes their leading block hashes to
  the replica call, where the request router (:mod:`kvledger.cluster.router` or Ray Serve's
  default) picks the replica. ``/metrics`` shows every replica's series with a ``replica``
  label and adds fleet totals (``replica="fleet"``, each series summed over replicas), read from a
  small board actor (:class:`MetricsBoard`) every replica publishes to each second;
  ``/fleet/ledger`` lists every replica's KV ledger (its pool) as JSON. A replica
  that fails or cannot be reached answers 503 with ``Retry-After``; Ray Serve restarts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, AsyncIterator

from ray import serve

log = logging.getLogger("kvledger.cluster")

RETRY_AFTER_S = 5
"""Seconds a client is told to wait (``Retry-After``) when its replica failed."""
REPLICA_LABEL = "replica"
FLEET = "fleet"
NAMESPACE = "kvledger"
BOARD_NAME = "kvledger-metrics-board"
PUBLISH_PERIOD_S = 1.0
"""Seconds between a replica's publications of its metrics and ledger."""
STALE_AFTER_S = 10.0
"""A replica that has not published for this long is left out of ``/metrics`` (it is down)."""


class MetricsBoard:
    """The replicas' latest ``/metrics`` texts and ledgers, by replica (a Ray actor)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, str, dict[str, Any]]] = {}

    def put(self, replica: str, text: str, ledger: dict[str, Any]) -> None:
        self.entries[replica] = (time.time(), text, ledger)

    def get(self) -> dict[str, tuple[float, str, dict[str, Any]]]:
        return self.entries

    def clear(self) -> None:
        """Forget every replica (a redeployment replaced them)."""
        self.entries = {}


async def asgi_exchange(app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]],
                        body: bytes) -> AsyncIterator[Any]:
    """One HTTP exchange with an ASGI ``app`` in-process: yields ``(status, headers)`` first, then
    each body chunk as the app sends it."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    sent = False
    disconnected = asyncio.Event()
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield (message["status"], [(k.decode(), v.decode()) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()  # a client that went away ends the request in the app (an abort)
        await task


class EngineReplica:
    """One engine and its server app, as one Ray Serve replica (see the module)."""

    def __init__(self, engine_kwargs: dict[str, Any], app_kwargs: dict[str, Any], num_threads: int | None = None) -> None:
        import torch

        from kvledger.config import EngineConfig
        from kvledger.engine.llm_engine import LLMEngine
        from kvledger.server.engine_thread import on_engine_thread
        from kvledger.server.launcher import build_app

        if num_threads:
            on_engine_thread(torch.set_num_threads, num_threads)
        self.engine = on_engine_thread(LLMEngine, EngineConfig(**engine_kwargs))  # the thread that runs its steps
        self.app = build_app(self.engine, **app_kwargs)
        self._lifespan: Any = None
        self.name = serve.get_replica_context().replica_id.unique_id
        threading.Thread(target=self._publish, daemon=True, name="kvledger-metrics-publisher").start()

    async def _start(self) -> None:
        if self._lifespan is None:
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()

    async def http(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                   block_hashes: list[bytes] | None = None) -> AsyncIterator[Any]:
        """The app's response to one request: ``(status, headers)``, then body chunks.
        ``block_hashes`` is for the router only."""
        await self._start()
        async for item in asgi_exchange(self.app, method, path, query, headers, body):
            yield item

    def _publish(self) -> None:
        """Every ``PUBLISH_PERIOD_S``: this replica's ``/metrics`` text and ledger to the board."""
        import ray

        board = ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
        metrics = self.app.state.aengine.metrics
        while True:
            try:
                board.put.remote(self.name, metrics.render().decode(), self.ledger())
            except Exception as err:  # noqa: BLE001 - the board is gone: the fleet is shutting down
                log.warning("metrics board unreachable: %s", err)
            time.sleep(PUBLISH_PERIOD_S)

    def ledger(self) -> dict[str, Any]:
        """This replica's KV ledger (blocks, prefix-cache counters, bytes) as a dict: the one taken
        after the engine's latest step, the state its ``/metrics`` text shows (a ledger computed here,
        on another thread than the engine's, could catch a step half-way)."""
        return {"replica": self.name, **self.app.state.aengine.snapshot()}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped (a TP rank died) is restarted."""
        failure = self.engine.runner.failure
        if failure is not None:
            raise RuntimeError(failure)


def label_series(text: str, replica: str) -> list[tuple[str, str, float]]:
    """``(name, labels, value)`` of every sample in Prometheus text, ``replica`` added to the labels."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, labels, value = _sample(line)
        labels = f'{REPLICA_LABEL}="{replica}"' + ("," + labels if labels else "")
        samples.append((name, labels, value))
    return samples


def fleet_metrics(texts: dict[str, str]) -> str:
    """Every replica's series with a ``replica`` label, then each series summed over the fleet
    (``replica="fleet"``; shares, ``*_perc``, averaged), with the first replica's ``# HELP``/``# TYPE`` lines."""
    lines: list[str] = []
    totals: dict[tuple[str, str], float] = {}
    headers = [line for line in next(iter(texts.values()), "").splitlines() if line.startswith("#")]
    lines.extend(headers)
    for replica, text in sorted(texts.items()):
        for name, labels, value in label_series(text, replica):
            lines.append(f"{name}{{{labels}}} {value!r}")
            rest = labels.split(",", 1)[1] if "," in labels else ""
            totals[(name, rest)] = totals.get((name, rest), 0.0) + value
    for (name, rest), value in totals.items():
        if name.endswith("_perc"):  # a share: the fleet's is the mean (the pools are equal)
            value /= len(texts)
        labels = f'{REPLICA_LABEL}="{FLEET}"' + ("," + rest if rest else "")
        lines.append(f"{name}{{{labels}}} {value!r}")
    return "\n".join(lines) + "\n"


def read_fleet_metrics(text: str) -> dict[tuple[str, str], float]:
    """``{(series name, replica): value}`` of a fleet's ``/metrics`` (:func:`fleet_metrics`), the
    other labels dropped (each replica has one series per name but for histograms and counters
    by reason, which this keeps last)."""
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in (s for line in text.splitlines() if line and not line.startswith("#")
                                for s in [_sample(line)]):
        replica = labels.split('"')[1] if labels.startswith(f'{REPLICA_LABEL}="') else ""
        out[(name, replica)] = value
    return out


def _sample(line: str) -> tuple[str, str, float]:
    series, _, value = line.rpartition(" ")
    name, _, labels = series.partition("{")
    return name, labels.rstrip("}"), float(value)


class Ingress:
    """The HTTP face of the fleet (see the module). ``engine`` is the replicas' deployment handle."""

    def __init__(self, engine: Any, model: str | None, tokenizer: str | None, block_size: int,
                 num_replicas: int) -> None:
        from transformers import AutoTokenizer

        from kvledger.loader.resolve import converted_dir, resolve_model

        self.engine = engine
        self.block_size = block_size
        self.num_replicas = num_replicas
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or converted_dir(resolve_model(model))))

    def prompt_ids(self, path: str, body: bytes) -> list[int]:
        """The prompt's token ids as the replica's server computes them; [] when there is none."""
        try:
            req = json.loads(body or b"{}")
            if path.endswith("/chat/completions"):
                text = self.tokenizer.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
                return self.tokenizer.encode(text, add_special_tokens=False)
            prompt = req.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # noqa: BLE001 - a malformed body: the replica's server answers it (4xx)
            pass
        return []

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

        from kvledger.kvcache.block_pool import prefix_block_hashes

        path = request.url.path
        body = await request.body()
        if path == "/fleet/ledger":  # each live replica's pool, for a fleet view
            try:
                board = await self._board()
                entries = await board.get.remote()
            except Exception as err:  # noqa: BLE001
                return self._unavailable(err)
            now = time.time()
            return JSONResponse([ledger for _, (at, _, ledger) in sorted(entries.items()) if now - at < STALE_AFTER_S])
        if path == "/metrics":
            try:
                return PlainTextResponse(await self.fleet_metrics_text(),
                                         media_type="text/plain; version=0.0.4; charset=utf-8")
            except Exception as err:  # noqa: BLE001
                return self._unavailable(err)
        hashes = prefix_block_hashes(self.prompt_ids(path, body), self.block_size) if request.method == "POST" else []
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        try:  # routing itself can fail (no live replica, the controller restarting): a 503 too
            stream = self.engine.options(stream=True).http.remote(request.method, path, request.url.query, headers,
                                                                  body, block_hashes=hashes)
            status, resp_headers = await stream.__anext__()
        except Exception as err:  # noqa: BLE001 - the replica died or is unreachable
            return self._unavailable(err)
        keep = {k: v for k, v in resp_headers if k.lower() not in ("content-length", "transfer-encoding")}
        media = keep.pop("content-type", None)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as err:  # noqa: BLE001 - mid-stream failure: end the stream with an error event
                log.error("replica failed mid-response: %s", err)
                yield f"data: {json.dumps({'error': {'message': 'the replica failed; retry', 'code': 503}})}\n\n".encode()

        if media is not None and media.startswith("text/event-stream"):
            return StreamingResponse(chunks(), status_code=status, headers=keep, media_type=media)
        payload = b"".join([c async for c in chunks()])
        from starlette.responses import Response

        return Response(payload, status_code=status, headers=keep, media_type=media)

    async def fleet_metrics_text(self) -> str:
        """Every live replica's ``/metrics`` (published within ``STALE_AFTER_S``), labelled, and the
        fleet totals."""
        board = await self._board()
        entries = await board.get.remote()
        now = time.time()
        return fleet_metrics({name: text for name, (at, text, _) in entries.items() if now - at < STALE_AFTER_S})

    async def _board(self) -> Any:
        import ray

        return ray.get_actor(BOARD_NAME, namespace=NAMESPACE)

    @staticmethod
    def _unavailable(err: Exception) -> Any:
        from starlette.responses import JSONResponse

        log.warning("answering 503: %s: %s", type(err).__name__, err)
        message = f"a replica is unavailable ({type(err).__name__}); retry after {RETRY_AFTER_S} s"
        return JSONResponse({"error": {"message": message, "type": "ServiceUnavailable", "code": 503}},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
