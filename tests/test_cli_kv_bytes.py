"""``kvledger kv-bytes`` as a user runs it: numbers, JSON, bad input, and no torch (nor in plan, advise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_helpers import assert_one_line_error, kvledger


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
    code = ("import sys; from kvledger.cli.main import main; import kvledger.spec, kvledger; "
            f"rc = main({argv!r}); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch was imported'; print('clean')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("clean")
