"""``panel_linear``: products of a few rows against a weight packed in panels
(``csrc/panel_linear.cpp``), and ``pack_panels``, which lays a weight out for it
(:mod:`kvledger.layers.linear` decides when).
"""

from __future__ import annotations

import torch

from kvledger.kernels import cpu_kernels


def panel_width() -> int:
    """Output rows per panel for the current build (a weight's rows must be a multiple)."""
    return int(cpu_kernels.ops().panel_width())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as panels ``[out / P, in, P]``, its dtype."""
    return cpu_kernels.ops().pack_panels(weight.contiguous())


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias + residual``, ``[tokens, out]`` in ``x``'s dtype."""
    return cpu_kernels.ops().panel_linear(x, panels, bias, residual)
