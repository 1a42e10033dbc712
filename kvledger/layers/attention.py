"""Attention over the paged KV cache, for a step that mixes decodes and prefill chunks.

A step's tokens are flattened into one batch: first one token per decoding sequence, then
the prefill chunks, each contiguous. Per layer every new K/V is written into the cache
first (:meth:`KVCache.write`), then attention runs:

* decodes: on CPU, over a cache that stores the compute dtype (float32, bfloat16) or 8 bits an
  element (int8, fp8), one call of the decode kernel per group reads K/V where they lie in the
  blocks (:mod:`kvledger.kernels.paged_decode`; ``AttentionMetadata.decode_in_place``). Otherwise one
  attention call per group, queries ``[B, H, 1, d]`` against K/V gathered through the block
  tables ``[B, H_kv, T, d]``, padding positions masked by an additive mask built once per
  step. Decodes come sorted by context length and split into groups whose longest context is
  at most twice their shortest, so the padding gathered never exceeds the useful K/V read. An
  unquantized cache goes through SDPA; an 8-bit cache hands over its values widened but
  unscaled (:class:`DecodeKV`) and :func:`decode_attention` applies the scales to the scores
  and the probabilities, so the context is never dequantized into a full-size copy;
* prefill chunks: on CPU, over a cache that stores the compute dtype, the prefill kernel reads
  K/V in place for a first chunk and a later one alike (:mod:`kvledger.kernels.paged_prefill`;
  ``AttentionMetadata.prefill_in_place``; bfloat16 on the matrix unit where the CPU has AMX).
  Otherwise a chunk that starts
  at position 0 runs causal SDPA over its own fresh K/V, and a later chunk (chunked prefill,
  prefix-cache hit, recompute) SDPA over K/V gathered through its block table with a causal
  mask offset by the tokens already in the cache; on CPU SDPA gets contiguous copies of its
  operands (its fast path; strided views ran 6x slower at 512 tokens).

Sliding-window layers (Gemma-3) get metadata of their own KV group: its block tables start at
the first block the window reaches (``gather_start`` tokens in), and the masks also hide every
key more than ``window - 1`` positions before its query (:meth:`PrefillChunk.windowed`,
:meth:`DecodeGroup.window_mask`); nothing else changes.

Under ``torch.compile`` (:mod:`kvledger.engine.compile`) all of this is one opaque operator,
``torch.ops.kvledger.paged_attention(q, k, v, scale)``: the compiler fuses the dense work
around it and never looks inside, so a step's metadata (its groups, lengths, block tables)
never becomes part of a compiled graph or of its guards. The operator reads the step's
metadata, cache and current layer from :func:`attention_step`, which the model runner sets
around each forward pass (vLLM's "forward context").
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from kvledger.kernels.paged_decode import paged_decode_attention
from kvledger.kernels.paged_prefill import paged_prefill_attention
from kvledger.kvcache.storage import DecodeKV, KVCache


@dataclass
class PrefillChunk:
    """Tokens ``[start, end)`` of the flat batch; ``num_computed`` tokens of the sequence are cached."""

    start: int
    end: int
    num_computed: int
    block_table: torch.Tensor  # [1, blocks covering num_computed + (end - start) tokens, from gather_start]
    mask: torch.Tensor | None  # [1, 1, n, ctx] bool when num_computed > 0 (or a window cuts in)
    gather_start: int = 0  # the position of the table's first slot (a whole number of blocks)
    sliding: bool = False  # a sliding window hides keys of this chunk: its mask is more than causal

    @classmethod
    def causal(cls, start: int, n: int, num_computed: int, block_table: torch.Tensor) -> "PrefillChunk":
        """``n`` new tokens at flat offset ``start`` after ``num_computed`` cached ones, each
        attending to every earlier position and itself (no mask needed when nothing is cached)."""
        mask = None
        if num_computed:
            ctx = num_computed + n
            q_pos = torch.arange(num_computed, ctx, device=block_table.device)[:, None]
            mask = (torch.arange(ctx, device=block_table.device)[None, :] <= q_pos).view(1, 1, n, ctx)
        return cls(start, start + n, num_computed, block_table, mask)

    @classmethod
    def windowed(cls, start: int, n: int, num_computed: int, block_table: torch.Tensor, window: int,
                 gather_start: int) -> "PrefillChunk":
        """As :meth:`causal`, each query also blind to keys ``window`` or more positions back (a
        key ``j`` is seen by query ``i`` when ``i - window < j <= i``); ``block_table`` starts at
        position ``gather_start``. No mask when plain causal attention already is that."""
        ctx = num_computed + n
        if num_computed == 0 and n <= window:
            return cls(start, start + n, 0, block_table, None, 0)
        device = block_table.device
        q_pos = torch.arange(num_computed, ctx, device=device)[:, None]
        k_pos = torch.arange(gather_start, ctx, device=device)[None, :]
        mask = ((k_pos <= q_pos) & (k_pos > q_pos - window)).view(1, 1, n, ctx - gather_start)
        return cls(start, start + n, num_computed, block_table, mask, gather_start, sliding=True)


@dataclass
class DecodeGroup:
    """Decode tokens ``[start, end)`` of the flat batch, one per sequence, attended together."""

    start: int
    end: int
    block_tables: torch.Tensor  # [B, blocks]
    max_len: int  # tokens to gather per sequence (the group's longest context)
    mask: torch.Tensor | None  # [B, 1, 1, max_len] added to the scores: 0 within a context, -inf past
    # its end, in the compute dtype; None when every context is max_len long (or read in place)
    context_lens: torch.Tensor | None = None  # [B] tokens per sequence, for reading in place
    # (kvledger.kernels.paged_decode); None when the step gathers instead, and for sliding windows

    @staticmethod
    def padding_mask(lengths: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[B, 1, 1, max_len]`` for contexts of ``lengths`` tokens ``[B]``."""
        past_end = torch.arange(max_len, device=lengths.device)[None, :] >= lengths[:, None]
        mask = torch.zeros(past_end.shape, dtype=dtype, device=lengths.device).masked_fill_(past_end, float("-inf"))
        return mask.view(-1, 1, 1, max_len)

    @staticmethod
    def window_mask(firsts: torch.Tensor, lengths: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[B, 1, 1, max_len]`` hiding, per row, the gathered slots before
        ``firsts`` (keys out of the window) and from ``lengths`` on (past the context)."""
        t = torch.arange(max_len, device=lengths.device)[None, :]
        hidden = (t >= lengths[:, None]) | (t < firsts[:, None])
        mask = torch.zeros(hidden.shape, dtype=dtype, device=lengths.device).masked_fill_(hidden, float("-inf"))
        return mask.view(-1, 1, 1, max_len)


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each attends to."""

    slot_mapping: torch.Tensor  # [N] physical slot of every new token
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_in_place: bool = False
    """Decode groups with ``context_lens`` read their K/V in place (:mod:`kvledger.kernels.paged_decode`)
    instead of gathering them; set by the model runner where the kernel serves the cache."""
    prefill_in_place: bool = False
    """Prefill chunks without a sliding window read their K/V in place (:mod:`kvledger.kernels.paged_prefill`)
    instead of SDPA over fresh or gathered K/V; set by the model runner where the kernel serves the cache."""


@dataclass
class _Step:
    meta: AttentionMetadata
    cache: KVCache
    next_layer: int = 0  # the layer the compiled operator's next call is for


class _Steps(threading.local):
    """The steps in progress on this thread (innermost last): engines may step on several threads."""

    def __init__(self) -> None:
        self.stack: list[_Step] = []


_STEPS = _Steps()


@contextmanager
def attention_step(meta: AttentionMetadata, cache: KVCache) -> Iterator[None]:
    """Make ``meta`` and ``cache`` the ones the compiled attention operator reads during one
    forward pass over the layers (in order: its ``i``-th call is layer ``i``)."""
    _STEPS.stack.append(_Step(meta, cache))
    try:
        yield
    finally:
        _STEPS.stack.pop()


@torch.library.custom_op("kvledger::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`paged_attention` of the step set by :func:`attention_step`, for its next layer. The
    layer index is not an argument so that one compiled graph serves every layer; the cache it
    writes is outside the compiled graph, so no argument is declared mutated."""
    step = _STEPS.stack[-1]
    layer, step.next_layer = step.next_layer, step.next_layer + 1
    return _paged_attention(layer, q, k, v, step.meta, step.cache, scale)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata, cache: KVCache, scale: float) -> torch.Tensor:
    """Attention output ``[N, H, d]`` for queries ``q`` ``[N, H, d]`` and new ``k``/``v`` ``[N, H_kv, d]``."""
    if torch.compiler.is_compiling():  # the step's meta, cache and layer come from attention_step
        return torch.ops.kvledger.paged_attention(q, k, v, scale)
    return _paged_attention(layer, q, k, v, meta, cache, scale)


def _paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, cache: KVCache, scale: float) -> torch.Tensor:
    cache.write(layer, k, v, meta.slot_mapping)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for group in meta.decodes:
        if meta.decode_in_place and group.context_lens is not None:
            paged_decode_attention(q[group.start:group.end], cache.layer_pools(layer), group.block_tables,
                                   group.context_lens, scale, out=out[group.start:group.end])
            continue
        kv = cache.gather_decode(layer, group.block_tables, group.max_len)
        out[group.start:group.end] = decode_attention(q[group.start:group.end], kv, group.mask, scale)
    for chunk in meta.prefills:
        if meta.prefill_in_place and not chunk.sliding:
            pools = cache.layer_pools(layer)
            paged_prefill_attention(q[chunk.start:chunk.end], pools.k, pools.v, chunk.block_table,
                                    chunk.num_computed, scale, out=out[chunk.start:chunk.end])
            continue
        qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.num_computed == 0 and not cache.read_back_fresh:
            kc = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        else:  # earlier tokens are in the cache (or read_back_fresh asks for a read-back)
            ctx = chunk.num_computed + chunk.end - chunk.start - chunk.gather_start
            kc, vc = cache.gather(layer, chunk.block_table, ctx)
        if q.device.type == "cpu":  # CPU flash SDPA takes its fast path on contiguous operands only
            qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[chunk.start:chunk.end] = o.squeeze(0).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, kv: DecodeKV, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query per sequence: ``q`` ``[B, H, d]`` over ``kv`` (``[B, H_kv, T, d]``), ``mask``
    ``[B, 1, 1, T]`` added to the scores (:meth:`DecodeGroup.padding_mask`) or None; returns
    ``[B, H, d]``.

    With scales (8-bit caches), for query head ``h`` of KV head ``j``::

        scores[t] = scale * (q_h . k_j[t]) * k_scale_j[t]
        out       = sum_t softmax(scores)[t] * v_scale_j[t] * v_j[t]

    which is attention over the dequantized K/V, with the multiplies moved onto ``[T]``-sized
    rows instead of ``[T, d]``-sized tensors. Per-layer (float) scales fold into ``q`` and the
    output."""
    if not kv.has_scales:
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kv.k, kv.v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != kv.k.shape[1])
        return o.squeeze(2)
    batch, heads, head_dim = q.shape
    kv_heads = kv.k.shape[1]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # query heads grouped by KV head
    k_scale, v_scale = kv.k_scale, kv.v_scale
    scores = torch.matmul(qg * (scale * k_scale if isinstance(k_scale, float) else scale), kv.k.transpose(2, 3))
    if not isinstance(k_scale, float):
        scores.mul_(k_scale.unsqueeze(2))  # [B, H_kv, 1, T] over [B, H_kv, G, T]
    if mask is not None:
        scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # float32 under a 16-bit model too, as SDPA
    if not isinstance(v_scale, float):
        probs.mul_(v_scale.unsqueeze(2))
    o = torch.matmul(probs.to(kv.v.dtype), kv.v)  # [B, H_kv, G, d]
    if isinstance(v_scale, float):
        o.mul_(v_scale)
    return o.reshape(batch, heads, head_dim)
