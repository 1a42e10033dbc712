"""The memory wall, with vLLM's semantics: what is left of the card for the KV cache.

    pool = total x gpu_memory_utilization - weights - activation peak - non-torch memory

``total`` is the memory the device reports (see ``gpus``). vLLM measures the last two terms
by profiling a forward pass of ``max_num_batched_tokens`` tokens and a sampler pass over
``max_num_seqs`` rows; here each has a formula of the model's shapes and the flags (below),
calibrated on vLLM 0.19's own start-up logs (``kvledger.planner.validation``), shown, and
overridable one by one, or all together with ``--overhead``. ``--kv-cache-memory`` replaces
the pool outright, as vLLM's ``kv_cache_memory_bytes`` does.

Outside the pool, in the ``1 - gpu_memory_utilization`` share of the card, vLLM 0.19 also
needs the CUDA context and the communicators it creates at start-up, the CUDA graphs it
captures *after* sizing the pool (its log: "CUDA graph memory profiling will be enabled by
default" in a later release), and the sampler's warm-up over ``max_num_seqs`` dummy requests.
When that headroom is short the engine runs out of memory after the pool is allocated (the
gpt-oss-20b runs of the table): the verdict is then "tight", not "fits".

The pool is cut into blocks of ``block_size`` tokens; one block holds every layer's K and V
(and, for quantized caches, their scales) for those tokens on one rank:

    num_blocks = pool // (block_size x token bytes)
    kv_tokens  = num_blocks x block_size        (vLLM's "GPU KV cache size: N tokens")

All sizes are bytes; under tensor parallelism everything is per rank (one card), under
pipeline parallelism it is the last stage's (the one with ``lm_head`` and the sampler, whose
pool is the smallest and so sets vLLM's count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from kvledger.config import (CUDA_BLOCK_SIZE, LARGE_CARD_MAX_NUM_BATCHED_TOKENS, LARGE_CARD_MAX_NUM_SEQS,
                             MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, VLLM_BLOCK_SIZES, PlannerConfig)
from kvledger.errors import KVLedgerError
from kvledger.planner.gpus import GPU, kv_dtype_warning
from kvledger.spec import ModelSpec, kv_bytes
from kvledger.spec.head_split import split_heads
from kvledger.spec.hybrid import DEFAULT_VLLM_VERSION, HybridLayout, layout_for, vllm_rules
from kvledger.spec.weights import MODEL_DTYPES, WeightBytes, model_dtype, weight_bytes_breakdown
from kvledger.units import GiB, MiB

LARGE_CARD_BYTES = 70 * GiB
"""vLLM raises its serving defaults on cards of at least this much memory, the A100 excepted
(``LARGE_CARD_MAX_NUM_SEQS``, ``LARGE_CARD_MAX_NUM_BATCHED_TOKENS``)."""

# ----- the activation peak of the profiling pass (calibrated on the validation table)
SAMPLER_FP32_COPIES = 3
"""The sampler pass holds the logits of ``max_num_seqs`` rows in the model dtype plus three
float32 working copies (the cast, softmax, log-probabilities): ``max_num_seqs x vocab x
(3 x 4 + s)`` bytes. The full vocabulary on every TP rank (vLLM gathers the logits)."""
RESIDUAL_COPIES = 3
"""Beside the sampler, the forward pass keeps three hidden-state tensors of every profiled token
live (residual, normed input, output): ``3 x max_num_batched_tokens x hidden x s``."""
VISION_PROFILE_BYTES = int(0.25 * GiB)
"""A multimodal checkpoint (``vision_config`` in config.json) also profiles its vision encoder
on dummy images: the Gemma-3 rows of the table measure about 0.25 GiB more."""

# ----- non-torch memory and what lies outside the pool
NON_TORCH_BYTES = int(0.25 * GiB)
"""Memory allocated outside PyTorch's allocator during the profiling pass at TP 1 (cuBLAS
workspaces): vLLM 0.19 logs 0.24-0.27 GiB on an H100 for every dense and MoE model of the table."""
NON_TORCH_TP_BYTES = int(2.0 * GiB)
NON_TORCH_TP_PER_RANK_BYTES = int(0.035 * GiB)
"""At TP >= 2 the first forward also allocates the NCCL and custom all-reduce buffers:
2.06-2.11 GiB per rank at TP 2 and 2.13-2.21 at TP 4 in the table, ``2 GiB + 0.035 GiB x TP``."""
NON_TORCH_PP_BYTES = int(0.07 * GiB)
"""At PP >= 2 (TP 1) the stages' forward allocates only 0.07 GiB outside PyTorch (the table);
their communicators are created at start-up, before the profile (``COMM_INIT_BYTES``)."""
CUDA_CONTEXT_BYTES = int(0.51 * GiB)
"""The CUDA context of the engine process, in use before the model loads ("init memory
snapshot: cuda_memory=0.51GiB"): outside vLLM's budget, out of the headroom."""
COMM_INIT_BYTES = int(1.0 * GiB)
"""The communicators created at start-up when TP or PP >= 2: the table's snapshots read
1.43-2.07 GiB before the model loads, 0.9-1.5 GiB above the CUDA context."""
CUDA_GRAPH_BYTES_PER_SIZE = 12 * MiB
CUDA_GRAPH_BYTES_PER_SIZE_LAYER = MiB // 4
"""Captured CUDA graphs (piecewise and full, per captured batch size): ``12 MiB + 0.25 MiB x
layers`` per size fits the table's measured graph pools (0.64-1.84 GiB) within about 25%."""
CUDA_GRAPH_MAX_CAPTURE = 512
"""vLLM's largest captured batch size; sizes 1, 2, 4, then every 8 to 256, every 16 above:
51 sizes up to 512."""
CUDA_GRAPH_MAX_CAPTURE_BY_ARCH = {"GptOssForCausalLM": 1024}
"""vLLM's per-architecture configuration raises the capture size for these (gpt-oss: 83 sizes)."""
HEADROOM_MIN_MARGIN_BYTES = int(0.5 * GiB)
"""The least memory that must stay free outside the pool once the CUDA context, the
communicators, the CUDA graphs and one float32 copy of the sampler's warm-up logits are counted;
``headroom_margin`` asks for twice the warm-up when that is more."""
WARMUP_MARGIN_FACTOR = 2
"""The allocator can strand as much again as the warm-up asks for: gpt-oss-20b's warm-up asked
786 MiB with 552 MiB free and 1.78 GiB reserved but unallocated, and ran out of memory."""

TOKEN_SPREAD = 0.03
"""How far the estimated KV tokens may be from vLLM's: the validation table holds every started
run within it (its worst is 1.66%, see BENCHMARKS.md). A pool that holds the request by less
than this share of itself is "tight"."""

CONTEXTS = (2048, 8192, 32768, 131072)
"""The chapter's context lengths for the users-per-context table (tokens)."""
TP_HINT_SIZES = (2, 4, 8, 16, 32, 64)
"""Tensor-parallel sizes the does-not-fit error tries, smallest first."""


def default_max_num_seqs(gpu: GPU) -> int:
    """vLLM's serving default of ``--max-num-seqs`` on ``gpu``: 1024 on cards of 70 GiB and
    more except the A100, else 256."""
    return LARGE_CARD_MAX_NUM_SEQS if _large_card(gpu) else MAX_NUM_SEQS


def default_max_num_batched_tokens(gpu: GPU) -> int:
    """vLLM's serving default of ``--max-num-batched-tokens`` on ``gpu``: 8192 on large cards, else 2048."""
    return LARGE_CARD_MAX_NUM_BATCHED_TOKENS if _large_card(gpu) else MAX_NUM_BATCHED_TOKENS


def _large_card(gpu: GPU) -> bool:
    return gpu.memory_bytes >= LARGE_CARD_BYTES and "a100" not in gpu.name


@dataclass(frozen=True)
class Overheads:
    """The non-weight terms of the wall inside the pool's budget, bytes per rank."""

    activation_bytes: int
    non_torch_bytes: int
    given_total: int | None = None
    """``--overhead``: replaces the sum of the two terms when set."""

    @property
    def total(self) -> int:
        if self.given_total is not None:
            return self.given_total
        return self.activation_bytes + self.non_torch_bytes


def activation_peak_bytes(spec: ModelSpec, tensor_parallel_size: int = 1,
                          max_num_batched_tokens: int = LARGE_CARD_MAX_NUM_BATCHED_TOKENS,
                          max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS, act_bytes: int = 2) -> int:
    """Peak of PyTorch's allocator in vLLM's profiling pass (bytes per rank), from the shapes.

    The sampler term dominates: ``max_num_seqs x vocab x (3 x 4 + act_bytes)`` (see
    ``SAMPLER_FP32_COPIES``), not sharded by TP. Beside it the forward pass keeps
    ``RESIDUAL_COPIES`` hidden states per token. A MoE layer adds its routed activations, the
    ``top_k`` copies of each token entering the experts and the experts' gate/up outputs:
    ``tokens x top_k x (hidden + 2 x moe_intermediate / TP) x act_bytes``. A multimodal
    checkpoint adds its vision encoder's profile. Llama-3.1-8B on an H100 (1024 rows, 8192
    tokens): 1.90 GiB; vLLM 0.19 measured 1.89 GiB ("torch peak memory increase").
    """
    tp = tensor_parallel_size
    sampler = max_num_seqs * spec.vocab_size * (SAMPLER_FP32_COPIES * 4 + act_bytes)
    residual = RESIDUAL_COPIES * max_num_batched_tokens * spec.hidden_size * act_bytes
    moe = 0
    if spec.is_moe:
        moe_i = spec.moe_intermediate_size or spec.intermediate_size
        moe = max_num_batched_tokens * spec.num_experts_per_token * (spec.hidden_size + 2 * moe_i // tp) * act_bytes
    vision = VISION_PROFILE_BYTES if isinstance(spec.config.get("vision_config"), dict) else 0
    return sampler + residual + moe + vision


def non_torch_bytes(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """Memory allocated outside PyTorch during the profiling pass, per rank (see the constants)."""
    if tensor_parallel_size >= 2:
        return NON_TORCH_TP_BYTES + NON_TORCH_TP_PER_RANK_BYTES * tensor_parallel_size
    if pipeline_parallel_size >= 2:
        return NON_TORCH_PP_BYTES
    return NON_TORCH_BYTES


def cuda_graph_capture_sizes(spec: ModelSpec, max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS) -> int:
    """How many batch sizes vLLM captures: 1, 2, 4, every 8 to 256, every 16 above, up to
    ``min(max capture, 2 x max_num_seqs)`` (the architecture's max capture where vLLM raises it)."""
    archs = spec.config.get("architectures") or []
    top = max([CUDA_GRAPH_MAX_CAPTURE] + [CUDA_GRAPH_MAX_CAPTURE_BY_ARCH.get(a, 0) for a in archs])
    top = min(top, 2 * max_num_seqs)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
    return len([n for n in sizes if n <= top])


def cuda_graph_bytes(spec: ModelSpec, stage_layers: int, max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS) -> int:
    """CUDA graph memory vLLM captures after the pool is sized, per rank (bytes)."""
    per_size = CUDA_GRAPH_BYTES_PER_SIZE + CUDA_GRAPH_BYTES_PER_SIZE_LAYER * stage_layers
    return cuda_graph_capture_sizes(spec, max_num_seqs) * per_size


def sampler_warmup_bytes(spec: ModelSpec, max_num_seqs: int) -> int:
    """One float32 copy of the logits of ``max_num_seqs`` dummy requests: what vLLM's sampler
    warm-up allocates after the pool (gpt-oss-20b: "Tried to allocate 786.00 MiB")."""
    return max_num_seqs * spec.vocab_size * 4


def stage_layers(spec: ModelSpec, pipeline_parallel_size: int = 1) -> int:
    """Layers on the last pipeline stage: vLLM splits evenly and gives the remainder to the
    stages before the last."""
    if pipeline_parallel_size > spec.num_layers:
        raise KVLedgerError(f"--pipeline-parallel-size {pipeline_parallel_size} exceeds the {spec.num_layers} layers "
                            f"of {spec.name}")
    return spec.num_layers // pipeline_parallel_size


def overheads(spec: ModelSpec, tensor_parallel_size: int = 1, *, overhead: int | None = None,
              activation: int | None = None, non_torch: int | None = None,
              max_num_batched_tokens: int = LARGE_CARD_MAX_NUM_BATCHED_TOKENS,
              max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS, pipeline_parallel_size: int = 1,
              act_bytes: int = 2) -> Overheads:
    """The in-budget overhead terms at ``tensor_parallel_size``: each user value (bytes per
    rank) where given, else its formula; ``overhead`` replaces their sum."""
    return Overheads(
        activation_bytes=(activation_peak_bytes(spec, tensor_parallel_size, max_num_batched_tokens, max_num_seqs,
                                                act_bytes) if activation is None else activation),
        non_torch_bytes=non_torch_bytes(tensor_parallel_size, pipeline_parallel_size) if non_torch is None else non_torch,
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
    """Per rank (of the last pipeline stage)."""
    weights_bytes_all_ranks: int
    activation_bytes: int
    non_torch_bytes: int
    overhead_bytes: int
    """Inside the budget: activation peak + non-torch memory (or ``--overhead``)."""
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
    pipeline_parallel_size: int = 1
    dtype: str = "bfloat16"
    """The model dtype the weights and an ``auto`` cache take (vLLM's ``--dtype``)."""
    quantization: str | None = None
    max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS
    max_num_batched_tokens: int = LARGE_CARD_MAX_NUM_BATCHED_TOKENS
    cuda_graph_bytes: int = 0
    """Outside the pool: captured after it is sized (vLLM 0.19)."""
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    comm_init_bytes: int = 0
    sampler_warmup_bytes: int = 0
    headroom_bytes: int = 0
    """``total - requested``: where the CUDA context, communicators, graphs and warm-up must fit."""
    headroom_left_bytes: int = 0
    """What is left of ``headroom_bytes`` after those terms (negative: short)."""
    expert_bytes: int = 0
    """Per rank: the routed experts' share of ``weights_bytes`` (a decode step reads only the touched ones)."""
    embedding_table_bytes: int = 0
    """Per rank: what is resident but not streamed by a decode step: a vision tower. (The input
    embedding table stays in the read, as the chapter counts it, though a step gathers only one
    row of it per sequence.)"""
    num_experts: int = 0
    experts_per_token: int = 0
    engine_block_bytes: int = 0
    """One block of this project's engine's pool: ``block_size`` tokens of one KV group's layers
    (equal to ``block_bytes`` for a uniform model, a sixth of it for Gemma-3's six groups)."""
    engine_group_layers: int = 0
    """Layers of one KV group (``L`` for a uniform model): what one engine block holds."""
    engine_num_blocks: int = 0
    """Blocks of ``engine_block_bytes`` in the same pool: what the engine allocates."""
    engine_pool_bytes: int = 0
    """The engine's pool tensors, scales included: ``engine_num_blocks x engine_block_bytes``
    (plus any per-layer scales): its measured cache bytes, to the byte."""
    warnings: tuple[str, ...] = ()
    """What the plan stands on but a user should know (fp8 on a card without FP8 hardware)."""
    vllm_version: str = DEFAULT_VLLM_VERSION
    """The vLLM release whose rules the plan follows (``--vllm-version``)."""
    hybrid: bool = False
    """A linear-attention or state-space hybrid: the pool is vLLM's hybrid one (``spec.hybrid``);
    ``block_bytes`` is then one block of ``group_size`` layers' pages, state or attention."""
    state_bytes_per_request: int = 0
    """Per rank: every state layer's state for one request, unpadded."""
    state_page_bytes: int = 0
    """Per rank: one state layer's state, unpadded (vLLM's mamba page)."""
    page_bytes: int = 0
    """Per rank: one layer's page, ``block_size`` tokens of attention or one padded state."""
    state_padding_pct: float = 0.0
    """vLLM's "Padding mamba page size by X%"."""
    block_size_raised: bool = False
    """vLLM set the block size to fit the state ("Setting attention block size to N tokens")."""
    group_size: int = 0
    attention_groups: int = 0
    state_groups: int = 0
    state_blocks_per_request: int = 0
    """Blocks a request holds in each state group, from admission to finish."""
    prefix_caching: bool | None = None
    """Hybrid models: whether prefix caching is on (``--enable-prefix-caching``, else the release's default)."""
    mamba_ssm_cache_dtype: str = "auto"
    refuses_max_num_seqs: bool = False
    """Whether this vLLM release refuses to start with ``max_num_seqs`` above the blocks (hybrids)."""
    tokens_at_max_model_len: int | None = None
    """The ``max_model_len`` the hybrid token line and concurrency are printed at."""

    @property
    def token_bytes(self) -> int:
        """What one cached token costs on one rank in every layer: elements plus scales."""
        return self.block_bytes // self.block_size


def plan_memory(spec: ModelSpec, gpu: GPU, config: PlannerConfig | None = None, **settings) -> MemoryWall:
    """The wall for ``spec`` on ``gpu`` under ``config`` (:class:`kvledger.config.PlannerConfig`;
    keyword arguments name its fields and replace them); raises KVLedgerError when the model does
    not fit. Unset settings take vLLM's defaults (see ``PlannerConfig``); ``max_model_len`` is
    where a hybrid model's token line (vLLM 0.20+) is printed."""
    c = replace(config or PlannerConfig(), **settings)
    if not 0 < c.gpu_memory_utilization <= 1:
        raise KVLedgerError(f"--gpu-memory-utilization must be in (0, 1], got {c.gpu_memory_utilization}")
    rules = vllm_rules(c.vllm_version)
    given_block_size = block_size = c.block_size
    if block_size is None:
        block_size = CUDA_BLOCK_SIZE
    for value, flag in ((block_size, "--block-size"), (c.tensor_parallel_size, "--tensor-parallel-size"),
                        (c.pipeline_parallel_size, "--pipeline-parallel-size")):
        if not isinstance(value, int) or value <= 0:
            raise KVLedgerError(f"{flag} must be a positive integer, got {value!r}")
    if block_size not in VLLM_BLOCK_SIZES:
        raise KVLedgerError(f"--block-size {block_size} is not one vLLM accepts; choose one of "
                            f"{', '.join(map(str, VLLM_BLOCK_SIZES))}")
    for value, flag in ((c.overhead, "--overhead"), (c.kv_cache_memory, "--kv-cache-memory"),
                        (c.activation, "--activation-memory"), (c.non_torch, "--non-torch-memory"),
                        (c.cuda_graph, "--cuda-graph-memory")):
        if value is not None and value < 0:
            raise KVLedgerError(f"{flag} must not be negative, got {value}")
    seqs = c.max_num_seqs if c.max_num_seqs is not None else default_max_num_seqs(gpu)
    batched = c.max_num_batched_tokens if c.max_num_batched_tokens is not None else default_max_num_batched_tokens(gpu)
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    check_vllm_heads(spec, tp)
    layers = stage_layers(spec, pp)
    unq = model_dtype(spec, c.dtype)
    act_bytes = MODEL_DTYPES[unq]
    kvb = kv_bytes(spec, c.kv_cache_dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, model_dtype=unq,
                   mamba_ssm_cache_dtype=c.mamba_ssm_cache_dtype)
    layout: HybridLayout | None = None
    if spec.is_hybrid:
        layout = layout_for(kvb, mla=spec.is_mla, block_size=given_block_size, prefix_caching=c.enable_prefix_caching,
                            vllm_version=rules.name)
        block_size = layout.block_size
    block_bytes = layout.block_bytes if layout else block_size * kvb.token_bytes
    warning = kv_dtype_warning(gpu, kvb.kv_cache_dtype)
    parts_at = partial(weight_bytes_breakdown, spec, c.weights_dtype, dtype=c.dtype, quantization=c.quantization,
                       compute_capability=gpu.compute_capability)  # mxfp4 experts as the card's kernel holds them
    parts = parts_at(tensor_parallel_size=tp)
    all_weights = parts.total
    # --overhead is the chapter's whole bill beside the checkpoint's tensors: the rotary table is in it
    weights = parts.per_rank(spec.num_layers, layers, tp, first_stage=pp == 1, last_stage=True,
                             rope_cache=c.overhead is None)
    overheads_at = partial(overheads, spec, overhead=c.overhead, activation=c.activation, non_torch=c.non_torch,
                           max_num_batched_tokens=batched, max_num_seqs=seqs, pipeline_parallel_size=pp,
                           act_bytes=act_bytes)
    terms = overheads_at(tp)
    requested = int(gpu.memory_bytes * c.gpu_memory_utilization)

    def blocks_at(size: int) -> int:
        """The blocks this plan's pool would hold at tensor-parallel size ``size`` (for the hint)."""
        kvb_at = kv_bytes(spec, c.kv_cache_dtype, tensor_parallel_size=size, pipeline_parallel_size=pp,
                          model_dtype=unq, mamba_ssm_cache_dtype=c.mamba_ssm_cache_dtype)
        weights_at = parts_at(tensor_parallel_size=size).per_rank(spec.num_layers, layers, size, first_stage=pp == 1,
                                                                  last_stage=True, rope_cache=c.overhead is None)
        pool_at = requested - weights_at - overheads_at(size).total
        if spec.is_hybrid:
            return layout_for(kvb_at, mla=spec.is_mla, block_size=given_block_size,
                              prefix_caching=c.enable_prefix_caching, vllm_version=rules.name).num_blocks(pool_at)
        return kvb_at.num_blocks(pool_at, block_size)

    if c.kv_cache_memory is not None:
        pool = c.kv_cache_memory
        if weights + pool > gpu.memory_bytes:
            raise KVLedgerError(
                f"weights ({weights / GiB:.2f} GiB per rank) plus --kv-cache-memory ({pool / GiB:.2f} GiB) exceed "
                f"{gpu.name}'s {gpu.memory_bytes / GiB:.2f} GiB; lower --kv-cache-memory or raise --tensor-parallel-size")
    else:
        pool = requested - weights - terms.total
        if pool <= 0:
            fits = _fitting_tp(spec, tp, blocks_at)
            raise KVLedgerError(_does_not_fit(spec, gpu, weights, terms.total, requested, tp, c.gpu_memory_utilization,
                                              c.weights_dtype, fits))
    if layout:  # vLLM's hybrid pool: blocks of a page per group layer (the engine has no hybrid path)
        blocks = engine_blocks = layout.num_blocks(pool)
    else:
        blocks = kvb.num_blocks(pool, block_size)  # vLLM's count
        engine_blocks = kvb.num_pages(pool, block_size)  # the engine's (a block of one KV group), the call it sizes with
    if blocks == 0:
        raise KVLedgerError(f"the KV pool ({pool:,} bytes) holds not even one block of {block_size} tokens "
                            f"({block_bytes:,} bytes); give the cache more memory")
    token_len = c.max_model_len or spec.max_position_embeddings
    kv_tokens = blocks * block_size
    if layout and token_len:
        kv_tokens = layout.kv_tokens(blocks, token_len)
    elif layout:
        kv_tokens = blocks // layout.num_groups * block_size
    headroom = gpu.memory_bytes - (requested if c.kv_cache_memory is None else weights + terms.total + pool)
    if c.overhead is not None:  # --overhead is the whole bill beside the weights (the chapter's assumption)
        context = comm = graphs = warmup = 0
    else:
        context = CUDA_CONTEXT_BYTES
        graphs = cuda_graph_bytes(spec, layers, seqs) if c.cuda_graph is None else c.cuda_graph
        comm = COMM_INIT_BYTES if tp > 1 or pp > 1 else 0
        warmup = sampler_warmup_bytes(spec, seqs)
    left = headroom - context - comm - graphs - warmup
    return MemoryWall(
        model=spec.name, gpu=gpu.name, total_bytes=gpu.memory_bytes, gpu_memory_utilization=c.gpu_memory_utilization,
        requested_bytes=requested, weights_bytes=weights, weights_bytes_all_ranks=all_weights,
        activation_bytes=terms.activation_bytes, non_torch_bytes=terms.non_torch_bytes,
        overhead_bytes=terms.total, overhead_given=c.overhead is not None,
        kv_pool_bytes=pool, kv_pool_given=c.kv_cache_memory is not None, kv_cache_dtype=kvb.kv_cache_dtype,
        bytes_per_token=kvb.bytes_per_token, scale_bytes_per_token=kvb.scale_bytes_per_token,
        block_size=block_size, block_bytes=block_bytes, num_blocks=blocks,
        kv_tokens=kv_tokens, tensor_parallel_size=tp, sliding_window=spec.sliding_window,
        num_sliding_layers=spec.num_sliding_layers, pipeline_parallel_size=pp, dtype=unq,
        quantization=parts.quantization, max_num_seqs=seqs, max_num_batched_tokens=batched,
        cuda_graph_bytes=graphs, cuda_context_bytes=context, comm_init_bytes=comm, sampler_warmup_bytes=warmup,
        headroom_bytes=headroom, headroom_left_bytes=left,
        expert_bytes=math.ceil(parts.experts * layers / spec.num_layers / tp),
        embedding_table_bytes=math.ceil((parts.vision if pp == 1 else 0) / tp),
        num_experts=spec.num_experts, experts_per_token=spec.num_experts_per_token,
        engine_block_bytes=block_bytes if layout else kvb.page_bytes(block_size),
        engine_group_layers=layout.group_size if layout else kvb.group_layers or kvb.num_layers,
        engine_num_blocks=engine_blocks,
        engine_pool_bytes=blocks * block_bytes if layout else kvb.pages_bytes(engine_blocks, block_size),
        warnings=(warning,) if warning else (),
        vllm_version=rules.name, hybrid=layout is not None,
        state_bytes_per_request=kvb.state_bytes_per_request, state_page_bytes=kvb.state_bytes_per_layer,
        page_bytes=layout.page_bytes if layout else 0, state_padding_pct=layout.padding_pct if layout else 0.0,
        block_size_raised=layout.block_size_raised if layout else False,
        group_size=layout.group_size if layout else 0, attention_groups=layout.attention_groups if layout else 0,
        state_groups=layout.state_groups if layout else 0,
        state_blocks_per_request=layout.state_blocks_per_request if layout else 0,
        prefix_caching=layout.prefix_caching if layout else c.enable_prefix_caching,
        mamba_ssm_cache_dtype=c.mamba_ssm_cache_dtype,
        refuses_max_num_seqs=bool(layout) and rules.refuses_max_num_seqs_above_blocks,
        tokens_at_max_model_len=token_len if layout else None,
    )


def check_vllm_heads(spec: ModelSpec, tp: int) -> None:
    """vLLM's rule for ``tp`` ranks: every rank holds as many heads as every other
    (:mod:`kvledger.spec.head_split`, ``even``); a KVLedgerError naming the sizes that work, and
    those kvledger's engine adds, otherwise."""
    split_heads(spec.num_attention_heads, spec.num_kv_heads, tp, spec.name, latent=spec.is_mla, even=True)


def _fitting_tp(spec: ModelSpec, tp: int, blocks_at: Callable[[int], int]) -> int | None:
    """The smallest tensor-parallel size above ``tp`` whose ranks split the heads evenly and whose
    KV pool holds at least one block, ``blocks_at(size)`` being the plan's own count of blocks at
    that size (the same weights, overheads and block layout); ``None`` when none does."""
    for size in TP_HINT_SIZES:
        if size <= tp:
            continue
        try:
            check_vllm_heads(spec, size)
            if blocks_at(size) > 0:
                return size
        except KVLedgerError:  # the heads do not split evenly over this many ranks (vLLM's rule)
            continue
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
    sliding-window layers pages as vLLM's hybrid allocator does: a block of the pool is one
    page for each of its layer groups (``kv_bytes``: ``page_layers`` layers in groups of
    ``g``); the full groups take a page per ``block_size`` tokens, the sliding groups at most
    ``ceil(window / block_size) + 1`` (a window need not start at a block's edge). The pages
    are counted back in whole blocks.

    A hybrid model (``wall.hybrid``) holds ``cdiv(tokens, block_size)`` blocks in each attention
    group and its state blocks in each state group (``spec.hybrid``)."""
    pages = math.ceil(tokens / wall.block_size)
    if wall.hybrid:
        return wall.attention_groups * pages + wall.state_groups * wall.state_blocks_per_request
    if not wall.num_sliding_layers or not wall.sliding_window:
        return pages
    window_pages = min(pages, math.ceil(wall.sliding_window / wall.block_size) + 1)
    full_groups, sliding_groups = _page_groups(spec, wall)
    return math.ceil((full_groups * pages + sliding_groups * window_pages) / (full_groups + sliding_groups))


def _page_groups(spec: ModelSpec, wall: MemoryWall) -> tuple[int, int]:
    """(full-attention groups, sliding groups) of vLLM's hybrid allocator: layers grouped by the
    smaller of the two kinds' counts (every layer slides: (0, 1))."""
    kvb = kv_bytes(spec, wall.kv_cache_dtype, tensor_parallel_size=wall.tensor_parallel_size,
                   pipeline_parallel_size=wall.pipeline_parallel_size, model_dtype=wall.dtype)
    num_full = kvb.num_layers - kvb.num_sliding_layers
    if not num_full:
        return 0, 1
    group = min(num_full, kvb.num_sliding_layers)
    return math.ceil(num_full / group), math.ceil(kvb.num_sliding_layers / group)


def request_held_bytes(spec: ModelSpec, wall: MemoryWall, tokens: int) -> int:
    """Bytes one request of ``tokens`` cached tokens holds in the engine's pool, per rank: every
    full layer ``tokens`` slots, every sliding layer what its blocks keep of the window
    (:attr:`KVBytes.held_bytes`, the figure the engine's ledger measures per request). A hybrid's
    request holds whole blocks of vLLM's pool, its state's padded pages included."""
    if wall.hybrid:
        return sequence_blocks(spec, wall, tokens) * wall.block_bytes
    return kv_bytes(spec, wall.kv_cache_dtype, tokens=tokens, tensor_parallel_size=wall.tensor_parallel_size,
                    pipeline_parallel_size=wall.pipeline_parallel_size, model_dtype=wall.dtype,
                    block_size=wall.block_size).held_bytes


def users_at(spec: ModelSpec, wall: MemoryWall, tokens: int, shared_prefix: int = 0) -> int:
    """Concurrent sequences of ``tokens`` cached tokens each that the pool holds. With prefix
    caching, the first ``shared_prefix`` tokens (whole blocks only, as blocks are what is shared)
    are held once for every sequence."""
    shared_blocks = shared_prefix // wall.block_size
    per_sequence = sequence_blocks(spec, wall, tokens) - shared_blocks
    return max(0, (wall.num_blocks - shared_blocks) // max(per_sequence, 1))


def max_concurrency(spec: ModelSpec, wall: MemoryWall, tokens: int) -> float:
    """vLLM's "Maximum concurrency for ``tokens`` tokens per request" (times, fractional as it
    prints it): the pool's blocks over the most one such request may hold. For a full-attention
    model that is ``ceil(tokens / block_size)``. A sliding group is counted, as vLLM 0.19's
    ``SlidingWindowSpec.max_memory_usage_bytes`` counts it, at its worst during chunked prefill:
    the window less one plus a whole ``max_num_batched_tokens`` chunk, at most ``tokens``, plus
    one block, not the window it keeps once decoding (``sequence_blocks``). A hybrid model's
    request holds its attention pages and its state blocks (``sequence_blocks``)."""
    if wall.hybrid:
        return wall.num_blocks / sequence_blocks(spec, wall, tokens)
    pages = math.ceil(tokens / wall.block_size)
    if not wall.num_sliding_layers or not wall.sliding_window:
        return wall.num_blocks / pages
    worst = min(wall.sliding_window - 1 + wall.max_num_batched_tokens, tokens)
    window_pages = math.ceil(worst / wall.block_size) + 1
    full_groups, sliding_groups = _page_groups(spec, wall)
    return wall.num_blocks * (full_groups + sliding_groups) / (full_groups * pages + sliding_groups * window_pages)


def max_fitting_length(spec: ModelSpec, wall: MemoryWall) -> int | None:
    """The longest single sequence (tokens) the pool holds, at most the model's context
    (``max_position_embeddings``): vLLM's "estimated maximum model length", which it too searches
    up to the model's limit. A sequence costs at least its full-attention layers' share of every
    token, so without a context limit the pool bounds it; ``None`` when nothing does (every layer
    slides, the config names no context, and one window fits)."""
    limits = [spec.max_position_embeddings] if spec.max_position_embeddings else []
    if wall.hybrid:  # every attention group takes a block per block_size tokens
        limits.append((wall.num_blocks // max(wall.attention_groups, 1) + 1) * wall.block_size)
    elif spec.num_full_layers:  # the full layers' pages alone bound it (hybrid pages: at most 2 L of them)
        limits.append(wall.kv_tokens * 2 * spec.num_layers // spec.num_full_layers)
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


def startup_request_bytes(spec: ModelSpec, wall: MemoryWall, tokens: int) -> int:
    """The KV memory vLLM 0.19 requires at start-up for one ``tokens``-token request
    (``check_enough_kv_cache_memory``: every layer's ``max_memory_usage_bytes``), bytes per rank.
    A full layer needs ``ceil(tokens / block_size)`` blocks. A sliding layer is counted at its
    worst during chunked prefill, not at the window it keeps once decoding: ``min(window - 1 +
    max_num_batched_tokens, tokens)`` tokens plus one block. For Gemma-3-27B at 131,072 tokens on
    an H100 (52 of 62 layers slide over 1,024) that is 13.7 GiB where the decoding window needs
    10.4 GiB: a pool between the two starts in no vLLM, though the window fits."""
    if wall.hybrid:  # its attention pages and state blocks, as vLLM's hybrid check counts them
        return sequence_blocks(spec, wall, tokens) * wall.block_bytes
    kvb = kv_bytes(spec, wall.kv_cache_dtype, tensor_parallel_size=wall.tensor_parallel_size,
                   pipeline_parallel_size=wall.pipeline_parallel_size, model_dtype=wall.dtype)
    layer_block = wall.block_size * ((kvb.bytes_per_token + kvb.scale_bytes_per_token) // kvb.num_layers)
    pages = math.ceil(tokens / wall.block_size)
    num_sliding = kvb.num_sliding_layers if wall.sliding_window else 0
    worst = pages
    if num_sliding:
        worst = math.ceil(min(wall.sliding_window - 1 + wall.max_num_batched_tokens, tokens) / wall.block_size) + 1
    return ((kvb.num_layers - num_sliding) * pages + num_sliding * worst) * layer_block


def startup_max_model_len(spec: ModelSpec, wall: MemoryWall) -> int:
    """vLLM's "estimated maximum model length" in its start-up refusal: the longest request whose
    ``startup_request_bytes`` the pool holds, at most the model's context (tokens). Equal to
    ``max_fitting_length`` for a model without sliding layers."""
    hi = spec.max_position_embeddings or wall.kv_tokens * spec.num_layers
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if startup_request_bytes(spec, wall, mid) <= wall.num_blocks * wall.block_bytes:
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
    need_bytes = max(need * wall.block_bytes, startup_request_bytes(spec, wall, max_model_len))
    if need_bytes <= wall.num_blocks * wall.block_bytes:
        return None
    return (f"to serve at least one request with max_model_len ({max_model_len:,}), {need_bytes / GiB:.2f} GiB KV cache "
            f"is needed, which is larger than the available KV cache memory ({wall.kv_pool_bytes / GiB:.2f} GiB); "
            f"based on the available memory, the estimated maximum model length is {startup_max_model_len(spec, wall):,}; "
            "try increasing --gpu-memory-utilization or decreasing --max-model-len")


def useful_work(users: int) -> str:
    """Whether a decode batch of ``users`` keeps the card doing useful work (the chapter's column).

    Every step reads all the weights once for the whole batch, so a batch below 8 spends the
    card's bandwidth mostly on weights for a handful of tokens ("no"); 8-31 is "marginal";
    32 and more is a fat batch ("yes")."""
    if users >= 32:
        return "yes"
    return "marginal" if users >= 8 else "no"


# ---------------------------------------------------------------------------- the verdict
def headroom_margin(wall: MemoryWall) -> int:
    """Bytes that must stay free outside the pool: ``WARMUP_MARGIN_FACTOR`` x the sampler's
    warm-up, at least ``HEADROOM_MIN_MARGIN_BYTES``."""
    return max(WARMUP_MARGIN_FACTOR * wall.sampler_warmup_bytes, HEADROOM_MIN_MARGIN_BYTES)


@dataclass(frozen=True)
class Verdict:
    """``fits``, ``tight`` or ``does not fit``, the term most likely to break it, and what buys room."""

    verdict: str
    term: str | None
    reason: str
    advice: str


def verdict(spec: ModelSpec, wall: MemoryWall, max_model_len: int | None = None, users: int | None = None,
            context: int | None = None) -> Verdict:
    """Whether the plan starts and holds its load, with the estimate's spread taken into account.

    "does not fit": the pool cannot hold one ``max_model_len`` sequence (or the ``users`` x
    ``context`` load). "tight": it holds it by less than ``TOKEN_SPREAD`` of the pool (the
    validation table's bar), or the memory outside the pool leaves less than
    ``headroom_margin``: vLLM may then run out of memory after sizing the pool.
    "fits" otherwise. The advice says what a higher ``--gpu-memory-utilization`` or a lower
    ``--max-model-len`` (or fewer ``--max-num-seqs``) would buy.
    """
    if wall.refuses_max_num_seqs and wall.max_num_seqs > wall.num_blocks:
        return Verdict("does not fit", "max_num_seqs",
                       f"vLLM {wall.vllm_version} refuses to start: max_num_seqs ({wall.max_num_seqs}) exceeds "
                       f"available Mamba cache blocks ({wall.num_blocks}); every running request holds "
                       f"{wall.state_groups * wall.state_blocks_per_request} state blocks of the pool from admission "
                       "to finish, and the CUDA graphs are captured for max_num_seqs of them",
                       f"set --max-num-seqs {wall.num_blocks} or less, or raise --gpu-memory-utilization "
                       "(more memory, more blocks)")
    need = 0
    what = ""
    if users and context:
        need, what = users * sequence_blocks(spec, wall, context), f"{users} x {context:,}-token users"
    if max_model_len:  # vLLM's start-up requirement: sliding layers at their prefill worst case
        one = max(sequence_blocks(spec, wall, max_model_len),
                  math.ceil(startup_request_bytes(spec, wall, max_model_len) / wall.block_bytes))
        if one > need:
            need, what = one, f"one {max_model_len:,}-token sequence (max_model_len)"
    per_point = int(wall.total_bytes * 0.01) // wall.block_bytes * wall.block_size  # tokens per +0.01 utilization
    if need > wall.num_blocks:
        return Verdict("does not fit", "KV pool", f"the pool holds {wall.kv_tokens:,} tokens; {what}: "
                       f"{need * wall.block_size:,} tokens needed", "raise --gpu-memory-utilization, lower --max-model-len or the load")
    margin = int(wall.num_blocks * (1 - TOKEN_SPREAD))
    if need and need > margin:
        return Verdict("tight", "KV pool",
                       f"the pool holds {what} with {(wall.num_blocks - need) * wall.block_size:,} tokens to spare, "
                       f"less than the estimate's {TOKEN_SPREAD:.0%} spread ({wall.kv_tokens - margin * wall.block_size:,} tokens)",
                       f"each +0.01 of --gpu-memory-utilization adds about {per_point:,} tokens; "
                       f"--max-model-len {margin * wall.block_size} fits with the margin")
    margin = headroom_margin(wall)
    if wall.headroom_left_bytes < margin and not wall.overhead_given:
        outside = {"CUDA graphs": wall.cuda_graph_bytes, "the sampler warm-up": wall.sampler_warmup_bytes,
                   "the communicators": wall.comm_init_bytes}
        term = max(outside, key=lambda k: outside[k])
        short = margin - wall.headroom_left_bytes
        lower = math.floor((wall.requested_bytes - short) / wall.total_bytes * 100) / 100
        lost = (wall.requested_bytes - int(wall.total_bytes * lower)) // wall.block_bytes * wall.block_size
        return Verdict("tight", term,
                       f"outside the pool {wall.headroom_bytes / GiB:.2f} GiB must hold the CUDA context, "
                       f"{wall.comm_init_bytes / GiB:.2f} GiB of communicators, {wall.cuda_graph_bytes / GiB:.2f} GiB "
                       f"of CUDA graphs and the sampler's {wall.sampler_warmup_bytes / GiB:.2f} GiB warm-up; "
                       f"{wall.headroom_left_bytes / GiB:.2f} GiB is left, less than the "
                       f"{margin / GiB:.2f} GiB margin (the allocator can strand as much again as the warm-up asks)",
                       f"--gpu-memory-utilization {lower:.2f} leaves the margin (about {lost:,} "
                       f"fewer KV tokens), or lower --max-num-seqs (now {wall.max_num_seqs:,}) to shrink the warm-up")
    return Verdict("fits", None, f"the pool holds {what or 'the load'} with room to spare" if what else
                   "the pool is sized and the headroom holds what vLLM needs outside it", "")
