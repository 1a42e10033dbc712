"""Public vLLM start-up logs of hybrid models, reproduced from a config and the flags each log states
(``tests/data/vllm_hybrid_startup_logs.json``; each row names its source). Block size and padding
exactly, the block count within what the two-decimal pool allows, the token line as that vLLM
release prints it and the maximum concurrency within 0.5%, and the refusals vLLM printed."""

from __future__ import annotations

import pytest

from kvledger.planner.hybrid_validation import (WITHIN, check_hybrid_row, hybrid_table, implied_blocks,
                                                load_hybrid_rows, markdown, row_layout)
from kvledger.units import GiB
from tests.cli_helpers import kvledger

ROWS = load_hybrid_rows()


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['model']}@{r['vllm_version']}: {r['source']}" for r in ROWS])
def test_every_logged_hybrid_start_up_reproduces(row):
    check = check_hybrid_row(row)
    assert check.failures == [], check.failures
    for key in ("kv_tokens", "max_concurrency"):
        if key in row["logged"]:
            assert abs(check.error(key)) <= WITHIN


def test_the_table_covers_six_addressed_logs_two_families_and_a_refusal():
    addressed = [r for r in ROWS if r["source"].startswith("https://") and not r.get("indexed_only")]
    assert len(addressed) >= 6
    assert {"mamba2", "gated_deltanet"} <= {r["family"] for r in addressed}
    assert any(r["logged"].get("refused_max_num_seqs") for r in addressed)
    assert any("estimated_max_model_len" in r["logged"] for r in addressed)


def test_a_changed_rule_breaks_the_rows_it_should():
    """The rows hold the rules: the 0.19 token line read with 0.20's meaning (or a 0.24 GDN
    request with one state block) no longer reproduces."""
    old = next(r for r in ROWS if r["vllm_version"] == "0.19" and "kv_tokens" in r["logged"]
               and r["family"] == "gated_deltanet")
    assert check_hybrid_row({**old, "vllm_version": "0.20"}).failures
    new = next(r for r in ROWS if r["vllm_version"] == "0.24")
    assert check_hybrid_row({**new, "enable_prefix_caching": False}).failures


def test_implied_block_counts_are_unique():
    for row in ROWS:
        if "num_blocks_implied" in row["logged"]:
            assert implied_blocks(row_layout(row), row["max_model_len"], row["logged"]) == \
                [row["logged"]["num_blocks_implied"]]


def test_markdown_table_has_a_line_per_row():
    table = markdown(hybrid_table())
    assert len(table.splitlines()) == 2 + len(ROWS)


# ---------------------------------------------------------------- the same logs through `kvledger plan --json`
REFUSAL = next(r for r in ROWS if r["logged"].get("refused_max_num_seqs"))


def _plan(*extra: str, row=REFUSAL):
    pool = int(row["logged"]["kv_memory_gib"] * GiB)
    return kvledger("plan", row["config"], "--gpu", "h100-80gb", "-tp", str(row["tensor_parallel_size"]),
                    "--kv-cache-memory", str(pool), "--vllm-version", row["vllm_version"], *extra, "--json")


def test_plan_json_reproduces_the_refusal_row():
    """vllm#49064: Qwen3.8-27B, TP 2, vLLM 0.23.1, a 3.86 GiB pool: 161 blocks of 784 tokens,
    "GPU KV cache size: 123,399 tokens", and max_num_seqs 256 refused."""
    out = _plan("--max-model-len", "122633", "--max-num-seqs", "256").json()
    assert (out["block_size"], out["num_blocks"], out["kv_tokens"]) == (784, 161, 123_399)
    assert out["verdict"] == "does not fit" and out["verdict_term"] == "max_num_seqs"
    assert "exceeds available Mamba cache blocks (161)" in out["verdict_reason"]
    assert "--max-num-seqs 161" in out["verdict_advice"]
    assert out["max_concurrency"] == pytest.approx(161 / 160)
    assert out["vllm_version"] == "0.23"


def test_plan_json_starts_with_max_num_seqs_at_the_blocks():
    out = _plan("--max-model-len", "122633", "--max-num-seqs", "161").json()
    assert out["verdict"] != "does not fit"


def test_plan_refuses_the_max_model_len_vllm_refused_with_its_estimate():
    result = _plan("--max-model-len", "132000", "--max-num-seqs", "128")
    assert result.returncode == 2
    assert "estimated maximum model length is 123,872" in result.stderr
