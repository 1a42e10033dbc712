"""Dense projections ``y = x W^T + b``; bfloat16 on CPU through oneDNN with the weight prepacked once.

On CPU a bfloat16 weight is reordered once, at load (:meth:`Linear.pack`), into oneDNN's
blocked layout, and every product then runs ``torch.ops.mkldnn._linear_pointwise`` on it: no
per-call reorder, and the kernels oneDNN picks for the machine (AMX where the CPU has it). A
residual can be added in the same kernel (``residual=``). Measured here (Xeon with AMX, 1 thread,
SmolLM2's five projection shapes summed, medians of alternating rounds), bfloat16: 6.4 ms
prepacked against 8.3 ms for ``F.linear`` at 1 row, 10.1 against 17.1 ms at 64 rows, equal at
512. float32 gained nothing on this CPU (MKL's ``F.linear`` 9.6 / 64.7 / 371 ms, oneDNN
prepacked 11.0 / 56.7 / 385 ms at 1 / 64 / 512 rows) and a prepacked copy doubles the weights'
memory, so float32, other dtypes and other devices use ``torch.nn.functional.linear``. (The
``W @ x.T`` form this module used before for small batches, measured faster on an AMD CPU, was
the slowest of the three here.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16,)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` ``[out, in]`` for CPU products, or None where that path
    does not apply (another device, another dtype, a torch built without oneDNN)."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[tokens, in]`` times ``weight`` ``[out, in]`` transposed, plus ``bias``, plus
    ``residual`` ``[tokens, out]``: ``[tokens, out]``. ``packed`` is :func:`pack_weight`'s copy of
    ``weight`` (used when given)."""
    if packed is not None:
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) whose product runs through :func:`linear`;
    :meth:`pack` prepares the CPU kernel's copy of the weight after the weights are loaded."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """(Re)build the prepacked weight from the current ``weight``; call after loading it."""
        self.packed = pack_weight(self.weight)

    @property
    def kernel_weight(self) -> torch.Tensor | None:
        """The prepacked weight for :func:`linear`, or None inside a graph that ``torch.compile``
        traces: oneDNN's blocked tensors have no fake-tensor form, so a compiled layer multiplies
        by the plain weight and inductor chooses the kernel."""
        return None if torch.compiler.is_compiling() else self.packed

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return linear(x, self.weight, self.bias, self.kernel_weight, residual)
