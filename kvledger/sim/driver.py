"""The virtual-clock driver: the engine's own scheduler and block pool, a step-time model in place
of the model runner, and a router in front of one or more replicas.

A replica is what ``LLMEngine`` is without the model: a :class:`BlockPool`, a
:class:`KVCacheManager` and a :class:`Scheduler` (the same classes, not copies). One step:
``schedule()``; the step model says how long the batch takes; at the end of the step the
scheduler's ``update()`` advances every scheduled request, each request whose step computed its
last known token gets a token (at the step's end time), and a request with all its output
tokens is finished with ``finish(..., "length")``, its blocks back in the pool at once, exactly
as ``LLMEngine.step`` does with ``ignore_eos``. A request that arrives while a step runs
lengthens it by the timer's ``arrival_seconds`` (the server's cost of receiving it; 0 when the
timer has none, as a replay of recorded times, whose steps already hold it).

Events are processed in time order: arrivals first when they coincide with a step's end (the
engine adds what has arrived before it schedules), all arrivals of one instant before any idle
replica starts its step. Times are virtual seconds from the start of the run.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from kvledger.kvcache.block_pool import BlockPool
from kvledger.config import EngineConfig
from kvledger.kvcache.manager import KVCacheManager
from kvledger.engine.outputs import StepRecord
from kvledger.engine.scheduler import Scheduler, SchedulerOutput
from kvledger.errors import KVLedgerError
from kvledger.progress import progress_bar
from kvledger.kvcache.offload import OffloadStore
from kvledger.sim.hybrid import HybridKVCacheManager, HybridPool
from kvledger.sim.offload import OffloadTier, OffloadTraffic
from kvledger.sim.requests import SimRequest


class StepTimer(Protocol):
    """Anything that prices a batch: ``(num_computed_tokens, num_new_tokens)`` per request."""

    def step_seconds(self, batch: Sequence[tuple[int, int]], num_samples: int) -> float: ...


def arrival_seconds(timer: StepTimer) -> float:
    """Seconds a step gains per request received during it: the timer's ``arrival_seconds``, or 0."""
    return float(getattr(timer, "arrival_seconds", 0.0))


class RecordedStepTimes:
    """Step times replayed from a recorded run: the ``i``-th step takes ``wall_s[i]`` seconds."""

    def __init__(self, wall_s: Sequence[float]) -> None:
        self.wall_s = list(wall_s)
        self.index = 0

    def step_seconds(self, batch: Sequence[tuple[int, int]], num_samples: int) -> float:
        if self.index >= len(self.wall_s):
            raise KVLedgerError(f"the replay ran more steps than the {len(self.wall_s)} recorded")
        seconds = self.wall_s[self.index]
        self.index += 1
        return seconds


@dataclass
class Series:
    """Samples over virtual time (seconds): KV blocks allocated, tokens held (in blocks), cached
    free blocks, running and waiting requests of one replica."""

    time_s: list[float] = field(default_factory=list)
    blocks_allocated: list[int] = field(default_factory=list)
    token_blocks: list[float] = field(default_factory=list)
    cached_free_blocks: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)


