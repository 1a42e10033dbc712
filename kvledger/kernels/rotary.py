"""``rotary``: RoPE of stacked query and key heads in one call (``csrc/rotary.cpp``), with the
roundings of :func:`kvledger.layers.rotary.apply_rotary`'s torch operators."""

from __future__ import annotations

import torch

from kvledger.kernels import cpu_kernels


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """True when :func:`rotary` takes ``x`` ``[N, heads, d]`` (last dimension contiguous) and
    ``cos``/``sin`` of its dtype."""
    return x.dim() == 3 and x.stride(-1) == 1 and x.dtype == cos.dtype == sin.dtype and cpu_kernels.runs_eagerly_on(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by ``cos``/``sin`` ``[N, 1, d]`` (a new tensor)."""
    n = x.shape[0]
    return cpu_kernels.ops().rotary(x, cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous())
