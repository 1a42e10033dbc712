"""Causal attention of a prefill chunk that reads K/V where they lie in the paged cache: a CPU kernel of our own.

A chunk's ``n`` queries (``q`` ``[n, H, d]``, at positions ``num_computed`` .. ``num_computed +
n - 1``) against the keys and values of positions ``0 .. num_computed + n - 1`` in the blocks of
its table, each query seeing the keys up to its own position. The chunk's own K/V are written to
the cache first, so a first chunk (nothing cached) and a later one (chunked prefill, a
prefix-cache hit) are the same call, and nothing is gathered into a ``[1, H_kv, T, d]`` copy.

The kernel (``csrc/paged_prefill.cpp``) is flash attention: blocks of query positions, with all
the query heads of their KV head (GQA), walk the context's keys up to their causal end with an
online softmax in float32 (as SDPA does under a 16-bit model); nothing above the diagonal is
computed, past the chunk of keys that holds it. vLLM's CPU backend has an attention kernel of
its own for its prefills too. It has two paths:

* **through oneDNN** (float32 everywhere; bfloat16 on a CPU that multiplies it: on its matrix unit,
  AMX, where ATen's batch-reduce GEMM can pack for it, ``cpublas::could_pack``, or with the
  AVX512-BF16 dot products, AMD Zen 4 and Intel Cooper Lake): the context of each
  KV head is copied once into chunks of up to 256 positions (keys transposed; bfloat16 in the
  VNNI layout, pairs of rows interleaved), and each work item, 64 query positions, gets its scores ``Q K^T`` and
  its ``P V`` from ATen's batch-reduce GEMM (``cpublas::brgemm``, as torch's flash SDPA), with
  the probabilities rounded to bfloat16 in a bfloat16 model, as SDPA does; ``exp`` is torch's
  faster vector one (20 ulp), as in its flash SDPA;
* **on the vectors** (bfloat16 on a CPU without either, AVX2 alone): the context copied once into float32 tiles
  of 32 positions, blocks of 16 query positions, scores and weighted sums in register
  accumulators.

Measured on an AMD EPYC with AVX-512 (2 threads, SmolLM2's 9 query and 3 KV heads of 64), the
vector path in float32: a 512-token prompt's attention took 2.5 ms a layer in the engine against
4.95 ms for the CPU flash SDPA it replaced (vLLM's own kernel: 2.3 ms); one layer alone, medians,
3.5 against 6.9 ms at 512 tokens and 11.0 against 12.5 ms for 256 new tokens after 1,792 cached.
Key tiles of 32 positions ran about 5% faster than 16 or 64.

On an Intel Xeon with AMX (2 threads, SmolLM2's heads, best of 20), through oneDNN: bfloat16
0.60-0.65 ms at 512 new tokens against 0.78-1.03 ms for flash SDPA on contiguous copies (the
vector path: 1.88 ms), 1.90-1.95 against 1.99-2.06 ms for 256 new tokens after 1,792 cached (SDPA
with a mask over gathered K/V), 7.9-8.5 against 8.0-8.8 ms at 2,048 (the machine's spread);
float32 1.42 / 5.06 / 20.3 ms against the vector path's 1.69 / 6.11 / 25.6 and SDPA's 2.2 / 5.1
/ 22.8. In the engine a 512-token bfloat16 prefill took 123-129 ms against 133-138 ms with SDPA.
On an AMD EPYC with AVX512-BF16 (Zen 4, no AMX; 2 threads, SmolLM2's heads, 512 new tokens),
bfloat16 through oneDNN took 1.25-1.35 ms against 2.37-2.47 ms for the vector path, with the same
largest difference from float32 SDPA (6.6e-3); a 512-token bfloat16 prefill in the engine
346 / 394 ms against 363 / 420 ms (two alternating pairs).
Key chunks of 128 positions and work items of 32 or 16 positions were 5-15% slower; oneDNN's
packing routine refuses a ``[64][256]`` operand (its packed rows take at most 64 columns), so
the kernel lays the chunks out itself.

The copy of the context takes ``2 * context * H_kv * d`` elements (float32 on the vector path;
1.5 MiB for SmolLM2 at 1,024 tokens); the calling thread keeps it for the next layer up to 64
MiB, and frees a larger one after its call.

It serves float32 and bfloat16 caches on CPU that store the compute dtype, head sizes 64, 128
and 256, causal attention without a sliding window; elsewhere attention runs SDPA (over the fresh
K/V of a first chunk, or K/V gathered through the block table).
"""

from __future__ import annotations

import torch

from kvledger.kernels import cpu_kernels

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


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_computed: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[n, H, d]`` in ``q``'s dtype, written into ``out`` when given: query ``i``
    (position ``num_computed + i``) over positions ``0 .. num_computed + i`` of the blocks
    ``block_table`` (``[blocks]`` int64, from position 0) of ``k_pool``/``v_pool``
    (``[num_blocks, block_size, H_kv, d]``). Only where :func:`supports` said so."""
    q, out = cpu_kernels.attention_operands(q, out)
    cpu_kernels.ops().paged_prefill(out, q, k_pool, v_pool, block_table.reshape(-1), num_computed, scale)
    return out
