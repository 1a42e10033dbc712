"""RMSNorm as in Llama: normalise in float32, scale by a learned weight in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same formula
            return F.rms_norm(x, shape, self.weight, self.eps)
        # 16-bit: normalised in float32 (one fused op), rounded to the model dtype, then scaled
        return self.weight * F.rms_norm(x.to(torch.float32), shape, None, self.eps).to(x.dtype)
