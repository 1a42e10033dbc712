"""8-bit KV caches on tiny synthetic pools whose expected contents can be read off by eye."""

from __future__ import annotations

import pytest
import torch

from kvledger.layers.kv_quant import dequantize_int8, quantize_int8
from kvledger.layers.paged_kv import KVCache
from kvledger.layers.quantized_kv import Fp8KVCache, Int8KVCache, make_kv_cache

L, BLOCKS, BS, H, D = 2, 3, 2, 1, 4


def test_int8_roundtrip_is_exact_for_multiples_of_the_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0]])
    q, scale = quantize_int8(x)
    assert scale.item() == pytest.approx(1.0)
    assert q.tolist() == [[1, -2, 0, 127]] or q.tolist() == [[1, -2, 1, 127]]  # 0.5 rounds to even
    assert dequantize_int8(q, scale, torch.float32).tolist()[0][:2] == [1.0, -2.0]


def test_int8_zero_vector_keeps_a_unit_scale():
    q, scale = quantize_int8(torch.zeros(1, 4))
    assert scale.item() == 1.0 and q.abs().sum() == 0


def _write_two_tokens(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.tensor([[[0.1, 0.2, 0.3, 0.4]], [[-1.0, 2.0, -3.0, 4.0]]])  # [tokens=2, H=1, D=4]
    v = -k
    cache.write(0, k, v, torch.tensor([5, 0]))  # token 0 -> block 2 offset 1; token 1 -> block 0 offset 0
    return k, v


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_write_then_gather_through_a_block_table(kind):
    cache = make_kv_cache(kind, L, BLOCKS, BS, H, D, torch.float32)
    k, v = _write_two_tokens(cache)
    keys, values = cache.gather(0, torch.tensor([[2, 0]]))  # logical order: block 2, then block 0
    assert keys.shape == (1, H, 2 * BS, D)
    tol = {"int8": 0.02, "fp8": 0.13, "fp8_e4m3": 0.13, "fp8_e5m2": 0.26}[kind]
    assert torch.allclose(keys[0, 0, 1], k[0, 0], rtol=tol, atol=tol * 0.1)   # slot 5 = block 2, offset 1
    assert torch.allclose(keys[0, 0, 2], k[1, 0], rtol=tol, atol=tol * 0.1)   # slot 0 = block 0, offset 0
    assert torch.allclose(values[0, 0, 2], v[1, 0], rtol=tol, atol=tol * 0.1)
    # layer 1 was never written: its slots still hold zeros
    k1, _ = cache.gather(1, torch.tensor([[0]]))
    assert k1.abs().sum() == 0


def test_int8_pool_is_one_byte_per_element_plus_scales():
    cache = Int8KVCache(L, BLOCKS, BS, H, D, torch.float32)
    elements = L * 2 * BLOCKS * BS * H * D
    scales = L * 2 * BLOCKS * BS * H * 2
    assert cache.storage.dtype == torch.int8
    assert cache.measured_bytes == elements + scales


def test_fp8_pool_is_one_byte_per_element_plus_two_scales_per_layer():
    cache = Fp8KVCache(L, BLOCKS, BS, H, D, torch.float32, "fp8_e4m3")
    assert cache.storage.element_size() == 1
    assert cache.measured_bytes == L * 2 * BLOCKS * BS * H * D + L * 2 * 4


def test_fp8_scale_is_set_by_the_first_write_and_then_frozen():
    cache = Fp8KVCache(L, BLOCKS, BS, H, D, torch.float32, "fp8_e4m3")
    _write_two_tokens(cache)
    first = cache.scales[0].clone()
    assert first[0].item() == pytest.approx(4.0 * 4 / 448)  # amax 4 lands at a quarter of E4M3's 448
    cache.write(0, torch.full((1, H, D), 100.0), torch.full((1, H, D), 100.0), torch.tensor([1]))
    assert torch.equal(cache.scales[0], first)


def test_int8_beats_fp8_on_relative_error_for_gaussian_vectors():
    torch.manual_seed(0)
    x = torch.randn(256, H, 64)
    slots = torch.arange(256)
    errors = {}
    for kind in ("int8", "fp8_e4m3", "fp8_e5m2"):
        cache = make_kv_cache(kind, 1, 256, 1, H, 64, torch.float32)
        cache.write(0, x, x, slots)
        k, _ = cache.gather(0, slots.view(1, -1))
        errors[kind] = ((k[0].transpose(0, 1) - x).norm() / x.norm()).item()
    assert errors["int8"] < errors["fp8_e4m3"] < errors["fp8_e5m2"]
    assert errors["int8"] < 0.01


def test_fast_e4m3_decode_equals_torchs_cast_for_every_byte():
    from kvledger.layers.kv_quant import dequantize_fp8

    raw = torch.arange(256, dtype=torch.uint8)
    expected = raw.view(torch.float8_e4m3fn).float() * 0.5
    ours = dequantize_fp8(raw.view(torch.float8_e4m3fn), 0.5, torch.float32)
    finite = ~expected.isnan()
    assert torch.equal(ours[finite], expected[finite])
