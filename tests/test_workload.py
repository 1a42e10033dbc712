"""Workload sizing: the trace readers on the four shared traces and generic files, the replay,
prefix savings and the recommended limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.errors import KVLedgerError
from kvledger.planner import trace_sizing as wl
from kvledger.workload.traces import read_trace
from tests.cli_helpers import assert_one_line_error, kvledger

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
ALL = ("azure2023_code.csv", "azure2023_conv.csv", "mooncake_conversation.jsonl", "mooncake_synthetic.jsonl")
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="shared traces not beside the clone")


# ------------------------------------------------------------------------------ shared traces
@needs_traces
@pytest.mark.parametrize("name, rows, fmt", [
    ("azure2023_code.csv", 8819, "azure"), ("azure2023_conv.csv", 19366, "azure"),
    ("mooncake_conversation.jsonl", 12031, "mooncake"), ("mooncake_synthetic.jsonl", 3993, "mooncake")])
def test_reads_every_shared_trace(name, rows, fmt):
    trace = read_trace(TRACES / name)
    assert (len(trace), trace.format) == (rows, fmt)
    assert trace.arrival_s is not None and trace.arrival_s[0] == 0 and np.all(np.diff(trace.arrival_s) >= 0)
    assert (trace.hash_ids is not None) == (fmt == "mooncake")


@needs_traces
def test_percentiles_match_the_published_summaries():
    """The traces' README: code context p50 1,469, p99 7,436; conv p99 4,142, max 14,050;
    Mooncake conversation input mean 12,035, p99 85,401; the Azure files span about an hour."""
    code = read_trace(TRACES / "azure2023_code.csv")
    assert wl.percentiles(code.prompt)["p50"] == 1469 and wl.percentiles(code.prompt)["p99"] == 7436
    assert round(wl.percentiles(code.prompt)["mean"]) == 2048
    conv = read_trace(TRACES / "azure2023_conv.csv")
    stats = wl.percentiles(conv.prompt)
    assert stats["p99"] == 4142 and stats["max"] == 14050
    assert 55 * 60 < conv.duration_s < 65 * 60
    moon = read_trace(TRACES / "mooncake_conversation.jsonl")
    assert round(wl.percentiles(moon.prompt)["mean"]) == 12035
    assert abs(wl.percentiles(moon.prompt)["p99"] - 85401) <= 1
    assert 55 * 60 < moon.duration_s < 61 * 60


@needs_traces
def test_mooncake_prefix_reuse_from_hash_ids():
    trace = read_trace(TRACES / "mooncake_conversation.jsonl")
    saved = wl.prefix_savings(trace)
    assert saved["source"].startswith("hash_ids")
    assert 0.2 < saved["saved_share"] < 0.6  # multi-turn chat reuses its history
    assert 0 < saved["saved_tokens"] <= saved["prompt_tokens"]


@needs_traces
@pytest.mark.parametrize("name", ALL)
def test_plan_sizes_every_shared_trace(name):
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--workload", str(TRACES / name), "--json")
    assert r.returncode == 0, r.stderr
    w = r.json()["workload"]
    assert w["requests"] > 3000
    assert {"p50", "p90", "p99"} <= set(w["prompt_tokens"])
    live = w["replay"]["live_tokens"]
    assert 0 <= live["p50"] <= live["p90"] <= live["p99"] <= live["max"]
    rec = w["recommend"]
    assert rec["max_model_len"] % 16 == 0 and 0 <= rec["rejected_share"] < 0.05 and rec["max_num_seqs"] >= 1
    assert sum(h["total"] for h in w["histogram"]) == w["requests"]


@needs_traces
def test_plan_prints_workload_tables():
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(TRACES / "azure2023_conv.csv"),
                 "--shared-prefix-tokens", "256")
    assert r.returncode == 0, r.stderr
    for needle in ("p50", "p90", "p99", "live tokens", "recommend --max-model-len", "--max-num-seqs",
                   "prefix caching (--shared-prefix-tokens 256)"):
        assert needle in r.stdout


# ------------------------------------------------------------------------------ generic files
def test_generic_csv_and_jsonl(tmp_path):
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("prompt_tokens,output_tokens,timestamp\n100,10,2.0\n200,20,0.5\n")
    trace = read_trace(csv_file)
    assert trace.prompt.tolist() == [200, 100] and trace.arrival_s.tolist() == [0.0, 1.5]  # sorted by arrival
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"prompt_tokens": 5, "output_tokens": 1}\n\n{"prompt_tokens": 7, "output_tokens": 0}\n')
    trace = read_trace(jsonl)
    assert trace.prompt.tolist() == [5, 7] and trace.arrival_s is None
    assert wl.replay(trace, lambda live: 0.01, 1e-4) is None


@pytest.mark.parametrize("text, where", [
    ("prompt_tokens,output_tokens\n10,2\nten,2\n", ":3:"),
    ("prompt_tokens,output_tokens\n10,2\n10\n", ":3:"),
    ("prompt_tokens,output_tokens\n0,2\n", ":2:"),
    ("a,b\n1,2\n", ":1:"),
])
def test_malformed_csv_names_the_line(tmp_path, text, where):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(KVLedgerError, match=where):
        read_trace(f)


def test_generic_aliases_mooncake_without_hashes_and_empty_files(tmp_path):
    """One reader for every client: vLLM-style ``input_len``/``output_len`` columns, Mooncake rows
    without ``hash_ids`` (lengths and millisecond times only), and an empty file named as such."""
    f = tmp_path / "g.jsonl"
    f.write_text('{"input_len": 12, "output_len": 3}\n{"input_len": 7, "output_len": 1}\n')
    trace = read_trace(f)
    assert (trace.format, trace.prompt.tolist(), trace.output.tolist()) == ("jsonl", [12, 7], [3, 1])
    f = tmp_path / "m.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n'
                 '{"timestamp": 1500, "input_length": 20, "output_length": 4}\n')
    trace = read_trace(f)
    assert trace.format == "mooncake" and trace.hash_ids is None and trace.arrival_s.tolist() == [0.0, 1.5]
    for name in ("empty.jsonl", "empty.csv"):
        (tmp_path / name).write_text("\n")
        with pytest.raises(KVLedgerError, match="is empty"):
            read_trace(tmp_path / name)


def test_malformed_jsonl_through_the_cli_is_one_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"input_length": 10, "output_length": 2, "timestamp": 0, "hash_ids": [0]}\n{"input_length": 10,\n')
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--workload", str(f))
    assert_one_line_error(r, "bad.jsonl:2")
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--workload", str(tmp_path / "missing.csv"))
    assert_one_line_error(r, "no such trace file")


# ------------------------------------------------------------------------------ replay, prefixes, limits
def _trace(prompt, output, arrival):
    return wl.Trace("t", "csv", np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64),
                    np.asarray(arrival, dtype=float))


def test_one_request_holds_its_prompt_then_grows_one_token_per_step():
    trace = _trace([100], [10], [0.0])
    times, live, seqs = wl._sample(trace, step=1.0, prefill_s_per_token=0.0, samples=11)
    assert times.tolist() == [float(t) for t in range(11)]
    assert live.tolist() == [100 + t for t in range(10)] + [0]
    assert seqs.tolist() == [1] * 10 + [0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 500), st.floats(0, 100)), min_size=1, max_size=40),
       st.floats(0.001, 0.1), st.floats(0, 1e-3))
def test_sampled_live_tokens_match_a_direct_sum(requests, step, prefill):
    prompt, output, arrival = zip(*requests)
    order = np.argsort(arrival, kind="stable")
    trace = _trace(np.asarray(prompt)[order], np.asarray(output)[order], np.asarray(arrival)[order])
    times, live, seqs = wl._sample(trace, step, prefill, samples=257)
    a = trace.arrival_s
    d = a + trace.prompt * prefill
    e = d + trace.output * step
    for i in range(0, 257, 16):
        t = times[i]
        on = (a <= t) & (t < e)
        grown = np.clip((t - d) / step, 0, None)
        assert seqs[i] == on.sum()
        assert abs(live[i] - (trace.prompt[on] + grown[on]).sum()) <= 1 + 1e-6 * live[i]


def test_replay_solves_the_step_time_for_its_own_load():
    trace = _trace([1000] * 50, [100] * 50, np.linspace(0, 10, 50))
    rep = wl.replay(trace, lambda live: 0.01 + live * 1e-6, 1e-4)
    assert rep.step_time_s == pytest.approx(0.01 + rep.live_tokens.mean() * 1e-6, rel=0.02)


def test_prefix_savings_from_hash_ids_count_leading_seen_blocks():
    trace = _trace([1500, 1200, 600, 900], [1, 1, 1, 1], [0, 1, 2, 3])
    trace.hash_ids = [[0, 1, 2], [0, 1, 3], [0, 4], [5, 1]]
    saved = wl.prefix_savings(trace)
    assert saved["saved_tokens"] == 1024 + 512 and saved["prompt_tokens"] == 4200
    shared = wl.prefix_savings(trace, shared_prefix_tokens=1000)
    assert shared["saved_tokens"] == 1000 + 600 + 900


def test_recommendation_rounds_up_to_a_block_and_counts_rejections():
    prompt = np.arange(1, 1001) * 10
    trace = _trace(prompt, np.full(1000, 5), np.arange(1000.0))
    rec = wl.recommend(trace, 16, pool_tokens=100_000, live_per_sequence=5000.0)
    p99 = np.percentile(prompt, 99) + 5
    assert rec["max_model_len"] == int(np.ceil(p99 / 16) * 16)
    assert rec["rejected_share"] == pytest.approx((prompt + 5 > rec["max_model_len"]).mean())
    assert rec["max_num_seqs"] == 20
    assert wl.recommend(trace, 16, 100_000, None, model_max_len=4096)["max_model_len"] == 4096


def test_replay_reads_a_sliding_window_models_window_only(tmp_path):
    """Mistral-7B-v0.1 slides every layer over 4,096 tokens: with 30,000-token prompts (and 10
    output tokens, so 30,005 live on average) a live token reads 131,072 x 4,096 / 30,005 bytes,
    not 131,072, in the replayed step time."""
    f = tmp_path / "long.csv"
    f.write_text("prompt_tokens,output_tokens,timestamp\n" + "".join(f"30000,10,{i * 0.5}\n" for i in range(40)))
    r = kvledger("plan", "mistral-7b", "--gpu", "a100-80gb", "--workload", str(f), "--json")
    assert r.returncode == 0, r.stderr
    out = r.json()
    rep = out["workload"]["replay"]
    token_bytes = 131_072 * 4096 / 30_005
    expected = (out["weights_bytes"] + rep["live_tokens"]["mean"] * token_bytes) / out["bandwidth_bytes_per_s"]
    assert rep["step_time_s"] == pytest.approx(expected, rel=2e-3)
