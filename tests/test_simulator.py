"""The simulator: the engine's own scheduler replayed step for step, pools equal to plan's, fleets,
SLOs, saturation, bad input, and no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

from kvledger.config import EngineConfig
from kvledger.sim.driver import RecordedStepTimes
from kvledger.sim.replay import on_recorded_clock, step_periods
from kvledger.sim.requests import make_request
from kvledger.sim.simulate import Fleet, simulate
from tests.cli_helpers import assert_one_line_error, kvledger

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
MOONCAKE = TRACES / "mooncake_conversation.jsonl"
AZURE_CONV = TRACES / "azure2023_conv.csv"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="shared traces not beside the clone")


def sim_json(*args: str) -> dict:
    r = kvledger("simulate", *args, "--json")
    assert r.returncode == 0, r.stderr
    return r.json()


# ---- the same scheduler, proven ----------------------------------------------------------------
def _record_and_replay(config: EngineConfig, prompts: list[list[int]], max_tokens: list[int],
                       arrive_at: dict[int, Sequence[int]]):
    """Run the real engine on ``prompts`` (request ``i`` added before step ``k`` for ``i`` in
    ``arrive_at[k]``, greedy, ``max_tokens[i]`` tokens), recording its steps; replay the same requests
    in the simulator on the run's recorded clock, :mod:`kvledger.sim.replay` (with the engine's KV offloading tier, if it has one,
    its copies already in those times). Checks, step by step and per request, that the replay is the run: the same
    batches and preemptions, first-token and finish steps, finish times, preemptions and prefix hits
    by source. Returns (engine, records, simulated requests, the replica, the run's end time)."""
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.engine.sampling_params import SamplingParams

    engine = LLMEngine(config)
    records = engine.step_records = []
    first_step: dict[str, int] = {}
    finish_step: dict[str, int] = {}
    real = {}
    step = 0
    while step <= max(arrive_at) or engine.has_unfinished_requests():
        for i in arrive_at.get(step, []):
            engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0,
                                                                   ignore_eos=True))
            real[f"r{i}"] = engine.requests[f"r{i}"]
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
            if out.finished:
                finish_step[out.request_id] = step
        step += 1
    assert len(records) == step  # the engine was never idle, so step k is record k

    periods = step_periods(records)
    start, now = {}, 0.0
    for k, w in enumerate(periods):  # the virtual time at which step k starts, summed as the driver sums it
        start[k] = now
        now = now + w
    # the workload as a trace would give it (no times, other ids); the recorded clock sets both
    workload = [make_request(i, len(prompts[i]), max_tokens[i], 0.0, prompt_token_ids=prompts[i])
                for i in range(len(prompts))]
    requests = on_recorded_clock(workload, records)
    assert [r.request_id for r in requests] == [f"r{i}" for k in sorted(arrive_at) for i in arrive_at[k]]
    for k, ids in arrive_at.items():  # taken after the step before ended, by the time step k started
        for i in ids:
            arrival = next(r for r in requests if r.request_id == f"r{i}").arrival_time
            assert (start[k - 1] + records[k - 1].wall_s if k else 0.0) <= arrival <= start[k]
    offload = None
    if engine.offload_capacity is not None:
        from kvledger.sim.offload import OffloadTier

        offload = OffloadTier(engine.offload_capacity, None, engine.kv_manager.offload.policy,
                              engine.kv_manager.store_rule)
    fleet = Fleet(config, engine.num_blocks, lambda: RecordedStepTimes(periods), replicas=1, router="round-robin",
                  offload=offload)
    res = simulate(requests, fleet, record_steps=True)
    replica = res.replicas[0]

    assert [(r.batch, r.preempted) for r in replica.records] == [(r.batch, r.preempted) for r in records]
    for sim in requests:
        rid = sim.request_id
        assert (sim.first_token_step, sim.finish_step) == (first_step[rid], finish_step[rid]), rid
        assert sim.num_preemptions == real[rid].num_preemptions, rid
        assert (sim.num_cached_tokens, sim.num_offloaded_tokens) == (real[rid].num_cached_tokens,
                                                                      real[rid].num_offloaded_tokens), rid
        assert sim.finish_time == pytest.approx(start.get(finish_step[rid] + 1, now)), rid
    assert replica.kv.stats == engine.kv_manager.stats  # queries and hits of both tiers
    return engine, records, requests, replica, now


