"""The memory wall, with vLLM's semantics: what is left of the card for the KV cache.

    pool = total x gpu_memory_utilization - weights - activation peak - non-torch - CUDA graphs

``total`` is the memory the device reports (see ``gpus``). vLLM measures the last three terms
by profiling a forward pass; here each has a documented default (below), is shown, and can be
overridden one by one, or all together with ``--overhead``. ``--kv-cache-memory`` replaces the
pool outright, as vLLM's ``kv_cache_memory_bytes`` does.

The pool is cut into blocks of ``block_size`` tokens; one block holds every layer's K and V
(and, for 8-bit caches, their scales) for those tokens on one rank:

    num_blocks = pool // (block_size x (bytes_per_token + scale_bytes_per_token))
    kv_tokens  = num_blocks x block_size        (vLLM's "GPU KV cache size: N tokens")

All sizes are bytes; under tensor parallelism everything is per rank (one card).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

from kvledger.errors import KVLedgerError
from kvledger.planner.gpus import GPU, check_kv_dtype_supported
from kvledger.spec import ModelSpec, kv_bytes, weights_bytes
from kvledger.units import GiB

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default ``--block-size`` on CUDA (tokens per block)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens in vLLM's profiling forward pass (its default ``--max-num-batched-tokens`` for serving)."""
DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's default ``--max-num-seqs``: the sampler's profiling batch."""
NON_TORCH_BYTES = int(0.15 * GiB)
"""Memory allocated outside PyTorch's allocator after start-up (cuBLAS/cuDNN workspaces) at TP 1.
vLLM logs 0.05-0.2 GiB here for single-card 8B models ("non_torch_memory takes 0.12GiB")."""
NON_TORCH_BYTES_TP = int(1.0 * GiB)
"""At TP >= 2 add NCCL communicators and the custom all-reduce buffers: about 1 GiB per rank."""
CUDA_GRAPH_BYTES = int(0.5 * GiB)
"""Captured CUDA graphs (decode batch sizes up to 512): a few hundred MiB for an 8B model."""

CONTEXTS = (2048, 8192, 32768, 131072)
"""The chapter's context lengths for the users-per-context table (tokens)."""
TP_HINT_SIZES = (2, 4, 8, 16, 32, 64)
"""Tensor-parallel sizes the does-not-fit error tries, smallest first."""


@dataclass(frozen=True)
class Overheads:
    """The non-weight terms of the wall, bytes per rank."""

    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    given_total: int | None = None
    """``--overhead``: replaces the sum of the three terms when set."""

    @property
    def total(self) -> int:
        if self.given_total is not None:
            return self.given_total
        return self.activation_bytes + self.non_torch_bytes + self.cuda_graph_bytes


