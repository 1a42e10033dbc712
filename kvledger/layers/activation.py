"""Gated activations over a fused ``[gate | up]`` projection: SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` is ``[..., 2 * intermediate]`` (gate first); returns ``[..., intermediate]``.
    On CPU, eager, in float32 and bfloat16 one call of kvledger's ``silu_and_mul`` kernel
    (:mod:`kvledger.layers.cpu_kernels`), equal to the torch operators below, which run elsewhere."""
    if (gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.is_contiguous()
            and gate_up.dtype in cpu_kernels.KERNEL_DTYPES and not torch.compiler.is_compiling() and cpu_kernels.loaded()):
        return cpu_kernels.ops().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Gemma): ``gelu_tanh(gate) * up`` over a fused ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
