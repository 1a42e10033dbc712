"""Hybrid models in the spec: layer kinds from every way configs say them, and the per-request state
bytes per layer, each expected value worked by hand from vLLM 0.32's rules
(``vllm/model_executor/layers/mamba/mamba_utils.py``: ``MambaStateShapeCalculator``,
``MambaStateDtypeCalculator``; ``platforms/interface.py``: ``_align_hybrid_block_size``)."""

from __future__ import annotations

import math

import pytest

from kvledger.errors import ConfigError, KVLedgerError
from kvledger.spec import ModelSpec, kv_bytes, load_model_spec
from kvledger.spec.hybrid import hybrid_layout, layout_for, parse_vllm_version
from kvledger.spec.state import FULL, LINEAR, MAMBA, NO_CACHE, state_bytes

# Written here with only the sizing fields of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (no
# verbatim copy is in the shared data): a Gated DeltaNet hybrid, 3 linear-attention layers to 1 attention layer.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
}


def granite_small() -> ModelSpec:
    return load_model_spec("granite-4.0-h-small")


# ---------------------------------------------------------------- layer kinds
def test_granite_layer_types_mamba_and_attention():
    spec = granite_small()
    assert spec.num_layers == 40 and spec.num_state_layers == 36 and spec.num_attention_layers == 4
    assert [i for i, t in enumerate(spec.layer_types) if t == FULL] == [5, 15, 25, 35]
    assert spec.state.family == "mamba2"
    assert set(spec.layer_types) == {FULL, LINEAR}            # transformers' names
    assert spec.layer_kinds.count(MAMBA) == 36


def test_full_attention_interval_gives_three_linear_to_one_attention():
    spec = ModelSpec.from_config_dict(QWEN3_NEXT_80B)
    assert spec.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL)
    assert (spec.num_attention_layers, spec.num_state_layers) == (12, 36)
    assert spec.state.family == "gated_deltanet"


@pytest.mark.parametrize("keys, attention", [
    ({"hybrid_override_pattern": "M-M*-E"}, [3]),                              # Nemotron-H
    ({"layers_block_type": ["mamba", "mamba", "attention", "mlp", "mamba", "mamba"]}, [2]),
    ({"attn_layer_indices": [1, 4]}, [1, 4]),                                  # Bamba
    ({"attn_layer_period": 3, "attn_layer_offset": 1}, [1, 4]),               # Jamba
])
def test_every_way_configs_say_which_layers_attend(keys, attention):
    cfg = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "model_type": "nemotron_h" if "hybrid_override_pattern" in keys else "bamba",
           "mamba_d_state": 16, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_n_heads": 16,
           "mamba_d_head": 64, "n_groups": 1, "mamba_num_heads": 16, "mamba_head_dim": 64, "ssm_state_size": 16,
           "conv_kernel": 4, **keys}
    spec = ModelSpec.from_config_dict(cfg)
    assert [i for i, t in enumerate(spec.layer_types) if t == FULL] == attention
    assert all(t in (MAMBA, NO_CACHE) for i, t in enumerate(spec.layer_kinds) if i not in attention)


def test_models_without_state_are_unchanged():
    spec = load_model_spec("llama-3.1-8b")
    assert spec.state is None and not spec.is_hybrid
    kb = kv_bytes(spec)
    assert kb.state_bytes_per_request == 0 and kb.bytes_per_token == 131_072 and kb.num_layers == 32


def test_unknown_layer_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="kinds kvledger does not know"):
        ModelSpec.from_config_dict({**QWEN3_NEXT_80B, "layer_types": ["linear_attention"] * 47 + ["weird"]})


