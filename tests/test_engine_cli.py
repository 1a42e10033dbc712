"""``kvledger generate`` as a user runs it: streamed text, the ledger, --json, one-line errors."""

from __future__ import annotations

import pytest

from tests.cli_helpers import assert_one_line_error, kvledger

pytestmark = pytest.mark.slow


def test_generate_json_reports_text_tokens_and_kv_bytes():
    result = kvledger("generate", "The capital of France is", "--max-tokens", "8", "--json",
                      "--kv-cache-memory", "64MiB", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    out = result.json()
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert "Paris" in out["text"]
    kv = out["kv"]
    for key in ("block_size", "num_blocks", "blocks_allocated_peak", "bytes_per_token", "predicted_bytes",
                "measured_bytes"):
        assert key in kv
    assert kv["bytes_per_token"] == 46080
    assert kv["predicted_bytes"] == kv["measured_bytes"] == 46080 * kv["num_blocks"] * kv["block_size"]
    assert kv["blocks_allocated_peak"] == 1  # 5 prompt + 8 new tokens fit one 16-token block


def test_generate_bfloat16_with_enforce_eager():
    """The interface's bfloat16 run with vLLM's --enforce-eager: a bfloat16 cache (half the bytes)."""
    result = kvledger("generate", "The capital of France is", "--max-tokens", "8", "--json", "--dtype", "bfloat16",
                      "--enforce-eager", "--kv-cache-memory", "64MiB", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    out = result.json()
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["kv"]["bytes_per_token"] == 46080 // 2


def test_generate_streams_text_then_prints_the_ledger():
    result = kvledger("generate", "--model", "smollm2-135m", "--chat", "Say hello.", "--max-tokens", "12",
                      "--kv-cache-memory", "64MiB", "--block-size", "32", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "measured pool bytes" in result.stdout and "(equal)" in result.stdout
    assert result.stdout.split("\n\n")[0].strip()  # generated text before the ledger


def test_generate_bad_input_is_one_line():
    assert_one_line_error(kvledger("generate", "hi", "--max-model-len", "100000"), "max-model-len")
    assert_one_line_error(kvledger("generate", "hi", "--model", "/nonexistent/model"), "not found")
    assert_one_line_error(kvledger("generate", "hi", "--max-tokens", "9000", "--kv-cache-memory", "64MiB"),
                          "max-model-len")


def test_engine_flags_become_the_engine_config():
    import argparse

    from kvledger.cli.engine_args import add_engine_args, engine_config_from_args
    from kvledger.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB",
                              "--max-model-len", "512", "--kv-cache-dtype", "int8"])
    config = engine_config_from_args(args)
    assert config == EngineConfig(block_size=32, enable_prefix_caching=False, kv_cache_memory=64 * 2**20,
                                  max_model_len=512, kv_cache_dtype="int8")


def test_a_pool_the_user_sized_is_refused_before_the_weights_load(tmp_path):
    """``--num-gpu-blocks-override`` beyond the machine's memory is refused before any weight is
    read: the checkpoint here has SmolLM2's config and an unreadable weights file, so only a check
    made before loading can give the pool's message."""
    import shutil

    from kvledger.loader.resolve import converted_dir, resolve_model

    shutil.copy(converted_dir(resolve_model(None)) / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    result = kvledger("generate", "hi", "--model", str(tmp_path), "--num-gpu-blocks-override", "100000000000")
    assert_one_line_error(result, "100,000,000,000 blocks", "lower --num-gpu-blocks-override")