@pytest.mark.slow
def test_replay_of_a_recorded_engine_run_is_identical(tmp_path):
    """The real SmolLM2 engine on a small pool (preemptions) with a shared prefix (prefix hits) and
    late arrivals; its recorded step times as the simulator's clock: the same steps, the same
    batches, and per request the same first-token step, finish step, preemptions and hits. The
    records survive a step log (what 'serve --step-log' writes), and 'calibrate --step-log' fits a
    profile from them that simulate takes for this model and refuses for another."""
    config = EngineConfig(model="smollm2-135m", dtype="float32", block_size=16, num_gpu_blocks_override=14,
                          max_num_batched_tokens=48, max_num_seqs=8, max_model_len=224)
    shared = list(range(1000, 1032))  # two full blocks every prompt starts with
    prompts = [shared + [2000 + 100 * i + j for j in range(5 + 5 * (i % 5))] for i in range(8)]
    max_tokens = [16 + 4 * (i % 4) for i in range(8)]
    arrive_at = {0: range(5), 2: [5], 6: [6], 11: [7]}  # step -> requests added before it
    engine, records, requests, replica, now = _record_and_replay(config, prompts, max_tokens, arrive_at)
    assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.stats.hits > 0
    assert replica.scheduler.num_preemptions == engine.scheduler.num_preemptions
    assert replica.blocks_allocated_peak == engine.blocks_allocated_peak

    from kvledger.engine.step_log import StepLog, read_step_log

    log = StepLog(tmp_path / "steps.jsonl", {"model": engine.spec.name, "hf_config": engine.hf_config,
                                             "device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto",
                                             "block_size": 16, "num_blocks": 14})
    for r in records:
        log.append(r)
    log.close()
    header, back = read_step_log(tmp_path / "steps.jsonl")
    assert back == records and header["num_blocks"] == 14
    r = kvledger("calibrate", "--step-log", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert "steps of a serving run" in r.stdout and "fit error: median" in r.stdout
    out = sim_json("smollm2-135m", "--profile", str(tmp_path / "p.json"), "--workload", str(AZURE_CONV),
                   "--num-prompts", "5", "--length-scale", "0.05", "--max-model-len", "224")
    assert out["num_blocks"] == 14 and out["completed"] == 5
    assert_one_line_error(kvledger("simulate", "llama-3.1-8b", "--profile", str(tmp_path / "p.json"), "--workload",
                                   str(AZURE_CONV)), "measured on", "not llama-3.1-8b")


@pytest.mark.slow
def test_replay_of_a_recorded_engine_run_with_a_kv_offloading_tier_is_identical():
    """The same with a second KV tier under a 14-block pool: three families of prompts take turns, so a
    family's prefix leaves the pool and comes back from tier 2. The simulator's tier (the engine's
    store and rule, its copies inside the recorded step times) gives every request the same hits by
    source, and the tiers end holding the same blocks."""
    config = EngineConfig(model="smollm2-135m", dtype="float32", block_size=16, num_gpu_blocks_override=14,
                          max_num_batched_tokens=48, max_num_seqs=4, max_model_len=224, kv_offloading_size=0.005)
    families = [list(range(1000 * f, 1000 * f + 80)) for f in (1, 3, 5)]  # five full blocks each: 15 > the pool
    prompts = [families[i % 3] + [2000 + 100 * i + j for j in range(3 + 4 * (i % 3))] for i in range(7)]
    max_tokens = [12 + 4 * (i % 3) for i in range(7)]
    arrive_at = {4 * i: [i] for i in range(7)}
    engine, _, requests, replica, _ = _record_and_replay(config, prompts, max_tokens, arrive_at)
    stats = engine.kv_manager.stats
    assert stats.offload_hits > 0 and stats.hits > 0
    assert sum(r.num_offloaded_tokens for r in requests) == stats.offload_hits
    tier, sim_tier = engine.kv_manager.offload, replica.kv.offload
    assert dict(tier._policy.items()) == dict(sim_tier._policy.items())  # the same hashes in the same slots


# ---- calibrate and profiles --------------------------------------------------------------------
@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A quick calibration of the real SmolLM2 engine on this machine."""
    path = tmp_path_factory.mktemp("profile") / "smollm2.json"
    r = kvledger("calibrate", "--quick", "--out", str(path), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "fit error: median" in r.stdout and "error %" in r.stdout
    return path


@needs_traces
@pytest.mark.slow
def test_profile_round_trips_and_drives_simulate(profile_path):
    from kvledger.sim.step_model import CPU_TERMS, Profile

    profile = Profile.load(profile_path)
    assert profile.model == "smollm2-135m" and profile.device.startswith("cpu")
    assert len(profile.fit) == 8 and all(row["steps"] >= 1 for row in profile.fit)
    assert profile.coefficients["cpu_step"] + profile.coefficients["cpu_samples"] > 0  # CPU overhead: its own terms
    again = Profile.load(profile.save(profile_path.with_name("again.json")))
    assert again == profile
    assert set(CPU_TERMS) <= set(again.coefficients)
    out = sim_json("smollm2-135m", "--profile", str(profile_path), "--workload", str(AZURE_CONV),
                   "--num-prompts", "20", "--length-scale", "0.1", "--request-rate", "2")
    assert out["step_model"] == f"profile:{profile_path.name}" and out["num_blocks"] == profile.num_blocks
    assert out["completed"] == 20


def test_busy_pauses_count_only_the_gaps_where_the_engine_stayed_busy():
    """A step's period is its wall time plus the pause before the next step, when the next step
    carries on one of its requests within a second; an idle wait, a fresh batch or a clock that
    ran backwards counts 0."""
    from kvledger.engine.outputs import StepRecord
    from kvledger.sim.calibrate import busy_pauses

    steps = [StepRecord(0, [("a", 0, 8)], 1, start_s=10.0, wall_s=0.5),   # a continues 0.1 s later
             StepRecord(1, [("a", 8, 1)], 1, start_s=10.6, wall_s=0.1),   # then a 5 s idle wait
             StepRecord(2, [("a", 9, 1)], 1, start_s=15.7, wall_s=0.1),   # next: only b, a finished
             StepRecord(3, [("b", 0, 4)], 1, start_s=15.85, wall_s=0.2),  # next starts before this ends
             StepRecord(4, [("b", 4, 1)], 1, start_s=16.0, wall_s=0.1)]   # the last step: no next
    assert busy_pauses(steps) == pytest.approx([0.1, 0.0, 0.0, 0.0, 0.0])


def test_the_recorded_clock_runs_start_to_start_and_takes_requests_when_the_engine_did():
    """Periods from one step's start to the next (an idle wait belongs to the step before it), the
    last step its wall time; arrivals in virtual seconds from the first step's start (what came
    before it, at 0), matched to the workload by shape, in the engine's order, with its ids."""
    from kvledger.engine.outputs import Arrival, StepRecord
    from kvledger.errors import KVLedgerError

    steps = [StepRecord(0, [("x", 0, 8), ("y", 0, 4)], 2, start_s=10.0, wall_s=0.1,
                        arrivals=[Arrival("y", 4, 2, 9.95), Arrival("x", 8, 3, 9.9)]),
             StepRecord(1, [("x", 8, 1), ("y", 4, 1), ("z", 0, 8)], 3, start_s=10.1, wall_s=0.1,
                        arrivals=[Arrival("z", 8, 1, 10.06)]),
             StepRecord(2, [("x", 9, 1)], 1, start_s=10.2, wall_s=0.05),
             StepRecord(3, [("w", 0, 4)], 1, start_s=12.0, wall_s=0.2,  # after 1.75 s idle
                        arrivals=[Arrival("w", 4, 1, 11.9)])]
    assert step_periods(steps) == pytest.approx([0.1, 0.1, 1.8, 0.2])
    # the workload in its own order and ids: two of the same shape (8 tokens), told apart by max_tokens
    workload = [make_request(0, 8, 1, 0.0), make_request(1, 8, 3, 0.0), make_request(2, 4, 2, 0.0),
                make_request(3, 4, 1, 0.0)]
    taken = on_recorded_clock(workload, steps)
    assert [(r.request_id, r.uid) for r in taken] == [("x", 1), ("y", 2), ("z", 0), ("w", 3)]
    assert [r.arrival_time for r in taken] == pytest.approx([0.0, 0.0, 0.06, 1.9])

    with pytest.raises(KVLedgerError, match="took 4 requests and the workload has 3"):
        on_recorded_clock(workload[:3], steps)
    with pytest.raises(KVLedgerError, match=r"request w \(4 prompt tokens, max_tokens 1\) is not in the workload"):
        on_recorded_clock([*workload[:3], make_request(3, 5, 1, 0.0)], steps)
    with pytest.raises(KVLedgerError, match="records no arrivals"):
        on_recorded_clock(workload, [StepRecord(0, [("x", 0, 8)], 1, start_s=0.0, wall_s=0.1)])


