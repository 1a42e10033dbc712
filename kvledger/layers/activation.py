"""Gated activations over a fused ``[gate | up]`` projection: SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` is ``[..., 2 * intermediate]`` (gate first); returns ``[..., intermediate]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Gemma): ``gelu_tanh(gate) * up`` over a fused ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
