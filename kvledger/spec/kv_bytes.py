"""Equation 2.2: ``M_kv = 2 . L . B . T . H_kv . d_h . s`` bytes, with its seven terms named.

Extensions the chapter's formula needs on real models, each keeping the seven terms visible:

* **Sliding-window layers** cache at most ``window`` tokens, so ``T`` is per layer:
  ``T_layer = min(T, window)``. The total sums the full and the sliding layers.
* **MLA** (DeepSeek-V2/V3) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` elements
  per token per layer: the K/V factor is 1, ``H_kv`` is 1 and ``d_h`` is the latent width.
* **Tensor parallelism**: the ranks share the heads by :mod:`kvledger.spec.head_split`'s rule
  (whole GQA groups per rank, unevenly when ``TP`` does not divide ``H_kv``; one KV head copied
  to ``TP / H_kv`` ranks when ``TP`` exceeds it); an MLA latent is replicated on every rank.
  ``bytes_per_token`` and ``total_bytes`` are one rank's: the largest rank's (rank 0), which
  every rank's pool is sized by, or rank ``rank``'s when given; ``*_all_ranks`` sum over the
  ranks, each with its own heads.
* **Pipeline parallelism**: a stage holds its own layers; the numbers are the last stage's
  (``L // PP`` layers: vLLM gives the remainder to the earlier stages).
* **Quantized caches** store scales beside the elements (``spec.dtypes`` gives each layout):
  ``scale_bytes_per_token`` is kept apart so that ``bytes_per_token`` stays Eq 2.2 exactly.
* **vLLM's pool pages for hybrid models**: with sliding and full layers, vLLM's hybrid
  allocator groups layers ``g`` at a time, ``g`` the smallest count of any attention type, and
  pads each type to whole groups; a block of the pool then holds ``page_layers`` layers' worth
  of one token (Gemma-3-27B: 10 full + 52 sliding layers page as 7 groups of 10 = 70). vLLM's
  "GPU KV cache size" counts tokens at that cost, so ``token_bytes`` (what the pool is cut
  by) does too; ``bytes_per_token`` stays Eq 2.2 over the real layers.
* **Linear-attention and state-space hybrids** (``spec.state``): only the attention layers keep
  K and V, so ``L`` counts them; every other layer keeps a fixed state per request, however long
  the context: ``state_bytes_per_request`` (per rank), the term that does not grow with ``T``.
  vLLM's pool for them (block size aligned to the state, padding, groups) is ``spec.hybrid``.
* **The engine's block granularity** (``block_size`` given): a sliding layer keeps whole blocks,
  from the one holding the first of the last ``window`` tokens, so it holds
  ``T - block_size * floor(max(0, T - window) / block_size)`` token slots, between the window and
  the window plus ``block_size - 1`` (:func:`sliding_held_tokens`); the engine's pool is paged
  in blocks of one KV group's ``group_layers`` layers (:meth:`KVBytes.page_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.errors import KVLedgerError
from kvledger.spec.dtypes import (KV_CACHE_DTYPE_BYTES, PER_LAYER_SCALE_DTYPES, PER_TOKEN_SCALE_BYTES,
                                  resolve_kv_cache_dtype)
from kvledger.spec.head_split import split_heads
from kvledger.spec.model_spec import ModelSpec
from kvledger.spec.state import ATTENTION_KINDS, MAMBA_DTYPE_BYTES, state_bytes

# Bytes of one scale: fp8 keeps one float32 k_scale and v_scale per layer (per-token scales:
# ``PER_TOKEN_SCALE_BYTES``).
INT8_SCALE_BYTES = PER_TOKEN_SCALE_BYTES["int8"]
FP8_SCALE_BYTES = 4


@dataclass(frozen=True)
class KVBytes:
    """Eq 2.2 evaluated for one model, dtype, load and tensor-parallel size. Sizes in bytes."""

    model: str
    kv_cache_dtype: str
    kv_factor: int
    """The leading 2 (K and V); 1 for an MLA latent."""
    num_layers: int
    """``L``."""
    batch: int
    """``B``: concurrent sequences."""
    tokens: int
    """``T``: cached tokens per sequence (before sliding windows)."""
    kv_heads: int
    """``H_kv`` on the rank described (the largest rank's unless ``rank`` was given)."""
    head_dim: int
    """``d_h`` (for MLA: latent width)."""
    element_bytes: float
    """``s`` (0.5 for a packed 4-bit cache)."""
    tensor_parallel_size: int
    num_sliding_layers: int
    sliding_window: int | None
    bytes_per_token: int
    """Per rank: ``kv_factor . L . H_kv . d_h . s``: what one token costs in every layer."""
    bytes_per_token_all_ranks: int
    total_bytes: int
    """Per rank, for ``B`` sequences of ``T`` tokens, sliding layers capped at the window."""
    total_bytes_all_ranks: int
    scale_bytes_per_token: int
    """Per rank: bytes of quantization scales per token (int8; 0 for 16/32-bit caches)."""
    scale_bytes_fixed: int = 0
    """Per rank: bytes of scales that do not grow with tokens (fp8's per-layer k_scale/v_scale)."""
    total_scale_bytes: int = 0
    """Per rank: every scale byte for ``B`` sequences of ``T`` tokens (per-token and fixed)."""
    page_layers: int = 0
    """Layers one token of vLLM's pool pays for: ``L``, or more for a hybrid model (see the module)."""
    pipeline_parallel_size: int = 1
    block_size: int | None = None
    """The block granularity the sliding layers' tokens were counted at (None: exactly the window)."""
    group_layers: int = 0
    """Layers in one KV-cache group, what one block of the engine's pool holds: ``L`` for a uniform
    model, ``g = min(full, sliding)`` for a hybrid one."""
    num_full_groups: int = 0
    num_sliding_groups: int = 0
    sliding_tokens: int = 0
    """Token slots a sliding layer holds for one sequence of ``T`` tokens (``T`` when none slides)."""
    held_bytes: int = 0
    """Per rank: what ``B`` sequences hold in the engine's pages, scales included: every group's
    ``group_layers`` layers (a type's last group padded, as its pages are), the full groups for
    ``T`` tokens, the sliding ones for ``sliding_tokens``."""
    num_state_layers: int = 0
    """Hybrid models: layers keeping a fixed-size state per request instead of K and V (not in ``L``)."""
    state_family: str | None = None
    state_bytes_per_layer: int = 0
    """Per rank: one state layer's state for one request (conv + SSM), unpadded (``spec.state``)."""
    state_bytes_per_request: int = 0
    """Per rank: every state layer's state for one request, the term that does not grow with ``T``."""
    state_bytes_per_request_all_ranks: int = 0
    total_state_bytes: int = 0
    """Per rank: ``B x state_bytes_per_request``."""
    kv_heads_by_rank: tuple[int, ...] = ()
    """``H_kv`` of every rank, rank 0 first (unequal when ``TP`` does not divide ``H_kv``)."""
    rank: int | None = None
    """The rank the per-rank figures describe; None: the largest (rank 0's figures)."""

    @property
    def token_bytes(self) -> int:
        """What one token of the pool costs on one rank: Eq 2.2's elements plus their scales,
        over ``page_layers`` layers (equal to ``L`` but for hybrid sliding/full models)."""
        per_layer = (self.bytes_per_token + self.scale_bytes_per_token) // self.num_layers
        return per_layer * (self.page_layers or self.num_layers)

    @property
    def uneven_split_note(self) -> str | None:
        """A line saying the ranks hold unequal KV heads and which the per-rank figures are; None
        when every rank holds as many as every other."""
        heads = self.kv_heads_by_rank
        if len(set(heads)) < 2:
            return None
        return (f"TP {self.tensor_parallel_size} splits the {sum(heads)} KV heads unevenly, whole GQA groups per "
                f"rank ({', '.join(map(str, heads))}); per rank is rank 0, the largest, which every rank's pool is "
                "sized by; vLLM refuses this size, kvledger's engine runs it")

    def num_blocks(self, pool_bytes: int, block_size: int) -> int:
        """Blocks of ``block_size`` tokens that a pool of ``pool_bytes`` holds, scales included.
        The one block arithmetic of the project: the planner and the engine both size with it."""
        usable = pool_bytes - self.scale_bytes_fixed
        return max(0, usable // (block_size * self.token_bytes))

    def pool_bytes(self, num_blocks: int, block_size: int) -> int:
        """Bytes of a pool of ``num_blocks`` blocks: what its tensors, scales included, must weigh."""
        return num_blocks * block_size * self.token_bytes + self.scale_bytes_fixed

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of the engine's pool: ``block_size`` tokens of one KV group's
        ``group_layers`` layers, scales included (``token_bytes * block_size`` for a uniform model)."""
        per_layer = (self.bytes_per_token + self.scale_bytes_per_token) // self.num_layers
        return block_size * per_layer * (self.group_layers or self.num_layers)

    def num_pages(self, pool_bytes: int, block_size: int) -> int:
        """Blocks of :meth:`page_bytes` that ``pool_bytes`` holds: the engine's pool size
        (:meth:`num_blocks` times the number of KV groups, give or take the last group's floor)."""
        return max(0, (pool_bytes - self.scale_bytes_fixed) // self.page_bytes(block_size))

    def pages_bytes(self, num_pages: int, block_size: int) -> int:
        """Bytes of an engine pool of ``num_pages`` blocks, scales included."""
        return num_pages * self.page_bytes(block_size) + self.scale_bytes_fixed

    @property
    def slot_bytes(self) -> int:
        """Per rank: the bytes the ``B x T`` tokens occupy, Eq 2.2's elements plus their per-token
        scales, sliding layers holding only their window (fixed per-layer scales left out)."""
        return self.total_bytes + self.total_scale_bytes - self.scale_bytes_fixed

    def terms(self) -> list[tuple[str, str, int, str]]:
        """The seven terms as (symbol, meaning, value, unit) rows."""
        factor_meaning = "one MLA latent (no separate K and V)" if self.kv_factor == 1 else "K and V"
        head_meaning = "latent width (kv_lora_rank + qk_rope_head_dim)" if self.kv_factor == 1 else "head dimension"
        return [
            ("2", factor_meaning, self.kv_factor, "tensors"),
            ("L", "attention layers (the others keep a fixed state)" if self.num_state_layers else "layers",
             self.num_layers, "layers"),
            ("B", "concurrent sequences", self.batch, "sequences"),
            ("T", "cached tokens per sequence", self.tokens, "tokens"),
            ("H_kv", "KV heads" + (" per rank" if self.tensor_parallel_size > 1 else ""), self.kv_heads, "heads"),
            ("d_h", head_meaning, self.head_dim, "elements"),
            ("s", f"bytes per element ({self.kv_cache_dtype})", self.element_bytes, "bytes"),
        ]


def kv_bytes(
    spec: ModelSpec,
    kv_cache_dtype: str = "auto",
    tokens: int = 1,
    batch: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    model_dtype: str | None = None,
    block_size: int | None = None,
    mamba_ssm_cache_dtype: str = "auto",
    rank: int | None = None,
) -> KVBytes:
    """Evaluate Eq 2.2 for ``batch`` sequences of ``tokens`` cached tokens each, on one rank of
    the last pipeline stage. ``model_dtype`` (vLLM's ``--dtype``) is what ``auto`` resolves to
    (default: the config's ``torch_dtype``). With ``block_size``, sliding layers hold what the
    engine's blocks hold (:func:`sliding_held_tokens`) instead of exactly the window.

    A hybrid model's Eq 2.2 runs over its attention layers only (``L`` counts them); its state
    layers' fixed per-request state is ``state_bytes_per_request`` (``spec.state``), its SSM
    part in ``mamba_ssm_cache_dtype`` (vLLM's ``--mamba-ssm-cache-dtype``).

    The per-rank figures are the largest rank's, or rank ``rank``'s (``0 <= rank < TP``)."""
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise KVLedgerError(f"block-size must be a positive integer, got {block_size!r}")
    for value, what in ((tokens, "tokens"), (batch, "batch"), (tensor_parallel_size, "tensor-parallel-size"),
                        (pipeline_parallel_size, "pipeline-parallel-size")):
        if not isinstance(value, int) or value <= 0:
            raise KVLedgerError(f"{what} must be a positive integer, got {value!r}")
    if pipeline_parallel_size > spec.num_layers:
        raise KVLedgerError(f"pipeline-parallel-size {pipeline_parallel_size} exceeds the {spec.num_layers} layers "
                            f"of {spec.name}")
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype or spec.torch_dtype)
    s = KV_CACHE_DTYPE_BYTES[dtype]
    tp = tensor_parallel_size
    split = split_heads(spec.num_attention_heads, spec.num_kv_heads, tp, spec.name, latent=spec.is_mla)
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < tp):
        raise KVLedgerError(f"rank must be one of the {tp} ranks 0..{tp - 1}, got {rank!r}")
    heads_by_rank = tuple(r.num_kv_heads for r in split.ranks)
    if spec.is_hybrid and pipeline_parallel_size > 1:
        raise KVLedgerError(f"pipeline parallelism of a hybrid model ({spec.name}) is not modeled; use "
                            "--tensor-parallel-size")
    layer_types = [t for t in spec.layer_types[-(spec.num_layers // pipeline_parallel_size):]
                   if t in ATTENTION_KINDS]
    if not layer_types:
        raise KVLedgerError(f"{spec.name} has no attention layer: an attention-free model keeps no KV cache")
    num_layers = len(layer_types)
    num_sliding = sum(1 for t in layer_types if t != "full_attention")
    num_full = num_layers - num_sliding
    if spec.is_mla:
        factor, width = 1, spec.kv_lora_rank + spec.qk_rope_head_dim  # one latent, replicated per rank
    else:
        factor, width = 2, spec.head_dim
    heads = split.max_kv_heads if rank is None else heads_by_rank[rank]
    rank_layer_tokens = [int(factor * h * width * s) for h in heads_by_rank]  # whole bytes: d_h even, 4-bit pairs pack
    per_layer_token = int(factor * heads * width * s)
    per_token = num_layers * per_layer_token
    window = spec.sliding_window
    if window and block_size:
        sliding_tokens = sliding_held_tokens(tokens, window, block_size)
    else:
        sliding_tokens = min(tokens, window) if window else tokens
    total = per_layer_token * batch * (num_full * tokens + num_sliding * sliding_tokens)
    total_all_ranks = sum(rank_layer_tokens) * batch * (num_full * tokens + num_sliding * sliding_tokens)
    scale = _scale_bytes_per_token(dtype, factor, heads, num_layers)
    fixed = 2 * num_layers * FP8_SCALE_BYTES if dtype in PER_LAYER_SCALE_DTYPES else 0
    layer_token_slots = batch * (num_full * tokens + num_sliding * sliding_tokens)
    group, full_groups, sliding_groups = kv_group_sizes(num_full, num_sliding)
    total_scales = scale // num_layers * layer_token_slots + fixed
    state_layer = 0
    if spec.state is not None:
        state_layer = state_bytes(spec.state, tp, _state_dtype(model_dtype or spec.torch_dtype),
                                  mamba_ssm_cache_dtype).page_bytes
    state_request = state_layer * spec.num_state_layers
    return KVBytes(
        model=spec.name,
        kv_cache_dtype=dtype,
        kv_factor=factor,
        num_layers=num_layers,
        batch=batch,
        tokens=tokens,
        kv_heads=heads,
        head_dim=width,
        element_bytes=s,
        tensor_parallel_size=tp,
        num_sliding_layers=num_sliding,
        sliding_window=window if num_sliding else None,
        bytes_per_token=per_token,
        bytes_per_token_all_ranks=num_layers * sum(rank_layer_tokens),
        total_bytes=total,
        total_bytes_all_ranks=total_all_ranks,
        scale_bytes_per_token=scale,
        scale_bytes_fixed=fixed,
        total_scale_bytes=total_scales,
        page_layers=vllm_page_layers(num_full, num_sliding),
        pipeline_parallel_size=pipeline_parallel_size,
        block_size=block_size,
        group_layers=group,
        num_full_groups=full_groups,
        num_sliding_groups=sliding_groups,
        sliding_tokens=sliding_tokens if num_sliding else tokens,
        held_bytes=(per_layer_token + scale // num_layers) * group * batch
        * (full_groups * tokens + sliding_groups * sliding_tokens) + fixed,
        num_state_layers=spec.num_state_layers,
        state_family=spec.state.family if spec.state else None,
        state_bytes_per_layer=state_layer,
        state_bytes_per_request=state_request,
        state_bytes_per_request_all_ranks=state_request * tp,
        total_state_bytes=state_request * batch,
        kv_heads_by_rank=heads_by_rank,
        rank=rank,
    )


def _state_dtype(model_dtype: str) -> str:
    """The dtype name a state takes for the model dtype (``auto`` cache: the model's own)."""
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(model_dtype.lower(), model_dtype.lower())
    return name if name in MAMBA_DTYPE_BYTES else "bfloat16"


def sliding_held_tokens(tokens: int, window: int, block_size: int) -> int:
    """Token slots a sliding-window layer holds for a sequence of ``tokens`` computed tokens when
    it keeps whole blocks of ``block_size``: from the start of the block holding the first of
    the last ``window`` tokens to the end, ``min(T, window + up to block_size - 1)``."""
    return tokens - first_kept_block(tokens, window, block_size) * block_size


def first_kept_block(tokens: int, window: int | None, block_size: int) -> int:
    """Index of the first block a layer keeps for ``tokens`` computed tokens: 0 without a window,
    else the block holding token ``tokens - window`` (the oldest one a next query may still see)."""
    return max(0, tokens - window) // block_size if window else 0


def kv_group_sizes(num_full: int, num_sliding: int) -> tuple[int, int, int]:
    """(``g``, full groups, sliding groups) of the KV-cache grouping (vLLM's): each attention type
    cut into groups of ``g = min(num_full, num_sliding)`` layers; one group of every layer when
    only one type is present."""
    if not num_full or not num_sliding:
        return num_full + num_sliding, int(num_full > 0), int(num_sliding > 0)
    group = min(num_full, num_sliding)
    return group, math.ceil(num_full / group), math.ceil(num_sliding / group)


def vllm_page_layers(num_full: int, num_sliding: int) -> int:
    """Layers vLLM's pool pays for per token: ``L`` for a uniform model; for a hybrid one, each
    attention type padded to whole groups of ``g = min(num_full, num_sliding)`` layers."""
    if not num_full or not num_sliding:
        return num_full + num_sliding
    group = min(num_full, num_sliding)
    return group * (math.ceil(num_full / group) + math.ceil(num_sliding / group))


def _scale_bytes_per_token(dtype: str, kv_factor: int, kv_heads: int, num_layers: int) -> int:
    """Per-token-head caches keep a scale per token, per KV head, for K and V in every layer
    (``PER_TOKEN_SCALE_BYTES``); fp8 keeps one K and one V scale per layer
    (``scale_bytes_fixed``), so it costs 0 per token."""
    return kv_factor * kv_heads * num_layers * PER_TOKEN_SCALE_BYTES.get(dtype, 0)
