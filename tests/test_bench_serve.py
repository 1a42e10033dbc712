"""``kvledger bench serve``: the requests it draws from a trace, arrivals, vLLM's metric definitions,
and a real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvledger.cli.main import main
from kvledger.errors import KVLedgerError
from kvledger.loadgen.serve import make_prompts
from kvledger.metrics.serving import RequestResult, calculate_metrics
from kvledger.workload.sampling import SampledRequest, arrival_times, select
from kvledger.workload.traces import read_trace

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.4900000,80,8
2023-11-16 18:15:52.0000000,120,12
"""
MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1200, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [4, 5]},
]


@pytest.fixture
def azure_csv(tmp_path):
    path = tmp_path / "azure_conv.csv"
    path.write_text(AZURE)
    return path


def test_azure_trace_is_read_with_times(azure_csv):
    trace = read_trace(azure_csv)
    assert trace.format == "azure"
    rows = select(trace, None, seed=0, sample="head", length_scale=1.0)
    assert [(r.input_len, r.output_len) for r in rows] == [(374, 44), (396, 109), (80, 8), (120, 12)]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(4.314579, abs=1e-6)


def test_mooncake_trace_keeps_hash_ids_and_ms_times(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MOONCAKE) + "\n")
    trace = read_trace(path)
    assert trace.format == "mooncake"
    rows = select(trace, None, seed=0, sample="head", length_scale=1.0)
    assert rows[1].hash_ids == [0, 1, 3] and rows[1].arrival_s == pytest.approx(0.25)
    chosen = select(trace, 3, seed=0, sample="head", length_scale=0.25)
    assert [(r.input_len, r.output_len) for r in chosen] == [(275, 10), (300, 5), (150, 3)]
    prompts = make_prompts(chosen, seed=0, vocab_size=1000, token_id_low=10, length_scale=0.25)
    assert [len(p) for p in prompts] == [275, 300, 150]
    # equal hash ids -> equal token blocks (128 tokens each at scale 0.25): the first two share 256 tokens
    assert prompts[0][:256] == prompts[1][:256] and prompts[0][256:275] != prompts[1][256:275]
    assert prompts[2][:128] != prompts[0][:128]
    assert all(10 <= t < 1000 for p in prompts for t in p)


def test_generic_csv_and_bad_files(tmp_path):
    path = tmp_path / "g.csv"
    path.write_text("input_len,output_len\n10,5\n7,3\n")
    trace = read_trace(path)
    rows = select(trace, None, seed=0, sample="head", length_scale=1.0)
    assert trace.format == "csv" and [(r.input_len, r.output_len, r.arrival_s) for r in rows] == [(10, 5, None), (7, 3, None)]
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(KVLedgerError, match="unknown CSV header"):
        read_trace(bad)
    with pytest.raises(KVLedgerError, match="no such trace file"):
        read_trace(tmp_path / "missing.csv")


def test_select_is_seeded_and_respects_max_model_len(azure_csv):
    rows = read_trace(azure_csv)
    a = select(rows, 2, seed=1, sample="random", length_scale=1.0)
    b = select(rows, 2, seed=1, sample="random", length_scale=1.0)
    assert a == b and len(a) == 2
    clipped = select(rows, 4, seed=0, sample="head", length_scale=1.0, max_model_len=200)
    assert all(r.input_len + r.output_len <= 200 for r in clipped)
    assert [r.output_len for r in clipped] == [44, 109, 8, 12]  # outputs kept, prompts cut


def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    t1 = arrival_times(2000, 4.0, seed=7)
    assert t1 == arrival_times(2000, 4.0, seed=7) and t1 != arrival_times(2000, 4.0, seed=8)
    assert t1[-1] == pytest.approx(2000 / 4.0)  # vLLM rescales to n / rate
    gaps = np.diff([0.0] + t1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)  # exponential: cv = 1
    bursty = np.diff([0.0] + arrival_times(2000, 4.0, seed=7, burstiness=0.25))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.25)  # gamma(k): cv = 1/sqrt(k)
    assert arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    rows = [SampledRequest(1, 1, 10.0), SampledRequest(1, 1, 12.0), SampledRequest(1, 1, 16.0)]
    assert arrival_times(3, "trace", seed=0, trace=rows, time_scale=2.0) == [0.0, 1.0, 3.0]


