"""Continuous batching: which requests run this step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running requests go first, in
admission order: a decoding request takes one token, a request still in prefill takes a chunk
of its remaining prompt (chunked prefill). When the pool cannot give a running request the
blocks it needs, the most recently admitted running request is preempted by recompute: its
blocks go back to the pool (their full blocks stay in the prefix cache) and it rejoins the
front of the waiting queue. Waiting requests are then admitted first come, first served while
budget, ``max_num_seqs`` and free blocks last, starting from their longest cached prefix (in the
pool, then in the KV offloading tier where there is one: the copies between the tiers that the
step needs are its output's ``kv_transfers``, to be run before the model).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvledger.config import EngineConfig
from kvledger.kvcache.manager import KVCacheManager
from kvledger.kvcache.offload import KVTransfers
from kvledger.engine.sequence import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_transfers: KVTransfers | None = None
    """Copies between the KV cache's tiers to run before this step's model run (None without a tier)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """FCFS admission, chunked prefill, preemption by recompute."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        kv = self.kv
        if kv.offload is None:
            return self._schedule()
        kv.begin_step()
        out = self._schedule()
        out.kv_transfers = kv.take_transfers()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running, allocate_slots, scheduled = self.running, self.kv.allocate_slots, out.scheduled  # hot loop
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is running
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, hit_tokens = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - hit_tokens
            num_new = min(remaining, budget)
            request.num_computed_tokens = hit_tokens
            if not self.kv.allocate_slots(request, num_new, hits):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            offloaded = self.kv.record_admission(request, hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
                request.num_offloaded_tokens = offloaded
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by the tokens the step computed; sliding-window groups
        then give back the blocks that left their window."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        if self.kv.hybrid:
            for s in out.scheduled:
                self.kv.free_out_of_window(s.request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stopped, length, abort); its blocks return to the pool at once."""
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
        self.kv.forget(request.request_id)
