"""``kvledger kv-bytes`` as a user runs it: numbers, JSON, bad input, and no torch (nor in plan, advise)."""

from __future__ import annotations

import pytest

from tests.cli_helpers import assert_one_line_error, assert_runs_without_torch, kvledger


def test_llama_per_token_and_8k():
    out = kvledger("kv-bytes", "llama-3.1-8b", "--json").json()
    assert out["bytes_per_token"] == 131_072
    out = kvledger("kv-bytes", "llama-3.1-8b", "--tokens", "8192", "--json").json()
    assert out["total_bytes"] == 1024**3


def test_table_shows_seven_terms_and_binary_units():
    r = kvledger("kv-bytes", "llama-3.1-8b", "--tokens", "8192")
    assert r.returncode == 0
    for term in ("K and V", "layers", "concurrent sequences", "cached tokens per sequence", "KV heads",
                 "head dimension", "bytes per element"):
        assert term in r.stdout
    assert "131,072" in r.stdout and "128.00 KiB" in r.stdout and "1,073,741,824" in r.stdout and "1.00 GiB" in r.stdout


def test_custom_spec_exercise_3():
    base = ("kv-bytes", "--layers", "24", "--kv-heads", "4", "--head-dim", "128", "--kv-cache-dtype", "bfloat16")
    assert kvledger(*base, "--json").json()["bytes_per_token"] == 49_152
    assert kvledger(*base, "--batch", "4", "--tokens", "2048", "--json").json()["total_bytes"] == 402_653_184


def test_qwen3_and_deepseek():
    assert kvledger("kv-bytes", "qwen3-8b", "--json").json()["bytes_per_token"] == 147_456
    assert kvledger("kv-bytes", "deepseek-v3", "--kv-cache-dtype", "bfloat16", "--json").json()["bytes_per_token"] == 70_272


def test_tensor_parallel_is_per_rank():
    out = kvledger("kv-bytes", "llama-3.1-8b", "--tensor-parallel-size", "2", "--tokens", "10", "--json").json()
    assert out["bytes_per_token"] == 65_536 and out["total_bytes"] == 655_360
    assert out["bytes_per_token_all_ranks"] == 131_072


def test_smollm2_at_tp2_prints_the_largest_rank_and_says_the_split_is_uneven():
    """The bundled model's 3 KV heads at TP 2: 2 and 1 per rank, the per-rank figure rank 0's."""
    out = kvledger("kv-bytes", "HuggingFaceTB/SmolLM2-135M-Instruct", "--tensor-parallel-size", "2", "--json").json()
    assert out["kv_heads_by_rank"] == [2, 1] and out["kv_heads"] == 2
    assert out["bytes_per_token"] == 15_360 and out["bytes_per_token_all_ranks"] == 23_040
    table = kvledger("kv-bytes", "smollm2-135m", "-tp", "2")
    assert table.returncode == 0, table.stderr
    assert "bytes per token per rank (TP 2)   15,360" in table.stdout
    assert "note: TP 2 splits the 3 KV heads unevenly, whole GQA groups per rank (2, 1)" in table.stdout
    assert "unevenly" not in kvledger("kv-bytes", "smollm2-135m", "-tp", "3").stdout


def test_config_path_and_directory(tmp_path):
    from kvledger.spec import presets

    d = presets()["qwen3-8b"]
    assert kvledger("kv-bytes", str(d), "--json").json()["bytes_per_token"] == 147_456
    assert kvledger("kv-bytes", str(d / "config.json"), "--json").json()["bytes_per_token"] == 147_456


