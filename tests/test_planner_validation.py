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
    assert s.usable >= 41 and s.started >= 37 and s.failed >= 4
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


def test_phi_2_and_llama_4_scout_from_their_own_configs(checks):
    """phi-2: two biased MLP matrices (not three), 2.78 B parameters in float16 = 5.18 GiB (vLLM
    5.19); its 8,192-token run is refused above the 2,048 context. Llama-4-Scout at TP 4: the
    shared expert (48 x 3 x 5120 x 8192) and vLLM's rotary table of 10,485,760 positions x 128 x
    2 B = 2.5 GiB on every rank bring the weights to vLLM's 53.12 GiB."""
    by = {(c.model, c.flags.split("--max-model-len ")[-1]): c for c in checks if c.usable}
    phi = by[("microsoft/phi-2", "2048")]
    assert phi.predicted["weights"] == pytest.approx(phi.measured["weights"], abs=0.02)
    assert abs(phi.token_error) < 0.001
    refused = by[("microsoft/phi-2", "8192")]
    assert not refused.started and refused.verdict == "does not fit"
    scout = by[("meta-llama/Llama-4-Scout-17B-16E-Instruct", "8192")]
    assert scout.started and scout.predicted["weights"] == pytest.approx(scout.measured["weights"], abs=0.1)
    assert abs(scout.token_error) < 0.01


def test_every_number_a_log_prints_is_compared_and_weights_hold_within_one_percent(checks):
    """Issue 36: the error of each term on every row, not only the token count. Every usable row
    that printed "Model loading took" is within 1% (gpt-oss included, since mxfp4 experts are
    sized as vLLM's Triton kernel holds them on an H100); on started runs the pool and the token
    count within 3% and vLLM's "Maximum concurrency" line within 3% (sliding models counted at
    vLLM's chunked-prefill worst case). Activation, non-torch and CUDA-graph memory are reported,
    with no bar (BENCHMARKS.md shows them)."""
    from kvledger.planner.validation import ERROR_COLUMNS, WEIGHTS_WITHIN, error_table, worst_errors

    table = error_table(checks)
    weighed = [r for r in table if "weights" in r]
    assert len(weighed) >= 43 and {"openai/gpt-oss-20b", "deepseek-ai/DeepSeek-V2-Lite-Chat"} <= {r["model"] for r in weighed}
    for r in weighed:
        assert abs(r["weights"]) <= WEIGHTS_WITHIN, (r["model"], r["flags"], r["weights"])
    started = [r for r in table if r["started"]]
    assert all(set(ERROR_COLUMNS) <= set(r) for r in started)  # every column on every started run
    worst = worst_errors(checks)
    assert worst["kv_memory"] <= 0.03 and worst["kv_tokens"] <= 0.03 and worst["max_concurrency"] <= 0.03


def test_no_term_gets_worse_on_any_row(checks):
    """Each column's error on every planned row (failed runs included) within its bar."""
    from kvledger.planner.validation import ERROR_BARS, error_table

    for row in error_table(checks):
        for column, bar in ERROR_BARS.items():
            if column in row:
                assert abs(row[column]) <= bar, (row["model"], row["flags"], column, row[column])


def test_gpt_oss_weights_to_the_byte_against_the_v0_19_logs(checks):
    """13.64 GiB at TP 1 (the run vLLM could not finish starting) and 7.01 GiB at TP 2: the
    checkpoint's count gave 12.82 and 6.42 (-6%, -8%)."""
    rows = [c for c in checks if c.model == "openai/gpt-oss-20b" and c.usable]
    assert len(rows) == 3
    for c in rows:
        assert abs(c.errors["weights"]) < 0.005, (c.flags, c.errors)


def test_the_rows_the_last_round_could_not_cover(checks):
    """DeepSeek-V2-Lite-Chat (MLA: 576 latent elements a token a layer), Mistral-Small-3.1-24B (a
    vision tower beside its 40 layers), Qwen1.5-MoE-A2.7B (60 experts and a shared one) and
    granite-3.3-8b-instruct, now bundled, plan within 1% on tokens and weights."""
    new = {"deepseek-ai/DeepSeek-V2-Lite-Chat", "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
           "Qwen/Qwen1.5-MoE-A2.7B", "ibm-granite/granite-3.3-8b-instruct"}
    rows = [c for c in checks if c.model in new]
    assert {c.model for c in rows if c.usable and c.started} == new
    for c in rows:
        assert c.verdict == "fits" and abs(c.token_error) < 0.01 and abs(c.errors["weights"]) < 0.01, c.model
        assert abs(c.errors["max_concurrency"]) < 0.01, c.model


PUBLIC = Path(__file__).parent / "data" / "vllm_public_startup_logs.json"


def test_public_start_up_logs_each_with_its_address():
    """Public logs beyond the v0.19 sweep. The A100 run of vLLM 0.19.0 (Marlin mxfp4 layout on SM
    8.0): weights within 1% and the KV pool within 3%; every failed run, of any version, not
    predicted to fit."""
    rows = load_rows(PUBLIC)
    assert rows and all(r["source"].startswith("https://") and r["vllm_version"] for r in rows)
    for row in rows:
        c = check_row(row)
        assert c.usable, (row["source"], c.reason)
        assert c.verdict_ok, (row["source"], c.verdict, c.error)
        if row["vllm_version"].startswith("0.19"):
            assert abs(c.errors["weights"]) <= 0.01, (row["source"], c.errors)
            assert abs(c.errors["kv_memory"]) <= 0.03, (row["source"], c.errors)
    a100 = check_row(next(r for r in rows if r["gpu"] == "a100-80gb"))
    assert a100.predicted["weights"] == pytest.approx(13.72, abs=0.03)  # Marlin pads H to 3,072, I to 2,944
