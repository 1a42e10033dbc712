"""MoE in the bandwidth model, vLLM's KV-cache dtypes byte for byte, and the plan's verdict."""

from __future__ import annotations

import pytest

from kvledger.planner import bandwidth as bw
from kvledger.planner.gpus import get_gpu
from kvledger.planner.memory_wall import plan_memory, verdict
from kvledger.spec import kv_bytes, load_model_spec
from tests.cli_helpers import kvledger

GiB = 1 << 30


def test_expected_experts_under_uniform_routing():
    assert bw.expected_experts(128, 4, 1) == pytest.approx(4)
    assert bw.expected_experts(128, 4, 2) == pytest.approx(128 * (1 - (124 / 128) ** 2))  # 7.875: a little overlap
    assert bw.expected_experts(128, 4, 10_000) == pytest.approx(128)
    assert bw.expected_experts(0, 0, 5) == 0


def test_gpt_oss_120b_at_batch_1_reads_dense_attention_four_experts_and_kv():
    """By hand from its config.json: 36 layers, hidden 2,880, 64 query / 8 KV heads of 64, vocabulary
    201,088 (embedding and lm_head untied), 128 experts of 3 x 2,880 x 2,880 in mxfp4 (4.25 bits),
    top 4; attention, router, embeddings and norms in bf16. Half the layers slide over 128 tokens."""
    spec = load_model_spec("gpt-oss-120b")
    wall = plan_memory(spec, get_gpu("h100-80gb"))
    L, h, V, E = 36, 2880, 201_088, 128
    attention = L * (2 * h * 64 * 64 + 2 * h * 8 * 64) * 2
    dense = (2 * V * h + L * h * E) * 2  # embedding + lm_head + routers
    four_experts = L * 4 * 3 * h * h * 4.25 / 8
    kv = 2 * 8 * 64 * 2 * (18 * 8192 + 18 * 128)  # one 8,192-token sequence
    expected = attention + dense + four_experts + kv
    step = bw.weight_bytes_read_per_step(wall, 1) + bw.kv_read_bytes(spec, "auto", 1, 8192)
    assert step == pytest.approx(expected, rel=0.10)
    assert step < 0.1 * wall.weights_bytes  # not the 65 GiB of weights
    # 60.7 GiB as the checkpoint stores them; 65.5 GiB as vLLM 0.19's Triton MoE kernel holds them on
    # an H100 (test_planner_validation: mxfp4 experts to the byte)
    assert 60 * GiB < wall.weights_bytes < 66 * GiB
    # a big batch touches every expert: every weight is read once
    assert bw.weight_bytes_read_per_step(wall, 4096) == pytest.approx(wall.weights_bytes, rel=0.001)


def test_moe_plan_json_reports_the_read_and_the_crossover_uses_it():
    out = kvledger("plan", "gpt-oss-120b", "--gpu", "h100-80gb", "--users", "1", "--context", "8192", "--json").json()
    assert out["weight_bytes_read_per_step"] == out["weights_bytes_per_step"] < 0.1 * out["weights_bytes"]
    # at its 131,072-token context one H100 does not hold it: 65.5 GiB of weights leave 2.2 GiB of KV
    # cache for a request of 4.5 GiB (vLLM refuses to start)
    assert out["verdict"] == "does not fit"
    dense = kvledger("plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--json").json()
    assert dense["weight_bytes_read_per_step"] == dense["weights_bytes"]  # a dense model reads every weight
    # the crossover batch touches (nearly) every expert, so its weights read is (nearly) all of them
    assert out["crossover_tokens"] > 0.9 * out["weights_bytes"] / (out["kv_bytes_per_step"] / 8192)


@pytest.mark.parametrize("dtype, element, scale_per_token, fixed", [
    ("int8_per_token_head", 1, 2 * 8 * 32 * 4, 0),   # vLLM: a float32 scale per token per KV head, K and V
    ("fp8_per_token_head", 1, 2 * 8 * 32 * 4, 0),
    ("int8", 1, 2 * 8 * 32 * 2, 0),                  # kvledger's engine cache: float16 scales
    ("fp8", 1, 0, 2 * 32 * 4),                       # one float32 k_scale and v_scale per layer
    ("fp8_e4m3", 1, 0, 2 * 32 * 4),
    ("fp8_e5m2", 1, 0, 2 * 32 * 4),
    ("bfloat16", 2, 0, 0),
    ("float32", 4, 0, 0),
])
def test_kv_cache_dtypes_as_vllm_lays_them_out(dtype, element, scale_per_token, fixed):
    spec = load_model_spec("llama-3.1-8b")
    kb = kv_bytes(spec, dtype, tokens=8192)
    assert kb.bytes_per_token == 2 * 32 * 8 * 128 * element
    assert kb.scale_bytes_per_token == scale_per_token and kb.scale_bytes_fixed == fixed
    # vLLM's page: 2 x block x H_kv x (d_h x s + scale bytes) per layer
    assert kb.token_bytes * 16 == 32 * (2 * 16 * 8 * 128 * element + 16 * scale_per_token // 32)


def test_verdicts():
    spec = load_model_spec("llama-3.1-8b")
    h100 = get_gpu("h100-80gb")
    roomy = plan_memory(spec, h100, gpu_memory_utilization=0.9)
    assert verdict(spec, roomy, max_model_len=8192).verdict == "fits"
    # headroom: at 0.99 the CUDA graphs and the warm-up have 0.79 GiB outside the pool
    squeezed = plan_memory(spec, h100, gpu_memory_utilization=0.99)
    v = verdict(spec, squeezed, max_model_len=8192)
    assert v.verdict == "tight" and v.term in ("CUDA graphs", "the sampler warm-up") and "--gpu-memory-utilization" in v.advice
    # the pool holds the request by less than the table's spread
    users = roomy.num_blocks * 16 // 8192
    close = verdict(spec, roomy, users=users, context=8192)
    assert close.verdict == "tight" and close.term == "KV pool"
    assert verdict(spec, roomy, users=users + 1, context=8192).verdict == "does not fit"
    assert verdict(spec, roomy, users=users // 2, context=8192).verdict == "fits"