def test_metrics_follow_vllm_definitions():
    ok1 = RequestResult(prompt_len=10, expected_output_len=4, success=True, ttft=0.1, latency=0.4,
                        itl=[0.1, 0.1, 0.1], output_tokens=4)
    ok2 = RequestResult(prompt_len=20, expected_output_len=3, success=True, ttft=0.3, latency=0.7,
                        itl=[0.2, 0.2], output_tokens=3)
    one = RequestResult(prompt_len=5, expected_output_len=1, success=True, ttft=0.2, latency=0.2, output_tokens=1)
    failed = RequestResult(prompt_len=50, expected_output_len=9, error="HTTP 503")
    m = calculate_metrics([ok1, ok2, one, failed], duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(21.5)
    assert m.stats_ms["ttft"]["mean"] == pytest.approx(200.0)
    # TPOT: (E2EL - TTFT) / (tokens - 1), only requests with more than one token
    assert m.stats_ms["tpot"]["mean"] == pytest.approx(np.mean([100.0, 200.0]))
    # ITL: all gaps of all requests pooled
    assert m.stats_ms["itl"]["mean"] == pytest.approx(np.mean([100, 100, 100, 200, 200]))
    assert m.stats_ms["itl"]["p50"] == pytest.approx(100.0)
    assert m.stats_ms["e2el"]["median"] == pytest.approx(400.0)
    assert m.stats_ms["e2el"]["p99"] == pytest.approx(np.percentile([400, 700, 200], 99))
    assert m.errors == ["HTTP 503"]


@pytest.mark.slow
def test_bench_serve_against_our_server(azure_csv, tmp_path, capsys):
    from tests.server_harness import scrape, shared_server

    server = shared_server()
    report = tmp_path / "BENCH.md"
    argv = ["bench", "serve", "--base-url", server.url, "--trace", str(azure_csv), "--num-prompts", "4",
            "--sample", "head", "--length-scale", "0.1", "--request-rate", "8", "--seed", "3", "--ignore-eos",
            "--markdown", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected_tokens = sum(math.ceil(n * 0.1) for n in (44, 109, 8, 12))  # ignore_eos: every token is generated
    assert "Successful requests" in out and "TTFT" in out and "ITL" in out and "E2EL" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("Total generated tokens"))
    assert int(line.split()[-1]) == expected_tokens
    assert next(ln for ln in out.splitlines() if ln.startswith("Failed requests")).split()[-1] == "0"
    text = report.read_text()
    assert "`kvledger bench serve" in text and "| TTFT" in text

    before = scrape(server.url)["kvledger:prefix_cache_hits_total"]
    assert main(argv[:-2] + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metrics"]["completed"] == 4 and data["metrics"]["total_output"] == expected_tokens
    assert data["metrics"]["stats_ms"]["tpot"]["mean"] > 0
    repeated = scrape(server.url)["kvledger:prefix_cache_hits_total"]
    assert repeated - before >= 32  # the same prompts again: the 38- and 40-token ones hit a full block or more

    # the same requests with fresh token ids: nothing of the earlier runs is found in the prefix cache
    assert main(argv[:-2] + ["--json", "--id-seed", "4"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert fresh["metrics"]["total_output"] == expected_tokens and fresh["info"]["id_seed"] == 4
    assert scrape(server.url)["kvledger:prefix_cache_hits_total"] == repeated


@pytest.mark.slow
def test_bench_serve_writes_only_where_told_and_shows_progress(azure_csv, tmp_path, monkeypatch, capsys):
    """Without --markdown nothing is written: not where it runs, not in the repository (whose
    BENCHMARKS.md a README example once appended to). ``--markdown results.md``, as the README has
    it, writes that file where the user runs it. While the requests run, a bar on stderr; stdout is
    the report alone."""
    from tests.server_harness import shared_server

    server = shared_server()
    benchmarks = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
    before = benchmarks.read_bytes()
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    # two requests at 1 req/s: the last goes out at 2 s, past the bar's delay
    argv = ["bench", "serve", "--base-url", server.url, "--trace", str(azure_csv), "--num-prompts", "2",
            "--sample", "head", "--length-scale", "0.1", "--request-rate", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Successful requests" in captured.out and "bench serve:" not in captured.out
    assert "bench serve:" in captured.err and "2/2" in captured.err, captured.err
    assert list(here.iterdir()) == [] and benchmarks.read_bytes() == before

    assert main(argv + ["--markdown", "results.md"]) == 0
    assert [p.name for p in here.iterdir()] == ["results.md"] and benchmarks.read_bytes() == before
    assert "| TTFT" in (here / "results.md").read_text()


@pytest.mark.slow
def test_bench_serve_text_prompts_with_a_tokenizer(azure_csv, capsys):
    """For servers that take only text: random ids decoded with the model's tokenizer."""
    from kvledger.loader.resolve import converted_dir, resolve_model
    from tests.server_harness import shared_server

    server = shared_server()
    tokenizer = str(converted_dir(resolve_model("smollm2-135m")))
    argv = ["bench", "serve", "--base-url", server.url, "--trace", str(azure_csv), "--num-prompts", "2",
            "--sample", "head", "--length-scale", "0.1", "--prompt-format", "text", "--tokenizer", tokenizer,
            "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["info"]["prompt_format"] == "text"
    assert data["metrics"]["completed"] == 2 and data["metrics"]["failed"] == 0
    assert 0 < data["metrics"]["total_output"] <= math.ceil(44 * 0.1) + math.ceil(109 * 0.1)
    # the server's usage counts the prompts it tokenized: about the 38 + 40 ids drawn
    assert abs(data["metrics"]["total_input"] - (38 + 40)) <= 20
