"""``silu_and_mul``: SwiGLU over a fused ``[gate | up]`` row in one call (``csrc/silu_and_mul.cpp``)."""

from __future__ import annotations

import torch

from kvledger.kernels import cpu_kernels


def supports(gate_up: torch.Tensor) -> bool:
    """True when :func:`silu_and_mul` takes ``gate_up``: a contiguous ``[tokens, 2 * inter]``."""
    return gate_up.dim() == 2 and gate_up.is_contiguous() and cpu_kernels.runs_eagerly_on(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, ``[tokens, inter]``."""
    return cpu_kernels.ops().silu_and_mul(gate_up)
