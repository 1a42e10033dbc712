"""The CPU prefill-attention kernel (kvledger/kernels/paged_prefill.py) against causal SDPA over the
same K/V gathered, on tiny caches: a first chunk and later ones, contexts that end inside a block
and inside a key tile, blocks out of order, GQA and plain multi-head, the head sizes it is built
for, strided query rows, and the engine with the kernel against the engine without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import cpu_kernels, paged_prefill
from kvledger.kernels.paged_prefill import paged_prefill_attention
from tests.engine_helpers import tokens_and_last_logits

pytestmark = pytest.mark.usefixtures("capability")  # every test under each vector capability


def _cache(blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(blocks, block_size, kv_heads, dim).to(dtype), torch.randn(blocks, block_size, kv_heads, dim).to(dtype))


def _reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, computed: int,
               scale: float) -> torch.Tensor:
    """Causal SDPA in float32 over the context gathered through ``table``: ``[n, H, d]``."""
    n, heads, dim = q.shape
    ctx = computed + n
    k = k_pool[table].reshape(-1, k_pool.shape[2], dim)[:ctx].transpose(0, 1).unsqueeze(0).float()
    v = v_pool[table].reshape(-1, v_pool.shape[2], dim)[:ctx].transpose(0, 1).unsqueeze(0).float()
    mask = torch.arange(ctx)[None, :] <= torch.arange(computed, ctx)[:, None]  # query i sees keys <= its position
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0).float(), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=heads != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


def test_the_kernel_builds_here():
    """This machine has the compiler the engine needs: the kernel must build and take SmolLM2's and
    Gemma-3 270M's heads, and refuse what it is not built for."""
    assert cpu_kernels.loaded(), cpu_kernels.reason()
    assert paged_prefill.supports(torch.device("cpu"), torch.float32, 9, 3, 64)
    assert paged_prefill.supports(torch.device("cpu"), torch.bfloat16, 4, 1, 256)
    assert not paged_prefill.supports(torch.device("cpu"), torch.int8, 9, 3, 64)
    assert not paged_prefill.supports(torch.device("cpu"), torch.float32, 9, 3, 96)
    assert not paged_prefill.supports(torch.device("cpu"), torch.float32, 9, 4, 64)


def _check_chunk(dtype: torch.dtype, tol: float, n: int, computed: int, bs: int, heads: int, kv_heads: int,
                 scale: float) -> None:
    """A chunk of ``n`` queries after ``computed`` cached tokens, over blocks of ``bs`` in random
    order (a few spare blocks outside the table), against :func:`_reference`."""
    torch.manual_seed(n * 1000 + computed)
    dim = 64
    blocks = -(-(computed + n) // bs)
    k_pool, v_pool = _cache(blocks + 5, bs, kv_heads, dim, dtype)
    table = torch.randperm(blocks + 5)[:blocks]
    q = torch.randn(n, heads, dim).to(dtype)
    out = paged_prefill_attention(q, k_pool, v_pool, table, computed, scale)
    assert out.dtype == dtype and out.shape == (n, heads, dim)
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, table, computed, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n, computed", [(1, 0), (7, 0), (40, 0), (33, 0), (5, 9), (50, 21), (16, 64), (3, 130)])
def test_matches_causal_attention_over_the_gathered_context(dtype, tol, n, computed):
    """Chunks of ``n`` queries after ``computed`` cached tokens, blocks of 4 out of order: the last
    block is part-filled and the last key tile of 32 too."""
    _check_chunk(dtype, tol, n, computed, bs=4, heads=6, kv_heads=2, scale=0.3)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n, computed", [(300, 0), (70, 250), (129, 400)])
def test_long_chunks_match_causal_attention(dtype, tol, n, computed):
    """Contexts longer than one chunk of the matrix-unit path (256 positions) and chunks of more
    than one of its work items (64 queries), SmolLM2's heads, blocks of 16; float32 within the
    rounding of a few hundred terms (as for the head shapes below)."""
    _check_chunk(dtype, tol, n, computed, bs=16, heads=9, kv_heads=3, scale=0.125)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 128), (4, 1, 256), (9, 3, 64)])
