"""The simulator: the engine's own scheduler replayed step for step, pools equal to plan's, fleets,
SLOs, saturation, bad input, and no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.engine.config import EngineConfig
from kvledger.sim.driver import RecordedStepTimes
from kvledger.sim.requests import make_request
from kvledger.sim.simulate import Fleet, simulate
from tests.cli_helpers import assert_one_line_error, kvledger

TRACES = Path("/work/shared/data/traces")
MOONCAKE = TRACES / "mooncake_conversation.jsonl"
AZURE_CONV = TRACES / "azure2023_conv.csv"


def sim_json(*args: str) -> dict:
    r = kvledger("simulate", *args, "--json")
    assert r.returncode == 0, r.stderr
    return r.json()


# ---- the same scheduler, proven ----------------------------------------------------------------
def test_replay_of_a_recorded_engine_run_is_identical():
    """The real SmolLM2 engine on a small pool (preemptions) with a shared prefix (prefix hits) and
    late arrivals; its recorded step times as the simulator's clock: the same steps, the same
    batches, and per request the same first-token step, finish step, preemptions and hits."""
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.engine.sampling_params import SamplingParams

    config = EngineConfig(model="smollm2-135m", dtype="float32", block_size=16, num_gpu_blocks_override=22,
                          max_num_batched_tokens=64, max_num_seqs=8, max_model_len=352)
    engine = LLMEngine(config)
    shared = list(range(1000, 1048))  # three full blocks every prompt starts with
    prompts = [shared + [2000 + 100 * i + j for j in range(9 + 7 * (i % 5))] for i in range(10)]
    max_tokens = [30 + 5 * (i % 4) for i in range(10)]
    arrive_at = {0: range(6), 3: [6], 9: [7], 16: [8], 24: [9]}  # step -> requests added before it
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
    assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.stats.hits > 0

    walls = [r.wall_s for r in records]
    start, now = {}, 0.0
    for k, w in enumerate(walls):  # the virtual time at which step k starts, summed as the driver sums it
        start[k] = now
        now = now + w
    requests = [make_request(i, len(prompts[i]), max_tokens[i], start[k], prompt_token_ids=prompts[i],
                             request_id=f"r{i}") for k, ids in arrive_at.items() for i in ids]
    requests.sort(key=lambda r: (r.arrival_time, r.uid))
    fleet = Fleet(config, 22, lambda: RecordedStepTimes(walls), replicas=1, router="round-robin")
    res = simulate(requests, fleet, record_steps=True)
    replica = res.replicas[0]

    assert [(r.batch, r.preempted) for r in replica.records] == [(r.batch, r.preempted) for r in records]
    for sim in requests:
        rid = sim.request_id
        assert (sim.first_token_step, sim.finish_step) == (first_step[rid], finish_step[rid]), rid
        assert sim.num_preemptions == real[rid].num_preemptions, rid
        assert sim.num_cached_tokens == real[rid].num_cached_tokens, rid
        assert sim.finish_time == pytest.approx(start.get(finish_step[rid] + 1, now)), rid
    assert replica.scheduler.num_preemptions == engine.scheduler.num_preemptions
    assert (replica.kv.stats.hits, replica.kv.stats.queries) == (engine.kv_manager.stats.hits,
                                                                 engine.kv_manager.stats.queries)
    assert replica.blocks_allocated_peak == engine.blocks_allocated_peak
