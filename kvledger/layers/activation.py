"""Gated activations over a fused ``[gate | up]`` projection: SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.kernels import silu_and_mul as kernel


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` is ``[..., 2 * intermediate]`` (gate first); returns ``[..., intermediate]``.
    On CPU, eager, in float32 and bfloat16 one call of kvledger's ``silu_and_mul`` kernel
    (:mod:`kvledger.kernels.silu_and_mul`), equal to the torch operators below, which run elsewhere."""
    if kernel.supports(gate_up):
        return kernel.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Gemma): ``gelu_tanh(gate) * up`` over a fused ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
