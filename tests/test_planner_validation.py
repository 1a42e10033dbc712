"""The validation table: vLLM 0.19's own start-up logs, every usable one planned from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.planner.validation import ENVIRONMENT_FAILURES, check_row, load_rows, summary

DATA = Path(__file__).parent / "data" / "vllm_startup_logs.json"


@pytest.fixture(scope="module")
def checks():
    return [check_row(row) for row in load_rows(DATA)]


def test_the_data_file_keeps_numbers_and_their_source():
    rows = load_rows(DATA)
    assert len(rows) == 74
    assert all(r["source"].startswith("accuracy/results/v0.19.0/logs/") for r in rows)
    started = [r for r in rows if r["started"]]
    assert all(r["kv_tokens"] and r["kv_memory_gib"] and r["weights_gib"] for r in started)
    # vLLM 0.19: pool = total x utilization - weights - activation - non-torch, to vLLM's rounding
    for r in started:
        budget = r["total_memory_gib"] * r["gpu_memory_utilization"]
        assert budget - r["weights_gib"] - r["activation_gib"] - r["non_torch_gib"] == pytest.approx(
            r["kv_memory_gib"], abs=0.05), r["source"]


def test_done_when_bar(checks):
    s = summary(checks)
    assert s.usable >= 38 and s.started >= 35 and s.failed >= 3
    assert s.within_share >= 0.9
    assert s.worst_token_error <= 0.10
    assert s.failed_predicted == s.failed  # every failed run predicted "tight" or "does not fit"
    assert s.started_refused == 0  # no started run predicted "does not fit"
    assert s.passes


def test_every_started_run_within_three_percent(checks):
    for c in checks:
        if c.usable and c.started:
            assert c.token_error is not None and abs(c.token_error) <= 0.03, (c.model, c.flags, c.token_error)


def test_failed_runs_and_their_verdicts(checks):
    by_flags = {(c.model, c.flags): c for c in checks}
    oom = by_flags[("openai/gpt-oss-20b", "--gpu h100-80gb --gpu-memory-utilization 0.95 --max-model-len 8192")]
    assert not oom.started and oom.verdict == "tight"
    started = by_flags[("openai/gpt-oss-20b", "--gpu h100-80gb --gpu-memory-utilization 0.9 --tensor-parallel-size 2 "
                                              "--max-model-len 8192")]
    assert started.started and started.verdict == "fits"
    tp5 = by_flags[("Qwen/Qwen3-14B", "--gpu h100-80gb --gpu-memory-utilization 0.95 --tensor-parallel-size 5 "
                                      "--max-model-len 8192")]
    assert tp5.verdict == "does not fit" and "tensor-parallel size 5" in tp5.error


def test_each_term_of_llama_matches_vllm(checks):
    c = next(c for c in checks if c.model == "meta-llama/Llama-3.1-8B-Instruct" and c.usable and c.started
             and c.flags.endswith("--gpu-memory-utilization 0.95 --max-model-len 8192"))
    for term, tolerance in (("weights", 0.05), ("activation", 0.05), ("non_torch", 0.02), ("kv_memory", 0.05)):
        assert c.predicted[term] == pytest.approx(c.measured[term], abs=tolerance), term
    assert abs(c.token_error) < 0.001


def test_environment_failures_are_left_out_with_their_reason(checks):
    left = [c for c in checks if not c.usable]
    assert left and all(c.reason for c in left)
    assert {c.reason for c in left if not c.started} <= set(ENVIRONMENT_FAILURES) | {
        "no verbatim config.json shipped for this model", "data parallelism is not planned"}