class Replica:
    """One engine's scheduling state on a virtual clock."""

    def __init__(self, index: int, config: EngineConfig, num_blocks: int, timer: StepTimer,
                 record_steps: bool = False, series_interval_s: float = 0.0, hybrid: HybridPool | None = None,
                 offload: OffloadTier | None = None) -> None:
        self.index = index
        self.config = config
        if hybrid is not None:  # a hybrid's requests also hold state blocks (kvledger.sim.hybrid)
            self.pool = BlockPool(num_blocks, enable_caching=False)
            self.kv: KVCacheManager = HybridKVCacheManager(self.pool, config.block_size, hybrid)
        else:
            self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
            if offload is None:
                self.kv = KVCacheManager(self.pool, config.block_size)
            else:
                self.kv = KVCacheManager(self.pool, config.block_size, store_rule=offload.store_rule,
                                         offload=OffloadStore(offload.capacity.num_blocks, offload.policy))
        self.offload = offload
        self.offload_traffic = OffloadTraffic()
        self.scheduler = Scheduler(config, self.kv)
        self.timer = timer
        self.arrival_s = arrival_seconds(timer)
        self._arrived_idle = 0  # requests added while idle: the step they start is theirs to lengthen
        self.num_steps = 0
        self.blocks_allocated_peak = 0
        self.busy_s = 0.0
        self.step_end = 0.0
        self._out: SchedulerOutput | None = None
        self._samplers: list[SimRequest] = []
        self.records: list[StepRecord] | None = [] if record_steps else None
        self.series = Series()
        self.series_interval_s = series_interval_s
        self._next_sample = 0.0
        self.finished: list[SimRequest] = []

    @property
    def load(self) -> int:
        """Running plus waiting requests (what least-loaded routing compares)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def busy(self) -> bool:
        return self._out is not None

    def add(self, request: SimRequest) -> None:
        """Queue ``request``; its arrival lengthens the running step, or the next one if idle."""
        request.replica = self.index
        self.scheduler.add(request)
        if not self.arrival_s:
            return
        if self._out is None:
            self._arrived_idle += 1
            return
        self.step_end += self.arrival_s
        self.busy_s += self.arrival_s
        if self.records is not None:
            self.records[-1].wall_s += self.arrival_s
            self.records[-1].model_s += self.arrival_s

    def start_step(self, now: float) -> bool:
        """Schedule a batch at ``now``; False (and idle) when there is nothing to run."""
        if now >= self._next_sample:
            self._sample(now)
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise KVLedgerError(f"replica {self.index} cannot schedule its {len(self.scheduler.waiting)} waiting "
                                    "requests: the pool is too small for one of them")
            return False
        batch = []
        samplers = self._samplers = []
        for s in out.scheduled:
            r, n = s.request, s.num_new_tokens
            batch.append((r.num_computed_tokens, n))
            if r.num_computed_tokens + n == r.num_tokens:  # ScheduledRequest.samples, inlined
                samplers.append(r)
        seconds = self.timer.step_seconds(batch, len(self._samplers)) + self._arrived_idle * self.arrival_s
        self._arrived_idle = 0
        if out.kv_transfers:  # copies between the tiers, before the model run
            copy_s = self.offload.seconds(out.kv_transfers)
            self.offload_traffic.add(out.kv_transfers, copy_s)
            seconds += copy_s
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise KVLedgerError(f"the step model priced a step at {seconds} s")
        if self.records is not None:
            self.records.append(StepRecord(self.num_steps, [(s.request.request_id, c, n) for s, (c, n)
                                                            in zip(out.scheduled, batch)],
                                           len(self._samplers), now, seconds, seconds,
                                           [r.request_id for r in out.preempted]))
        self._out = out
        self.step_end = now + seconds
        self.busy_s += seconds
        return True

    def finish_step(self) -> list[SimRequest]:
        """End the running step at :attr:`step_end`: advance, emit tokens, finish; returns the finished."""
        out, now, step = self._out, self.step_end, self.num_steps
        assert out is not None
        self._out = None
        scheduler = self.scheduler
        scheduler.update(out)
        pool = self.pool
        allocated = pool.num_blocks - pool.num_free_blocks
        if allocated > self.blocks_allocated_peak:
            self.blocks_allocated_peak = allocated
        done = []
        for request in self._samplers:
            request.num_output += 1
            request.num_tokens += 1
            request.token_times.append(now)
            if request.first_token_step is None:
                request.first_token_step = step
                request.first_token_time = now
            if request.num_output >= request.output_len:
                scheduler.finish(request, "length")
                request.finish_time = now
                request.finish_step = step
                done.append(request)
        self.num_steps += 1
        self.finished.extend(done)
        return done

    def _sample(self, now: float) -> None:
        s, pool, sched = self.series, self.pool, self.scheduler
        bs = self.config.block_size
        s.time_s.append(now)
        s.blocks_allocated.append(pool.num_blocks - pool.num_free_blocks)
        s.token_blocks.append(self.kv.tokens_used(sched.running) / bs)
        s.cached_free_blocks.append(pool.num_cached_free_blocks)
        s.running.append(len(sched.running))
        s.waiting.append(len(sched.waiting))
        self._next_sample = now + self.series_interval_s


Router = Callable[[SimRequest, list[Replica]], int]


def run(requests: Sequence[SimRequest], replicas: list[Replica], router: Router,
        progress: bool | None = None) -> float:
    """Drive every request through the replicas; returns the virtual time the last step ended.

    ``requests`` must be sorted by ``arrival_time``. ``progress``: the shared bar on stderr
    (:func:`kvledger.progress.progress_bar`, shown once the run has lasted a second; None: the
    same as True), False: none."""
    n = len(requests)
    heap: list[tuple[float, int]] = []
    bar = progress_bar(n, "simulate", "req", enabled=progress is not False)
    i = 0
    end = 0.0
    finished = 0
    while i < n or heap:
        arrival = requests[i].arrival_time if i < n else math.inf
        if heap and heap[0][0] < arrival:
            now, r = heapq.heappop(heap)
            replica = replicas[r]
            if not replica.busy or now != replica.step_end:
                continue  # an end that arrivals moved later: the step's entry at its new end stands
            done = replica.finish_step()
            end = now
            if done:
                finished += len(done)
                bar.update(len(done))
            if replica.start_step(now):
                heapq.heappush(heap, (replica.step_end, r))
            continue
        touched = []
        while i < n and requests[i].arrival_time == arrival:
            r = router(requests[i], replicas)
            replicas[r].add(requests[i])
            touched.append(r)
            i += 1
        for r in dict.fromkeys(touched):
            replica = replicas[r]
            if replica.busy:
                if replica.arrival_s:  # the arrivals lengthened its step: its end moved
                    heapq.heappush(heap, (replica.step_end, r))
            elif replica.start_step(arrival):
                heapq.heappush(heap, (replica.step_end, r))
    bar.close()
    if finished != n:
        raise KVLedgerError(f"{n - finished} of {n} requests never finished")
    return end

