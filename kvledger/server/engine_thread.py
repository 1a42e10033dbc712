"""The one thread of a server process that runs the engine's torch work: loading the model and
every step.

Why one: torch's CPU build runs its parallel loops on libgomp (GNU OpenMP), which keeps a team
of worker threads for each thread that has run a parallel region. Once the process holds more
of those workers than it has CPUs, libgomp stops letting them spin between regions (about 100
spins instead of 300,000): each worker goes to sleep on a futex and has to be woken by a system
call at the next region. A decode step runs hundreds of small regions, so a server that loaded
the model on its main thread and then stepped on another thread paid that wake-up at every one.
Measured on 2 cores: a small parallel ``torch.add`` with a little Python between calls took 19
us a call on the main thread and on a thread whose process had never run a region elsewhere,
but 71-105 us on a thread after the main thread had run one; the 64-request workload took 31.3
s stepped on the main thread against 34.7-38.0 s stepped from asyncio's worker threads (batch-1
decode steps 27 against 52 ms).

So ``kvledger serve`` builds its :class:`~kvledger.engine.llm_engine.LLMEngine` with
:func:`on_engine_thread` and :class:`~kvledger.server.async_engine.AsyncEngine` runs each step
on :func:`engine_thread`; the event loop's thread never runs a parallel region.

The two threads share the GIL: the engine thread takes it back after every torch operator, and
while the event loop's thread runs Python (the handlers sending a step's tokens) it waits up to
Python's switch interval, 5 ms by default. Starting the engine thread sets
:data:`GIL_SWITCH_INTERVAL_S` for the process (``kvledger serve`` and each replica of a fleet).
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

GIL_SWITCH_INTERVAL_S = 0.0005
"""``sys.setswitchinterval`` of a process that starts the engine thread (seconds). The 64-request
float32 workload of ``bench/bench_vs_vllm.py --servers`` on 2 cores, servers alternating with the engine alone in one
run: 5 ms (Python's default) 99.0 / 107.7 / 113.5 output tok/s, 0.5 ms 105.5 / 111.7 / 116.0, the
engine alone 117.1 / 118.6 / 117.7."""

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's engine thread (an executor of one worker, started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvledger-engine")
        return _executor


def on_engine_thread(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` run on the engine thread; its result, or its exception raised here."""
    return engine_thread().submit(fn, *args, **kwargs).result()