# ---------------------------------------------------------------- granite-4.0-h-small, hand-worked
# Mamba2: I = 2 x 4096 = 8192, G = 1 (padded to TP), N = 128, 128 heads of 64, conv kernel 4, bf16.
# Attention: 8 KV heads of 128, bf16: 2 x 8/TP x 128 x 2 bytes per token per layer.
@pytest.mark.parametrize("tp, conv, ssm, attn_token, block, padding", [
    # TP 1: conv 3 x (8192 + 2 x 1 x 128) x 2 = 50,688; SSM 128 x 64 x 128 x 2 = 2,097,152
    #       block 16 x cdiv(2,147,840, 16 x 4,096) = 16 x 33 = 528; page 528 x 4,096 = 2,162,688
    (1, 3 * 8448 * 2, 128 * 64 * 128 * 2, 4096, 528, (2_162_688 - 2_147_840) / 2_147_840 * 100),
    # TP 2: groups 1 -> 2; conv 3 x (8192 + 2 x 2 x 128)/2 x 2 = 26,112; SSM 64 x 64 x 128 x 2
    #       block 16 x cdiv(1,074,688, 16 x 2,048) = 528; page 1,081,344
    (2, 3 * 4352 * 2, 64 * 64 * 128 * 2, 2048, 528, (1_081_344 - 1_074_688) / 1_074_688 * 100),
    # TP 4: groups 1 -> 4; conv 3 x (8192 + 2 x 4 x 128)/4 x 2 = 13,824; SSM 32 x 64 x 128 x 2
    #       block 16 x cdiv(538,112, 16 x 1,024) = 528; page 540,672
    (4, 3 * 2304 * 2, 32 * 64 * 128 * 2, 1024, 528, (540_672 - 538_112) / 538_112 * 100),
])
def test_granite_h_small_state_block_and_padding_by_hand(tp, conv, ssm, attn_token, block, padding):
    spec = granite_small()
    sb = state_bytes(spec.state, tp)
    assert (sb.conv_bytes, sb.ssm_bytes) == (conv, ssm)
    kb = kv_bytes(spec, tensor_parallel_size=tp)
    assert kb.bytes_per_token == 4 * attn_token                      # attention layers only
    assert kb.state_bytes_per_layer == conv + ssm
    assert kb.state_bytes_per_request == 36 * (conv + ssm)
    layout = layout_for(kb, prefix_caching=False)
    assert layout.block_size == block
    assert layout.page_bytes == block * attn_token
    assert layout.padding_pct == pytest.approx(padding)
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (4, 1, 9)


def test_granite_tp1_is_16_kib_per_token_and_77_mb_of_state():
    kb = kv_bytes(granite_small())
    assert kb.bytes_per_token == 16_384
    assert kb.state_bytes_per_request == 36 * 2_147_840 == 77_322_240


def test_mamba_ssm_cache_dtype_float32_doubles_the_ssm_state():
    spec = granite_small()
    assert state_bytes(spec.state, 1, mamba_ssm_cache_dtype="float32").ssm_bytes == 128 * 64 * 128 * 4
    kb = kv_bytes(spec, mamba_ssm_cache_dtype="float32")
    assert kb.state_bytes_per_layer == 50_688 + 4_194_304


def test_fp8_kv_cache_leaves_the_state_in_the_model_dtype():
    spec = granite_small()
    assert kv_bytes(spec, "fp8").state_bytes_per_layer == kv_bytes(spec).state_bytes_per_layer
    assert kv_bytes(spec, "fp8").bytes_per_token == 8_192


# ---------------------------------------------------------------- Gated DeltaNet, hand-worked
def test_qwen3_next_gated_deltanet_by_hand():
    spec = ModelSpec.from_config_dict(QWEN3_NEXT_80B, name="qwen3-next")
    kb = kv_bytes(spec)
    # conv: 3 x (2 x 16 x 128 + 32 x 128) x 2 = 49,152; state: 32 x 128 x 128 x 2 = 1,048,576
    assert kb.state_bytes_per_layer == 49_152 + 1_048_576 == 1_097_728
    assert kb.bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    layout = layout_for(kb, prefix_caching=False)
    # attention page of one token: 2 x 2 x 256 x 2 = 2,048; 16 x cdiv(1,097,728, 32,768) = 16 x 34
    assert layout.block_size == 544
    assert layout.padding_pct == pytest.approx((544 * 2048 - 1_097_728) / 1_097_728 * 100)  # 1.49%
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (12, 1, 3)
    # TP 4: value heads 32/4, conv 8192/4; the 2 KV heads replicate (1 per rank)
    kb4 = kv_bytes(spec, tensor_parallel_size=4)
    assert kb4.state_bytes_per_layer == 3 * 2048 * 2 + 8 * 128 * 128 * 2
    assert layout_for(kb4, prefix_caching=False).block_size == 16 * math.ceil(274_432 / (16 * 1024))


