"""Caching removes compute, not traffic: the bytes a decode step moves, and what they cost.

A decode step reads the weights once (shared by the whole batch) and every sequence's own
live KV cache. At a sustained bandwidth ``bw`` (bytes/s):

    step_time = (weights read + sum over sequences of KV bytes) / bw
    tokens/s  = batch / step_time          (one token per sequence per step)

**Weights read** (``weight_bytes_read_per_step``) are the resident weights less what a step does
not stream: a vision tower. The input embedding table is counted in full, as the chapter counts
"all the weights once per step" (a step really gathers one row of it per sequence: for
Llama-3.1-8B that overstates the read by 0.98 GiB of 14.96).
For a MoE model, of each layer's ``E`` routed experts a batch of ``B`` sequences with top-``k``
routing touches ``E x (1 - (1 - k/E)^B)`` distinct experts in expectation, **assuming uniform,
independent routing** (real routers are skewed, which touches fewer); shared experts and the
router are always read. gpt-oss-120b at batch 1 reads its attention, router, ``lm_head`` and 4
experts per layer: about 5.7 GiB, not its 61 GiB of weights.

KV traffic equals weight traffic at ``weights / bytes_per_token`` live tokens: the crossover.
Below it, quantizing weights pays most; above it, the cache owns the bandwidth. A bound, not a
benchmark: fused kernels beat parts of it. All bytes are per rank (one card).

One arithmetic serves every KV read: ``kv_read_bytes`` (Eq 2.2's elements plus per-token scales,
sliding layers reading only their window). Where only a count of live tokens is known (the
crossover, the trace replay), each live token costs ``live_token_bytes(context)``: the read of
one ``context``-token sequence divided by its tokens. That is exact when every sequence holds
``context`` tokens; for a full-attention model it is exact for any mix of lengths (every token
costs every layer); for a sliding-window model with mixed lengths it is the cost at a typical
length, an approximation, since the window caps each sequence, not the sum.

A hybrid model's state layers read their whole per-request state and write it back every decode
step, however long the context: ``kv_read_bytes`` adds ``2 x users x state_bytes_per_request``
(read and write), so a short-context batch of a hybrid can move more state than K and V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.planner.gpus import GPU
from kvledger.spec import ModelSpec, count_params, kv_bytes

DEFAULT_BANDWIDTH_EFFICIENCY = 0.75
"""Share of the datasheet bandwidth a decode step sustains. The chapter's "realistically
achievable ~1.5 TB/s" on an A100 80 GB (2.039 TB/s peak) is 0.74 of peak."""
CROSSOVER_CONTEXT = 8192
"""Tokens per conversation in which the crossover is counted when no context is given (the chapter's 8K)."""


@dataclass(frozen=True)
class DecodeStep:
    """Bytes and time of one decode step for ``users`` sequences of ``context`` tokens."""

    users: int
    context: int
    bandwidth_bytes_per_s: float
    weights_bytes_per_step: int
    kv_bytes_per_step: int
    total_bytes_per_step: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_user: float
    kv_byte_share: float


def effective_bandwidth(gpu: GPU, bandwidth: float | None = None,
                        efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY) -> float:
    """``--bandwidth`` as given (absolute), else the card's peak times ``efficiency``. Bytes/s."""
    return float(bandwidth) if bandwidth is not None else gpu.bandwidth_bytes_per_s * efficiency


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts per layer that ``batch`` sequences touch under uniform, independent top-k
    routing: ``E x (1 - (1 - k/E)^B)``."""
    if not num_experts:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** max(batch, 0))


def weight_bytes_read_per_step(wall, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` sequences streams on one rank (see the module)."""
    streamed = wall.weights_bytes - wall.embedding_table_bytes
    if not wall.num_experts or not wall.expert_bytes:
        return streamed
    touched = expected_experts(wall.num_experts, wall.experts_per_token, batch) / wall.num_experts
    return int(streamed - wall.expert_bytes * (1 - touched))


