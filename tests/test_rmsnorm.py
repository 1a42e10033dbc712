"""RMSNorm (kvledger/layers/rmsnorm.py): the CPU kernel against torch's operators, same formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import cpu_kernels
from kvledger.layers.rmsnorm import RMSNorm

pytestmark = pytest.mark.usefixtures("capability")  # every test under each vector capability


def _torch_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 3, 64), (2, 100)])
def test_kernel_matches_torch_operators(dtype, shape):
    """Rows of the model's widths, a head-wise norm's 3-D input, and a width that is no multiple of
    the vector: float32 within rounding; bfloat16 the same up to one rounding step of the result."""
    assert cpu_kernels.loaded(), cpu_kernels.reason()
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1)
    x = (torch.randn(shape) * 3).to(dtype)
    got = norm(x)
    want = _torch_formula(x, norm.weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # one bfloat16 step (2**-8 relative) at most, and equal almost everywhere
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
        assert (got == want).float().mean() > 0.98
