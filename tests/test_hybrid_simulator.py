"""The simulator admits hybrid requests against the plan's pool: each holds its state blocks from
admission to finish, a preemption frees them, and max_num_seqs cannot exceed the blocks."""

from __future__ import annotations

import math

import pytest

from kvledger.config import EngineConfig
from kvledger.errors import KVLedgerError
from kvledger.planner.gpus import get_gpu
from kvledger.planner.memory_wall import plan_memory, sequence_blocks
from kvledger.sim.hybrid import HybridPool, check_max_num_seqs
from kvledger.sim.requests import make_request
from kvledger.sim.simulate import Fleet, simulate
from kvledger.spec import load_model_spec
from kvledger.units import GiB

LENGTH = 32768


class Constant:
    def step_seconds(self, batch, num_samples):
        return 0.01


def granite_plan(prefix_caching: bool, pool_gib: float = 2.0):
    spec = load_model_spec("granite-4.0-h-small")
    wall = plan_memory(spec, get_gpu("h100-80gb"), kv_cache_memory=int(pool_gib * GiB), max_model_len=LENGTH,
                       enable_prefix_caching=prefix_caching, max_num_seqs=16)
    return spec, wall


def fleet_for(wall, **config) -> Fleet:
    cfg = EngineConfig(block_size=wall.block_size, max_num_seqs=config.pop("max_num_seqs", 64),
                       max_num_batched_tokens=config.pop("max_num_batched_tokens", 8 * LENGTH),
                       enable_prefix_caching=bool(wall.prefix_caching), num_gpu_blocks_override=wall.num_blocks)
    return Fleet(cfg, wall.num_blocks, Constant, hybrid=HybridPool.from_wall(wall))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_granite_peak_blocks_within_the_pool_and_concurrency_equals_plans(prefix_caching):
    spec, wall = granite_plan(prefix_caching)
    assert wall.hybrid and wall.block_size == 528
    per_request = sequence_blocks(spec, wall, LENGTH)
    assert per_request == 63 + 9 * (3 if prefix_caching else 1)
    plan_limit = math.floor(wall.num_blocks / per_request)
    requests = [make_request(i, LENGTH - 1, 1, 0.0) for i in range(3 * plan_limit + 1)]
    result = simulate(requests, fleet_for(wall))
    replica = result.replicas[0]
    running_peak = max(replica.series.running + [0])
    peak = replica.blocks_allocated_peak
    assert peak <= wall.num_blocks
    assert peak == plan_limit * per_request          # every admitted request holds its state blocks
    assert all(r.finish_time is not None for r in requests)
    # the running set the simulator reached is the plan's concurrency, no more
    first_step = {r.first_token_step for r in requests}
    admitted_together = max(sum(1 for r in requests if r.first_token_step == s) for s in first_step)
    assert admitted_together == plan_limit
    assert running_peak <= plan_limit
    assert replica.pool.num_free_blocks == wall.num_blocks and not replica.kv.side


def test_preemption_frees_the_state_blocks():
    spec, wall = granite_plan(False, pool_gib=1.0)   # 124 blocks: one request of 32K holds 72
    prompts = [make_request(i, 8000, 12000, 0.0) for i in range(4)]  # they grow until they no longer fit
    result = simulate(prompts, fleet_for(wall))
    replica = result.replicas[0]
    assert replica.scheduler.num_preemptions > 0
    assert replica.blocks_allocated_peak <= wall.num_blocks
    assert all(r.num_output == r.output_len for r in prompts)
    assert replica.pool.num_free_blocks == wall.num_blocks and not replica.kv.side


def test_max_num_seqs_cannot_exceed_the_blocks():
    _, wall = granite_plan(False, pool_gib=1.0)
    with pytest.raises(KVLedgerError, match=rf"max_num_seqs \(256\) exceeds available Mamba cache blocks \({wall.num_blocks}\)"):
        check_max_num_seqs(256, wall.num_blocks)
    check_max_num_seqs(wall.num_blocks, wall.num_blocks)


def test_simulate_cli_runs_a_hybrid_on_vllms_block_and_refuses_too_many_seqs(tmp_path):
    from tests.cli_helpers import assert_one_line_error, kvledger

    trace = tmp_path / "trace.csv"
    trace.write_text("prompt_tokens,output_tokens\n1000,50\n2000,80\n500,20\n")
    base = ("simulate", "granite-4.0-h-small", "--gpu", "h100-80gb", "--workload", str(trace), "--request-rate", "10",
            "--max-model-len", "32768")
    out = kvledger(*base, "--max-num-seqs", "64", "--json").json()
    # 528-token blocks; each request holds 9 state groups x 3 blocks (prefix caching on, vLLM 0.32)
    assert out["block_size"] == 528 and out["completed"] == 3
    assert out["peak_blocks_allocated"] == (2 + 27) + (4 + 27) + (1 + 27)
    refused = kvledger(*base, "--kv-cache-memory", "2GiB")
    assert_one_line_error(refused, "max_num_seqs (1024) exceeds available Mamba cache blocks (248)")
