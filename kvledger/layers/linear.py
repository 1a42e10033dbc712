"""Dense projections ``y = x W^T + b`` on CPU: oneDNN with the weight prepacked once, and a kernel of
our own for a few rows.

* **At most three rows** (a decode step of a few sequences, the LM head of a step): kvledger's
  ``skinny_linear`` (:mod:`kvledger.layers.cpu_kernels`) streams the plain weight once, one
  row after the next, and multiplies it by the rows held in float32, float32 or bfloat16
  weights, so the product runs at the speed of reading the weight; packed or not (at one row it
  reads a bfloat16 weight about twice as fast as oneDNN's own kernels, below).
* **More rows**: ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once, at load
  (:meth:`Linear.pack`), into oneDNN's blocked layout: no per-call reorder, and the kernels
  oneDNN picks for the CPU (AMX where it has it). A residual can be added in the same kernel.
  On a CPU without bfloat16 kernels (AVX2 only: oneDNN refuses to reorder a bfloat16 weight
  there, and torch's own bfloat16 product runs at about 15 GFLOP/s) a bfloat16 weight is packed
  as its float32 values and the product computed in float32, rounded once to bfloat16.
* Elsewhere (other devices, other dtypes, inside a ``torch.compile`` graph): ``F.linear``.

Measured on an AVX2 AMD EPYC (2 threads, SmolLM2's four projection shapes of all 30 layers, so
the weights come from memory; medians): float32 ``F.linear`` (MKL) 48.6 / 96.7 / 120.7 / 287.6 /
1198 ms at 1 / 4 / 16 / 64 / 512 rows, oneDNN prepacked 40.6 / 46.8 / 64.4 / 208.4 / 877 ms,
``skinny_linear`` 29.5 ms at 1 row and 36.0 at 4 (float32 weights), 21.5 and 28.5 ms (bfloat16
weights). On an AMD EPYC with AVX-512 and AVX512-BF16 (Zen 4), same shapes: float32 ``F.linear``
57.8 / 79.4 / 72.9 / 192.8 / 941 ms, oneDNN on the plain weight 41.2 / 42.6 / 56.2 / 131.8 /
664, prepacked 43.1 / 27.7 / 35.6 / 103.4 / 608, ``skinny_linear`` 26.7 at 1 row and 32.6 at 4;
bfloat16 prepacked 17.4 / 16.7 / 19.4 / 52.0 / 308 against ``skinny_linear``'s 18.3 and 23.0 at
1 and 4 rows; over the engine's 64-request workload (24 requests, float32, eager, 4 alternating
processes each) the prepacked float32 weights took 13.5 s against 15.7 s on the plain weight
(medians; 14% faster). Since ``skinny_linear`` reads one weight row after the next (it read
four rows side by side before, and half as fast), on the same Zen 4 (the four shapes of 30
layers and the LM head, alternating, best of 5): float32 at 1 / 2 / 3 / 4 rows 13.6 / 12.9 /
19.4 / 23.7 ms against oneDNN prepacked 20.2 / 20.9 / 16.8 / 17.2 (an earlier run, with two
accumulators at 2 rows: 19.0 / 17.9 / 19.8 / 22.5 against 24.7 / 24.9 / 21.9 / 19.5); bfloat16 7.7 / 9.0 / 11.0 / 12.5 against 14.2
/ 12.2 / 12.0 / 10.8; the rows' kernel before the change took 19.4 ms (float32) and 12.1 ms
(bfloat16) at one row. On a Xeon with AMX (1 thread, one layer's shapes) float32 was even between MKL and
oneDNN (9.6 / 64.7 / 371 ms against 11.0 / 56.7 / 385 ms at 1 / 64 / 512 rows) and bfloat16
prepacked beat ``F.linear`` (6.4 against 8.3 ms at 1 row, 10.1 against 17.1 at 64). The prepacked
copy is kept beside the plain weight (which the few-row kernel and compiled graphs read), so the
projections take twice their bytes (a bfloat16 model's three times on an AVX2 CPU): for
SmolLM2-135M in float32, 538 MB of weights and as much again packed (the process held 1,296 MB
after loading the model, against 782 MB without the packed copies).
"""


from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.layers import cpu_kernels

SKINNY_ROWS = 3
"""Products of at most this many rows run kvledger's ``skinny_linear`` kernel where it is built."""
SMALL_BATCH_ROWS = 2
"""Up to this many rows, a bfloat16 product on a CPU without bfloat16 kernels reads the bfloat16
weight (half the bytes of its float32 copy, and a product of a few rows is bound by them)."""


def packs(dtype: torch.dtype) -> bool:
    """True when this CPU's oneDNN reorders and multiplies ``dtype`` weights itself: bfloat16 only
    with AVX-512 or AVX-NE-CONVERT (an AVX2-only CPU has no bfloat16 kernels); float32 always."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` ``[out, in]`` for CPU products, or None where that path
    does not apply (another device, another dtype, a torch built without oneDNN). A bfloat16
    weight on a CPU without bfloat16 kernels is packed as its float32 values (exact: every
    bfloat16 is a float32), and its products computed in float32 (:func:`linear`)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if packs(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    if packs(torch.float32):  # a bfloat16 weight on a CPU without bfloat16 kernels
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), None)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[tokens, in]`` times ``weight`` ``[out, in]`` transposed, plus ``bias``, plus
    ``residual`` ``[tokens, out]``: ``[tokens, out]`` in ``x``'s dtype. ``packed`` is
    :func:`pack_weight`'s copy of ``weight`` (used when given)."""
    if _skinny(x, weight, bias, residual):
        return torch.ops.kvledger_cpu.skinny_linear(x, weight, bias, residual)
    if packed is not None and packed.dtype != x.dtype:  # bfloat16 through its float32 copy
        if x.shape[0] > SMALL_BATCH_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(x.float(), packed, None if bias is None else bias.float(),
                                                   "none", [], "").to(x.dtype)
            return y if residual is None else y + residual
        packed = None
    if packed is not None:
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def _eager_cpu_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor | None) -> bool:
    """True for what the CPU kernels below take: eager (nothing about the shape is asked inside a
    compiled graph, where a question about a symbolic size would become a guard, and a graph per
    answer), on CPU, a contiguous ``[tokens, in]`` and weight, bias and residual of x's dtype."""
    if torch.compiler.is_compiling():
        return False
    return (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or bias.dtype == x.dtype)
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)))


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    """True when ``skinny_linear`` takes this product (1 to 4 rows, its dtypes and layouts)."""
    return (_eager_cpu_operands(x, weight, bias, residual) and 1 <= x.shape[0] <= SKINNY_ROWS
            and x.dtype in cpu_kernels.KERNEL_DTYPES and weight.dtype in cpu_kernels.KERNEL_DTYPES
            and cpu_kernels.loaded() and x.shape[1] % cpu_kernels.vector_width() == 0)


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
