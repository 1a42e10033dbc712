"""The ranks of a tensor-parallel group as processes: ranks 1..N-1 spawned, rank 0 in the caller's.

:class:`RankGroup` starts the group from rank 0: a TCP store, one spawned process per other rank
running a target the caller names (the engine's model runner: nothing here knows what a rank
does), and a watchdog. Each step, rank 0 :meth:`RankGroup.broadcast`\\s the step's inputs on the
gloo dispatch group; the other ranks receive them with :func:`receive`.

Failure: the watchdog polls the ranks' processes every ``WATCHDOG_PERIOD_S``; a collective with
a dead peer fails at once (gloo sees the socket close) and one that waits on a hung rank fails
after ``COLLECTIVE_TIMEOUT_S``. Either way :meth:`RankGroup.guard` raises one
:class:`RankFailure` naming the rank, the other ranks are stopped, and every later use raises
the same error. Each spawned rank exits when rank 0's process is gone.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvledger.distributed import parallel_state as ps
from kvledger.errors import KVLedgerError

WATCHDOG_PERIOD_S = 0.5


class RankFailure(KVLedgerError):
    """A tensor-parallel rank died or stopped answering; the engine cannot run further steps."""


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` in a CUDA group, else the CPU."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts, dataclasses) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj


def receive() -> Any:
    """On a rank above 0: the next message rank 0 broadcast (None: stop)."""
    return _broadcast(None)


def _broadcast(message: Any) -> Any:
    """Rank 0's ``message`` on every rank (pickled over the gloo dispatch group)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ps.dispatch_group())
    return box[0]


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _rank_main(rank: int, group: ps.GroupInfo, num_threads: int, target: Callable[..., None], args: tuple) -> None:
    """A spawned rank's process: watch for rank 0's exit, join the group, then ``target(rank, *args)``."""
    parent = os.getppid()

    def orphan_watch() -> None:  # rank 0 gone: nothing will ever be asked of this rank again
        while os.getppid() == parent:
            time.sleep(WATCHDOG_PERIOD_S)
        os._exit(3)

    threading.Thread(target=orphan_watch, daemon=True).start()
    torch.set_num_threads(num_threads)
    if group.backend == "nccl":
        torch.cuda.set_device(rank_device("cuda", rank))
    store = dist.TCPStore(group.host, group.port, group.world_size, is_master=False,
                          timeout=_seconds(ps.STARTUP_TIMEOUT_S))
    ps.init_group(group, rank, store)
    try:
        target(rank, *args)
    finally:
        ps.destroy_group()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start processes that run only kvledger's code: spawn re-runs the starting script's top
    level in every child unless that script guards it with ``if __name__ == "__main__"``; with
    the main module's file and spec hidden while the children start, it is not re-run at all."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class RankGroup:
    """Rank 0's handle on a group of ``size`` ranks: ranks 1..size-1 run ``target(rank, *args)`` in
    processes of their own (``target`` a module-level function, as spawn pickles it by name)."""

    def __init__(self, size: int, device_type: str, target: Callable[..., None], args: tuple) -> None:
        if dist.is_initialized():
            raise KVLedgerError("this process already runs a tensor-parallel engine; shut it down "
                                "(LLMEngine.shutdown()) before starting another")
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise KVLedgerError(f"--tensor-parallel-size {size} needs {size} CUDA devices, "
                                f"{torch.cuda.device_count()} are visible; lower it or use --device cpu")
        self.size = size
        self.failure: str | None = None
        self.closed = False
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_seconds(ps.STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        group = ps.GroupInfo("127.0.0.1", store.port, size, "nccl" if device_type == "cuda" else "gloo")
        threads = max(1, torch.get_num_threads() // size)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, args=(r, group, threads, target, args), daemon=True,
                                  name=f"kvledger-tp-rank{r}") for r in range(1, size)]
        with _main_module_hidden():
            for p in self.procs:
                p.start()
        atexit.register(self.shutdown)
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="kvledger-tp-watchdog")
        self._watchdog.start()
        self._store = store
        with self.guard("starting"):
            ps.init_group(group, 0, store, alive=self._raise_if_failed)

    def broadcast(self, message: Any) -> None:
        """Send ``message`` (tensors on the CPU) to every other rank."""
        _broadcast(message)

    @contextmanager
    def guard(self, stage: str) -> Iterator[None]:
        """Runs the block, turning a failed collective (or a rank found dead) into one
        :class:`RankFailure` that names the rank; raises it at once once the group has failed."""
        if self.failure is not None or self.closed:
            raise RankFailure(self.failure or "the tensor-parallel engine was shut down")
        try:
            yield
        except BaseException as err:
            if isinstance(err, (RuntimeError, OSError)) or self.failure is not None:
                self._fail_from(err, stage)
            raise

    # ---- failure and shutdown -----------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)

    def _watch(self) -> None:
        while not self.closed and self.failure is None:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self.failure = (f"tensor-parallel rank {rank} of {self.size} (pid {p.pid}) exited with code "
                                    f"{p.exitcode}; the engine stopped. Restart it.")
                    return
            time.sleep(WATCHDOG_PERIOD_S)

    def _fail_from(self, err: BaseException, stage: str) -> None:
        """Raise one RankFailure for ``err``: the watchdog's account of a dead rank if it has one
        (given a moment to notice), else the collective's own error; the other ranks are stopped."""
        deadline = time.monotonic() + 2 * WATCHDOG_PERIOD_S + 0.5
        while self.failure is None and time.monotonic() < deadline and self._watchdog.is_alive():
            time.sleep(0.05)
        if self.failure is None:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.failure = (f"tensor-parallel ranks failed while {stage} ({type(err).__name__}: {first}); "
                            f"the engine stopped. Restart it.")
        self._stop_ranks()
        raise RankFailure(self.failure) from err

    def stop(self) -> None:
        """Kill the other ranks now (rank 0 failed before they had work); idempotent."""
        if not self.closed:
            self._stop_ranks()

    def _stop_ranks(self) -> None:
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        ps.destroy_group()

    def shutdown(self) -> None:
        """Stop every rank (idempotent): a clean stop message, then a kill for any that linger."""
        if self.closed:
            return
        self.closed = True  # the watchdog stops before the ranks exit
        if self.failure is None:
            try:
                _broadcast(None)
            except Exception:  # noqa: BLE001 - a rank already gone; it is killed below
                pass
            for p in self.procs:
                p.join(5)
        self._stop_ranks()
