"""Dense projections ``y = x W^T + b`` on CPU: a kernel of our own on column panels for the rows of
a decode step, oneDNN with the weight prepacked once for more.

* **One row to a few dozen** (decode steps; :func:`panel_rows` says how many on this CPU):
  kvledger's ``panel_linear`` (:mod:`kvledger.kernels.panel_linear`) on a copy of the weight laid
  out in panels of 32 output columns (16 with AVX2), each one forward stream of memory; the rows
  are taken in groups whose accumulators stay in registers, so a few rows read the weight at
  memory speed and a few dozen keep the FMA units busy. float32 and bfloat16 weights, with
  float32 or bfloat16 rows; a bfloat16 weight is widened as it is read, and the sums are float32.
* **More rows**: ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once, at load
  (:func:`pack_weight`), into oneDNN's blocked layout: no per-call reorder, and the kernels
  oneDNN picks for the CPU (AMX where it has it). A residual can be added in the same kernel.
  On a CPU without bfloat16 kernels (AVX2 only: oneDNN refuses to reorder a bfloat16 weight
  there, and torch's own bfloat16 product runs at about 15 GFLOP/s) a bfloat16 weight is packed
  as its float32 values and the product computed in float32, rounded once to bfloat16.
* Elsewhere (other devices, other dtypes, inside a ``torch.compile`` graph): ``F.linear``.

Measured on an AMD EPYC with AVX-512 and AVX512-BF16 (Zen 4, 2 threads; SmolLM2's four projection
shapes of all 30 layers, so the weights come from memory; best of alternating rounds), float32:
oneDNN prepacked 17.9 / 20.9 / 22.4 / 26.3 / 33.9 / 41.1 / 60.5 / 73.8 / 132.2 ms at 4 / 8 / 12 /
16 / 24 / 32 / 48 / 64 / 128 rows, the panels 14.9 / 15.0 / 16.5 / 23.5 / 32.1 / 39.2 / 52.6 / 70.2
/ 145.5 ms (1.05-1.40x oneDNN's speed up to 64 rows, 0.91x at 128); against the few-row kernel
that read the plain weight one row after the next, at 1 / 2 / 3 / 4 rows: 15.2 / 14.4 / 16.4 /
17.6 ms, the panels 13.7 / 13.5 / 13.2 / 13.6. bfloat16: oneDNN 10.0 / 11.9 / 12.8 / 14.6 ms at 4 /
8 / 12 / 16 rows, the panels 8.0 / 11.2 / 15.8 / 21.8 (oneDNN multiplies bfloat16 pairs in one
instruction there, so it wins from 12 rows); the few-row kernel 7.8 / 9.6 / 9.9 / 13.3 ms at 1-4
rows, the panels 7.8 / 7.8 / 8.2 / 8.6. Built for AVX2 on the same CPU, the panels were faster than
oneDNN (which used AVX-512) at 2 and 4 rows only. Over the engine's 64-request float32 workload the
243 decode-only steps took 12.9 s against 14.1 s with the few-row kernel and oneDNN.
Earlier, on an AVX2-only AMD EPYC, oneDNN prepacked against ``F.linear`` (MKL): 40.6 / 46.8 / 64.4
/ 208.4 / 877 ms against 48.6 / 96.7 / 120.7 / 287.6 / 1198 ms at 1 / 4 / 16 / 64 / 512 rows; on a
Xeon with AMX (1 thread, one layer's shapes) float32 was even between MKL and oneDNN (9.6 / 64.7
/ 371 ms against 11.0 / 56.7 / 385 ms at 1 / 64 / 512 rows) and bfloat16 prepacked beat
``F.linear`` (6.4 against 8.3 ms at 1 row, 10.1 against 17.1 at 64).

The packed copies are kept beside the plain weight (which compiled graphs read), so the
projections take three times their bytes: for SmolLM2-135M in float32, 425 MB of layer
weights, as much again in oneDNN's layout and as much in panels; its LM head (113 MB, the
embedding's) is kept plain and in panels only (:func:`pack_weight`'s ``logits``).
"""


from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.kernels import cpu_kernels, panel_linear as kernel

SMALL_BATCH_ROWS = 2
"""Up to this many rows, a bfloat16 product on a CPU without bfloat16 kernels and without
kvledger's kernels reads the bfloat16 weight (half the bytes of its float32 copy, and a product of
a few rows is bound by them)."""
PANEL_ROWS_AVX512 = 64
"""With AVX-512, products of at most this many rows run on the panels (float32, and bfloat16
where oneDNN has no bfloat16 kernels): measured faster than oneDNN from 1 to 64 rows, slower at 128."""
PANEL_ROWS_AVX512_BF16 = 8
"""With AVX-512 and oneDNN's bfloat16 kernels (two products a lane), bfloat16 products of at most
this many rows run on the panels (memory-bound there; oneDNN's dot products win above)."""
PANEL_ROWS_NARROW = 4
"""With narrower vectors (AVX2), products of at most this many rows run on the panels (bound by
reading the weight; no wider row counts were measured on such a CPU)."""


