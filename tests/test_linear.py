"""The projections of kvledger.layers.linear: every kernel path against torch's F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import cpu_kernels
from kvledger.layers.linear import SMALL_BATCH_ROWS, Linear, PackedWeight, linear, pack_weight, packs

pytestmark = pytest.mark.usefixtures("capability")  # every test under each vector capability

needs_onednn = pytest.mark.skipif(not packs(torch.float32), reason="torch built without oneDNN")


def _operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    r = torch.randn(rows, 80, generator=g).to(dtype)
    return x, w, b, r


def _onednn_only(w: torch.Tensor) -> PackedWeight:
    """oneDNN's copy of ``w`` alone, so that every row count takes oneDNN's product."""
    onednn = torch.ops.mkldnn._reorder_linear_weight(w if packs(w.dtype) else w.float(), None)
    return PackedWeight(onednn, None, 0)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 64, 512])
def test_float32_prepacked_product_matches_f_linear(rows: int) -> None:
    """A float32 weight prepacked by oneDNN: float32 arithmetic in another order, so within
    float32's rounding of F.linear; a residual added in the same kernel."""
    x, w, b, r = _operands(rows, torch.float32)
    packed = _onednn_only(w)
    assert packed.onednn is not None and packed.onednn.dtype == torch.float32
    y = linear(x, w, b, packed)
    assert y.dtype == torch.float32 and y.shape == (rows, 80)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w, None, packed, residual=r), F.linear(x, w) + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_unpacked_products_take_torchs_own(rows: int) -> None:
    """Without a packed copy (a weight never packed, or not contiguous) F.linear computes the product."""
    x, w, b, r = _operands(rows, torch.float32)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w, None, residual=r), F.linear(x, w) + r)
    wt = w.t().contiguous().t()
    torch.testing.assert_close(linear(x, wt, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 40])
def test_bfloat16_product_through_a_float32_copy(rows: int) -> None:
    """The path of a CPU without bfloat16 kernels, taken here on any CPU by packing the float32
    copy by hand: a few rows read the bfloat16 weight, more multiply the float32 copy and round
    once to bfloat16. Both agree with a float32 product of the same bfloat16 values to bfloat16's
    rounding, and the result is bfloat16."""
    x, w, b, r = _operands(rows, torch.bfloat16)
    copy = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.float(), None), None, 0)
    reference = F.linear(x.float(), w.float(), b.float())
    y = linear(x, w, b, copy)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 80)
    torch.testing.assert_close(y.float(), reference, rtol=1.6e-2, atol=1e-2)
    if rows > SMALL_BATCH_ROWS:  # the float32 product rounded once: exactly what rounding the reference gives
        assert torch.equal(linear(x, w, None, copy), F.linear(x.float(), w.float()).to(torch.bfloat16))
    with_residual = linear(x, w, None, copy, residual=r)
    torch.testing.assert_close(with_residual.float(), (F.linear(x.float(), w.float()) + r.float()), rtol=2e-2, atol=2e-2)


def test_pack_weight_follows_the_cpu() -> None:
    """float32 packed as itself; bfloat16 packed as itself where the CPU has bfloat16 kernels and as its
    float32 values elsewhere; other dtypes not at all. The panels keep the weight's dtype and values."""
    w = torch.randn(64, 16)
    if packs(torch.float32):
        packed32 = pack_weight(w)
        assert packed32 is not None and packed32.onednn is not None
        assert packed32.onednn.dtype == torch.float32 and torch.equal(packed32.onednn.to_dense(), w)
    assert pack_weight(w.half()) is None
    packed = pack_weight(w.bfloat16())
    if packs(torch.bfloat16):
        assert packed is not None and packed.onednn is not None and packed.onednn.dtype == torch.bfloat16
    elif packs(torch.float32):
        assert packed is not None and packed.onednn is not None and packed.onednn.dtype == torch.float32
    if cpu_kernels.loaded():
        assert packed is not None and packed.panels is not None and packed.panels.dtype == torch.bfloat16
        width = cpu_kernels.ops().panel_width()
        # panel p, row k holds the weights of output columns p * width .. p * width + width - 1 at input k
        assert torch.equal(packed.panels[1, 5], w.bfloat16()[width:2 * width, 5])
        assert pack_weight(torch.randn(width + 8, 16)).panels is None  # no whole number of panels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_module_after_pack(dtype: torch.dtype) -> None:
    layer = Linear(96, 80, bias=False).to(dtype)
    layer.pack()
    x, _, _, r = _operands(5, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=tol, atol=tol)
    torch.testing.assert_close(layer(x, residual=r).float(), F.linear(x.float(), layer.weight.float()) + r.float(),
                               rtol=tol, atol=tol)


