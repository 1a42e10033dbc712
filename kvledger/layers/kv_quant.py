"""8-bit KV-cache formats: how a K or V vector becomes one byte per element plus a scale.

* **int8**, per token and per KV head: ``scale = max|x| / 127`` over the head's ``d_h``
  elements, ``q = round(x / scale)``. One float16 scale per token, per KV head, for K and for V:
  ``2 * H_kv * 2`` bytes per token per layer, stored beside the blocks (3% on 64-wide heads;
  float32 scales would cost 6% and leave int8 under 3.8x the float32 token capacity).
* **fp8** (``fp8``/``fp8_e4m3`` = E4M3, ``fp8_e5m2`` = E5M2), per layer: one ``k_scale`` and one
  ``v_scale`` per layer, as vLLM's. They are computed on the fly from the first tokens
  written to that layer (their largest magnitude maps to a quarter of the format's range,
  leaving 4x headroom for later tokens) and then frozen; ``q = fp8(x / scale)``, saturating.

Quantize on write, dequantize on read: nothing outside :mod:`kvledger.layers.paged_kv` sees
the 8-bit values. CPU kernels lack ``index_copy`` for float8, so fp8 bytes move as uint8.
"""

from __future__ import annotations

import torch

from kvledger.errors import KVLedgerError

INT8_MAX = 127.0
FP8_HEADROOM = 4.0
SCALE_DTYPE = torch.float32
"""Arithmetic and fp8's per-layer scales are float32."""
INT8_SCALE_DTYPE = torch.float16
"""int8's per-token, per-head scales are stored as float16."""
_FP8_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch float8 dtype of an fp8 ``--kv-cache-dtype``, or a clear error when torch lacks it."""
    name = _FP8_NAMES[kv_cache_dtype]
    dtype = getattr(torch, name, None)
    if dtype is None:
        raise KVLedgerError(f"--kv-cache-dtype {kv_cache_dtype} needs torch.{name}, which this torch "
                            f"{torch.__version__} lacks; upgrade torch or use --kv-cache-dtype int8")
    return dtype


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _FP8_NAMES


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` -> (int8 values ``[..., d]``, float16 scales ``[...]``), symmetric absmax.
    Values are divided by the stored (rounded) scale, so dequantization is consistent."""
    scale = (x.abs().amax(dim=-1).to(SCALE_DTYPE) / INT8_MAX).to(INT8_SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero (or underflowed) vectors
    q = torch.round(x.to(SCALE_DTYPE) / scale.to(SCALE_DTYPE).unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int8` into ``dtype``."""
    # int8 x float32 promotes inside one kernel: no float copy of q is made first
    return torch.mul(q, scale.to(SCALE_DTYPE).unsqueeze(-1)).to(dtype)


def fp8_scale_for(x: torch.Tensor, fp8: torch.dtype) -> float:
    """Per-layer scale: the largest magnitude of ``x`` lands at 1/FP8_HEADROOM of the fp8 range."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return amax * FP8_HEADROOM / torch.finfo(fp8).max if amax > 0 else 1.0


def quantize_fp8(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """``x / scale`` as fp8, saturating at the format's largest finite value."""
    limit = torch.finfo(fp8).max
    return (x.to(SCALE_DTYPE) / scale).clamp_(-limit, limit).to(fp8)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``. E4M3 goes through :func:`_e4m3_as_float16`: torch's CPU cast
    from E4M3 is about 5x slower than these integer ops (E5M2 is half of a float16 and casts fast)."""
    if q.dtype == torch.float8_e4m3fn:
        return _e4m3_as_float16(q.view(torch.uint8)).to(SCALE_DTYPE).mul_(scale * 256.0).to(dtype)
    return q.to(SCALE_DTYPE).mul_(scale).to(dtype)


def _e4m3_as_float16(raw: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes as float16 values 256 times too small, exactly (subnormals included).

    Moving the exponent and mantissa bits up by 7 puts them in float16's fields; float16's
    exponent bias is 8 more than E4M3's, so every value, normal or subnormal, comes out
    scaled by 2**-8. (The NaN codes, never written here, would read as finite values.)"""
    x = raw.to(torch.int16)
    return (((x & 0x80) << 8) | ((x & 0x7F) << 7)).view(torch.float16)