@pytest.mark.slow
def test_replay_takes_requests_that_came_while_the_engine_was_idle_or_mid_run_as_it_did():
    """The real engine taking requests in three waves (before the first step, between two steps of a
    running batch, and after an idle wait of 50 ms with nothing to do): replayed on the recorded
    clock, every step's batch and preemptions are the run's."""
    import time

    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.engine.sampling_params import SamplingParams

    config = EngineConfig(model="smollm2-135m", dtype="float32", block_size=16, num_gpu_blocks_override=8,
                          max_num_batched_tokens=48, max_num_seqs=4, max_model_len=128)
    prompts = [[3000 + 100 * i + j for j in range(9 + 7 * i)] for i in range(6)]
    max_tokens = [10 + 3 * i for i in range(6)]
    engine = LLMEngine(config)
    records = engine.step_records = []

    def add(i: int) -> None:
        engine.add_request(f"q{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0,
                                                                 ignore_eos=True))

    for i in (0, 1, 2):
        add(i)
    for _ in range(3):
        engine.step()
    add(3)
    while engine.has_unfinished_requests():
        engine.step()
    time.sleep(0.05)
    assert engine.step() == []  # idle: nothing scheduled, nothing recorded
    add(4)
    add(5)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0  # eight blocks: the third wave does not fit whole

    workload = [make_request(i, len(p), max_tokens[i], 0.0, prompt_token_ids=p) for i, p in enumerate(prompts)]
    requests = on_recorded_clock(workload, records)
    periods = step_periods(records)
    fleet = Fleet(config, engine.num_blocks, lambda: RecordedStepTimes(periods), replicas=1, router="round-robin")
    replica = simulate(requests, fleet, record_steps=True).replicas[0]
    assert [(r.batch, r.preempted) for r in replica.records] == [(r.batch, r.preempted) for r in records]
    assert replica.scheduler.num_preemptions == engine.scheduler.num_preemptions
    assert replica.blocks_allocated_peak == engine.blocks_allocated_peak
    engine.shutdown()


