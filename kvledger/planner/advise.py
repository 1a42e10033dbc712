"""Which lever buys more users: the levers ranked by the users they add for a scenario, with their cost.

A scenario is a model on a card, requests of ``prompt_tokens + output_tokens`` (optionally
sharing a ``shared_prefix_tokens`` system prompt), ``users`` served today and ``target_users``
wanted. Each user is sized at its full live context (prompt + output), as the block pool
must hold it at the end of its response.

**What binds.** If today's users fill the pool (at least ``CAPACITY_BINDS_AT`` of what it
holds), memory binds: "capacity". Otherwise the pool has room and the limit is admission
control (``--max-num-seqs``, a router's concurrency cap): "concurrency". A target already
met binds nothing: every gain is 0 and the advice says so.

**Gains add up.** A lever's ``users_after`` is how many such users are served once it is
applied alone, given what binds: while concurrency binds, admission stays where it is, so a
lever that only grows the pool adds nothing (``users_after`` = today's users) until admission
is lifted; ``users_after_with_admission`` says what it would serve then. Its ``gain`` is
``min(users_after, target) - served today``, never negative. The score discounts the gain by
the lever's cost (``COST_WEIGHT``: free flags first, then latency, headroom, rejected
requests, model quality, hardware, product changes); ties go to what a lever adds beyond
lifting admission alone, discounted the same way. The admission lever changes ``--max-num-seqs`` only; a higher
``--gpu-memory-utilization`` is its own lever. No lever sets ``--max-model-len`` above the
model's context. FP8 KV is offered only on cards with FP8 in hardware (SM 8.9+).

**Hybrids.** On a linear-attention or state-space hybrid a user also holds its recurrent state,
a fixed number of blocks however short its context (``spec.hybrid``): for short users most of
what a user costs may be state, which no token lever (KV dtype, shorter contexts,
``--max-model-len``) shrinks. The advice says how much of a user is state, and offers turning
prefix caching off where it is on (a request then holds one state block per state group, not
two or three).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvledger.config import PlannerConfig
from kvledger.errors import KVLedgerError
from kvledger.planner.bandwidth import decode_step, effective_bandwidth, kv_read_bytes, weight_bytes_read_per_step
from kvledger.planner.gpus import GPU
from kvledger.planner.memory_wall import MemoryWall, plan_memory, sequence_blocks, users_at, verdict
from kvledger.spec import ModelSpec
from kvledger.spec.dtypes import QUANTIZED_KV_DTYPES
from kvledger.workload.sampling import check_shared_prefix

CAPACITY_BINDS_AT = 0.9
"""Share of the pool today's users must fill for capacity, not concurrency, to bind
(the scheduler starts preempting as the pool nears full)."""
RAISED_UTILIZATION = 0.95
"""The ``--gpu-memory-utilization`` the utilization lever raises to (vLLM's headroom, see the verdict)."""
SHORTER_CONTEXT_FACTOR = 0.5
"""Retrieval or summarisation is assumed to halve the prompt (the shared prefix excepted)."""
COST_WEIGHT = {
    "none": 1.0,          # prefix caching: no quality cost
    "latency": 0.9,       # admission control: decode steps get slower
    "headroom": 0.85,     # a higher --gpu-memory-utilization: less room outside the pool
    "rejections": 0.8,    # max-model-len: requests above the ceiling are refused
    "quality-fp8": 0.5,   # fp8 KV: quality to validate, native on SM >= 8.9
    "quality-int8": 0.45,  # int8 KV: quality to validate, per-token scales
    "hardware": 0.3,      # tensor parallelism: more GPUs
    "product": 0.25,      # shorter contexts: a product change, slowest to ship
}


@dataclass(frozen=True)
class Lever:
    """One way to serve more users, scored for the scenario."""

    name: str
    flag: str
    users_after: int
    gain_users: int
    score: float
    cost: str
    detail: str
    gain: int = 0
    """The users it adds towards the target given what binds (``gain_users``, never negative)."""
    users_after_with_admission: int = 0
    """Users served if admission were lifted too (the pool's capacity after the lever)."""


@dataclass
class Advice:
    """The scenario's verdict and its ranked levers."""

    model: str
    gpu: str
    binding: str
    users: int
    target_users: int
    tokens_per_user: int
    kv_tokens: int
    kv_pool_bytes: int
    capacity_users: int
    live_tokens_now: int
    pool_share_now: float
    duplicated_prefix_tokens: int
    prefix_share_of_pool: float
    levers: list[Lever] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    target_met: bool = False
    state_share_per_user: float = 0.0
    """Hybrids: the share of one user's blocks that hold its recurrent state (0 for other models)."""


def advise(spec: ModelSpec, gpu: GPU, config: PlannerConfig | None = None, *, prompt_tokens: int, output_tokens: int,
           users: int, target_users: int, shared_prefix_tokens: int = 0, bandwidth: float | None = None,
           **settings: Any) -> Advice:
    """Rank the levers for the scenario on the card ``config`` plans (keyword ``settings`` name its
    fields and replace them, as in ``plan_memory``)."""
    for value, flag in ((prompt_tokens, "--prompt-tokens"), (users, "--users"), (target_users, "--target-users")):
        if value <= 0:
            raise KVLedgerError(f"{flag} must be a positive integer, got {value}")
    if output_tokens < 0 or shared_prefix_tokens < 0:
        raise KVLedgerError("--output-tokens and --shared-prefix-tokens must not be negative")
    check_shared_prefix(shared_prefix_tokens, prompt_tokens, "--prompt-tokens")
    config = replace(config or PlannerConfig(), **settings)
    wall = plan_memory(spec, gpu, config)
    per_user = prompt_tokens + output_tokens
    model_max = spec.max_position_embeddings
    if model_max and per_user > model_max:
        raise KVLedgerError(f"a user of {per_user:,} tokens (--prompt-tokens + --output-tokens) exceeds the model's "
                            f"context, max_position_embeddings = {model_max:,} in {spec.name}'s config")
    capacity = users_at(spec, wall, per_user)
    live_now = users * per_user
    served_now = min(users, capacity)
    target_met = served_now >= target_users
    binding = "capacity" if users >= CAPACITY_BINDS_AT * capacity else "concurrency"
    admission = users if binding == "concurrency" else math.inf  # a full pool admits as many as fit
    bw = effective_bandwidth(gpu, bandwidth)

    def lever(name: str, flag: str, pool_users: int, cost: str, detail: str, lifts_admission: bool = False) -> Lever:
        after = pool_users if lifts_admission else int(min(pool_users, admission))
        gain = 0 if target_met else max(0, min(after, target_users) - served_now)
        return Lever(name, flag, after, gain, round(gain * COST_WEIGHT[cost], 3), cost, detail, gain=gain,
                     users_after_with_admission=pool_users)

    def step_ms(n: int) -> float:
        kv = kv_read_bytes(spec, wall.kv_cache_dtype, n, per_user, wall.tensor_parallel_size)
        return 1e3 * decode_step(weight_bytes_read_per_step(wall, n), kv, n, per_user, bw).step_time_s

    levers: list[Lever] = []
    hybrid_notes: list[str] = []
    state_share = 0.0
    if wall.hybrid:
        state_blocks = wall.state_groups * wall.state_blocks_per_request
        state_share = state_blocks / sequence_blocks(spec, wall, per_user)
        hybrid_notes.append(
            f"{state_share:.0%} of a {per_user:,}-token user's pool bytes are its recurrent state ({state_blocks} of "
            f"{sequence_blocks(spec, wall, per_user)} blocks, {wall.state_bytes_per_request / 2**20:,.1f} MiB of state "
            "per request, fixed): token levers (KV dtype, shorter contexts, --max-model-len) act only on the rest")
        if wall.prefix_caching:
            alt = plan_memory(spec, gpu, config, enable_prefix_caching=False)
            levers.append(lever(
                "no-prefix-caching", "--no-enable-prefix-caching", users_at(spec, alt, per_user), "latency",
                f"a request then holds {alt.state_blocks_per_request} state block per state group instead of "
                f"{wall.state_blocks_per_request}; price: shared prefixes are computed again for every request"))
    duplicated = target_users * shared_prefix_tokens
    if shared_prefix_tokens >= wall.block_size:
        after = users_at(spec, wall, per_user, shared_prefix_tokens)
        levers.append(lever(
            "prefix-caching", "--enable-prefix-caching", after, "none",
            f"the {shared_prefix_tokens:,}-token shared prefix across {target_users:,} users is {duplicated:,} duplicated "
            f"tokens ({duplicated / wall.kv_tokens:,.0%} of the pool); shared once it costs {shared_prefix_tokens:,}; "
            "price: block-table bookkeeping and an invalidation path when the prompt changes"))
    else:
        levers.append(lever("prefix-caching", "--enable-prefix-caching", capacity, "none",
                            "no shared prefix of a whole block (--shared-prefix-tokens): nothing to share for diverse "
                            "one-shot traffic"))

    served = max(1, min(capacity, target_users))
    levers.append(lever(
        "admission-control", f"--max-num-seqs {served}", capacity, "latency",
        f"the pool holds {capacity:,} such users, {users:,} are admitted; free, but each decode step reads more KV: "
        f"{step_ms(max(1, served_now)):,.0f} ms -> {step_ms(served):,.0f} ms per token at {served:,} users; "
        "check the TPOT SLO", lifts_admission=True))

    if not wall.kv_pool_given and wall.gpu_memory_utilization < RAISED_UTILIZATION:
        raised = plan_memory(spec, gpu, config, gpu_memory_utilization=RAISED_UTILIZATION)
        levers.append(lever(
            "gpu-memory-utilization", f"--gpu-memory-utilization {RAISED_UTILIZATION}", users_at(spec, raised, per_user),
            "headroom", f"{raised.kv_tokens:,} tokens instead of {wall.kv_tokens:,}; price: less room outside the pool "
                        f"for CUDA graphs and the sampler's warm-up (the plan's verdict: "
                        f"{verdict(spec, raised).verdict})"))

    max_len = math.ceil(per_user / wall.block_size) * wall.block_size
    if model_max:
        max_len = min(max_len, model_max)
    before = users_at(spec, wall, max(model_max or 0, max_len))
    after = users_at(spec, wall, max_len)
    levers.append(lever(
        "max-model-len", f"--max-model-len {max_len}", after, "rejections",
        f"worst-case reservations: {before:,} users at the model's {model_max or max_len:,} tokens, {after:,} at "
        f"{max_len:,} (this prompt + output); price: longer requests are rejected, so measure the tail first"))

    if wall.kv_cache_dtype not in QUANTIZED_KV_DTYPES:
        kinds = (["fp8"] if gpu.fp8_kv else []) + ["int8"]
        for kind in kinds:
            alt = plan_memory(spec, gpu, config, kv_cache_dtype=kind)
            ratio = alt.num_blocks / wall.num_blocks
            levers.append(lever(
                f"kv-cache-{kind}", f"--kv-cache-dtype {kind}", users_at(spec, alt, per_user), f"quality-{kind}",
                f"{ratio:.2f}x the blocks ({alt.kv_tokens:,} tokens); price: validate quality on long-context "
                "evaluations, never short ones" + ("" if gpu.fp8_kv else f"; FP8 is unavailable on {gpu.sm}, INT8 is the path")))
    notes = [] if gpu.fp8_kv else [
        f"FP8 KV is not offered: {gpu.name} is {gpu.sm}, without FP8 in hardware (SM 8.9+: Ada, Hopper, Blackwell); "
        "vLLM would convert it in its kernels, and the chapter's advice there is int8"]
    notes = hybrid_notes + notes
    if target_met:
        notes.insert(0, f"the target is already met: {served_now:,} users are served and {target_users:,} are wanted; "
                        "no lever is needed")

    tp = wall.tensor_parallel_size
    bigger = _bigger_tensor_parallel(spec, gpu, config, tp)
    if bigger is not None:
        size, alt = bigger
        levers.append(lever(
            "tensor-parallel", f"--tensor-parallel-size {size}", users_at(spec, alt, per_user), "hardware",
            f"{size} GPUs split weights and KV heads: {alt.kv_tokens:,} tokens per rank; price: {size // tp}x the "
            "GPUs and an all-reduce per layer"))

    shorter = int((prompt_tokens - shared_prefix_tokens) * SHORTER_CONTEXT_FACTOR) + shared_prefix_tokens
    levers.append(lever(
        "shorter-contexts", "(retrieval / summarisation)", users_at(spec, wall, shorter + output_tokens), "product",
        f"assuming the prompt shrinks to {shorter:,} tokens; the largest lever in theory and the slowest to ship, "
        "because it is a product change, not a serving flag"))

    def later_score(lv: Lever) -> float:  # what it adds beyond lifting admission alone
        extra = min(lv.users_after_with_admission, target_users) - min(capacity, target_users)
        return max(0, extra) * COST_WEIGHT[lv.cost]

    levers.sort(key=lambda lv: (-lv.score, -later_score(lv), -COST_WEIGHT[lv.cost]))
    return Advice(
        model=spec.name, gpu=gpu.name, binding=binding, users=users, target_users=target_users,
        tokens_per_user=per_user, kv_tokens=wall.kv_tokens, kv_pool_bytes=wall.kv_pool_bytes,
        capacity_users=capacity, live_tokens_now=live_now, pool_share_now=live_now / wall.kv_tokens,
        duplicated_prefix_tokens=duplicated, prefix_share_of_pool=duplicated / wall.kv_tokens,
        levers=levers, notes=notes, target_met=target_met, state_share_per_user=state_share,
    )


def _bigger_tensor_parallel(spec: ModelSpec, gpu: GPU, config: PlannerConfig,
                            tp: int) -> tuple[int, MemoryWall] | None:
    """The first of 2, 4 and 8 times ``tp`` ranks that plans (its ranks split the heads and the
    model fits), with its wall; ``None`` when none does."""
    for size in (2 * tp, 4 * tp, 8 * tp):
        try:
            return size, plan_memory(spec, gpu, config, tensor_parallel_size=size)
        except KVLedgerError:
            continue
    return None
