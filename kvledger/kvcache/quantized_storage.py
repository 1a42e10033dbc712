"""8-bit paged KV caches: one byte per element in the block pool, plus scales.

Same layout and the same two operations as :class:`~kvledger.kvcache.storage.KVCache`
(``write`` by slot, ``gather`` by block table); quantization happens on write and
dequantization on read, so nothing else in the engine changes. Decode steps on CPU read the
8-bit elements in place (``layer_pools``, for :mod:`kvledger.kernels.paged_decode`, which widens
them as it reads); elsewhere they read through ``gather_decode``: the 8-bit values widened to the
compute dtype but not multiplied by their scales. Either way attention applies the scales to the
scores and probabilities (as the CUDA kernels of serving engines do), so no dequantized copy of
the context is made. The formats are in :mod:`kvledger.kvcache.quantization`:

* :class:`Int8KVCache`: int8 elements and a float16 scale per token, per KV head, for K and
  for V, kept in ``scales`` ``[L, 2, num_blocks, block_size, H_kv]`` beside the blocks, so a
  block's scales travel with it (prefix sharing, eviction).
* :class:`Fp8KVCache`: fp8 elements (E4M3 or E5M2) stored as raw bytes, and one K and one V
  scale per layer (vLLM's ``k_scale``/``v_scale``) in ``scales`` ``[L, 2]``.

``measured_bytes`` counts elements and scales: Eq 2.2's ``bytes_per_token`` plus
``scale_bytes_per_token`` per slot, plus ``scale_bytes_fixed`` for per-layer scales.
"""

from __future__ import annotations

import torch

from kvledger.kvcache.quantization import (
    INT8_SCALE_DTYPE, SCALE_DTYPE, dequantize_fp8, dequantize_int8, fp8_scale_for, quantize_fp8, quantize_int8,
    widen_fp8,
)
from kvledger.kvcache.storage import DecodeKV, KVCache, LayerPools, torch_dtype
from kvledger.spec.dtypes import PER_LAYER_SCALE_DTYPES


class Int8KVCache(KVCache):
    """int8 K/V with per-token, per-head float16 scales."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, torch.int8, device, compute_dtype)
        self.scales = torch.ones(num_layers, 2, num_blocks, block_size, num_kv_heads, dtype=INT8_SCALE_DTYPE,
                                 device=device)
        self._flat_scales = self.scales.view(num_layers, 2, num_blocks * block_size, num_kv_heads)

    @property
    def measured_bytes(self) -> int:
        return super().measured_bytes + self.scales.numel() * self.scales.element_size()

    def block_tensors(self) -> list[torch.Tensor]:
        return [self.storage, self.scales]  # the scales travel with their block

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        q, scale = quantize_int8(torch.stack((k, v)))  # K and V together: [2, tokens, H_kv, d_h]
        self._flat[layer].index_copy_(1, slot_mapping, q)
        self._flat_scales[layer].index_copy_(1, slot_mapping, scale)

    def layer_pools(self, layer: int) -> LayerPools:
        pools, scales = self.storage[layer], self.scales[layer]
        return LayerPools(pools[0], pools[1], scales[0], scales[1])

    def gather(self, layer: int, block_tables: torch.Tensor, num_tokens: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._gather_stored(layer, block_tables, num_tokens)  # int8, [B, H_kv, T, d_h]
        k_scale, v_scale = self._gather_scales(layer, block_tables, num_tokens)
        return (dequantize_int8(k, k_scale, self.compute_dtype), dequantize_int8(v, v_scale, self.compute_dtype))

    def gather_decode(self, layer: int, block_tables: torch.Tensor, num_tokens: int) -> DecodeKV:
        k, v = self._gather_stored(layer, block_tables, num_tokens)
        k_scale, v_scale = self._gather_scales(layer, block_tables, num_tokens)
        contiguous = torch.contiguous_format
        k, v = (x.to(self.compute_dtype, memory_format=contiguous) for x in (k, v))
        k_scale, v_scale = (s.to(SCALE_DTYPE, memory_format=contiguous) for s in (k_scale, v_scale))
        return DecodeKV(k, v, k_scale, v_scale)

    def _gather_scales(self, layer: int, block_tables: torch.Tensor, num_tokens: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scales as stored (float16), ``[B, H_kv, T]``."""
        batch, blocks = block_tables.shape
        s = self.scales[layer].index_select(1, block_tables.reshape(-1)).view(2, batch, blocks * self.block_size, self.num_kv_heads)
        if num_tokens is not None:
            s = s[:, :, :num_tokens]
        s = s.transpose(2, 3)
        return s[0], s[1]


class Fp8KVCache(KVCache):
    """fp8 K/V (bytes in the pool) with one K and one V scale per layer, set on the first write."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype, kv_cache_dtype: str = "fp8", device: torch.device | str = "cpu") -> None:
        self.fp8 = torch_dtype(kv_cache_dtype)
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, torch.uint8, device, compute_dtype)
        self.scales = torch.ones(num_layers, 2, dtype=SCALE_DTYPE, device=device)
        self._scale_values: list[tuple[float, float] | None] = [None] * num_layers  # host copies of ``scales``

    @property
    def measured_bytes(self) -> int:
        return super().measured_bytes + self.scales.numel() * self.scales.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self._scale_values[layer] is None:
            values = (fp8_scale_for(k, self.fp8), fp8_scale_for(v, self.fp8))
            self.scales[layer] = torch.tensor(values, dtype=SCALE_DTYPE)
            self._scale_values[layer] = values
        scales = self.scales[layer].view(2, 1, 1, 1)
        q = quantize_fp8(torch.stack((k, v)), scales, self.fp8)  # K and V together: [2, tokens, H_kv, d_h]
        self._flat[layer].index_copy_(1, slot_mapping, q.view(torch.uint8))

    def layer_pools(self, layer: int) -> LayerPools:
        pools = self.storage[layer].view(self.fp8)
        k_scale, v_scale = self._scale_values[layer] or (1.0, 1.0)
        return LayerPools(pools[0], pools[1], k_scale=k_scale, v_scale=v_scale)

    def gather(self, layer: int, block_tables: torch.Tensor, num_tokens: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._gather_stored(layer, block_tables, num_tokens)  # raw bytes, [B, H_kv, T, d_h]
        k_scale, v_scale = self._scale_values[layer] or (1.0, 1.0)
        return (dequantize_fp8(k.view(self.fp8), k_scale, self.compute_dtype),
                dequantize_fp8(v.view(self.fp8), v_scale, self.compute_dtype))

    def gather_decode(self, layer: int, block_tables: torch.Tensor, num_tokens: int) -> DecodeKV:
        k, v = self._gather_stored(layer, block_tables, num_tokens)
        k_scale, v_scale = self._scale_values[layer] or (1.0, 1.0)
        (kw, k_factor), (vw, v_factor) = (widen_fp8(x.view(self.fp8), self.compute_dtype) for x in (k, v))
        return DecodeKV(kw, vw, k_scale * k_factor, v_scale * v_factor)


def make_kv_cache(kv_cache_dtype: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
    """The cache for a ``--kv-cache-dtype``: plain (``auto``: the compute dtype), int8 or fp8."""
    if kv_cache_dtype == "int8":
        return Int8KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
    if kv_cache_dtype in PER_LAYER_SCALE_DTYPES:
        return Fp8KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype,
                          kv_cache_dtype, device)
    return KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                   compute_dtype if kv_cache_dtype == "auto" else torch_dtype(kv_cache_dtype), device, compute_dtype)
