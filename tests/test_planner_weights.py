"""Weights to the byte: mxfp4 experts as vLLM 0.19's MoE kernels hold them, worked by hand from
the shapes its mxfp4 method allocates and the layouts it converts them to."""

from __future__ import annotations

import pytest

from kvledger.planner.gpus import get_gpu
from kvledger.planner.memory_wall import plan_memory, verdict
from kvledger.spec import load_model_spec
from kvledger.spec.weights import mxfp4_expert_bytes, mxfp4_moe_backend, weight_bytes_breakdown
from kvledger.units import GiB


@pytest.mark.parametrize("sm, backend", [(None, "checkpoint"), ("8.0", "marlin"), ("8.9", "marlin"),
                                         ("9.0", "triton"), ("10.0", "flashinfer_trtllm"), ("12.0", "marlin")])
def test_the_kernel_vllm_picks_per_card(sm, backend):
    assert mxfp4_moe_backend(sm) == backend


def test_gpt_oss_20b_experts_on_hopper_by_hand():
    """24 layers x 32 experts, H = I = 2,880. Triton on SM 9.0, per expert at TP 1:
    w13 values 2,880/2 = 1,440 bytes padded to 1,472, times 2 x 2,880 = 5,760: 8,478,720;
    w2 values 1,472 x 2,880 = 4,239,360; the loaded e8m0 scales (5,760 + 2,880) x 90 = 777,600 stay,
    and their swizzled copy pads 5,760 -> 5,888 and 2,880 -> 3,072 rows: (5,888 + 3,072) x 90 =
    806,400; float32 biases (5,760 + 2,880) x 4 = 34,560. At TP 2, I = 1,440 is padded to 1,472:
    w13 1,472 x 2,944, w2 (736 -> 768) x 2,880, scales 2,944 x 90 + 2,880 x 46, swizzled
    3,072 x 90 + 3,072 x 46, biases (2,944 + 2,880) x 4."""
    spec = load_model_spec("gpt-oss-20b")
    tp1 = 8_478_720 + 4_239_360 + 777_600 + 806_400 + 34_560
    assert mxfp4_expert_bytes(spec, 1, "triton") == 24 * 32 * tp1 == 11_010_539_520
    tp2 = 1472 * 2944 + 768 * 2880 + (2944 * 90 + 2880 * 46) + (3072 * 90 + 3072 * 46) + (2944 + 2880) * 4
    assert mxfp4_expert_bytes(spec, 2, "triton") == 24 * 32 * tp2
    # the checkpoint: 4.25 bits for each of 3 x 2,880 x 2,880 weights and 2 x 2,880 + 2,880 biases
    assert mxfp4_expert_bytes(spec, 1, "checkpoint") == int(24 * 32 * (3 * 2880 * 2880 + 3 * 2880) * 4.25 / 8)
    # Marlin (A100): H 2,880 -> 3,072 and I 2,880 -> 2,944; scales one byte per 32; bf16 biases
    marlin = 3 * 2944 * 3072 // 2 + 3 * 2944 * 3072 // 32 + (2 * 2944 + 3072) * 2
    assert mxfp4_expert_bytes(spec, 1, "marlin") == 24 * 32 * marlin


@pytest.mark.parametrize("model, tp, logged", [("gpt-oss-20b", 1, 13.64), ("gpt-oss-20b", 2, 7.01)])
def test_gpt_oss_weights_within_one_percent_of_vllm_0_19(model, tp, logged):
    """vLLM 0.19 on an H100 printed "Model loading took 13.64 GiB" (TP 1) and 7.01 GiB (TP 2)
    (tests/data/vllm_startup_logs.json); the checkpoint's count was 12.82 and 6.42 GiB."""
    spec = load_model_spec(model)
    wall = plan_memory(spec, get_gpu("h100-80gb"), tensor_parallel_size=tp, gpu_memory_utilization=0.9)
    assert wall.weights_bytes / GiB == pytest.approx(logged, rel=0.01)
    stored = weight_bytes_breakdown(spec).per_rank(spec.num_layers, spec.num_layers, tp)
    assert wall.weights_bytes > stored * 1.05


def test_gpt_oss_120b_at_its_context_on_one_h100_is_not_a_pass():
    """The issue's false pass: at 131,072 tokens and utilization 0.9 one H100 holds 65.5 GiB of
    weights and 2.2 GiB of KV cache, less than the 4.5 GiB one request needs."""
    spec = load_model_spec("gpt-oss-120b")
    wall = plan_memory(spec, get_gpu("h100-80gb"), gpu_memory_utilization=0.9)
    assert wall.weights_bytes / GiB == pytest.approx(65.52, abs=0.01)
    assert verdict(spec, wall, max_model_len=131_072).verdict != "fits"


def test_llama_4_scout_fp8_dynamic_keeps_its_ignored_attention_in_bf16():
    """RedHatAI's FP8-dynamic Scout quantizes the experts, the shared expert and the dense MLPs to
    one byte per weight (a float32 scale per output channel) and lists every layer's q/k/v/o
    projections, the routers, the vision tower and lm_head in its ``ignore``: those stay bfloat16.
    Attention: 48 x (2 x 5,120 x 5,120 + 2 x 5,120 x 1,024) = 3,019,898,880 parameters at 2 bytes.
    (The routers, 48 x 5,120 x 16 = 3.9 M parameters, are counted with the MLPs at one byte.)"""
    from kvledger.spec import weights_bytes
    from kvledger.spec.weights import count_params

    spec = load_model_spec("llama-4-scout-17b-16e-instruct-fp8-dynamic")
    p = count_params(spec)
    assert p.attention == 48 * (2 * 5120 * 5120 + 2 * 5120 * 1024) == 3_019_898_880
    fp8 = (p.linear - p.attention) * (1 + 4 / 5120)
    bf16 = (p.attention + p.embedding + p.lm_head + p.norm + p.vision) * 2
    assert weights_bytes(spec) == pytest.approx(fp8 + bf16, abs=64)


@pytest.mark.parametrize("backend, align, logged, source", [
    ("marlin", 64, 65.9651, "vLLM 0.10.1, torch 2.7.1 (Marlin on Hopper), H100: github.com/vllm-project/vllm/issues/23278"),
    ("triton", 1, 64.38, "vLLM 0.14.1, 'Using Triton backend', H100: github.com/vllm-project/vllm/issues/33155"),
])
def test_gpt_oss_120b_weights_of_earlier_vllm_releases(backend, align, logged, source):
    """The same arithmetic reproduces the two public gpt-oss-120b start-ups of earlier releases to
    0.1%: 0.10.1 fell back to Marlin on an H100 (its Triton path wanted torch 2.8); 0.14.1 used
    Triton with the earlier Hopper value layout (whole tiles only). Non-expert tensors as counted
    for vLLM 0.19 (bf16, the float32 rotary table)."""
    spec = load_model_spec("gpt-oss-120b")
    parts = weight_bytes_breakdown(spec, compute_capability="9.0")
    rest = parts.per_rank(spec.num_layers, spec.num_layers, 1) - parts.experts
    total = rest + mxfp4_expert_bytes(spec, 1, backend, hopper_value_align=align)
    assert total / GiB == pytest.approx(logged, rel=0.002), source