@pytest.mark.parametrize("args, needles", [
    (("kv-bytes", "/nonexistent/config.json"), ("no such file",)),
    (("kv-bytes", "llama-3.1-8"), ("unknown model", "llama-3.1-8b")),
    (("kv-bytes", "llama-3.1-8b", "--tokens", "0"), ("--tokens", "positive")),
    (("kv-bytes", "llama-3.1-8b", "--batch", "-3"), ("--batch",)),
    (("kv-bytes", "--layers", "-1", "--kv-heads", "4", "--head-dim", "128"), ("--layers",)),
    (("kv-bytes", "llama-3.1-8b", "--kv-cache-dtype", "int3"), ("--kv-cache-dtype", "int3")),
    (("kv-bytes",), ("--layers",)),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(kvledger(*args), *needles)


def test_not_json_and_missing_keys(tmp_path):
    notjson = tmp_path / "config.json"
    notjson.write_text("hello")
    assert_one_line_error(kvledger("kv-bytes", str(notjson)), "not valid JSON")
    nokeys = tmp_path / "nokeys.json"
    nokeys.write_text('{"model_type": "llama", "hidden_size": 64}')
    assert_one_line_error(kvledger("kv-bytes", str(nokeys)), "num_hidden_layers")
    zero = tmp_path / "zero.json"
    zero.write_text('{"num_hidden_layers": 4, "num_attention_heads": 0, "hidden_size": 64}')
    assert_one_line_error(kvledger("kv-bytes", str(zero)), "num_attention_heads", "positive")


@pytest.mark.parametrize("argv", [
    ["kv-bytes", "llama-3.1-8b", "--json"],
    ["plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--json"],
    ["advise", "llama-3.1-8b", "--gpu", "a100-80gb", "--prompt-tokens", "6144", "--output-tokens", "400",
     "--users", "40", "--target-users", "100", "--json"],
])
def test_spec_and_planner_commands_never_import_torch(argv):
    assert_runs_without_torch(argv)


# ---------------------------------------------------------------- overrides on a model
def kv_json(*args: str) -> dict:
    r = kvledger("kv-bytes", *args, "--json")
    assert r.returncode == 0, r.stderr
    return r.json()


def test_layers_override_keeps_the_familys_sliding_rule():
    """Gemma-3-27B at 100,000 tokens: 10 full layers hold them all, 52 sliding layers hold 1,024;
    --layers re-applies the every-6th-layer-is-full rule rather than copying layer 0."""
    per_layer = 2 * 16 * 128 * 2
    out = kv_json("gemma-3-27b-it", "--tokens", "100000", "--layers", "62")
    assert out["total_bytes"] == per_layer * (10 * 100_000 + 52 * 1024) == 8_628_207_616
    out = kv_json("gemma-3-27b-it", "--tokens", "100000", "--layers", "12")
    assert out["num_sliding_layers"] == 10
    assert out["total_bytes"] == per_layer * (2 * 100_000 + 10 * 1024)


def test_heads_and_kv_heads_overrides_apply_and_are_checked():
    out = kv_json("llama-3.1-8b", "--heads", "16", "--kv-heads", "16")
    assert out["attention"] == "MHA" and out["head_dim"] == 128  # d_h stays 128, not 4096 / 16
    assert out["bytes_per_token"] == 2 * 32 * 16 * 128 * 2
    assert kv_json("llama-3.1-8b", "--kv-heads", "4")["bytes_per_token"] == 2 * 32 * 4 * 128 * 2


@pytest.mark.parametrize("args, needles", [
    (("llama-3.1-8b", "--kv-heads", "3"), ("--kv-heads 3", "not a multiple")),
    (("deepseek-v3", "--head-dim", "64"), ("--head-dim does not apply", "MLA")),
    (("deepseek-v3", "--kv-heads", "8"), ("--kv-heads does not apply", "MLA")),
    (("gpt-oss-20b", "--layers", "30"), ("--layers 30", "layer_types has 24 entries")),
    (("--layers", "4", "--heads", "32", "--kv-heads", "3", "--head-dim", "64"), ("not a multiple",)),
    (("llama-3.1-8b", "-tp", "12"), ("tensor-parallel size 12 cannot split", "1, 2, 3, 4, 5, 6, 7, 8, 16, 32")),
    (("deepseek-v3", "-tp", "3"), ("128 attention heads",)),
    (("smollm2-135m", "-tp", "4"), ("tensor-parallel size 4 cannot split", "sizes that do: 1, 2, 3, 9")),
])
def test_overrides_that_cannot_apply_are_one_line(args, needles):
    assert_one_line_error(kvledger("kv-bytes", *args), *needles)


# ---------------------------------------------------------------- bad values in a config
BASE = {"model_type": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "hidden_size": 512, "sliding_window": 256, "max_position_embeddings": 4096}


@pytest.mark.parametrize("change, needles", [
    ({"sliding_window": "wide"}, ("'sliding_window'", "positive integer", "'wide'")),
    ({"sliding_window": -5}, ("'sliding_window'", "-5")),
    ({"num_experts": "many"}, ("'num_experts'", "'many'")),
    ({"num_experts_per_tok": 1.5}, ("'num_experts_per_tok'",)),
    ({"layer_types": 5}, ("'layer_types'", "list")),
    ({"layer_types": [0, 1, 0, 1]}, ("'layer_types'", "list")),
    ({"max_position_embeddings": "long"}, ("'max_position_embeddings'", "'long'")),
    ({"vocab_size": "big"}, ("'vocab_size'",)),
    ({"intermediate_size": -1}, ("'intermediate_size'",)),
])
def test_bad_config_values_are_one_line(tmp_path, change, needles):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **change}))
    assert_one_line_error(kvledger("kv-bytes", str(config), "--tokens", "1000"), "config.json", *needles)


def test_a_window_on_no_sliding_layer_is_not_read(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, "model_type": "llama", "sliding_window": "unused"}))
    assert kvledger("kv-bytes", str(config), "--json").json()["bytes_per_token"] == 2 * 4 * 8 * 64 * 2
