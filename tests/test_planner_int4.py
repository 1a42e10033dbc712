"""vLLM's ``int4_per_token_head`` cache counted byte for byte in ``kv-bytes`` and ``plan``.

vLLM 0.32 (``TritonAttentionBackend.customize_spec``) stores, per token, per KV head, per layer:
``head_size // 2`` bytes of packed K nibbles, as many of V, and one float32 scale for K and one
for V (the 4-bit zero point hides in the scale's low mantissa bits). For Llama-3.1-8B (32 layers,
8 KV heads, head_dim 128) that is, worked out by hand:

    elements: 2 x 32 x 8 x 128 / 2      = 32,768 bytes per token
    scales:   2 x 32 x 8 x 4            =  2,048 bytes per token
    a token of the pool:                  34,816 bytes  (32 x 8 x (64 + 64 + 8))
    a 16-token block:        16 x 34,816 = 557,056 bytes
"""

from __future__ import annotations

from kvledger.planner.gpus import get_gpu
from kvledger.planner.memory_wall import plan_memory
from kvledger.spec import kv_bytes, load_model_spec
from tests.cli_helpers import kvledger

TOKEN_BYTES = 32 * 8 * (64 + 64 + 8)
BLOCK_BYTES = 16 * TOKEN_BYTES


def test_int4_per_token_head_layout():
    kb = kv_bytes(load_model_spec("llama-3.1-8b"), "int4_per_token_head", tokens=1000)
    assert kb.element_bytes == 0.5
    assert kb.bytes_per_token == 32_768 and kb.scale_bytes_per_token == 2_048 and kb.scale_bytes_fixed == 0
    assert kb.token_bytes == TOKEN_BYTES == 34_816
    assert kb.total_bytes + kb.total_scale_bytes == 1000 * 34_816


def test_int4_per_token_head_in_plan_and_kv_bytes_cli():
    spec = load_model_spec("llama-3.1-8b")
    h100 = get_gpu("h100-80gb")
    bf16 = plan_memory(spec, h100)
    int4 = plan_memory(spec, h100, kv_cache_dtype="int4_per_token_head")
    assert int4.kv_pool_bytes == bf16.kv_pool_bytes  # the cache dtype changes the tokens, not the pool
    assert int4.block_bytes == BLOCK_BYTES == 557_056
    assert int4.num_blocks == int4.kv_pool_bytes // BLOCK_BYTES and int4.kv_tokens == 16 * int4.num_blocks
    # 131,072 B of bf16 K/V per token (2 x 32 x 8 x 128 x 2) against 34,816 B: 3.76x the tokens
    assert abs(int4.kv_tokens / bf16.kv_tokens - 131_072 / 34_816) < 0.001
    out = kvledger("plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-model-len", "8192",
                   "--kv-cache-dtype", "int4_per_token_head", "--json").json()
    assert out["kv_tokens"] == int4.kv_tokens and out["bytes_per_token"] == 32_768
    text = kvledger("kv-bytes", "llama-3.1-8b", "--kv-cache-dtype", "int4_per_token_head", "--tokens", "1000").stdout
    assert "34,816,000" in text and "2,048" in text