def test_a_step_log_keeps_when_the_server_received_each_request(tmp_path):
    """An arrival's ``received_s`` survives the file; a log written before it existed (four
    fields an arrival) still reads, its receipt unknown."""
    import json

    from kvledger.engine.outputs import Arrival, StepRecord
    from kvledger.engine.step_log import StepLog, read_step_log

    log = StepLog(tmp_path / "steps.jsonl", {"model": "m"})
    log.append(StepRecord(0, [("a", 0, 8)], 1, start_s=5.0, wall_s=0.1,
                          arrivals=[Arrival("a", 8, 3, 4.99, received_s=4.97)]))
    log.close()
    old = StepRecord(1, [("a", 8, 1), ("b", 0, 4)], 2, start_s=5.1, wall_s=0.1)
    line = {**json.loads(json.dumps(old.__dict__)), "arrivals": [["b", 4, 2, 5.05]]}
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    _, records = read_step_log(tmp_path / "steps.jsonl")
    assert records[0].arrivals == [Arrival("a", 8, 3, 4.99, 4.97)]
    assert records[1].arrivals == [Arrival("b", 4, 2, 5.05, None)]


@needs_traces
def test_ingress_adds_to_every_ttft_and_e2el_and_changes_nothing_else():
    """A constant delay between the client and the server moves the run, not what happens in it:
    TTFT and E2EL gain exactly the ingress, every statistic of them; TPOT, ITL, the steps and the
    throughput stay as they were."""
    run = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "200",
           "--request-rate", "40")
    base, late = sim_json(*run), sim_json(*run, "--ingress-ms", "37.5")
    assert (base["ingress_ms"], late["ingress_ms"]) == (0.0, 37.5)
    for metric in ("ttft_ms", "e2el_ms"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            assert late[metric][stat] == pytest.approx(base[metric][stat] + 37.5), (metric, stat)
        assert late[metric]["std"] == pytest.approx(base[metric]["std"])
    assert late["tpot_ms"] == pytest.approx(base["tpot_ms"], rel=1e-12)  # (E2EL - TTFT) / tokens: both moved
    for key in ("itl_ms", "num_steps", "num_preemptions", "peak_blocks_allocated", "duration_s",
                "request_throughput"):
        assert late[key] == base[key], key


def test_calibrate_refuses_what_is_not_a_step_log(tmp_path):
    garbage = tmp_path / "steps.jsonl"
    garbage.write_text('{"index": 0}\n')
    assert_one_line_error(kvledger("calibrate", "--step-log", str(garbage)), "not a step log", "--step-log")
    assert_one_line_error(kvledger("calibrate", "--step-log", str(tmp_path / "none.jsonl")), "no such step log")


@needs_traces
@pytest.mark.slow
def test_profile_for_another_model_is_refused(profile_path):
    r = kvledger("simulate", "llama-3.1-8b", "--profile", str(profile_path), "--workload", str(AZURE_CONV),
                 "--num-prompts", "5")
    assert_one_line_error(r, "measured on smollm2-135m", "not llama-3.1-8b")


# ---- the pool, the interface, no torch ----------------------------------------------------------
@pytest.mark.parametrize("flags", [
    (),
    ("--kv-cache-dtype", "fp8", "--block-size", "32", "--gpu-memory-utilization", "0.8"),
    ("--tensor-parallel-size", "2", "--max-num-batched-tokens", "2048", "--max-num-seqs", "64"),
])
@needs_traces
def test_pool_is_plans_and_json_has_the_interface_keys(flags):
    plan = kvledger("plan", "llama-3.1-8b", "--gpu", "h100-80gb", *flags, "--json").json()
    out = sim_json("llama-3.1-8b", "--gpu", "h100-80gb", *flags, "--workload", str(AZURE_CONV),
                   "--num-prompts", "30", "--request-rate", "3")
    assert out["num_blocks"] == plan["num_blocks"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(out[key]) >= {"mean", "p50", "p90", "p99"} and out[key]["p99"] >= out[key]["p50"] > 0
    for key in ("output_throughput", "request_throughput", "goodput", "num_preemptions", "prefix_cache_hit_rate",
                "peak_blocks_allocated", "saturated", "replicas"):
        assert key in out, key
    assert out["replicas"] == 1 and out["completed"] == 30 and 0 < out["peak_blocks_allocated"] <= out["num_blocks"]
    assert "slo_met" not in out and "replicas_needed" not in out


@needs_traces
def test_override_sets_the_pool_and_the_plot_is_drawn(tmp_path):
    png = tmp_path / "sim.png"
    out = sim_json("llama-3.1-8b", "--gpu", "h100-80gb", "--num-gpu-blocks-override", "700",
                   "--workload", str(AZURE_CONV), "--num-prompts", "40", "--request-rate", "20", "--plot", str(png))
    assert out["num_blocks"] == 700 and out["peak_blocks_allocated"] <= 700
    series = out["series"][0]
    assert max(series["blocks_allocated"]) <= 700 and max(series["token_blocks"]) <= max(series["blocks_allocated"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert_one_line_error(kvledger("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV),
                                   "--plot", str(tmp_path / "sim.pdf")), ".png")


@needs_traces
def test_same_requests_and_arrivals_as_bench_serve():
    """simulate draws with bench serve's sampler: the same lengths, the same Poisson arrivals."""
    from kvledger.cli.main import build_parser
    from kvledger.cli.simulate import setup
    from kvledger.sim.simulate import build_requests
    from kvledger.workload.sampling import sample_requests
    from kvledger.workload.traces import read_trace

    sampled, times = sample_requests(read_trace(AZURE_CONV), 50, seed=3, sample="random", length_scale=0.5,
                                     request_rate=4.0, burstiness=0.7, max_model_len=131072)
    out = sim_json("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "50",
                   "--seed", "3", "--length-scale", "0.5", "--request-rate", "4", "--burstiness", "0.7")
    assert out["total_input_tokens"] == sum(r.input_len for r in sampled)
    assert out["total_output_tokens"] == sum(r.output_len for r in sampled)
    reqs = build_requests(sampled, times, 0.5)
    assert sorted(r.arrival_time for r in reqs) == sorted(times) and len(set(times)) == 50
    assert setup(build_parser().parse_args(["simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload",
                                            "x"]))[1].router == out["router"]


def test_simulate_and_bench_serve_read_a_rate_alike():
    """A finite rate and 'trace' parse the same for both commands; 'inf' is bench serve's burst only
    (the simulator refuses it, see the bad-input table)."""
    from kvledger.cli.main import build_parser

    parser = build_parser()
    for rate in ("2.5", "trace"):
        sim = parser.parse_args(["simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", "x",
                                 "--request-rate", rate]).request_rate
        bench = parser.parse_args(["bench", "serve", "--trace", "x", "--request-rate", rate]).request_rate
        assert sim == bench, rate
    assert parser.parse_args(["bench", "serve", "--trace", "x", "--request-rate", "inf"]).request_rate == float("inf")


@needs_traces
def test_a_shared_prefix_is_cached_once():
    """Azure prompts carry no hashes: no hits. With a 48-token system prompt (3 blocks; the shortest
    of these prompts has 64 tokens), every request after the first finds those blocks."""
    common = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "60",
              "--request-rate", "2", "--max-model-len", "8192")
    assert sim_json(*common)["prefix_cache_hits"] == 0
    shared = sim_json(*common, "--shared-prefix-tokens", "48")
    assert shared["prefix_cache_hits"] == 59 * 48 and shared["num_preemptions"] == 0


@needs_traces
def test_simulate_never_imports_torch():
    code = ("import sys, io, contextlib\n"
            "from kvledger.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['simulate', 'llama-3.1-8b', '--gpu', 'h100-80gb', '--workload', {str(MOONCAKE)!r},\n"
            "               '--num-prompts', '40', '--replicas', '2', '--router', 'prefix-affinity',\n"
            "               '--kv-offloading-size', '0,4', '--json'])\n"
            "assert rc == 0, rc\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print('TORCH' if loaded else 'NO-TORCH', loaded[:3])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("NO-TORCH"), proc.stdout


# ---- fleets, SLOs, saturation --------------------------------------------------------------------
@needs_traces
def test_prefix_affinity_beats_round_robin_on_mooncake_at_4_replicas():
    common = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(MOONCAKE), "--num-prompts", "400",
              "--sample", "head", "--time-scale", "0.5", "--replicas", "4")
    rr = sim_json(*common, "--router", "round-robin")
    pa = sim_json(*common, "--router", "prefix-affinity")
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] > 0
    assert len(pa["per_replica"]) == 4 and all(r["requests"] > 0 for r in pa["per_replica"])


@needs_traces
def test_more_replicas_never_raise_ttft_p99():
    p99 = []
    for n in (1, 2, 3, 4, 8):
        out = sim_json("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "300",
                       "--request-rate", "25", "--replicas", str(n))
        p99.append(out["ttft_ms"]["p99"])
    assert all(b <= a for a, b in zip(p99, p99[1:])), p99
    assert p99[-1] < p99[0] / 2, p99


@needs_traces
def test_find_replicas_returns_the_smallest_n():
    slo = "ttft_p99=1s,tpot_p99=60ms"
    common = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "300",
              "--request-rate", "25", "--slo", slo)
    found = sim_json(*common, "--find-replicas")
    n = found["replicas_needed"]
    assert n >= 2 and found["gpus_needed"] == n and found["slo_met"] is True
    assert found["below"]["replicas"] == n - 1 and found["below"]["slo_met"] is False
    assert sim_json(*common, "--replicas", str(n))["slo_met"] is True
    assert sim_json(*common, "--replicas", str(n - 1))["slo_met"] is False
    assert all(0 <= h < 1 for h in found["headroom"].values())


@needs_traces
def test_saturation_verdict():
    common = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "400")
    over = sim_json(*common, "--request-rate", "60")
    under = sim_json(*common, "--request-rate", "1")
    assert over["saturated"] is True and under["saturated"] is False
    assert 1 < over["saturation_rate"] < 60 and under["saturation_rate"] is None
    # the service rate it names is where queues start: well below it, none; well above it, one
    assert sim_json(*common, "--request-rate", str(over["saturation_rate"] * 0.5))["saturated"] is False
    assert sim_json(*common, "--request-rate", str(over["saturation_rate"] * 2))["saturated"] is True


