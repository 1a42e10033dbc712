"""Scale-out on this machine: SmolLM2-135M at TP 1 against TP 3, and two replicas behind Ray Serve
under the prefix-affinity router against Ray Serve's default, beside the simulator's prediction.

Part 1, tensor parallelism (``--tp``), the step time of TP 1 against TP 3 in the same run.

On CPU the ranks share the host's cores, so tensor parallelism buys no speed here: it splits
the matmuls three ways but adds an all-reduce per row-parallel projection (2 per layer, 60 per
step) and the step broadcast, and each rank still computes the replicated embedding, norms
and LM head. What this measures is that cost, beside the two ceilings it is made of, both
measured in the same run: the machine's float32 matmul rate and one gloo all-reduce of a
step's hidden states between processes.

Workloads (greedy, random token ids, a fixed seed): a batch-1 decode at a 256-token context,
a batch-12 decode at 128-token contexts, and one 512-token prefill. Per phase: the median of
the model time of the engine's steps (``StepRecord.model_s``). TP 1 is the reference (the
peer of a TP run is the same engine unsplit); the ratio is TP 3 over TP 1.

Part 2, replicas (``--fleet``): the shared-prefix workload
(:func:`kvledger.workload.shared_prefix.shared_prefix_workload`: 8 prefixes of 512 tokens, 64
requests interleaved at random, 8-token suffixes, 2 output tokens, 4 clients at a time) on 2
replicas of ``--blocks`` KV blocks each (default 144: four prefixes fit, eight do not), once per
router; the prefix-cache hit rate (tokens) read from the fleet's ``/metrics``. Then
``kvledger simulate`` on the same requests (a Mooncake trace: one block id per prefix) with
``--replicas 2`` and each of its routers, the prediction beside the measurement.

    .venv/bin/python bench/bench_scale.py [--tp 3] [--steps 24] [--fleet] [--skip-tp]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import matmul_flops  # noqa: E402

THREADS = 2


def phases(engine, steps: int, seed: int = 0) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median model seconds per step of each phase on ``engine``."""
    from kvledger import SamplingParams

    rng = random.Random(seed)
    vocab = engine.vocab_size
    out: dict[str, float] = {}

    def run(name: str, prompts: list[list[int]], max_tokens: int, decode_only: bool) -> None:
        engine.step_records = []
        for i, ids in enumerate(prompts):
            engine.add_request(f"{name}-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                  ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        records = engine.step_records
        engine.step_records = None
        if decode_only:
            records = [r for r in records if all(n == 1 for _, _, n in r.batch) and len(r.batch) == len(prompts)]
        out[name] = statistics.median(r.model_s for r in records)

    run("decode b=1 ctx 256", [[rng.randrange(vocab) for _ in range(256)]], steps, True)
    run("decode b=12 ctx 128", [[rng.randrange(vocab) for _ in range(128)] for _ in range(12)], steps, True)
    prefill = [[rng.randrange(vocab) for _ in range(512)] for _ in range(3)]
    run("prefill 512 tokens", prefill, 1, False)
    return out


def allreduce_seconds(world: int, numel: int, repeat: int = 50) -> float:
    """Median seconds of one gloo all-reduce of ``numel`` float32 between ``world`` processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, numel, repeat, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    return max(results)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_rank(rank: int, world: int, port: int, numel: int, repeat: int, q) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(numel)
    for _ in range(5):
        dist.all_reduce(x)
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    q.put(statistics.median(times))
    dist.destroy_process_group()


def fleet_hit_rates(blocks: int, routers: tuple[str, ...] = ("prefix-affinity", "default")) -> dict[str, float]:
    """The shared-prefix workload on 2 replicas per router: the fleet's hit rate (tokens) each."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import ray

    from kvledger.cluster import launch
    from kvledger.cluster.deployment import NAMESPACE, read_fleet_metrics
    from kvledger.workload.shared_prefix import shared_prefix_workload

    prompts = shared_prefix_workload().prompts
    engine = dict(model="smollm2-135m", dtype="float32", num_gpu_blocks_override=blocks, max_num_batched_tokens=1024,
                  max_model_len=1024, max_num_seqs=8)
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    rates = {}
    try:
        for router in routers:
            fleet = launch.deploy(engine, {}, 2, router, port=port)

            def totals() -> tuple[float, float, int]:
                m = read_fleet_metrics(httpx.get(fleet.url + "/metrics", timeout=60).text)
                busy = sum(v for (n, r), v in m.items() if r != "fleet" and n == "kvledger:kv_blocks_allocated")
                return (m.get(("kvledger:prefix_cache_hits_total", "fleet"), 0.0),
                        m.get(("kvledger:prefix_cache_queries_total", "fleet"), 0.0), int(busy))

            time.sleep(3)
            hits0, queries0, _ = totals()
            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(lambda p: httpx.post(fleet.url + "/v1/completions", timeout=600, json={
                    "model": "smollm2-135m", "prompt": p, "max_tokens": 2, "temperature": 0}).status_code, prompts))
            assert set(codes) == {200}, codes
            time.sleep(3)  # the replicas publish their metrics each second
            hits, queries, busy = totals()
            rates[router] = (hits - hits0) / (queries - queries0)
            print(f"fleet, router {router}: hit rate {rates[router]:.3f} ({hits - hits0:.0f} of {queries - queries0:.0f} "
                  f"prompt tokens); blocks still allocated afterwards: {busy}", flush=True)
    finally:
        launch.shutdown()
    return rates


