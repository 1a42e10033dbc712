"""Decode attention that reads K/V where they lie in the paged cache: a CPU kernel of our own.

One query per sequence (``q`` ``[B, H, d]``) against the blocks its table names in a layer's
pool (``[num_blocks, block_size, H_kv, d]``), positions from a sequence's length on ignored;
nothing of size ``[B, T, H_kv, d]`` is gathered. The kernel (``csrc/paged_decode.cpp``, C++
on ATen's vector types) reads each key and value once for all the query heads that share it
(GQA), scores, softmax and the weighted sum in float32 (as SDPA does under a 16-bit model),
and splits a long context of few sequences into spans that both cores work on, merged as
flash-decoding does. vLLM's CPU backend has kernels of its own for the same reason.

It is one of kvledger's CPU kernels (:mod:`kvledger.layers.cpu_kernels`: built on first use,
cached on disk). It serves float32 and bfloat16 caches on CPU that store the compute dtype,
with ``head_dim`` a multiple of the vector width and at most 16 query heads per KV head;
elsewhere (CUDA, 8-bit caches, sliding windows), or where the kernels cannot be built, attention
gathers the context instead (:meth:`kvledger.layers.paged_kv.KVCache.gather_decode`).

Measured here (2 threads, SmolLM2's 9 query and 3 KV heads of 64, one layer, medians of repeated
calls, so the pool is warm in cache) against the gather plus SDPA it replaces, for ``B``
sequences of up to ``T`` tokens: float32 0.19 -> 0.03 ms (1 x 512), 1.0 -> 0.21 ms (16 x 256),
15 -> 0.92 ms (64 x 256), 50 -> 3.3 ms (64 x 1024); bfloat16 0.13 -> 0.026, 0.71 -> 0.11,
2.7 -> 0.75, 30 -> 3.8 ms.
"""

from __future__ import annotations

import torch

from kvledger.layers import cpu_kernels

MAX_GROUP = 16
"""Query heads per KV head the kernel takes (``kMaxGroup`` in the C++)."""


def supports(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when decode steps on this device, cache dtype and head shape run the kernel (building it
    if it is not yet)."""
    if torch.device(device).type != "cpu" or dtype not in cpu_kernels.KERNEL_DTYPES:
        return False
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return False
    return cpu_kernels.loaded() and head_dim % cpu_kernels.vector_width() == 0


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[B, H, d]`` in ``q``'s dtype, written into ``out`` when given: query
    ``b`` over the first ``context_lens[b]`` positions of the blocks ``block_tables[b]``
    (``[B, blocks]`` int64, padded past a sequence's last block) of ``k_pool``/``v_pool``
    (``[num_blocks, block_size, H_kv, d]``). Only where :func:`supports` said so."""
    q, out = cpu_kernels.attention_operands(q, out)
    torch.ops.kvledger_cpu.paged_decode(out, q, k_pool, v_pool, block_tables, context_lens, scale)
    return out