needs_kernels = pytest.mark.skipif(not cpu_kernels.loaded(), reason=f"kvledger CPU kernels not built: {cpu_kernels.reason()}")


def _panel_operands(rows: int, out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * 1000 + out)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(out, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(out, generator=g).to(dtype)
    r = torch.randn(rows, out, generator=g).to(dtype)
    return x, w, b, r


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 25, 64, 70])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_panel_linear_matches_a_float32_product(rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """Rows through kvledger's panel kernel (row counts that fill the kernel's groups of rows, and
    that leave part-groups): the float32 product of the same values (a bfloat16 weight widened
    exactly), rounded once to x's dtype; then the residual added as torch adds."""
    width = cpu_kernels.ops().panel_width()
    for out in (width, 3 * width):
        x, w, b, r = _panel_operands(rows, out, x_dtype)
        w = w.to(w_dtype)
        panels = cpu_kernels.ops().pack_panels(w)
        reference = F.linear(x.float(), w.float())
        y = cpu_kernels.ops().panel_linear(x, panels, None, None)
        assert y.dtype == x_dtype and y.shape == (rows, out)
        exact = 1e-5 if x_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.float(), reference.to(x_dtype).float(), rtol=exact, atol=exact)
        full = cpu_kernels.ops().panel_linear(x, panels, b, r)
        expected = F.linear(x.float(), w.float(), b.float()).to(x_dtype) + r
        torch.testing.assert_close(full, expected, rtol=2e-2 if x_dtype == torch.bfloat16 else 1e-5,
                                   atol=2e-2 if x_dtype == torch.bfloat16 else 1e-5)
        if x_dtype == w_dtype:  # linear() takes the panels up to the rows this CPU gives them, oneDNN or torch above
            packed = pack_weight(w)
            assert packed is not None and packed.panels is not None
            via_linear = linear(x, w, b, packed, residual=r)
            if rows <= packed.panel_rows:
                assert torch.equal(via_linear, full)
            else:
                torch.testing.assert_close(via_linear, expected, rtol=2e-2 if x_dtype == torch.bfloat16 else 1e-5,
                                           atol=2e-2 if x_dtype == torch.bfloat16 else 1e-5)


@needs_kernels
def test_panel_linear_refuses_what_it_cannot_take() -> None:
    width = cpu_kernels.ops().panel_width()
    x, w, _, _ = _panel_operands(4, 2 * width, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of"):
        cpu_kernels.ops().pack_panels(w[:width + 1])
    panels = cpu_kernels.ops().pack_panels(w)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.ops().panel_linear(x.t().contiguous().t(), panels, None, None)
    with pytest.raises(RuntimeError, match="pack_panels"):
        cpu_kernels.ops().panel_linear(x, w, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.ops().panel_linear(x, panels, torch.zeros(width), None)


@needs_kernels
def test_the_lm_head_keeps_panels_alone_where_they_take_64_rows() -> None:
    """pack_weight(logits=True): with AVX-512 the panels take every row count of an LM head and
    no oneDNN copy is kept (the vocabulary makes it the largest weight); elsewhere it is packed as
    any weight. Either way the product is F.linear's."""

    width = cpu_kernels.ops().panel_width()
    x, w, _, _ = _panel_operands(100, 4 * width, torch.float32)
    head = pack_weight(w, logits=True)
    assert head is not None and head.panels is not None
    if cpu_kernels.vector_width() >= 16:
        assert head.onednn is None and head.panel_rows >= 100
        assert torch.equal(linear(x, w, None, head), cpu_kernels.ops().panel_linear(x, head.panels, None, None))
    else:
        assert head.panel_rows == pack_weight(w).panel_rows
    torch.testing.assert_close(linear(x, w, None, head), F.linear(x, w), rtol=1e-5, atol=1e-5)
