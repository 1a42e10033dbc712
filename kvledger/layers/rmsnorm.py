"""RMSNorm as in Llama: normalise in float32, scale by a learned weight in the model dtype.

On CPU in float32 and bfloat16 the eager step runs it as one call of kvledger's ``rms_norm``
kernel (:mod:`kvledger.kernels.rms_norm`), the same formula: torch's own version is five to
seven operators, each dearer to dispatch than a row of a small model is to normalise (measured
here: 98 us per bfloat16 ``[1, 576]`` row, 61 of them per decode step of SmolLM2). Inside a
compiled graph, and elsewhere, torch's operators run and inductor fuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.kernels import rms_norm as kernel


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if kernel.supports(x, self.weight):
            return kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same formula
            return F.rms_norm(x, shape, self.weight, self.eps)
        # 16-bit: normalised in float32 (one fused op), rounded to the model dtype, then scaled
        return self.weight * F.rms_norm(x.to(torch.float32), shape, None, self.eps).to(x.dtype)