def test_qwen35_config_ssm_dtype_float32():
    cfg = {**QWEN3_NEXT_80B, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "mamba_ssm_dtype": "float32"}
    kb = kv_bytes(ModelSpec.from_config_dict({"text_config": cfg, "model_type": "qwen3_5_moe"}))
    assert kb.state_bytes_per_layer == 49_152 + 32 * 128 * 128 * 4
    forced = kv_bytes(ModelSpec.from_config_dict(cfg), mamba_ssm_cache_dtype="bfloat16")
    assert forced.state_bytes_per_layer == 49_152 + 32 * 128 * 128 * 2


def test_state_heads_that_do_not_split_are_an_error():
    spec = ModelSpec.from_config_dict(QWEN3_NEXT_80B)
    with pytest.raises(KVLedgerError):
        kv_bytes(spec, tensor_parallel_size=3)


# ---------------------------------------------------------------- the pool's rules
def test_block_size_flag_raises_the_alignment_and_is_kept_when_large_enough():
    # granite TP 1: 528 with the alignment 16; --block-size 64 aligns to 64: 64 x cdiv(2,147,840, 64 x 4,096) = 576
    assert hybrid_layout(4096, 2_147_840, 4, 36, "mamba2", block_size=64, prefix_caching=False).block_size == 576
    big = hybrid_layout(4096, 2_147_840, 4, 36, "mamba2", block_size=1024, prefix_caching=False)
    assert big.block_size == 1024 and not big.block_size_raised


def test_state_blocks_per_request_follow_prefix_caching_and_version():
    lay = lambda pc, v, fam="mamba2": hybrid_layout(4096, 2_147_840, 4, 36, fam, prefix_caching=pc,
                                                    vllm_version=v)
    assert lay(False, "0.32").state_blocks_per_request == 1
    assert lay(True, "0.24", "gated_deltanet").state_blocks_per_request == 2
    assert lay(True, "0.32").state_blocks_per_request == 3           # Mamba2's prefill checkpoint
    assert lay(None, "0.24").prefix_caching is False                 # opt-in before 0.28
    assert lay(None, "0.32").prefix_caching is True


def test_token_line_meaning_follows_the_version():
    old = hybrid_layout(4096, 2_147_840, 4, 36, "mamba2", prefix_caching=False, vllm_version="0.19")
    new = hybrid_layout(4096, 2_147_840, 4, 36, "mamba2", prefix_caching=False, vllm_version="0.20")
    assert old.kv_tokens(1000, 32768) == 1000 // 10 * 528
    assert new.kv_tokens(1000, 32768) == int(1000 / (63 + 9) * 32768)


@pytest.mark.parametrize("text, version", [("0.19", (0, 19)), ("v0.24.0", (0, 24)), ("0.27.1", (0, 27)),
                                           (None, (0, 32))])
def test_parse_vllm_version(text, version):
    assert parse_vllm_version(text) == version


@pytest.mark.parametrize("text", ["0.9", "1.0", "0.33", "latest"])
def test_unmodeled_vllm_version_is_an_error(text):
    with pytest.raises(KVLedgerError, match="vllm-version"):
        parse_vllm_version(text)


# ---------------------------------------------------------------- the other families vLLM supports
# Configs written here with only the sizing fields of the published files.
def test_jamba_mamba1_state_by_hand():
    spec = ModelSpec.from_config_dict({
        "model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16,
        "mamba_d_conv": 4, "torch_dtype": "bfloat16"})          # ai21labs/Jamba-v0.1's sizing fields
    assert [i for i, t in enumerate(spec.layer_types) if t == FULL] == [4, 12, 20, 28]
    kb = kv_bytes(spec)
    assert kb.state_bytes_per_layer == 3 * 8192 * 2 + 8192 * 16 * 2      # conv (k-1) x I, SSM I x N
    layout = layout_for(kb, prefix_caching=False)
    assert (layout.group_size, layout.attention_groups, layout.state_groups) == (4, 1, 7)
    assert layout.block_size == 16 * math.ceil(311_296 / (16 * 2 * 8 * 128 * 2))   # 80


