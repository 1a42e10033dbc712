"""8-bit KV-cache formats: how a K or V vector becomes one byte per element plus a scale.

* **int8**, per token and per KV head: ``scale = max|x| / 127`` over the head's ``d_h``
  elements, ``q = round(x / scale)``. One float16 scale per token, per KV head, for K and for V:
  ``2 * H_kv * 2`` bytes per token per layer, stored beside the blocks (3% on 64-wide heads;
  float32 scales would cost 6% and leave int8 under 3.8x the float32 token capacity).
* **fp8** (``fp8``/``fp8_e4m3`` = E4M3, ``fp8_e5m2`` = E5M2), per layer: one ``k_scale`` and one
  ``v_scale`` per layer, as vLLM's. They are computed on the fly from the first tokens
  written to that layer (their largest magnitude maps to a quarter of the format's range,
  leaving 4x headroom for later tokens) and then frozen; ``q = fp8(x / scale)``, saturating.

Quantize on write; on read the cache either dequantizes (prefill chunks) or widens the bytes
and leaves the scales to decode attention, which applies them to scores and probabilities. CPU kernels lack ``index_copy`` for float8, so fp8 bytes move as uint8.
"""

from __future__ import annotations

import torch


INT8_MAX = 127.0
FP8_HEADROOM = 4.0
SCALE_DTYPE = torch.float32
"""Arithmetic and fp8's per-layer scales are float32."""
INT8_SCALE_DTYPE = torch.float16
"""int8's per-token, per-head scales are stored as float16."""
_FLOAT16_TINY = 2.0 ** -24
"""The smallest positive float16 (subnormal): the floor of an int8 scale."""
_FP8_AS_FLOAT16 = {"float8_e4m3fn": (7, 256.0), "float8_e5m2": (8, 1.0)}
"""Per fp8 format: the left shift that puts a byte's exponent and mantissa into float16's
fields, and the factor the resulting float16 is off by (2 ** the exponent-bias difference)."""


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` -> (int8 values ``[..., d]``, float16 scales ``[...]``), symmetric absmax.
    Values are divided by the stored (rounded) scale, so dequantization is consistent. A zero
    vector gets the smallest float16 scale and zero values. Few kernels on purpose: a decode
    step quantizes one token per layer, so each extra op is paid 2 x L times per step."""
    scale = x.abs().amax(dim=-1).to(SCALE_DTYPE).div_(INT8_MAX).to(INT8_SCALE_DTYPE).clamp_min_(_FLOAT16_TINY)
    q = torch.div(x.to(SCALE_DTYPE), scale.to(SCALE_DTYPE).unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int8` into ``dtype``."""
    # int8 x float32 promotes inside one kernel: no float copy of q is made first
    return torch.mul(q, scale.to(SCALE_DTYPE).unsqueeze(-1)).to(dtype)


def fp8_scale_for(x: torch.Tensor, fp8: torch.dtype) -> float:
    """Per-layer scale: the largest magnitude of ``x`` lands at 1/FP8_HEADROOM of the fp8 range."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return amax * FP8_HEADROOM / torch.finfo(fp8).max if amax > 0 else 1.0


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``x / scale`` as fp8, saturating at the format's largest finite value (``scale`` a float
    or a tensor that broadcasts against ``x``)."""
    limit = torch.finfo(fp8).max
    return (x.to(SCALE_DTYPE) / scale).clamp_(-limit, limit).to(fp8)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``."""
    widened, factor = widen_fp8(q, SCALE_DTYPE)
    return widened.mul_(scale * factor).to(dtype)


def widen_fp8(q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """fp8 values ``q`` as a contiguous ``dtype`` tensor ``w`` and a factor ``f``, with
    ``q == w * f`` exactly for every finite code.

    The bytes become float16 bit patterns with integer ops (torch's CPU casts from fp8 are 3-15x
    slower): each byte, read as int8, is widened to int16 (which sign-extends it) and shifted
    left. E5M2 shifted by 8 is a float16 (same exponent bias, ``f`` = 1). E4M3 shifted by 7 puts
    its exponent and mantissa at the bottom of float16's fields; the sign lands on bit 15
    through the sign extension, and its copy on bit 14 is cleared. float16's exponent bias is 8
    more than E4M3's, so every value, normal or subnormal, comes out 2**-8 times too small
    (``f`` = 256). NaN codes are never written. The widening to int16 also makes the tensor
    contiguous, so the later ops run over contiguous memory."""
    shift, factor = _FP8_AS_FLOAT16[str(q.dtype).removeprefix("torch.")]
    bits = q.view(torch.int8).to(torch.int16, memory_format=torch.contiguous_format).mul_(1 << shift)
    if shift == 7:
        bits.bitwise_and_(~0x4000)
    return bits.view(torch.float16).to(dtype), factor
