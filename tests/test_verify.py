"""The chapter's artifact: cached attention equals full causal attention; cache bytes equal Eq 2.2."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from kvledger.evaluate.verify import AppendOnlyKVCache, VerifyConfig, run_verify
from tests.cli_helpers import assert_one_line_error, kvledger

LONG_RUN_TOKENS = 3072
"""Tokens for which verify (two layers) runs well past the progress bar's delay: about 4 s on one core."""


def test_defaults_are_the_chapters_diagnostic():
    r = run_verify(VerifyConfig())
    assert r.predicted_bytes == r.measured_bytes == 65_536
    assert r.max_abs_diff < 1e-5 and r.passed


def test_cli_defaults_print_65536_and_pass():
    r = kvledger("verify", "--json")
    assert r.returncode == 0, r.stderr
    out = r.json()
    assert out["predicted_bytes"] == out["measured_bytes"] == 65_536 and out["passed"] is True
    text = kvledger("verify")
    assert "65,536" in text.stdout and "PASSED" in text.stdout


def test_a_long_run_shows_progress_on_stderr_and_leaves_stdout_alone():
    """A long sequence takes seconds (each cached token attends over the whole cache): a bar on
    stderr follows the cached pass; stdout, here --json, is the result alone. A quick run prints no bar."""
    quick = kvledger("verify")
    assert quick.returncode == 0 and "verify:" not in quick.stderr, quick.stderr
    tokens = str(LONG_RUN_TOKENS)
    long = kvledger("verify", "--tokens", tokens, "--layers", "2", "--json")
    assert long.returncode == 0, long.stderr
    assert long.json()["passed"] is True
    assert "verify:" in long.stderr and f"{tokens}/{tokens}" in long.stderr, long.stderr


def test_a_broken_cache_is_caught():
    """Dropping the newest token from the cache (an append-order bug) must fail the check."""
    original = AppendOnlyKVCache.append

    def buggy(self, layer, k, v):
        keys, values = original(self, layer, k, v)
        return (keys[:, :, :-1], values[:, :, :-1]) if keys.shape[2] > 1 else (keys, values)

    AppendOnlyKVCache.append = buggy
    try:
        assert not run_verify(VerifyConfig(tokens=8)).passed
    finally:
        AppendOnlyKVCache.append = original


def test_cli_fails_with_exit_1_when_tolerance_is_impossible():
    r = kvledger("verify", "--tokens", "16", "--tolerance", "0", "--json")
    assert r.returncode == 1 and r.json()["passed"] is False


def test_bad_geometry_is_one_line_exit_2():
    assert_one_line_error(kvledger("verify", "--heads", "6", "--kv-heads", "4"), "multiple of --kv-heads")
    assert_one_line_error(kvledger("verify", "--head-dim", "7"), "even")
    assert_one_line_error(kvledger("verify", "--tokens", "0"), "--tokens")


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), kv_heads=st.integers(1, 4), group=st.integers(1, 3),
       half_dim=st.integers(1, 24), tokens=st.integers(1, 24), batch=st.integers(1, 3),
       dtype=st.sampled_from(["float32", "float64"]), rope=st.booleans())
def test_property_any_geometry_passes_both_checks(layers, kv_heads, group, half_dim, tokens, batch, dtype, rope):
    torch.set_num_threads(1)
    cfg = VerifyConfig(layers=layers, heads=kv_heads * group, kv_heads=kv_heads, head_dim=2 * half_dim,
                       tokens=tokens, batch=batch, dtype=dtype, rope=rope)
    r = run_verify(cfg)
    element = 4 if dtype == "float32" else 8
    assert r.predicted_bytes == 2 * layers * batch * tokens * kv_heads * 2 * half_dim * element
    assert r.measured_bytes == r.predicted_bytes
    assert r.max_abs_diff <= r.tolerance, r


def test_text_names_the_attention_kind():
    for heads, kv_heads, kind in (("4", "4", "(MHA)"), ("4", "2", "(GQA)"), ("4", "1", "(MQA)")):
        r = kvledger("verify", "--heads", heads, "--kv-heads", kv_heads, "--tokens", "4", "--head-dim", "8")
        assert r.returncode == 0 and kind in r.stdout.splitlines()[0], r.stdout
