"""8-bit KV caches on tiny synthetic pools whose expected contents can be read off by eye."""

from __future__ import annotations

import pytest
import torch

from kvledger.kvcache.quantization import dequantize_int8, quantize_int8
from kvledger.kvcache.storage import KVCache
from kvledger.kvcache.quantized_storage import Fp8KVCache, Int8KVCache, make_kv_cache

L, BLOCKS, BS, H, D = 2, 3, 2, 1, 4


def test_int8_roundtrip_is_exact_for_multiples_of_the_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0]])
    q, scale = quantize_int8(x)
    assert scale.item() == pytest.approx(1.0)
    assert q.tolist() == [[1, -2, 0, 127]] or q.tolist() == [[1, -2, 1, 127]]  # 0.5 rounds to even
    assert dequantize_int8(q, scale, torch.float32).tolist()[0][:2] == [1.0, -2.0]


def test_int8_zero_vector_reads_back_as_exact_zeros():
    q, scale = quantize_int8(torch.zeros(1, 4))
    assert q.abs().sum() == 0
    assert 0 < scale.item() < 1e-6  # the float16 floor, not 0 (no division by zero)
    assert dequantize_int8(q, scale, torch.float32).tolist() == [[0.0, 0.0, 0.0, 0.0]]


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


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fast_fp8_decode_equals_torchs_cast_for_every_byte(fp8):
    from kvledger.kvcache.quantization import dequantize_fp8, widen_fp8

    raw = torch.arange(256, dtype=torch.uint8).view(getattr(torch, fp8))
    finite = raw.float().isfinite()
    assert finite.sum() >= 248  # the NaN (and E5M2's inf) codes alone are left out
    expected = raw.float() * 0.5
    assert torch.equal(dequantize_fp8(raw, 0.5, torch.float32)[finite], expected[finite])
    widened, factor = widen_fp8(raw, torch.float32)
    assert torch.equal((widened * factor)[finite], raw.float()[finite])
    # a transposed view (as gathered from the pool) comes back contiguous with the same values
    grid = raw.view(2, 128).t()
    widened, factor = widen_fp8(grid, torch.float32)
    finite = grid.float().isfinite()
    assert widened.is_contiguous() and torch.equal((widened * factor)[finite], grid.float()[finite])


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["float32", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_attention_with_folded_scales_equals_attention_over_dequantized_kv(kind, compute_dtype):
    """Two sequences of 5 and 3 tokens, GQA (4 query heads over 2 KV heads), padded and masked:
    attention that applies the scales to scores and probabilities equals SDPA over the
    dequantized K/V the cache gathers."""
    import torch.nn.functional as F

    from kvledger.layers.attention import DecodeGroup, decode_attention

    torch.manual_seed(0)
    heads, kv_heads, head_dim, bs = 4, 2, 8, 2
    cache = make_kv_cache(kind, 1, 6, bs, kv_heads, head_dim, compute_dtype)
    block_tables = torch.tensor([[4, 1, 3], [0, 5, 2]])
    lengths = [5, 3]
    slots = torch.cat([block_tables[b].repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for b, n in enumerate(lengths)])
    k_new, v_new = torch.randn(8, kv_heads, head_dim) * 3, torch.randn(8, kv_heads, head_dim)
    cache.write(0, k_new.to(compute_dtype), v_new.to(compute_dtype), slots)
    mask = DecodeGroup.padding_mask(torch.tensor(lengths), 5, compute_dtype)
    assert mask[1, 0, 0].tolist() == [0, 0, 0, float("-inf"), float("-inf")]  # 3 tokens, 2 padded
    q = torch.randn(2, heads, head_dim).to(compute_dtype)
    kv = cache.gather_decode(0, block_tables, 5)
    assert kv.has_scales == (kind not in ("float32", "bfloat16"))  # 8-bit caches leave the scales to attention
    assert kv.k.dtype == compute_dtype
    ours = decode_attention(q, kv, mask, 0.3)
    k, v = cache.gather(0, block_tables, 5)
    expected = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    atol = 1e-5 if compute_dtype == torch.float32 else 2e-2  # bfloat16 keeps 8 significant bits
    assert ours.dtype == compute_dtype
    assert torch.allclose(ours.float(), expected.squeeze(2).float(), atol=atol)
