"""Decode attention that reads K/V where they lie in the paged cache, with no gathered copy.

One query per sequence (``q`` ``[B, H, d]``) against the blocks its table names in a layer's
pool (``[num_blocks, block_size, H_kv, d]``). Written as element-wise products and sums over
positions rather than as matrix products, so that ``torch.compile`` (inductor) fuses the block
table lookup into the reductions: every key and value is loaded from its block inside the
loop that uses it, and nothing of size ``[B, T, H_kv, d]`` is ever written. Scores, softmax and
the weighted sum accumulate in float32 (as SDPA does under a 16-bit model); positions from a
sequence's length on are masked.

Eager, the same function materialises the lookups and is no faster than gathering; it is used
compiled, by the compiled model step (:mod:`kvledger.engine.compile`), for decode groups of two
or more sequences over an unquantized cache. Measured here (2 threads, SmolLM2's 3 KV heads of
64, one layer, medians) against the gather plus SDPA it replaces, for ``B`` sequences of up to
``T`` tokens: float32 1.66 -> 1.31 ms (16 x 256), 6.9 -> 3.1 ms (64 x 256), 58.6 -> 22.6 ms
(64 x 1024); bfloat16 1.45 -> 1.17, 10.6 -> 3.8, 39.5 -> 10.6 ms. At one sequence the gather is
as fast or faster (float32 0.64 against 0.98 ms at 512 tokens), so single rows keep it.
"""

from __future__ import annotations

import functools

import torch

MIN_ROWS = 2
"""Decode groups with fewer sequences than this gather instead (the gather is cheap for one)."""


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention output ``[B, H, d]`` in ``q``'s dtype: query ``b`` over the first
    ``context_lens[b]`` positions of the blocks ``block_tables[b]`` (``[B, blocks]``) of
    ``k_pool``/``v_pool`` (``[num_blocks, block_size, H_kv, d]``); ``H`` a multiple of ``H_kv``."""
    batch, num_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_pool.shape[1:]
    group = q.shape[1] // kv_heads
    qg = q.view(batch, 1, 1, kv_heads, group, head_dim).float()
    k = k_pool[block_tables].unsqueeze(4).float()  # [B, blocks, block_size, H_kv, 1, d], fused when compiled
    scores = (qg * k).sum(-1) * scale  # [B, blocks, block_size, H_kv, G]
    position = torch.arange(num_blocks * block_size, device=q.device).view(1, num_blocks, block_size, 1, 1)
    scores = scores.masked_fill(position >= context_lens.view(batch, 1, 1, 1, 1), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(1, 2), keepdim=True))
    total = weights.sum(dim=(1, 2))  # [B, H_kv, G]
    v = v_pool[block_tables].unsqueeze(4).float()
    out = (weights.unsqueeze(-1) * v).sum(dim=(1, 2)) / total.unsqueeze(-1)  # [B, H_kv, G, d]
    return out.reshape(batch, kv_heads * group, head_dim).to(q.dtype)


@functools.cache
def _compiled():
    return torch.compile(paged_decode_attention, dynamic=True)


def compiled_paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                                    scale: float) -> torch.Tensor:
    """:func:`paged_decode_attention` compiled by inductor, built on the first call (once per
    process; a table of a single block gets a graph of its own, and inductor's on-disk cache
    keeps the kernels between processes). The pools' sizes, and those of the cache tensor they
    are views of, are fixed for an engine's life, so they are marked static: only the batch and
    the table's length vary, and no size of the pool is confused with one of them."""
    for pool in (k_pool, v_pool, k_pool._base, v_pool._base):
        if pool is not None:
            torch._dynamo.mark_static(pool)
    return _compiled()(q, k_pool, v_pool, block_tables, context_lens, scale)
