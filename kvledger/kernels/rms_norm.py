"""``rms_norm``: RMSNorm of each row in one call (``csrc/rms_norm.cpp``), the formula of
:class:`kvledger.layers.rmsnorm.RMSNorm`."""

from __future__ import annotations

import torch

from kvledger.kernels import cpu_kernels


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`rms_norm` takes ``x`` (any shape ``[..., d]``) and ``weight`` ``[d]``."""
    return x.dtype == weight.dtype and cpu_kernels.runs_eagerly_on(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, in ``x``'s shape and dtype."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return cpu_kernels.ops().rms_norm(rows, weight, eps).view(x.shape)