def simulated_hit_rates(blocks: int, routers: tuple[str, ...] = ("prefix-affinity", "round-robin", "least-loaded")
                        ) -> dict[str, float]:
    """``kvledger simulate --replicas 2`` on the same requests, per router."""
    import json
    import subprocess
    import tempfile

    from kvledger.workload.shared_prefix import shared_prefix_workload

    with tempfile.TemporaryDirectory() as tmp:
        trace = shared_prefix_workload().write_mooncake(Path(tmp) / "shared-prefix.jsonl")
        rates = {}
        for router in routers:
            out = subprocess.run([sys.executable, "-m", "kvledger.cli.main", "simulate", "smollm2-135m", "--gpu",
                                  "a100-80gb", "--workload", str(trace), "--sample", "head", "--replicas", "2",
                                  "--router", router, "--num-gpu-blocks-override", str(blocks), "--block-size", "16",
                                  "--json"], capture_output=True, text=True, check=True)
            rates[router] = json.loads(out.stdout)["prefix_cache_hit_rate"]
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per decode phase (default 24)")
    ap.add_argument("--fleet", action="store_true", help="also run part 2 (Ray Serve replicas; kvledger[cluster])")
    ap.add_argument("--skip-tp", action="store_true", help="skip part 1")
    ap.add_argument("--routers", default="prefix-affinity,default", help="part 2's routers, comma-separated")
    ap.add_argument("--blocks", type=int, default=144, help="KV blocks per replica in part 2 (default 144)")
    args = ap.parse_args()
    if args.fleet:
        simulated = simulated_hit_rates(args.blocks)
        print("simulated (kvledger simulate --replicas 2): "
              + ", ".join(f"{r} {v:.3f}" for r, v in simulated.items()), flush=True)
        measured = fleet_hit_rates(args.blocks, tuple(args.routers.split(",")))
        if len(measured) == 2:
            print(f"measured: prefix-affinity / default = "
                  f"{measured['prefix-affinity'] / max(measured['default'], 1e-9):.2f}x; simulated prefix-affinity / "
                  f"round-robin = {simulated['prefix-affinity'] / max(simulated['round-robin'], 1e-9):.2f}x")
    if args.skip_tp:
        return 0
    torch.set_num_threads(THREADS)
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    flops = matmul_flops()
    config = dict(model="smollm2-135m", dtype="float32", num_gpu_blocks_override=256, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
    results = {}
    for tp in (1, args.tp):
        engine = LLMEngine(EngineConfig(**config, tensor_parallel_size=tp))
        phases(engine, 4)  # warm-up
        results[tp] = phases(engine, args.steps)
        engine.shutdown()
    hidden = 576
    ar = {rows: allreduce_seconds(args.tp, rows * hidden) for rows in (1, 12, 512)}
    print(f"ceilings: float32 matmul {flops / 1e9:.1f} GFLOP/s ({THREADS} threads); gloo all-reduce of a step's "
          f"hidden states between {args.tp} processes: "
          + ", ".join(f"{rows} rows {s * 1e3:.2f} ms" for rows, s in ar.items())
          + f" (x60 per step: {', '.join(f'{60 * s * 1e3:.0f} ms' for s in ar.values())})")
    print(f"{'phase':24} {'TP 1 ms':>9} {f'TP {args.tp} ms':>9} {'ratio':>7}")
    for name in results[1]:
        a, b = results[1][name], results[args.tp][name]
        print(f"{name:24} {a * 1e3:9.1f} {b * 1e3:9.1f} {b / a:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
