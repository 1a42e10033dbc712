"""A simulation run end to end: requests from the shared sampler, replicas, router, metrics.

The requests and their arrival times are :func:`kvledger.workload.sampling.sample_requests`'s,
so ``kvledger bench serve`` with the same flags sends the same ones; the metrics are
:func:`kvledger.metrics.serving.calculate_metrics`'s, on :class:`RequestResult` rows built
from the virtual times (send = arrival, a chunk per token at its step's end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvledger.config import EngineConfig
from kvledger.errors import KVLedgerError
from kvledger.metrics.serving import SLO, RequestResult, ServingMetrics, calculate_metrics, evaluate_slo
from kvledger.sim.driver import Replica, run
from kvledger.sim.hybrid import HybridPool
from kvledger.sim.offload import OffloadTier
from kvledger.sim.requests import SimRequest, make_request
from kvledger.sim.routers import make_router
from kvledger.workload.sampling import SampledRequest

PERCENTILES = (50, 90, 99)
SERIES_POINTS = 400
"""Samples per replica kept for the time series (``--json`` and ``--plot``)."""
MAX_REPLICAS = 1024
"""``--find-replicas`` gives up above this many."""
SIM_BLOCK_BYTES = 280
"""Host bytes one simulated KV block costs (its ``Block``, its free-queue entry, its slot in the
pool's list): 273 measured with tracemalloc over a pool of 10^5 blocks."""
SIM_REPLICA_BYTES = 3500
"""Host bytes one replica costs besides its blocks (scheduler, cache manager, series): 3,430
measured over 200 replicas of llama-3.1-8b."""
SIM_TOKEN_BYTES = 60
"""Host bytes per output token of a run at its peak (its time in ``token_times``, its gap in the
metrics): 58 measured, the slope between 400 requests of 50 and of 500 output tokens."""
SIM_REQUEST_BYTES = 8000
"""Host bytes per request besides its tokens (the request, its result row, the metrics' lists):
about 6,100 measured at the run's peak, plus the request built before it."""
SIM_SLOT_BYTES = 400
"""Host bytes one slot of a simulated second tier costs when it holds a block (its entry in the
policy's lists, ARC's ghost entry): 246 for LRU and 387 for ARC, measured with tracemalloc over
10^5 slots."""
HOST_MEMORY_SHARE = 0.8
"""The share of the host's available memory a run may take (the rest for the interpreter and others)."""


@dataclass
class Fleet:
    """What every replica is: engine flags (block size, budgets, prefix caching), its pool, its step
    model; and how many of them sit behind which router."""

    config: EngineConfig
    num_blocks: int
    timer_factory: Any
    """Called once per replica: returns that replica's :class:`StepTimer`."""
    replicas: int = 1
    router: str = "least-loaded"
    tensor_parallel_size: int = 1
    hybrid: HybridPool | None = None
    """A hybrid model's state blocks and attention groups per request (``kvledger.sim.hybrid``)."""
    offload: OffloadTier | None = None
    """Each replica's KV offloading tier (``kvledger.sim.offload``), or None."""
    ingress_s: float = 0.0
    """Seconds from a client's send to the server's receipt of a request, the same for every
    request. A constant delay moves the whole run later and changes nothing in it, so it is not
    simulated: :func:`result_of` adds it to each TTFT and E2EL."""


@dataclass
class SimResult:
    """One run: the requests as they went, the replicas as they ended, the metrics."""

    requests: list[SimRequest]
    replicas: list[Replica]
    metrics: ServingMetrics
    results: list[RequestResult]
    end_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def build_requests(sampled: Sequence[SampledRequest], times: Sequence[float], length_scale: float = 1.0,
                   shared_prefix: int = 0) -> list[SimRequest]:
    """Fresh simulated requests (their state changes as they run), sorted by arrival; the first
    ``shared_prefix`` tokens of every prompt are the same."""
    reqs = [make_request(i, r.input_len, r.output_len, t, hash_ids=r.hash_ids, length_scale=length_scale,
                         shared_prefix=shared_prefix)
            for i, (r, t) in enumerate(zip(sampled, times))]
    reqs.sort(key=lambda r: (r.arrival_time, r.uid))
    return reqs


def run_bytes(requests: Sequence[SimRequest], replicas: int, num_blocks: int, offload_blocks: int = 0) -> int:
    """Host bytes a run of ``requests`` on ``replicas`` pools of ``num_blocks`` blocks (and second
    tiers of ``offload_blocks`` slots) takes at most: every block of every pool and tier, and every
    output token's time and gap."""
    tokens = sum(r.output_len for r in requests)
    return (replicas * (num_blocks * SIM_BLOCK_BYTES + offload_blocks * SIM_SLOT_BYTES + SIM_REPLICA_BYTES)
            + len(requests) * SIM_REQUEST_BYTES + tokens * SIM_TOKEN_BYTES)


def check_host_memory(requests: Sequence[SimRequest], fleet: Fleet) -> None:
    """Refuse, before anything is built, a run that would take more than ``HOST_MEMORY_SHARE`` of
    the memory the host has available: one line naming the counts that size it and how far to
    lower ``--replicas``."""
    from kvledger.units import available_ram_bytes, format_bytes

    slots = fleet.offload.capacity.num_blocks if fleet.offload is not None else 0
    need = run_bytes(requests, fleet.replicas, fleet.num_blocks, slots)
    have = int(available_ram_bytes() * HOST_MEMORY_SHARE)
    if need <= have:
        return
    fixed = run_bytes(requests, 0, fleet.num_blocks)
    per_replica = run_bytes([], 1, fleet.num_blocks, slots)
    fit = max(0, (have - fixed) // per_replica)
    if fleet.replicas == 1:
        lower = "lower the pool"
    elif fit:
        lower = f"lower --replicas to {fit:,} or less, or the pool"
    else:
        lower = "lower --replicas and the pool"
    raise KVLedgerError(f"simulating {fleet.replicas:,} replica(s) of {fleet.num_blocks:,} KV blocks and "
                        f"{len(requests):,} requests needs about {format_bytes(need)} of host memory, but "
                        f"{format_bytes(have)} is available to it; {lower} (--num-gpu-blocks-override, "
                        "--kv-cache-memory), " + ("the second tier (--kv-offloading-size), " if slots else "")
                        + "--num-prompts or --max-model-len")


def simulate(requests: list[SimRequest], fleet: Fleet, *, progress: bool | None = None,
             record_steps: bool = False, slo: SLO | None = None) -> SimResult:
    """Run ``requests`` (sorted by arrival) through ``fleet``; refused first if the host's memory
    cannot hold it (:func:`check_host_memory`)."""
    check_host_memory(requests, fleet)
    span = max((r.arrival_time for r in requests), default=0.0)
    replicas = [Replica(i, fleet.config, fleet.num_blocks, fleet.timer_factory(), record_steps,
                        series_interval_s=span / SERIES_POINTS if span > 0 else 0.05, hybrid=fleet.hybrid,
                        offload=fleet.offload)
                for i in range(fleet.replicas)]
    router = make_router(fleet.router, fleet.config.block_size)
    t0 = time.perf_counter()
    end = run(requests, replicas, router, progress)
    wall = time.perf_counter() - t0
    results = [result_of(r, fleet.ingress_s) for r in requests]
    metrics = calculate_metrics(results, max(end, 1e-9), list(PERCENTILES))
    out = SimResult(requests, replicas, metrics, results, end, wall)
    if slo is not None:
        out.extra["slo"] = evaluate_slo(results, metrics, slo)
    return out


def result_of(r: SimRequest, ingress_s: float = 0.0) -> RequestResult:
    """What ``kvledger bench serve`` would have seen of the request (one chunk per token), sent
    ``ingress_s`` seconds before the server received it at its ``arrival_time``."""
    times = r.token_times
    itl = np.diff(times).tolist() if len(times) > 1 else []
    start = r.arrival_time - ingress_s
    return RequestResult(prompt_len=r.prompt_len, expected_output_len=r.output_len, success=True,
                         ttft=times[0] - start, latency=times[-1] - start, itl=itl,
                         output_tokens=r.num_output, start_time=start)


# ------------------------------------------------------------------------------------- summary
def saturation(requests: list[SimRequest], replicas: list[Replica], metrics: ServingMetrics) -> dict[str, Any]:
    """Whether arrivals outpace service, and the request rate at which that starts.

    The backlog is the requests that have arrived and not finished (waiting or running: with
    continuous batching and a roomy pool an overload shows as a growing running set before it
    shows as a queue). Saturated: over the second half of the arrival window it grows by more
    than a tenth of the requests that arrive in that half (and by at least 8): a stable system
    keeps it near ``rate x E2EL``, an overloaded one adds ``(arrival rate - service rate) x t``. The saturation rate, given when saturated, is
    the service rate: requests finished per second of the run, the replicas busy throughout
    (arrivals above it queue without bound). Unsaturated runs give none: with continuous batching
    a busy share says nothing about capacity (a batch of one keeps a card busy). A burst (every
    request at one instant) has no arrival rate to outpace: not saturated,
    and its saturation rate is the service rate under that full load."""
    arrivals = np.sort(np.fromiter((r.arrival_time for r in requests), float, len(requests)))
    ends = np.sort(np.fromiter((r.finish_time for r in requests), float, len(requests)))
    last = float(arrivals[-1]) if len(arrivals) else 0.0
    mid = last / 2

    def queued(t: float) -> int:
        return int(np.searchsorted(arrivals, t, "right") - np.searchsorted(ends, t, "right"))

    arrived = int(np.searchsorted(arrivals, last, "right") - np.searchsorted(arrivals, mid, "right"))
    growth = queued(last) - queued(mid)
    saturated = bool(last > 0 and growth >= 8 and growth > 0.1 * arrived)
    duration = metrics.duration_s
    busy = max((rep.busy_s for rep in replicas), default=0.0) / duration if duration else 0.0
    burst = len(requests) > 1 and last == 0
    return {"saturated": saturated,
            "saturation_rate": metrics.completed / duration if (saturated or burst) and duration else None,
            "queue_growth": growth, "busy_share": busy,
            "arrival_rate": len(requests) / last if last > 0 else None}


def _downsample(values: list, n: int = SERIES_POINTS) -> list:
    if len(values) <= n:
        return list(values)
    idx = np.linspace(0, len(values) - 1, n).round().astype(int)
    return [values[i] for i in idx]


def summary(res: SimResult, fleet: Fleet) -> dict[str, Any]:
    """Every number of a run, JSON-ready (the keys of ``kvledger simulate --json``)."""
    m = res.metrics
    keep = ("mean", "median", "std", "p50", "p90", "p99")
    out: dict[str, Any] = {f"{k}_ms": {s: v for s, v in m.stats_ms[k].items() if s in keep} for k in m.stats_ms}
    queries = sum(rep.kv.stats.queries for rep in res.replicas)
    hits = sum(rep.kv.stats.hits for rep in res.replicas)
    out.update(
        completed=m.completed, duration_s=m.duration_s, total_input_tokens=m.total_input,
        total_output_tokens=m.total_output, request_throughput=m.request_throughput,
        output_throughput=m.output_throughput, total_token_throughput=m.total_token_throughput,
        goodput=res.extra["slo"]["goodput"] if "slo" in res.extra else m.request_throughput,
        num_preemptions=sum(rep.scheduler.num_preemptions for rep in res.replicas),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        prefix_cache_hits=hits, prefix_cache_queries=queries,
        peak_blocks_allocated=max(rep.blocks_allocated_peak for rep in res.replicas),
        num_blocks=fleet.num_blocks, block_size=fleet.config.block_size, ingress_ms=fleet.ingress_s * 1e3,
        replicas=fleet.replicas, router=fleet.router, tensor_parallel_size=fleet.tensor_parallel_size,
        gpus=fleet.replicas * fleet.tensor_parallel_size,
        num_steps=sum(rep.num_steps for rep in res.replicas),
        wall_s=res.wall_s, simulated_s_per_wall_s=m.duration_s / res.wall_s if res.wall_s else None,
    )
    out.update(saturation(res.requests, res.replicas, m))
    if "slo" in res.extra:
        slo = res.extra["slo"]
        out.update(slo_met=slo["slo_met"], goodput_fraction=slo["goodput_fraction"], slo=slo)
    out.update(offload_summary(res, fleet))
    out["per_replica"] = [{
        "replica": rep.index, "requests": len(rep.finished), "steps": rep.num_steps,
        "num_preemptions": rep.scheduler.num_preemptions, "peak_blocks_allocated": rep.blocks_allocated_peak,
        "prefix_cache_hit_rate": rep.kv.stats.hits / rep.kv.stats.queries if rep.kv.stats.queries else 0.0,
        "busy_share": rep.busy_s / m.duration_s if m.duration_s else 0.0,
    } for rep in res.replicas]
    out["series"] = [{name: _downsample(getattr(rep.series, name)) for name in
                      ("time_s", "blocks_allocated", "token_blocks", "cached_free_blocks", "running", "waiting")}
                     for rep in res.replicas]
    return out


def offload_summary(res: SimResult, fleet: Fleet) -> dict[str, Any]:
    """Prompt tokens by vLLM's ``prompt_tokens_by_source`` labels and their shares of the tokens
    looked up (``prefix_cache_hit_rate_by_source``: the pool's hits, the tier's loads); with a
    tier, its size and the blocks and bytes copied each way (bytes of every rank)."""
    from kvledger.kvcache.manager import LOCAL_COMPUTE, PrefixCacheStats

    total = PrefixCacheStats()
    for rep in res.replicas:
        for name in ("queries", "hits", "offload_queries", "offload_hits"):
            setattr(total, name, getattr(total, name) + getattr(rep.kv.stats, name))
    by_source = total.by_source()
    out: dict[str, Any] = {
        "prompt_tokens_by_source": by_source,
        "prefix_cache_hit_rate_by_source": {k: v / total.queries if total.queries else 0.0
                                            for k, v in by_source.items() if k != LOCAL_COMPUTE},
        "kv_offloading_size": fleet.offload.capacity.size_gib if fleet.offload else 0,
    }
    if fleet.offload is None:
        return out
    cap = fleet.offload.capacity
    loaded = sum(rep.offload_traffic.blocks_loaded for rep in res.replicas)
    stored = sum(rep.offload_traffic.blocks_stored for rep in res.replicas)
    out.update(offload_capacity_blocks=cap.num_blocks, offload_capacity_tokens=cap.num_tokens,
               offload_bytes=cap.bytes, offload_eviction_policy=fleet.offload.policy,
               offload_store_rule=fleet.offload.store_rule,
               offload_bandwidth_bytes_per_s=fleet.offload.bandwidth_bytes_per_s,
               offload_blocks_loaded=loaded, offload_blocks_stored=stored,
               offload_bytes_loaded=loaded * cap.block_bytes, offload_bytes_stored=stored * cap.block_bytes,
               offload_transfer_s=sum(rep.offload_traffic.seconds for rep in res.replicas),
               offload_stored_blocks=[rep.kv.offload.num_stored for rep in res.replicas])
    return out


def find_replicas(make_requests: Any, fleet: Fleet, slo: SLO, progress: bool | None = None
                  ) -> tuple[int, SimResult, SimResult | None]:
    """The smallest replica count whose run meets ``slo``: doubling, then bisection (more replicas
    never hurt on the same arrivals). Returns (N, the run at N, the run at N - 1 or None for N = 1)."""
    import dataclasses

    runs: dict[int, SimResult] = {}

    def meets(n: int) -> bool:
        if n not in runs:
            runs[n] = simulate(make_requests(), dataclasses.replace(fleet, replicas=n), progress=progress, slo=slo)
        return runs[n].extra["slo"]["slo_met"]

    cap = min(MAX_REPLICAS, max(1, len(make_requests())))  # with as many replicas as requests, none waits
    hi = 1
    while not meets(hi):
        if hi >= cap:
            raise KVLedgerError(f"{hi} replicas still miss the SLO: requests miss it on an idle replica; "
                                "loosen the targets or use a faster GPU")
        hi = min(hi * 2, cap)
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    if hi > 1 and hi - 1 not in runs:
        meets(hi - 1)
    return hi, runs[hi], runs.get(hi - 1)