def test_minimax_lightning_attention_state_by_hand():
    spec = ModelSpec.from_config_dict({
        "model_type": "minimax_text_01", "num_hidden_layers": 16, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 6144, "torch_dtype": "bfloat16",
        "attn_type_list": [0, 0, 0, 0, 0, 0, 0, 1] * 2})
    assert spec.num_attention_layers == 2 and spec.state.family == "minimax_linear"
    assert kv_bytes(spec).state_bytes_per_layer == 64 * 128 * 128 * 2
    assert kv_bytes(spec, tensor_parallel_size=8).state_bytes_per_layer == 8 * 128 * 128 * 2


def test_kimi_delta_attention_state_in_float32_beside_mla():
    spec = ModelSpec.from_config_dict({
        "model_type": "kimi_linear", "num_hidden_layers": 8, "num_attention_heads": 32, "hidden_size": 2304,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 32,
                               "head_dim": 128, "short_conv_kernel_size": 4}})
    assert [i for i, t in enumerate(spec.layer_types) if t == FULL] == [3, 7]
    kb = kv_bytes(spec)
    assert kb.state_bytes_per_layer == 3 * (32 * 128 * 3) * 2 + 32 * 128 * 128 * 4
    layout = layout_for(kb, mla=True, prefix_caching=False)
    assert layout.kernel_alignment == 128                           # vLLM 0.32 for a hybrid with MLA
    assert layout.block_size == 128 * math.ceil(kb.state_bytes_per_layer / (128 * 576 * 2))


def test_falcon_h1_has_attention_and_mamba2_in_every_layer():
    spec = ModelSpec.from_config_dict({
        "model_type": "falcon_h1", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 1024, "mamba_d_ssm": 1536, "mamba_n_groups": 1, "mamba_n_heads": 24,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4, "torch_dtype": "bfloat16"})
    assert spec.num_attention_layers == 4 and spec.num_state_layers == 4
    kb = kv_bytes(spec)
    assert kb.state_bytes_per_layer == 3 * (1536 + 2 * 128) * 2 + 24 * 64 * 128 * 2


def test_short_conv_state():
    spec = ModelSpec.from_config_dict({
        "model_type": "lfm2", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512, "conv_L_cache": 3, "conv_dim": 512,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"]})
    assert kv_bytes(spec).state_bytes_per_layer == 2 * 512 * 2
    assert kv_bytes(spec, tensor_parallel_size=2).state_bytes_per_layer == 2 * 256 * 2


def test_nemotron_h_ssm_state_defaults_to_float32():
    cfg = {"model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M-M*",
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 1024,
           "mamba_num_heads": 16, "mamba_head_dim": 64, "n_groups": 2, "ssm_state_size": 128, "conv_kernel": 4}
    kb = kv_bytes(ModelSpec.from_config_dict(cfg))
    assert kb.state_bytes_per_layer == 3 * (1024 + 2 * 2 * 128) * 2 + 16 * 64 * 128 * 4   # NemotronH: float32 SSM
    assert kv_bytes(ModelSpec.from_config_dict(cfg), mamba_ssm_cache_dtype="bfloat16").state_bytes_per_layer == \
        3 * (1024 + 2 * 2 * 128) * 2 + 16 * 64 * 128 * 2
    # TP 2 splits the 2 groups; TP 4 pads them to 4: conv (1024 + 2 x 4 x 128) / 4 channels
    assert kv_bytes(ModelSpec.from_config_dict(cfg), tensor_parallel_size=2).state_bytes_per_layer == \
        3 * (1024 + 2 * 2 * 128) // 2 * 2 + 8 * 64 * 128 * 4
    assert kv_bytes(ModelSpec.from_config_dict(cfg), tensor_parallel_size=4).state_bytes_per_layer == \
        3 * (1024 + 2 * 4 * 128) // 4 * 2 + 4 * 64 * 128 * 4
