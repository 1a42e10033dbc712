"""The CPU decode-attention kernel (kvledger/kernels/paged_decode.py) against the gather plus SDPA it
replaces, on tiny caches: padded tables, contexts that end inside a block, blocks out of order,
GQA, a query with strided rows, a long single context split into spans, and the 8-bit caches
(int8 with per-token scales, fp8 E4M3 and E5M2 with per-layer ones) read as bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvledger.kernels import cpu_kernels, paged_decode
from kvledger.layers.attention import DecodeGroup, decode_attention
from kvledger.kernels.paged_decode import paged_decode_attention
from kvledger.kvcache.storage import KVCache
from kvledger.kvcache.quantized_storage import make_kv_cache
from tests.engine_helpers import tokens_and_last_logits

pytestmark = pytest.mark.usefixtures("capability")  # every test under each vector capability

BLOCKS, BS, H_KV, H, D = 12, 4, 2, 6, 32


def _filled_cache(dtype: torch.dtype, blocks: int = BLOCKS, block_size: int = BS) -> KVCache:
    cache = KVCache(1, blocks, block_size, H_KV, D, dtype)
    slots = torch.arange(blocks * block_size)
    cache.write(0, torch.randn(len(slots), H_KV, D), torch.randn(len(slots), H_KV, D), slots)
    return cache


def _gathered(q: torch.Tensor, cache: KVCache, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    max_len = int(lens.max())
    mask = DecodeGroup.padding_mask(lens, max_len, q.dtype)
    return decode_attention(q, cache.gather_decode(0, tables, max_len), mask, 0.35)


def test_the_kernel_builds_here():
    """This machine has the compiler the engine needs, so the kernel must build and serve SmolLM2's
    heads (a failure here would silently put every decode back on the gather)."""
    assert cpu_kernels.loaded(), cpu_kernels.reason()
    assert paged_decode.supports(torch.device("cpu"), torch.float32, 9, 3, 64)
    assert paged_decode.supports(torch.device("cpu"), torch.bfloat16, 4, 1, 256)  # Gemma-3 270M's
    assert not paged_decode.supports(torch.device("cpu"), torch.int8, 9, 3, 64)  # int8 is no compute dtype
    for kv_dtype in paged_decode.EIGHT_BIT_DTYPES:
        assert paged_decode.supports(torch.device("cpu"), torch.float32, 9, 3, 64, kv_dtype=kv_dtype)
        assert paged_decode.supports(torch.device("cpu"), torch.bfloat16, 9, 3, 64, kv_dtype=kv_dtype)
    assert not paged_decode.supports(torch.device("cpu"), torch.float32, 9, 3, 64, kv_dtype=torch.bfloat16)
    assert not paged_decode.supports(torch.device("cpu"), torch.float32, 64, 2, 64)  # 32 heads per KV head


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_reads_the_blocks_in_place_as_the_gather_would(dtype, tol):
    torch.manual_seed(0)
    cache = _filled_cache(dtype)
    # three sequences of 9, 3 and 12 tokens: 3, 1 and 3 blocks, padded with block 0
    tables = torch.tensor([[5, 2, 9], [7, 0, 0], [1, 11, 3]])
    lens = torch.tensor([9, 3, 12])
    q = torch.randn(3, H, D, dtype=dtype)
    in_place = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    assert in_place.dtype == dtype and in_place.shape == (3, H, D)
    torch.testing.assert_close(in_place.float(), _gathered(q, cache, tables, lens).float(), atol=tol, rtol=tol)
    # the second sequence sees only its 3 tokens: what lies past them in its blocks changes nothing
    cache.storage[0, :, 7, 3:] = 1e4
    cache.storage[0, :, 0] = -1e4
    again = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    torch.testing.assert_close(again[1], in_place[1])
    # and a change inside its context does change its output
    cache.storage[0, 1, 7, 1] = 5.0
    assert not torch.equal(paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)[1],
                           in_place[1])


def test_writes_into_strided_query_rows_and_an_output_slice():
    """The model hands over ``q`` as a view of its fused q/k/v rows and wants rows of a larger output."""
    torch.manual_seed(1)
    cache = _filled_cache(torch.float32)
    tables = torch.tensor([[3, 4], [10, 0]])
    lens = torch.tensor([7, 2])
    qkv = torch.randn(2, H + 2 * H_KV, D)
    q = qkv[:, :H]
    out = torch.zeros(5, H, D)
    paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35, out=out[1:3])
    torch.testing.assert_close(out[1:3], _gathered(q.contiguous(), cache, tables, lens), atol=1e-6, rtol=1e-6)
    assert out[0].abs().sum() == 0 and out[3:].abs().sum() == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_single_context_split_into_spans_merges_exactly(threads):
    """One sequence of 1,500 tokens (94 blocks of 16): on two threads its context is cut into spans
    whose partial softmaxes are merged; the result is the same attention."""
    torch.manual_seed(2)
    cache = _filled_cache(torch.float32, blocks=100, block_size=16)
    tables = torch.randperm(100)[:94].view(1, -1)
    lens = torch.tensor([1500])
    q = torch.randn(1, H, D)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        in_place = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, _gathered(q, cache, tables, lens), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_smollm2_heads_with_contexts_around_sixteen_keys(dtype, tol):
    """SmolLM2's heads (9 query heads on 3 KV heads of 64, the kernel's fixed-size path, whose scores
    are summed sixteen keys at a time with AVX-512) over contexts just below, at and past multiples of
    16 tokens, in blocks of 4 out of order."""
    torch.manual_seed(3)
    lens = torch.tensor([1, 15, 16, 17, 33, 47])
    blocks_each = (int(lens.max()) + 3) // 4
    cache = KVCache(1, blocks_each * len(lens), 4, 3, 64, dtype)
    slots = torch.arange(blocks_each * len(lens) * 4)
    cache.write(0, torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64), slots)
    tables = torch.randperm(blocks_each * len(lens)).view(len(lens), blocks_each)
    q = torch.randn(len(lens), 9, 64, dtype=dtype)
    in_place = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    torch.testing.assert_close(in_place.float(), _gathered(q, cache, tables, lens).float(), atol=tol, rtol=tol)


EIGHT_BIT = ("int8", "fp8_e4m3", "fp8_e5m2")


def _filled_8bit_cache(kind: str, dtype: torch.dtype, blocks: int, block_size: int, kv_heads: int,
                       head_dim: int) -> KVCache:
    """A cache (plain, or 8-bit) whose values differ in size from token to token, so that int8's per-token
    scales differ too (a kernel that ignored or misread them would be caught)."""
    cache = make_kv_cache(kind, 1, blocks, block_size, kv_heads, head_dim, dtype)
    tokens = blocks * block_size
    size = torch.rand(tokens, 1, 1) * 3 + 0.1
    k, v = torch.randn(tokens, kv_heads, head_dim) * size, torch.randn(tokens, kv_heads, head_dim) * size.flip(0)
    cache.write(0, k.to(dtype), v.to(dtype), torch.arange(tokens))
    return cache


def _exact_attention(q: torch.Tensor, pools, tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention the kernel approximates, in float64, one sequence and head at a time: stored
    elements times their scales (int8: per token per KV head; fp8: per layer), softmax, weighted sum."""
    def values(stored: torch.Tensor, per_token: torch.Tensor | None, per_layer: float) -> torch.Tensor:
        x = stored.double()
        return x * per_token.double()[..., None] if per_token is not None else x * per_layer

    keys, vals = values(pools.k, pools.k_scales, pools.k_scale), values(pools.v, pools.v_scales, pools.v_scale)
    block_size, kv_heads, head_dim = keys.shape[1:]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, :(n + block_size - 1) // block_size]
        k, v = keys[blocks].reshape(-1, kv_heads, head_dim)[:n], vals[blocks].reshape(-1, kv_heads, head_dim)[:n]
        for h in range(q.shape[1]):
            p = (k[:, h // group] @ q[b, h].double() * scale).softmax(0)
            out[b, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", EIGHT_BIT)
def test_8bit_caches_read_in_place_give_the_exact_attention(kind, dtype):
    """The kernel widens the stored bytes and applies the scales itself. Over SmolLM2's heads, padded
    and shuffled tables and contexts that end inside a block, its output is the exact attention of
    the stored values to within the output dtype's rounding (bfloat16: one unit in the last place,
    closer than the gather, which rounds every dequantized element to bfloat16 first); in float32
    it also equals the gather's."""
    torch.manual_seed(4)
    cache = _filled_8bit_cache(kind, dtype, blocks=24, block_size=4, kv_heads=3, head_dim=64)
    pools = cache.layer_pools(0)
    assert pools.k.dtype in paged_decode.EIGHT_BIT_DTYPES  # handed over as stored, not widened
    lens = torch.tensor([1, 9, 16, 30])
    tables = torch.zeros(4, 8, dtype=torch.int64)
    order, used = torch.randperm(24), 0
    for b, n in enumerate(lens.tolist()):  # 1 + 3 + 4 + 8 of the 24 blocks, shuffled
        need = (n + 3) // 4
        tables[b, :need] = order[used:used + need]
        used += need
    q = torch.randn(4, 9, 64, dtype=dtype)
    in_place = paged_decode_attention(q, pools, tables, lens, 0.35)
    exact = _exact_attention(q, pools, tables, lens, 0.35)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(in_place.double(), exact, atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(in_place, _gathered(q, cache, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", EIGHT_BIT)
def test_8bit_scales_are_the_ones_applied(kind):
    """Halving the stored scales of V halves the output (int8: per token; fp8: per layer); halving
    those of K changes the scores, so the output moves."""
    torch.manual_seed(5)
    cache = _filled_8bit_cache(kind, torch.float32, blocks=6, block_size=4, kv_heads=2, head_dim=32)
    tables, lens = torch.tensor([[4, 1, 3]]), torch.tensor([11])
    q = torch.randn(1, 4, 32)
    before = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    pools = cache.layer_pools(0)
    if kind == "int8":
        pools.v_scales.mul_(0.5)
    else:
        pools.v_scale *= 0.5
    torch.testing.assert_close(paged_decode_attention(q, pools, tables, lens, 0.35), before * 0.5,
                               atol=1e-6, rtol=1e-5)
    if kind == "int8":
        pools.k_scales[4].mul_(0.5)  # the first block's four tokens only
    else:
        pools.k_scale *= 0.5
    assert not torch.allclose(paged_decode_attention(q, pools, tables, lens, 0.35), before * 0.5, atol=1e-4)


@pytest.mark.parametrize("kind", EIGHT_BIT)
def test_8bit_long_context_split_into_spans(kind):
    """1,500 tokens of one sequence on two threads: spans of 8-bit blocks, each with its scales."""
    torch.manual_seed(6)
    cache = _filled_8bit_cache(kind, torch.float32, blocks=100, block_size=16, kv_heads=3, head_dim=64)
    tables = torch.randperm(100)[:94].view(1, -1)
    lens = torch.tensor([1500])
    q = torch.randn(1, 9, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        in_place = paged_decode_attention(q, cache.layer_pools(0), tables, lens, 0.35)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, _gathered(q, cache, tables, lens), atol=1e-5, rtol=1e-5)


def _tolerance(dtype: torch.dtype, path: str) -> float:
    """How far a path's attention output may lie from the float64 reference, relative to the
    largest output value. float32, both paths: a score is a 64-term dot product and an output a
    sum over at most n = 130 positions, so float32 rounding (u = 2**-24) bounds the error by about
    (d + n) u = 1.2e-5 of the largest value; measured 2.5e-7 to 5e-7 (kernel and gather alike).
    bfloat16 outputs are rounded once to bfloat16 by the kernel (half a unit in the last place,
    2**-9, with float32 work before it): 2**-8; measured 2.2e-3 to 2.9e-3. The gather rounds
    every dequantized key and value to bfloat16 before the products too, which moves each score
    by up to 2**-9 of its terms' size (up to about 8 here): 2**-6; measured 2.2e-3 to 6.7e-3."""
    if dtype == torch.float32:
        return 1.2e-5
    return 2 ** -8 if path == "kernel" else 2 ** -6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ("auto",) + EIGHT_BIT)
def test_both_paths_against_float64_attention_in_the_engines_shape(kind, dtype):
    """SmolLM2's shape (9 query heads over 3 KV heads of 64, blocks of 128) over contexts of 5, 40
    and 130 tokens: the kernel's output and the gather's each against attention computed in
    float64 over the stored values times their stored scales (int8: float16 per token and KV head;
    fp8: per layer), within :func:`_tolerance` of the largest output value."""
    torch.manual_seed(7)
    cache = _filled_8bit_cache(kind, dtype, blocks=6, block_size=128, kv_heads=3, head_dim=64)
    lens = torch.tensor([5, 40, 130])
    tables = torch.tensor([[4, 0], [1, 0], [5, 2]])  # padded with block 0, the last one out of order
    q = torch.randn(3, 9, 64, dtype=dtype)
    pools = cache.layer_pools(0)
    exact = _exact_attention(q, pools, tables, lens, 0.125)
    largest = exact.abs().max().item()
    kernel = paged_decode_attention(q, pools, tables, lens, 0.125)
    mask = DecodeGroup.padding_mask(lens, int(lens.max()), q.dtype)
    gathered = decode_attention(q, cache.gather_decode(0, tables, int(lens.max())), mask, 0.125)
    for path, out in (("kernel", kernel), ("gather", gathered)):
        error = (out.double() - exact).abs().max().item() / largest
        assert error <= _tolerance(dtype, path), f"{path}: {error:.2e} of the largest value {largest:.2f}"


@pytest.mark.parametrize("kind, max_tokens", [("auto", 12), ("int8", 2), ("fp8_e4m3", 2), ("fp8_e5m2", 2)])
def test_engine_decodes_alike_with_the_kernel_and_with_the_gather(kind, max_tokens, monkeypatch):
    """The same float32 engine, its decodes read in place by the kernel or gathered (the path CUDA
    and machines without the kernel take), for a batch of contexts of different lengths: the same
    greedy tokens, and in the kernel's run every decode attention call, in every layer, within
    float32 rounding of attention in float64 over the stored bytes, as is the gather's over the
    same inputs. With the float32 cache the last step's logits agree too, over 12 tokens.

    With an 8-bit cache the logits of the two runs are not the quantity to compare. Their first
    decode step reads the prompt's stored bytes, the same in both runs, but in each layer from the
    second on it also stores the new token's keys and values, quantized from hidden states that
    the layers before made in float32 by two different paths: a value on a rounding boundary lands
    one int8 step apart. Measured (int8, 3 prompts, 30 layers): 1 or 2 of a layer's 1,152 new
    codes one step apart in 1 or 2 layers per run, and the logits of that sequence then differ by
    0.0001 to 0.0024 here (0.016 on an AVX2-only AMD EPYC), while every attention call of both
    paths stayed within 1e-6 of the float64 reference."""
    from kvledger import LLM, SamplingParams
    from kvledger.layers import attention

    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_dtype=kind, kv_cache_memory="16MiB",
              enforce_eager=True, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    assert runner.decode_in_place
    layer_of = {runner.cache.layer_pools(i).k.data_ptr(): i for i in range(runner.cache.num_layers)}
    errors: dict[str, float] = {"kernel": 0.0, "gather": 0.0}
    in_place = attention.paged_decode_attention

    def checked(q, pools, tables, lens, scale, out=None):
        result = in_place(q, pools, tables, lens, scale, out=out)
        exact = _exact_attention(q, pools, tables, lens, scale)
        mask = DecodeGroup.padding_mask(lens, int(lens.max()), q.dtype)
        kv = runner.cache.gather_decode(layer_of[pools.k.data_ptr()], tables, int(lens.max()))
        largest = exact.abs().max().item()
        for path, o in (("kernel", result), ("gather", decode_attention(q, kv, mask, scale))):
            errors[path] = max(errors[path], (o.double() - exact).abs().max().item() / largest)
        return result

    monkeypatch.setattr(attention, "paged_decode_attention", checked)
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with_kernel, kernel_logits = tokens_and_last_logits(llm, prompts, params)
    assert errors["kernel"] > 0, "no decode step read the cache in place"
    assert errors["kernel"] <= _tolerance(torch.float32, "kernel"), errors
    assert errors["gather"] <= _tolerance(torch.float32, "gather"), errors
    runner.decode_in_place = False
    gathered, gathered_logits = tokens_and_last_logits(llm, prompts, params)
    assert with_kernel == gathered
    if kind == "auto":
        torch.testing.assert_close(kernel_logits, gathered_logits, atol=1e-4, rtol=1e-4)


def _huge_page_bytes(start: int, end: int) -> int:
    """Bytes of ``[start, end)`` this process has backed by transparent huge pages (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo < end and hi > start
            elif inside and first == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages on this kernel")
def test_the_pool_is_backed_by_huge_pages():
    """The block pool asks for transparent huge pages before its first touch (decode attention reads
    blocks scattered over it, and with 4 KiB pages nearly every block misses the TLB): a 128 MiB
    pool lies almost whole in 2 MiB pages (all but the ends of its mapping), even
    where THP is given only to memory that asks, and in a process whose heap has been used before."""
    scratch = [torch.ones(1 << 22) for _ in range(16)]  # 256 MiB through malloc's heap, then freed
    del scratch
    cache = KVCache(4, 1024, 16, 4, 64, torch.float32)  # 4 layers x (K, V) x 1,024 blocks of 16 KiB: 128 MiB
    assert not cache.storage.any()
    start = cache.storage.data_ptr()
    huge = _huge_page_bytes(start, start + cache.measured_bytes)
    assert huge >= cache.measured_bytes - 2 * (2 << 20), f"{huge} of {cache.measured_bytes} bytes in huge pages"
