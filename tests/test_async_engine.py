"""The server's engine loop when something inside it fails: every waiting handler gets an answer."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import pytest

from kvledger.config import EngineConfig
from kvledger.engine.llm_engine import LLMEngine
from kvledger.engine.sampling_params import SamplingParams
from kvledger.server.async_engine import AsyncEngine, EngineDeadError


@contextlib.asynccontextmanager
async def running(engine: LLMEngine) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine around ``engine``, its loop started, stopped on the way out."""
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        yield aengine
    finally:
        await aengine.stop()


def test_a_failure_while_applying_aborts_still_answers_the_adds_behind_it():
    """An abort that raises inside the loop (fault injected into this one engine instance) must
    not strand a request added in the same round: its handler gets EngineDeadError, not a hang."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_memory="32MiB",
                                    max_model_len=256))
    real_abort = engine.abort_request

    def abort_that_fails_once(request_id: str) -> None:
        engine.abort_request = real_abort
        raise RuntimeError("injected failure")

    async def scenario() -> None:
        async with running(engine) as aengine:
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            first = await aengine.add("first", list(range(100, 120)), params)
            await first.queue.get()  # the request is running
            async with aengine.hold():  # no round runs until both the abort and the add are pending
                engine.abort_request = abort_that_fails_once
                aengine.abort("first")
                second = asyncio.create_task(aengine.add("second", list(range(200, 220)), params))
                while aengine.num_waiting() == 0:
                    await asyncio.sleep(0.01)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(second, timeout=30)
            # and the loop keeps serving the next request
            third = await aengine.add("third", list(range(300, 310)), SamplingParams(max_tokens=3, temperature=0))
            deltas = [d async for d in third]
            assert deltas[-1].finished and deltas[-1].num_output_tokens == 3

    asyncio.run(scenario())
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_drain_ends_what_is_in_flight_and_refuses_new_requests():
    """``drain(0)`` (``--shutdown-timeout 0``): the request in flight ends at once with a 503
    RequestFailedError, a new one is refused with 503, and the pool is empty; a drain with time
    lets a short request finish first."""
    from kvledger.server.async_engine import RequestFailedError

    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_memory="32MiB",
                                    max_model_len=256))

    async def scenario() -> None:
        async with running(engine) as aengine:
            short = await aengine.add("short", list(range(100, 110)), SamplingParams(max_tokens=3, temperature=0))
            ended = await asyncio.wait_for(aengine.drain(30), timeout=60)  # the short one finishes in the drain
            assert ended == 0
            deltas = [d async for d in short]
            assert deltas[-1].finished and deltas[-1].num_output_tokens == 3
            aengine.accepting = True  # a fresh drain, now with a request that cannot finish
            long = await aengine.add("long", list(range(200, 220)),
                                     SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
            await long.queue.get()  # it is running
            assert await asyncio.wait_for(aengine.drain(0), timeout=10) == 1
            with pytest.raises(RequestFailedError) as err:
                async for _ in long:
                    pass
            assert err.value.status == 503 and "shutting down" in str(err.value)
            with pytest.raises(RequestFailedError) as refused:
                await aengine.add("late", [1, 2, 3], SamplingParams(max_tokens=2))
            assert refused.value.status == 503

    asyncio.run(scenario())
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_every_step_runs_on_the_engine_thread():
    """The server loads the model and runs every step on one thread (kvledger.server.engine_thread),
    never on asyncio's pool: each thread that runs torch's parallel loops keeps an OpenMP team, and
    two teams on a 2-core machine make every worker sleep between the step's small loops."""
    import threading

    from kvledger.server.engine_thread import on_engine_thread

    engine = on_engine_thread(LLMEngine, EngineConfig(model="smollm2-135m", dtype="float32",
                                                      kv_cache_memory="32MiB", max_model_len=256))
    loader = on_engine_thread(threading.get_ident)
    step_threads: set[int] = set()
    real_step = engine.step

    def step_that_notes_its_thread():  # the real step, its thread noted (this one engine instance)
        step_threads.add(threading.get_ident())
        return real_step()

    engine.step = step_that_notes_its_thread

    async def scenario() -> None:
        async with running(engine) as aengine:
            stream = await aengine.add("r", list(range(100, 140)), SamplingParams(max_tokens=4, temperature=0))
            deltas = [d async for d in stream]
            assert deltas[-1].finished and deltas[-1].num_output_tokens == 4

    asyncio.run(scenario())
    assert step_threads == {loader}


def test_a_request_counts_from_when_the_server_received_it():
    """``arrival_time`` (the handler's receipt) reaches the engine: the step log keeps it beside the
    moment the engine took the request, and the request's stream counts its latencies from it."""
    import time

    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_memory="32MiB",
                                    max_model_len=256))
    records = engine.step_records = []
    received = time.perf_counter() - 0.25  # as if reading and tokenizing the request took 250 ms

    async def scenario() -> None:
        async with running(engine) as aengine:
            stream = await aengine.add("r", list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0),
                                       arrival_time=received)
            assert stream.arrival == received
            assert [d async for d in stream][-1].finished
            later = await aengine.add("s", list(range(200, 210)), SamplingParams(max_tokens=1, temperature=0))
            assert [d async for d in later][-1].finished

    asyncio.run(scenario())
    (first,), (second,) = [r.arrivals for r in records if r.arrivals]
    assert first.request_id == "r" and first.received_s == received and first.time_s >= received + 0.25
    assert second.request_id == "s" and second.received_s <= second.time_s < second.received_s + 1.0