def test_slo_parsing_and_goodput():
    from kvledger.metrics.serving import RequestResult, calculate_metrics, evaluate_slo, parse_slo

    slo = parse_slo("ttft_p99=2s,tpot_median=100ms,e2el_mean=5000,goodput=90%")
    assert [(t.metric, t.stat, t.seconds) for t in slo.targets] == [("ttft", "p99", 2.0), ("tpot", "p50", 0.1),
                                                                   ("e2el", "mean", 5.0)]
    assert slo.goodput_fraction == 0.9
    results = [RequestResult(10, 11, True, ttft=0.5 + i, latency=1.5 + i, itl=[0.1] * 10, output_tokens=11)
               for i in range(4)]  # TTFT 0.5, 1.5, 2.5, 3.5 s; TPOT 100 ms
    ev = evaluate_slo(results, calculate_metrics(results, 10.0), parse_slo("ttft_p50=2s,tpot_p99=100ms"))
    assert ev["targets"]["ttft_p50"]["met"] and ev["goodput_fraction"] == 0.5 and ev["goodput"] == 0.2
    assert ev["slo_met"] is False  # half the requests good, 99% needed


# ---- bad input: one line, exit 2 ------------------------------------------------------------------
def _bad_traces(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input_length": 10, "output_length": 5, "timestamp": 0}\n{"input_length": \n')
    return empty, broken


@pytest.mark.parametrize("case", ["router", "gpu", "slo-form", "slo-duration", "slo-metric", "empty", "malformed",
                                  "rate-0", "rate-nan", "rate-inf", "rate--inf",
                                  "profile-garbage", "ingress-negative", "ingress-nan"])
@needs_traces
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    empty, broken = _bad_traces(tmp_path)
    garbage = tmp_path / "profile.json"
    garbage.write_text('{"kind": "something else"}')
    base = ["llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV), "--num-prompts", "5"]
    argv, needles = {
        "router": (base + ["--router", "random"], ("unknown router 'random'", "prefix-affinity")),
        "gpu": (["llama-3.1-8b", "--gpu", "h900", "--workload", str(AZURE_CONV)], ("unknown GPU 'h900'",)),
        "slo-form": (base + ["--slo", "ttft_p99"], ("--slo", "METRIC_STAT=DURATION")),
        "slo-duration": (base + ["--slo", "ttft_p99=fast"], ("--slo ttft_p99", "positive duration")),
        "slo-metric": (base + ["--slo", "latency_p99=2s"], ("ttft, tpot, itl or e2el",)),
        "empty": (["llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(empty)], ("is empty",)),
        "malformed": (["llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(broken)], ("broken.jsonl:2",)),
        "rate-0": (base + ["--request-rate", "0"], ("--request-rate", "positive finite")),
        "rate-nan": (base + ["--request-rate", "nan"], ("--request-rate", "positive finite")),
        "rate-inf": (base + ["--request-rate", "inf"], ("--request-rate", "'inf' is not a rate", "'trace'")),
        "rate--inf": (base + ["--request-rate=-inf"], ("--request-rate", "positive finite")),
        "profile-garbage": (["llama-3.1-8b", "--profile", str(garbage), "--workload", str(AZURE_CONV)],
                            ("not a step profile",)),
        "ingress-negative": (base + ["--ingress-ms=-1"], ("--ingress-ms", "zero or more")),
        "ingress-nan": (base + ["--ingress-ms", "nan"], ("--ingress-ms", "finite")),
    }[case]
    assert_one_line_error(kvledger("simulate", *argv), *needles)


# ---- a second KV tier (--kv-offloading-size) ------------------------------------------------------
OFFLOAD_RUN = ("llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(MOONCAKE), "--num-prompts", "200",
               "--sample", "head", "--time-scale", "0.1", "--num-gpu-blocks-override", "20000",
               "--max-model-len", "65536")


@needs_traces
def test_a_second_tier_sweep_on_mooncake_adds_hits_from_it():
    """A pool of 20,000 blocks (320K tokens) under Mooncake's first 200 requests, spread out so none is
    preempted: Mooncake's sessions come back after more tokens than the pool holds, so what the pool
    evicted is found again in a 256 GiB tier, loaded (the step pays for the copies at the H100's
    PCIe Gen5 link) and counted as external_kv_transfer, the pool's hits unchanged."""
    out = sim_json(*OFFLOAD_RUN, "--kv-offloading-size", "0,256")
    assert out["runs"][1]["offload_store_rule"] == "evict"  # the default
    assert out["kv_offloading_sizes"] == [0, 256]
    without, tier = out["runs"]
    for run in (without, tier):
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(run[key]) >= {"mean", "p50", "p90", "p99"}
        assert run["num_preemptions"] == 0 and run["completed"] == 200
        assert sum(run["prompt_tokens_by_source"].values()) == run["prefix_cache_queries"]
        assert run["prefix_cache_hit_rate_by_source"]["local_cache_hit"] == run["prefix_cache_hit_rate"]
    assert "offload_capacity_blocks" not in without
    assert without["prefix_cache_hit_rate_by_source"]["external_kv_transfer"] == 0
    assert tier["offload_capacity_blocks"] == 256 * 512 and tier["offload_capacity_tokens"] == 256 * 512 * 16
    assert tier["prefix_cache_hit_rate_by_source"]["external_kv_transfer"] > 0.01
    assert tier["prefix_cache_hits"] == without["prefix_cache_hits"]
    assert tier["prompt_tokens_by_source"]["external_kv_transfer"] == tier["offload_blocks_loaded"] * 16
    assert tier["offload_bytes_loaded"] == tier["offload_blocks_loaded"] * 2 * 2**20
    assert max(tier["offload_stored_blocks"]) <= tier["offload_capacity_blocks"]
    # each step pays max(loads, stores) x 2 MiB at 64 GB/s: loads and stores cross PCIe in both directions at once
    one_way = (tier["offload_bytes_loaded"], tier["offload_bytes_stored"])
    assert max(one_way) / 64e9 <= tier["offload_transfer_s"] <= sum(one_way) / 64e9


@needs_traces
def test_one_tier_size_reports_it_and_the_sweep_plot_is_drawn(tmp_path):
    one = sim_json(*OFFLOAD_RUN, "--num-prompts", "40", "--kv-offloading-size", "8", "--kv-offloading-store", "compute")
    assert one["kv_offloading_size"] == 8 and one["offload_store_rule"] == "compute"
    assert one["offload_bandwidth_bytes_per_s"] == 64e9 and one["offload_blocks_stored"] > 0  # written through
    png = tmp_path / "sweep.png"
    r = kvledger("simulate", *OFFLOAD_RUN, "--num-prompts", "40", "--kv-offloading-size", "0,8", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "tier hits" in r.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, needles", [
    (("--kv-offloading-size", "8,x"), ("--kv-offloading-size", "not a number of GiB")),
    (("--kv-offloading-size", "8,16", "--find-replicas"), ("--find-replicas takes one --kv-offloading-size",)),
    (("--kv-offloading-size", "8", "--no-enable-prefix-caching"), ("needs prefix caching",)),
    (("--kv-offloading-size", "1000000"), ("host memory", "--kv-offloading-size")),  # 5 x 10^8 slots to keep
])
@needs_traces
def test_bad_tier_input_is_one_line_exit_2(extra, needles):
    assert_one_line_error(kvledger("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(AZURE_CONV),
                                   "--num-prompts", "5", *extra), *needles)


# ---- what receiving a request costs a step ----------------------------------------------------------
def test_a_request_that_arrives_mid_step_lengthens_that_step_and_one_that_wakes_the_engine_its_first():
    """A timer of 1 s steps and 0.25 s per request received: ``a`` wakes the idle engine at 0 (its
    step takes 1.25 s), ``b`` arrives at 0.5 inside that step (which now ends at 1.5), ``c`` wakes it
    again at 10. Without the arrival cost (a replay's timer) the same run keeps 1 s steps."""
    class Timer:
        def __init__(self, arrival_seconds: float) -> None:
            self.arrival_seconds = arrival_seconds

        def step_seconds(self, batch, num_samples) -> float:
            return 1.0

    config = EngineConfig(model="smollm2-135m", block_size=16, num_gpu_blocks_override=64,
                          max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256)

    def run(arrival_seconds: float):
        reqs = [make_request(0, 32, 3, 0.0), make_request(1, 16, 2, 0.5), make_request(2, 16, 1, 10.0)]
        fleet = Fleet(config, 64, lambda: Timer(arrival_seconds), replicas=1, router="round-robin")
        res = simulate(reqs, fleet, record_steps=True)
        steps = [(r.start_s, r.wall_s) for r in res.replicas[0].records]
        return [r.token_times for r in reqs], steps, res.replicas[0].busy_s

    tokens, steps, busy = run(0.25)
    assert tokens == [[1.5, 2.5, 3.5], [2.5, 3.5], [11.25]]
    assert steps == [(0.0, 1.5), (1.5, 1.0), (2.5, 1.0), (10.0, 1.25)]
    assert busy == 4.75
    tokens, steps, _ = run(0.0)
    assert tokens == [[1.0, 2.0, 3.0], [2.0, 3.0], [11.0]]
    assert steps == [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0), (10.0, 1.0)]


def test_arrivals_count_on_the_step_they_came_in_or_on_the_step_they_woke():
    """Receipts inside a step, inside the busy pause after it, while the engine idled, and none."""
    from kvledger.engine.outputs import Arrival, StepRecord
    from kvledger.sim.calibrate import arrivals_received, busy_pauses

    steps = [StepRecord(0, [("x", 0, 8)], 1, start_s=0.0, wall_s=0.1, arrivals=[Arrival("x", 8, 3, 0.0, 0.0)]),
             StepRecord(1, [("x", 8, 1), ("y", 0, 4)], 2, start_s=0.1, wall_s=0.08,
                        arrivals=[Arrival("y", 4, 2, 0.099, 0.05)]),
             StepRecord(2, [("x", 9, 1), ("z", 0, 4)], 2, start_s=0.2, wall_s=0.05,  # 20 ms busy pause before it
                        arrivals=[Arrival("z", 4, 1, 0.195, 0.19)]),
             StepRecord(3, [("w", 0, 4), ("v", 0, 2)], 2, start_s=2.0, wall_s=0.2,  # after an idle wait
                        arrivals=[Arrival("w", 4, 1, 1.99, 1.0), Arrival("v", 2, 1, 1.99, None)])]
    assert busy_pauses(steps) == pytest.approx([0.0, 0.02, 0.0, 0.0])
    assert arrivals_received(steps, busy_pauses(steps)) == [2, 1, 0, 1]


def test_a_serving_fit_prices_an_arrival_in_the_model_run_and_around_it():
    """Steps made from known coefficients, a request received during one in ten: the step-log fit
    gives the arrival's cost as the sum of what it adds to the model run and to the CPU work."""
    import random

    from kvledger.engine.outputs import Arrival, StepRecord
    from kvledger.sim.calibrate import fit_step_log
    from kvledger.sim.step_model import ModelGeometry, batch_terms
    from kvledger.spec import load_model_spec

    geo = ModelGeometry.of(load_model_spec("smollm2-135m"))
    rng = random.Random(0)
    records, received_at, start = [], [], 0.0
    for k in range(400):
        batch = [(f"r{k}-{j}", rng.randrange(16, 900), 1) for j in range(rng.randrange(1, 9))]
        if k % 7 == 0:
            batch.append((f"p{k}", 0, rng.randrange(16, 600)))
        received = k % 10 == 3
        terms = batch_terms(geo, [(c, n) for _, c, n in batch], len(batch))
        model_s = 0.010 + 4e-4 * terms[2] + 1e-3 * terms[8] + 0.004 * received
        wall_s = model_s + 0.001 + 1e-4 * len(batch) + 0.0005 * received
        records.append(StepRecord(k, batch, len(batch), start_s=start, wall_s=wall_s, model_s=model_s))
        received_at.append(start + wall_s / 2 if received else None)
        start += wall_s
    for k, t in enumerate(received_at[:-1]):  # received during step k, taken before step k + 1
        if t is not None:
            records[k + 1].arrivals.append(Arrival(f"a{k}", 4, 1, records[k + 1].start_s, t))
    coef, _ = fit_step_log(records, geo)
    assert coef["arrivals"] == pytest.approx(0.0045, rel=1e-3)
    assert coef["cpu_step"] == pytest.approx(0.001, rel=1e-3) and coef["step"] == pytest.approx(0.010, rel=1e-3)