def test_head_shapes(heads, kv_heads, dim, dtype, tol):
    torch.manual_seed(dim)
    k_pool, v_pool = _cache(30, 8, kv_heads, dim, dtype)
    table = torch.randperm(30)[:20]
    q = torch.randn(70, heads, dim).to(dtype)
    out = paged_prefill_attention(q, k_pool, v_pool, table, 85, dim ** -0.5)
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, table, 85, dim ** -0.5), atol=tol, rtol=tol)


def test_keys_past_the_context_and_after_a_query_change_nothing():
    """What lies in the blocks past the context, and the keys after a query's own position, are not
    read into its output; a key before it is."""
    torch.manual_seed(3)
    k_pool, v_pool = _cache(8, 4, 1, 64, torch.float32)
    table = torch.tensor([6, 2, 4])  # 12 slots for a context of 10: 2 cached + 8 new
    q = torch.randn(8, 2, 64)
    first = paged_prefill_attention(q, k_pool, v_pool, table, 2, 0.2)
    k_pool[4, 2:], v_pool[4, 2:] = 1e4, 1e4  # past the context
    k_pool[0], v_pool[0] = -1e4, -1e4  # a block outside the table
    torch.testing.assert_close(paged_prefill_attention(q, k_pool, v_pool, table, 2, 0.2), first)
    k_pool[4, 1], v_pool[4, 1] = 3.0, 3.0  # position 9: only the last query sees it
    again = paged_prefill_attention(q, k_pool, v_pool, table, 2, 0.2)
    torch.testing.assert_close(again[:7], first[:7])
    assert not torch.equal(again[7], first[7])


def test_writes_into_strided_query_rows_and_an_output_slice():
    """The model hands over ``q`` as a view of its fused q/k/v rows and wants rows of a larger output."""
    torch.manual_seed(4)
    k_pool, v_pool = _cache(10, 4, 2, 64, torch.float32)
    table = torch.tensor([3, 9, 1, 0, 5])
    qkv = torch.randn(17, 6 + 4, 64)
    q = qkv[:, :6]
    out = torch.zeros(20, 6, 64)
    paged_prefill_attention(q, k_pool, v_pool, table, 3, 0.125, out=out[2:19])
    torch.testing.assert_close(out[2:19], _reference(q, k_pool, v_pool, table, 3, 0.125), atol=2e-6, rtol=2e-6)
    assert out[:2].abs().sum() == 0 and out[19:].abs().sum() == 0


def test_engine_prefills_alike_with_the_kernel_and_with_sdpa():
    """The same float32 engine, its prefill chunks attended by the kernel or by SDPA (the path CUDA,
    8-bit caches and machines without the kernel take): the same greedy tokens and logits within
    float32 rounding, for prompts split into chunks by a small token budget (so later chunks read
    the cache) and a prompt that shares a cached prefix."""
    from kvledger import LLM, SamplingParams

    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="16MiB", enforce_eager=True,
              max_num_batched_tokens=64)
    runner = llm.llm_engine.runner
    assert runner.prefill_in_place
    base = list(range(300, 400))
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 130)] + [base + [7, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run() -> tuple[list[list[int]], torch.Tensor]:
        llm.llm_engine.pool.reset_prefix_cache()  # each run computes the same chunks from scratch
        llm.generate([base], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # caches the prefix
        return tokens_and_last_logits(llm, prompts, params)

    with_kernel, kernel_logits = run()
    runner.prefill_in_place = False
    with_sdpa, sdpa_logits = run()
    assert with_kernel == with_sdpa
    torch.testing.assert_close(kernel_logits, sdpa_logits, atol=1e-4, rtol=1e-4)
