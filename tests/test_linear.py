"""The projections of kvledger.layers.linear: every kernel path against torch's F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.layers import cpu_kernels
from kvledger.layers.linear import SKINNY_ROWS, SMALL_BATCH_ROWS, Linear, linear, pack_weight, packs

needs_onednn = pytest.mark.skipif(not packs(torch.float32), reason="torch built without oneDNN")


def _operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    r = torch.randn(rows, 80, generator=g).to(dtype)
    return x, w, b, r


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, SKINNY_ROWS + 1, 17, 64, 512])
def test_float32_prepacked_product_matches_f_linear(rows: int) -> None:
    """A float32 weight prepacked by pack_weight (oneDNN above the few-row kernel's rows): float32
    arithmetic in another order, so within float32's rounding of F.linear; a residual added in
    the same kernel."""
    x, w, b, r = _operands(rows, torch.float32)
    packed = pack_weight(w)
    assert packed is not None and packed.dtype == torch.float32
    y = linear(x, w, b, packed)
    assert y.dtype == torch.float32 and y.shape == (rows, 80)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w, None, packed, residual=r), F.linear(x, w) + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [SKINNY_ROWS + 1, 17])
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
    copy = torch.ops.mkldnn._reorder_linear_weight(w.float(), None)
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
    float32 values elsewhere; other dtypes not at all."""
    w = torch.randn(8, 16)
    if packs(torch.float32):
        packed32 = pack_weight(w)
        assert packed32 is not None and packed32.dtype == torch.float32 and torch.equal(packed32.to_dense(), w)
    assert pack_weight(w.half()) is None
    packed = pack_weight(w.bfloat16())
    if packs(torch.bfloat16):
        assert packed is not None and packed.dtype == torch.bfloat16
    elif packs(torch.float32):
        assert packed is not None and packed.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_module_after_pack(dtype: torch.dtype) -> None:
    layer = Linear(96, 80, bias=False).to(dtype)
    layer.pack()
    x, _, _, r = _operands(5, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=tol, atol=tol)
    torch.testing.assert_close(layer(x, residual=r).float(), F.linear(x.float(), layer.weight.float()) + r.float(),
                               rtol=tol, atol=tol)


KERNEL_MAX_ROWS = 4  # skinny_linear takes 1 to 4 rows; linear() sends it up to SKINNY_ROWS
needs_kernels = pytest.mark.skipif(not cpu_kernels.loaded(), reason=f"kvledger CPU kernels not built: {cpu_kernels.reason()}")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_skinny_linear_matches_a_float32_product(rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """A few rows through kvledger's kernel: the float32 product of the same values (a bfloat16
    weight widened exactly), rounded once to x's dtype; then the residual added as torch adds."""
    x, w, b, r = _operands(rows, x_dtype)
    w = w.to(w_dtype)
    odd = torch.randn(77, 96).to(w_dtype)  # an output count no multiple of the rows the kernel takes at once
    for weight in (w, odd):
        reference = F.linear(x.float(), weight.float())
        y = torch.ops.kvledger_cpu.skinny_linear(x, weight, None, None)
        assert y.dtype == x_dtype and y.shape == (rows, weight.shape[0])
        exact = 1e-5 if x_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.float(), reference.to(x_dtype).float(), rtol=exact, atol=exact)
    full = torch.ops.kvledger_cpu.skinny_linear(x, w, b, r)
    torch.testing.assert_close(full, (F.linear(x.float(), w.float(), b.float()).to(x_dtype) + r), rtol=2e-2 if
                               x_dtype == torch.bfloat16 else 1e-5, atol=2e-2 if x_dtype == torch.bfloat16 else 1e-5)
    if rows <= SKINNY_ROWS:  # linear() takes the kernel for these rows, whether or not the weight was packed
        assert torch.equal(linear(x, w, b, None, residual=r), full)
        assert torch.equal(linear(x, w, b, pack_weight(w), residual=r), full)


@needs_kernels
def test_skinny_linear_refuses_what_it_cannot_take() -> None:
    x, w, _, _ = _operands(KERNEL_MAX_ROWS + 1, torch.float32)
    with pytest.raises(RuntimeError, match=f"1 to {KERNEL_MAX_ROWS} rows"):
        torch.ops.kvledger_cpu.skinny_linear(x, w, None, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvledger_cpu.skinny_linear(x[:2], w.t().contiguous().t(), None, None)
