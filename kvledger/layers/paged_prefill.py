"""Causal attention of a prefill chunk that reads K/V where they lie in the paged cache: a CPU kernel of our own.

A chunk's ``n`` queries (``q`` ``[n, H, d]``, at positions ``num_computed`` .. ``num_computed +
n - 1``) against the keys and values of positions ``0 .. num_computed + n - 1`` in the blocks of
its table, each query seeing the keys up to its own position. The chunk's own K/V are written to
the cache first, so a first chunk (nothing cached) and a later one (chunked prefill, a
prefix-cache hit) are the same call, and nothing is gathered into a ``[1, H_kv, T, d]`` copy.

The kernel (``csrc/paged_prefill.cpp``) is flash attention on the CPU's vectors: the context of
each KV head is copied once into float32 tiles (keys transposed), then blocks of 16 query
positions, with all the query heads of their KV head (GQA), walk the key tiles up to their
causal end with an online softmax, in float32 (as SDPA does under a 16-bit model). Nothing above
the diagonal is computed, past the tile that holds it. vLLM's CPU backend has an attention kernel
of its own for its prefills too.

Measured on an AMD EPYC with AVX-512 (2 threads, SmolLM2's 9 query and 3 KV heads of 64): a
512-token prompt's attention took 2.5 ms a layer in the engine against 4.95 ms for the CPU
flash SDPA it replaces (vLLM's own kernel: 2.3 ms); one layer alone, medians, float32 3.5
against 6.9 ms at 512 tokens and 11.0 against 12.5 ms for 256 new tokens after 1,792 cached.
Key tiles of 32 positions ran about 5% faster than 16 or 64. The float32 copy of the context
takes ``2 * context * H_kv * d * 4`` bytes (1.5 MiB for SmolLM2 at 1,024 tokens); the calling
thread keeps it for the next layer up to 64 MiB, and frees a larger one after its call.

On an Intel Xeon with AMX (2 threads, bfloat16, SmolLM2's heads, best of 10) torch's
flash SDPA, given contiguous operands, multiplies on the AMX tiles and beats this kernel, which
multiplies in float32: 1.08 against 1.88 ms at 512 new tokens, 9.4 against 26.0 at 2,048, and,
with K/V gathered through the block table and a mask, 3.1 against 6.3 ms for 256 new tokens after
1,792 cached. There bfloat16 chunks go to SDPA; float32 ones stay here (3.0 against 1.7 ms at 512).

It serves float32 and bfloat16 caches on CPU that store the compute dtype, head sizes 64, 128
and 256, causal attention without a sliding window; elsewhere attention runs SDPA (over the fresh
K/V of a first chunk, or K/V gathered through the block table).
"""

from __future__ import annotations

import torch

from kvledger.layers import cpu_kernels

HEAD_DIMS = (64, 128, 256)
"""Head sizes the kernel is built for."""


def supports(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when prefill chunks on this device, cache dtype and head shape run the kernel (building
    it if it is not yet)."""
    if torch.device(device).type != "cpu" or dtype not in cpu_kernels.KERNEL_DTYPES:
        return False
    if num_heads % num_kv_heads or head_dim not in HEAD_DIMS:
        return False
    return cpu_kernels.loaded()


def preferred(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when the engine runs prefill chunks through the kernel: where it :func:`supports` them,
    except bfloat16 on a CPU with AMX, where torch's flash SDPA is faster (see above)."""
    if dtype == torch.bfloat16 and amx():
        return False
    return supports(device, dtype, num_heads, num_kv_heads, head_dim)


def amx() -> bool:
    """True on a CPU with AMX tiles (and a torch that says so)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check())


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_computed: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[n, H, d]`` in ``q``'s dtype, written into ``out`` when given: query ``i``
    (position ``num_computed + i``) over positions ``0 .. num_computed + i`` of the blocks
    ``block_table`` (``[blocks]`` int64, from position 0) of ``k_pool``/``v_pool``
    (``[num_blocks, block_size, H_kv, d]``). Only where :func:`supports` said so."""
    q, out = cpu_kernels.attention_operands(q, out)
    torch.ops.kvledger_cpu.paged_prefill(out, q, k_pool, v_pool, block_table.reshape(-1), num_computed, scale)
    return out