def kv_read_bytes(spec: ModelSpec, kv_cache_dtype: str, users: int, context: int, tensor_parallel_size: int = 1) -> int:
    """KV bytes one step moves on one rank: Eq 2.2 for ``users`` x ``context`` plus scales, and a
    hybrid's per-request state read and written back (``2 x users x state``)."""
    kvb = kv_bytes(spec, kv_cache_dtype, tokens=context, batch=users, tensor_parallel_size=tensor_parallel_size)
    return kvb.slot_bytes + STATE_READ_WRITE * kvb.total_state_bytes


STATE_READ_WRITE = 2
"""A decode step reads a hybrid's recurrent state and writes the updated one back."""


def decode_step(weights_bytes: int, kv_bytes_per_step: int, users: int, context: int, bandwidth: float) -> DecodeStep:
    """The step for a batch whose KV read is ``kv_bytes_per_step`` bytes (per rank)."""
    total = weights_bytes + kv_bytes_per_step
    step = total / bandwidth
    return DecodeStep(
        users=users, context=context, bandwidth_bytes_per_s=bandwidth, weights_bytes_per_step=weights_bytes,
        kv_bytes_per_step=kv_bytes_per_step, total_bytes_per_step=total, step_time_s=step,
        tokens_per_s=users / step, tokens_per_s_per_user=1 / step, kv_byte_share=kv_bytes_per_step / total,
    )


def live_token_bytes(spec: ModelSpec, kv_cache_dtype: str, context: int, tensor_parallel_size: int = 1) -> float:
    """KV bytes a step reads per live token when sequences hold ``context`` tokens (per rank):
    ``kv_read_bytes`` of one such sequence over ``context``. Every layer's full cost for a
    full-attention model; less beyond the window for a sliding-window model."""
    return kv_read_bytes(spec, kv_cache_dtype, 1, context, tensor_parallel_size) / context


def step_time(weights_bytes: int, live_tokens: float, token_bytes: float, bandwidth: float) -> float:
    """Seconds per decode step with ``live_tokens`` cached tokens in the batch, each read at
    ``token_bytes`` (``live_token_bytes``)."""
    return (weights_bytes + live_tokens * token_bytes) / bandwidth


def crossover_tokens(weights_bytes: int, token_bytes: float) -> int:
    """Live tokens at which a step's KV traffic equals its weight traffic (rounded up), each live
    token read at ``token_bytes`` (``live_token_bytes``)."""
    return math.ceil(weights_bytes / token_bytes)


def crossover_for(wall, token_bytes: float, context: int) -> int:
    """The crossover when the weights read depend on the batch (MoE): the live tokens ``T`` with
    ``T x token_bytes = weight_bytes_read_per_step(T / context sequences)``, found by fixed-point
    iteration from one sequence (the read grows with the batch, so it converges from below)."""
    batch, tokens = 1, 0
    for _ in range(64):
        tokens = crossover_tokens(weight_bytes_read_per_step(wall, batch), token_bytes)
        nxt = max(1, math.ceil(tokens / context))
        if nxt == batch:
            break
        batch = nxt
    return tokens


PREFILL_EFFICIENCY = 0.5
"""Share of the card's dense bf16 FLOP/s a prefill sustains (model FLOP utilization)."""


def active_params(spec: ModelSpec) -> int:
    """Parameters one token passes through: all of them, less the experts it is not routed to."""
    params = count_params(spec)
    if not spec.is_moe:
        return params.total
    unused = params.expert * (1 - spec.num_experts_per_token / spec.num_experts)
    return int(params.total - unused)


def prefill_seconds_per_token(spec: ModelSpec, gpu: GPU, tensor_parallel_size: int = 1,
                              efficiency: float = PREFILL_EFFICIENCY) -> float:
    """Compute-bound prefill: ``2 x active parameters`` FLOPs per token, split over the ranks."""
    return 2 * active_params(spec) / tensor_parallel_size / (gpu.bf16_flops * efficiency)