def packs(dtype: torch.dtype) -> bool:
    """True when this CPU's oneDNN reorders and multiplies ``dtype`` weights itself: bfloat16 only
    with AVX-512 or AVX-NE-CONVERT (an AVX2-only CPU has no bfloat16 kernels); float32 always."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panel_rows(dtype: torch.dtype) -> int:
    """The most rows a product with a ``dtype`` weight runs on kvledger's panels on this CPU (0:
    never, the kernels not built)."""
    if dtype not in cpu_kernels.KERNEL_DTYPES or not cpu_kernels.loaded():
        return 0
    if cpu_kernels.vector_width() < 16:
        return PANEL_ROWS_NARROW
    if dtype == torch.bfloat16 and packs(torch.bfloat16):
        return PANEL_ROWS_AVX512_BF16
    return PANEL_ROWS_AVX512


@dataclass(frozen=True)
class PackedWeight:
    """The CPU kernels' copies of one weight ``[out, in]``, made once at load (:func:`pack_weight`)."""

    onednn: torch.Tensor | None
    """oneDNN's blocked copy (a bfloat16 weight's float32 values on a CPU without bfloat16 kernels)."""
    panels: torch.Tensor | None
    """kvledger's panel layout ``[out / P, in, P]`` (the kernels' ``pack_panels``), the weight's dtype."""
    panel_rows: int
    """Products of at most this many rows run on ``panels``."""


def pack_weight(weight: torch.Tensor, *, logits: bool = False) -> PackedWeight | None:
    """The kernels' copies of ``weight`` ``[out, in]`` for CPU products, or None where no kernel
    applies (another device, another dtype, a torch built without oneDNN and no kvledger kernels).
    A bfloat16 weight on a CPU without bfloat16 kernels gets a oneDNN copy of its float32 values
    (exact: every bfloat16 is a float32), and its products beyond the panels' rows are computed
    in float32 (:func:`linear`).

    ``logits``: the LM head, whose products have as many rows as a step has logits to read (a
    few, where prefill chunks end; more only in large decode batches). Where the panels take
    float32's 64 rows, they take every row count of it and no oneDNN copy is kept: its vocabulary
    makes it the largest weight (Gemma-3's is 671 MB in float32), and the panels ran at 0.91x of
    oneDNN's speed even at 128 rows."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    w = weight.detach()
    rows = panel_rows(weight.dtype)
    panels = None
    if rows and w.dim() == 2 and w.shape[0] % kernel.panel_width() == 0:
        panels = kernel.pack_panels(w)
    if logits and panels is not None and cpu_kernels.vector_width() >= 16:  # AVX-512: PANEL_ROWS_AVX512
        return PackedWeight(None, panels, sys.maxsize)
    onednn = None
    if packs(weight.dtype):
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    elif packs(torch.float32):  # a bfloat16 weight on a CPU without bfloat16 kernels
        onednn = torch.ops.mkldnn._reorder_linear_weight(w.float(), None)
    if onednn is None and panels is None:
        return None
    return PackedWeight(onednn, panels, rows if panels is not None else 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[tokens, in]`` times ``weight`` ``[out, in]`` transposed, plus ``bias``, plus
    ``residual`` ``[tokens, out]``: ``[tokens, out]`` in ``x``'s dtype. ``packed`` is
    :func:`pack_weight`'s copies of ``weight`` (used when given)."""
    if (packed is not None and packed.panels is not None and 1 <= x.shape[0] <= packed.panel_rows
            and _eager_cpu_operands(x, bias, residual) and x.dtype in cpu_kernels.KERNEL_DTYPES):
        return kernel.panel_linear(x, packed.panels, bias, residual)
    onednn = None if packed is None else packed.onednn
    if onednn is not None and onednn.dtype != x.dtype:  # bfloat16 through its float32 copy
        if x.shape[0] > SMALL_BATCH_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(x.float(), onednn, None if bias is None else bias.float(),
                                                   "none", [], "").to(x.dtype)
            return y if residual is None else y + residual
        onednn = None
    if onednn is not None:
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, onednn, bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def _eager_cpu_operands(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    """True for what the panel kernel takes: eager (nothing about the shape is asked inside a
    compiled graph, where a question about a symbolic size would become a guard, and a graph per
    answer), on CPU, a contiguous ``[tokens, in]``, and bias and residual of x's dtype."""
    if torch.compiler.is_compiling():
        return False
    return (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
            and (bias is None or bias.dtype == x.dtype)
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) whose product runs through :func:`linear`;
    :meth:`pack` prepares the CPU kernels' copies of the weight after the weights are loaded."""

    packed: PackedWeight | None = None

    def pack(self) -> None:
        """(Re)build the packed copies from the current ``weight``; call after loading it."""
        self.packed = pack_weight(self.weight)

    @property
    def kernel_weight(self) -> PackedWeight | None:
        """The packed copies for :func:`linear`, or None inside a graph that ``torch.compile``
        traces: oneDNN's blocked tensors have no fake-tensor form, so a compiled layer multiplies
        by the plain weight and inductor chooses the kernel."""
        return None if torch.compiler.is_compiling() else self.packed

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return linear(x, self.weight, self.bias, self.kernel_weight, residual)