def activation_peak_bytes(spec: ModelSpec, tensor_parallel_size: int = 1,
                          max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                          max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, act_bytes: int = 2) -> int:
    """Peak of PyTorch's allocator in vLLM's profiling pass, estimated from the model's shapes.

    The MLP is the widest point of a layer: for each of ``max_num_batched_tokens`` tokens the
    residual and the normed input (``2 h``) are live beside the gate/up output and the
    activated product (``3 I``, sharded by TP), in the activation dtype (``act_bytes``).
    The sampler adds float32 logits and one working copy for ``max_num_seqs`` rows (the
    vocabulary is sharded by TP). For Llama-3.1-8B this gives about 1.0 GiB; vLLM measured
    1.19 GiB on an A100 ("PyTorch activation peak memory takes 1.19GiB").
    """
    tp = tensor_parallel_size
    if spec.is_moe:
        width = (spec.moe_intermediate_size or spec.intermediate_size) * max(1, spec.num_experts_per_token)
    else:
        width = spec.intermediate_size
    per_token = (2 * spec.hidden_size + 3 * width // tp) * act_bytes
    logits = max_num_seqs * (spec.vocab_size // tp) * 4 * 2
    return max_num_batched_tokens * per_token + logits


def default_overheads(spec: ModelSpec, tensor_parallel_size: int = 1,
                      max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                      max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> Overheads:
    """The documented default of each overhead term."""
    non_torch = NON_TORCH_BYTES + (NON_TORCH_BYTES_TP if tensor_parallel_size >= 2 else 0)
    return Overheads(
        activation_bytes=activation_peak_bytes(spec, tensor_parallel_size, max_num_batched_tokens, max_num_seqs),
        non_torch_bytes=non_torch,
        cuda_graph_bytes=CUDA_GRAPH_BYTES,
    )


def overheads(spec: ModelSpec, tensor_parallel_size: int = 1, *, overhead: int | None = None,
              activation: int | None = None, non_torch: int | None = None, cuda_graph: int | None = None,
              max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> Overheads:
    """The overhead terms at ``tensor_parallel_size``: each user value (bytes per rank) where
    given, else its default; ``overhead`` replaces their sum."""
    terms = default_overheads(spec, tensor_parallel_size, max_num_batched_tokens, max_num_seqs)
    return Overheads(
        activation_bytes=terms.activation_bytes if activation is None else activation,
        non_torch_bytes=terms.non_torch_bytes if non_torch is None else non_torch,
        cuda_graph_bytes=terms.cuda_graph_bytes if cuda_graph is None else cuda_graph,
        given_total=overhead,
    )


@dataclass(frozen=True)
class MemoryWall:
    """One card's memory, term by term, and the KV capacity it leaves. Bytes per rank."""

    model: str
    gpu: str
    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    """``total x utilization``: what the engine may claim."""
    weights_bytes: int
    """Per rank."""
    weights_bytes_all_ranks: int
    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    overhead_bytes: int
    overhead_given: bool
    kv_pool_bytes: int
    kv_pool_given: bool
    kv_cache_dtype: str
    bytes_per_token: int
    """Eq 2.2 per rank (elements only)."""
    scale_bytes_per_token: int
    """Quantization scales per token per rank (0 for 16/32-bit caches)."""
    block_size: int
    block_bytes: int
    num_blocks: int
    kv_tokens: int
    tensor_parallel_size: int
    sliding_window: int | None
    num_sliding_layers: int

    @property
    def token_bytes(self) -> int:
        """What one cached token costs on one rank in every layer: elements plus scales."""
        return self.block_bytes // self.block_size


def plan_memory(
    spec: ModelSpec,
    gpu: GPU,
    *,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    weights_dtype: str | None = None,
    overhead: int | None = None,
    kv_cache_memory: int | None = None,
    activation: int | None = None,
    non_torch: int | None = None,
    cuda_graph: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> MemoryWall:
    """The wall for ``spec`` on ``gpu``; raises KVLedgerError when the model does not fit."""
    if not 0 < gpu_memory_utilization <= 1:
        raise KVLedgerError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    for value, flag in ((block_size, "--block-size"), (tensor_parallel_size, "--tensor-parallel-size")):
        if not isinstance(value, int) or value <= 0:
            raise KVLedgerError(f"{flag} must be a positive integer, got {value!r}")
    for value, flag in ((overhead, "--overhead"), (kv_cache_memory, "--kv-cache-memory"), (activation, "--activation-memory"),
                        (non_torch, "--non-torch-memory"), (cuda_graph, "--cuda-graph-memory")):
        if value is not None and value < 0:
            raise KVLedgerError(f"{flag} must not be negative, got {value}")
    tp = tensor_parallel_size
    kvb = kv_bytes(spec, kv_cache_dtype, tensor_parallel_size=tp)
    check_kv_dtype_supported(gpu, kvb.kv_cache_dtype)
    all_weights = weights_bytes(spec, weights_dtype)
    weights = math.ceil(all_weights / tp)
    overheads_at = partial(overheads, spec, overhead=overhead, activation=activation, non_torch=non_torch,
                           cuda_graph=cuda_graph, max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs)
    terms = overheads_at(tp)
    requested = int(gpu.memory_bytes * gpu_memory_utilization)
    if kv_cache_memory is not None:
        pool = kv_cache_memory
        if weights + pool > gpu.memory_bytes:
            raise KVLedgerError(
                f"weights ({weights / GiB:.2f} GiB per rank) plus --kv-cache-memory ({pool / GiB:.2f} GiB) exceed "
                f"{gpu.name}'s {gpu.memory_bytes / GiB:.2f} GiB; lower --kv-cache-memory or raise --tensor-parallel-size")
    else:
        pool = requested - weights - terms.total
        if pool <= 0:
            fits = _fitting_tp(spec, kv_cache_dtype, block_size, all_weights, requested, tp, overheads_at)
            raise KVLedgerError(_does_not_fit(spec, gpu, weights, terms.total, requested, tp, gpu_memory_utilization,
                                              weights_dtype, fits))
    blocks = kvb.num_blocks(pool, block_size)  # the engine sizes its block pool with the same call
    if blocks == 0:
        raise KVLedgerError(f"the KV pool ({pool:,} bytes) holds not even one block of {block_size} tokens "
                            f"({block_size * kvb.token_bytes:,} bytes); give the cache more memory")
    return MemoryWall(
        model=spec.name, gpu=gpu.name, total_bytes=gpu.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes=requested, weights_bytes=weights, weights_bytes_all_ranks=all_weights,
        activation_bytes=terms.activation_bytes, non_torch_bytes=terms.non_torch_bytes,
        cuda_graph_bytes=terms.cuda_graph_bytes, overhead_bytes=terms.total, overhead_given=overhead is not None,
        kv_pool_bytes=pool, kv_pool_given=kv_cache_memory is not None, kv_cache_dtype=kvb.kv_cache_dtype,
        bytes_per_token=kvb.bytes_per_token, scale_bytes_per_token=kvb.scale_bytes_per_token,
        block_size=block_size, block_bytes=block_size * kvb.token_bytes, num_blocks=blocks,
        kv_tokens=blocks * block_size, tensor_parallel_size=tp, sliding_window=spec.sliding_window,
        num_sliding_layers=spec.num_sliding_layers,
    )


def _fitting_tp(spec: ModelSpec, kv_cache_dtype: str, block_size: int, all_weights: int, requested: int, tp: int,
                overheads_at: Callable[[int], Overheads]) -> int | None:
    """The smallest tensor-parallel size above ``tp`` whose ranks split the heads and leave a KV
    pool of at least one block, with ``overheads_at(size)`` as the overhead there; ``None`` when
    none does."""
    for size in TP_HINT_SIZES:
        if size <= tp:
            continue
        try:
            kvb = kv_bytes(spec, kv_cache_dtype, tensor_parallel_size=size)
        except KVLedgerError:  # the heads do not split over this many ranks
            continue
        pool = requested - math.ceil(all_weights / size) - overheads_at(size).total
        if kvb.num_blocks(pool, block_size) > 0:
            return size
    return None


def _does_not_fit(spec: ModelSpec, gpu: GPU, weights: int, overhead: int, requested: int, tp: int,
                  utilization: float, weights_dtype: str | None, fits: int | None) -> str:
    """The one-line error for weights (plus overhead) larger than the card, with a TP that fits."""
    hint = (f"--tensor-parallel-size {fits} would fit" if fits else
            f"no tensor-parallel size up to {TP_HINT_SIZES[-1]} fits; use a bigger card")
    return (f"{spec.name} does not fit on {gpu.name}: weights {weights / GiB:.2f} GiB per rank (TP {tp}"
            f"{', ' + weights_dtype if weights_dtype else ''}) + overhead {overhead / GiB:.2f} GiB > "
            f"{gpu.memory_bytes / GiB:.2f} GiB x {utilization} = {requested / GiB:.2f} GiB; {hint}"
            f"{', or quantize the weights (--weights-dtype int8)' if not weights_dtype else ''}")


# ---------------------------------------------------------------------------- sequences
def sequence_blocks(spec: ModelSpec, wall: MemoryWall, tokens: int) -> int:
    """Blocks one sequence of ``tokens`` tokens occupies in the pool.

    A full-attention model takes ``ceil(tokens / block_size)`` blocks. A model with
    sliding-window layers caches only the window in those layers, so its sequence costs
    fewer bytes; the equivalent count of whole blocks is used."""
    padded = math.ceil(tokens / wall.block_size) * wall.block_size
    if not wall.num_sliding_layers or not wall.sliding_window or tokens <= wall.sliding_window:
        return padded // wall.block_size
    kvb = kv_bytes(spec, wall.kv_cache_dtype, tokens=padded, tensor_parallel_size=wall.tensor_parallel_size)
    return math.ceil(kvb.slot_bytes / wall.block_bytes)


def users_at(spec: ModelSpec, wall: MemoryWall, tokens: int, shared_prefix: int = 0) -> int:
    """Concurrent sequences of ``tokens`` cached tokens each that the pool holds. With prefix
    caching, the first ``shared_prefix`` tokens (whole blocks only, as blocks are what is shared)
    are held once for every sequence."""
    shared_blocks = shared_prefix // wall.block_size
    per_sequence = sequence_blocks(spec, wall, tokens) - shared_blocks
    return max(0, (wall.num_blocks - shared_blocks) // max(per_sequence, 1))


def max_fitting_length(spec: ModelSpec, wall: MemoryWall) -> int | None:
    """The longest single sequence (tokens) the pool holds, at most the model's context
    (``max_position_embeddings``): vLLM's "estimated maximum model length", which it too searches
    up to the model's limit. A sequence costs at least its full-attention layers' share of every
    token, so without a context limit the pool bounds it; ``None`` when nothing does (every layer
    slides, the config names no context, and one window fits)."""
    limits = [spec.max_position_embeddings] if spec.max_position_embeddings else []
    if spec.num_full_layers:
        limits.append(wall.kv_tokens * spec.num_layers // spec.num_full_layers)
    hi = min(limits) if limits else spec.sliding_window
    if not limits and sequence_blocks(spec, wall, hi) <= wall.num_blocks:
        return None
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sequence_blocks(spec, wall, mid) <= wall.num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_max_model_len(spec: ModelSpec, wall: MemoryWall, max_model_len: int) -> str | None:
    """``None`` when one ``max_model_len`` sequence can run, else vLLM's start-up error, with numbers:
    longer than the model's context (``max_position_embeddings``), or more than the pool holds."""
    model_max = spec.max_position_embeddings
    if model_max and max_model_len > model_max:
        return (f"--max-model-len {max_model_len:,} is greater than the model's context, max_position_embeddings "
                f"= {model_max:,} in {spec.name}'s config; vLLM refuses it (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, "
                "at the risk of wrong outputs); lower --max-model-len")
    need = sequence_blocks(spec, wall, max_model_len)
    if need <= wall.num_blocks:
        return None
    need_bytes = need * wall.block_bytes
    return (f"to serve at least one request with max_model_len ({max_model_len:,}), {need_bytes / GiB:.2f} GiB KV cache "
            f"is needed, which is larger than the available KV cache memory ({wall.kv_pool_bytes / GiB:.2f} GiB); "
            f"based on the available memory, the estimated maximum model length is {max_fitting_length(spec, wall):,}; "
            "try increasing --gpu-memory-utilization or decreasing --max-model-len")


def useful_work(users: int) -> str:
    """Whether a decode batch of ``users`` keeps the card doing useful work (the chapter's column).

    Every step reads all the weights once for the whole batch, so a batch below 8 spends the
    card's bandwidth mostly on weights for a handful of tokens ("no"); 8-31 is "marginal";
    32 and more is a fat batch ("yes")."""
    if users >= 32:
        return "yes"
    return "marginal" if users >= 8 else "no"
