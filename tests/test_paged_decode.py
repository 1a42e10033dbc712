"""The CPU decode-attention kernel (kvledger/layers/paged_decode.py) against the gather plus SDPA it
replaces, on tiny caches: padded tables, contexts that end inside a block, blocks out of order,
GQA, a query with strided rows, and a long single context split into spans."""

from __future__ import annotations

import pytest
import torch

from kvledger.layers import cpu_kernels, paged_decode
from kvledger.layers.attention import DecodeGroup, decode_attention
from kvledger.layers.paged_decode import paged_decode_attention
from kvledger.layers.paged_kv import KVCache

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
    assert not paged_decode.supports(torch.device("cpu"), torch.int8, 9, 3, 64)
    assert not paged_decode.supports(torch.device("cpu"), torch.float32, 64, 2, 64)  # 32 heads per KV head


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_reads_the_blocks_in_place_as_the_gather_would(dtype, tol):
    torch.manual_seed(0)
    cache = _filled_cache(dtype)
    # three sequences of 9, 3 and 12 tokens: 3, 1 and 3 blocks, padded with block 0
    tables = torch.tensor([[5, 2, 9], [7, 0, 0], [1, 11, 3]])
    lens = torch.tensor([9, 3, 12])
    q = torch.randn(3, H, D, dtype=dtype)
    in_place = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    assert in_place.dtype == dtype and in_place.shape == (3, H, D)
    torch.testing.assert_close(in_place.float(), _gathered(q, cache, tables, lens).float(), atol=tol, rtol=tol)
    # the second sequence sees only its 3 tokens: what lies past them in its blocks changes nothing
    cache.storage[0, :, 7, 3:] = 1e4
    cache.storage[0, :, 0] = -1e4
    again = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    torch.testing.assert_close(again[1], in_place[1])
    # and a change inside its context does change its output
    cache.storage[0, 1, 7, 1] = 5.0
    assert not torch.equal(paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)[1],
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
    paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35, out=out[1:3])
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
        in_place = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, _gathered(q, cache, tables, lens), atol=1e-6, rtol=1e-5)


def test_engine_decodes_alike_with_the_kernel_and_with_the_gather():
    """The same float32 engine, its decodes read in place by the kernel or gathered (the path CUDA,
    8-bit caches and machines without the kernel take): the same greedy tokens, logits within
    float32 rounding, for a batch of contexts of different lengths."""
    from kvledger import LLM, SamplingParams

    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="16MiB", enforce_eager=True)
    runner = llm.llm_engine.runner
    assert runner.decode_in_place
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run() -> tuple[list[list[int]], torch.Tensor]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], runner.last_logits.clone()

    with_kernel, kernel_logits = run()
    runner.decode_in_place = False
    gathered, gathered_logits = run()
    assert with_kernel == gathered
    torch.testing.assert_close(kernel_logits, gathered_logits, atol=1e-4, rtol=1e-4)


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
    in_place = paged_decode_attention(q, cache.storage[0, 0], cache.storage[0, 1], tables, lens, 0.35)
    torch.testing.assert_close(in_place.float(), _gathered(q, cache, tables, lens).float(), atol=tol, rtol=tol)
