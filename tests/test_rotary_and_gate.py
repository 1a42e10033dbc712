"""kvledger's RoPE and SwiGLU-gate CPU kernels (kvledger/kernels/csrc/rotary.cpp, silu_and_mul.cpp)
against the torch operators they replace, written out here: equal, not merely close, in float32
and bfloat16, for a decode token, a few tokens and a prompt, with queries and keys as a strided
view of the fused q/k/v rows as the model hands them over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import cpu_kernels
from kvledger.layers.activation import silu_and_mul
from kvledger.layers.rotary import apply_rotary

pytestmark = pytest.mark.usefixtures("capability")  # every test under each vector capability


def _rope_by_operators(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.loaded(), cpu_kernels.reason()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_equals_the_operators(dtype, tokens):
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, 9 + 2 * 3, 64).to(dtype)
    qk = qkv[:, :12]  # queries and keys, a view with the values' rows in between
    cos, sin = torch.randn(tokens, 1, 64).to(dtype), torch.randn(tokens, 1, 64).to(dtype)
    out = apply_rotary(qk, cos, sin)
    assert out.is_contiguous() and out.shape == qk.shape and out.dtype == dtype
    assert torch.equal(out, _rope_by_operators(qk, cos, sin))


def test_rotary_rotates_each_half_by_the_other():
    """A readable case: d = 4, cos = 1 and sin = 1 give [x0 - x2, x1 - x3, x2 + x0, x3 + x1]."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    ones = torch.ones(1, 1, 4)
    assert apply_rotary(x, ones, ones).tolist() == [[[-2.0, -2.0, 4.0, 6.0]]]
    assert apply_rotary(x, ones, torch.zeros(1, 1, 4)).tolist() == x.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_and_mul_equals_the_operators(dtype, rows):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, 1536) and out.dtype == dtype
    assert torch.equal(out, F.silu(gate) * up)


def test_silu_and_mul_of_a_readable_row():
    """silu(0) = 0, silu(g) -> g for large g, and the up half scales the result."""
    gate_up = torch.tensor([[0.0, 30.0, 2.0, 3.0]])
    assert torch.allclose(silu_and_mul(gate_up), torch.tensor([[0.0, 90.0]]))
