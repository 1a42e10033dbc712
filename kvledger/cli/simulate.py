"""``kvledger simulate``: a trace through the engine's own scheduler and block pool on a virtual clock."""

from __future__ import annotations

import argparse
from typing import Any

from kvledger.cli.common import (length_scale, non_negative_float, positive_float, positive_int, seed,
                                 simulated_request_rate, size, time_scale)
from kvledger.cli.flags import (add_block_size, add_gpu_memory_utilization, add_kv_cache_dtype,
                                add_kv_offloading_bandwidth, add_kv_offloading_size, add_max_num_batched_tokens,
                                add_max_num_seqs, add_tensor_parallel_size)
from kvledger.config import SimulatorConfig

SIMULATOR = SimulatorConfig(model="")
"""The simulator's defaults, which the flags take."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvledger.sim.routers import ROUTERS
    from kvledger.sim.setup import DEFAULT_FIND_SLO

    p = subparsers.add_parser(
        "simulate", help="simulate serving a trace: TTFT/TPOT/ITL/E2EL, preemptions, prefix hits, replicas needed",
        description="Replay a trace through the engine's own scheduler, KV cache manager and block pool on a "
                    "virtual clock, with a step-time model (GPU catalog or a calibrated profile) in place of the "
                    "model. Metrics have 'kvledger bench serve's definitions; requests and arrivals are the ones "
                    "it draws with the same flags.")
    p.add_argument("model", help="preset name (e.g. llama-3.1-8b), config.json or model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gpu", metavar="NAME", help="GPU from the catalog (default step model and memory wall)")
    src.add_argument("--profile", metavar="FILE", help="step profile written by 'kvledger calibrate'")
    p.add_argument("--workload", "--trace", dest="workload", required=True, metavar="FILE",
                   help="trace: Azure CSV, Mooncake JSONL (hash_ids give prefix reuse) or generic CSV/JSONL")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="requests to replay (default: every row)")
    p.add_argument("--sample", choices=["random", "head"], default="random",
                   help="with --num-prompts: rows at random with --seed, or the first ones (default random)")
    p.add_argument("--length-scale", type=length_scale, default=1.0, help="multiply lengths by this (default 1)")
    p.add_argument("--request-rate", type=simulated_request_rate, default="trace",
                   help="requests/s (Poisson), or 'trace' for the trace's timestamps (default trace)")
    p.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps (default 1)")
    p.add_argument("--time-scale", type=time_scale, default=1.0,
                   help="with --request-rate trace: divide the trace's times by this (default 1)")
    p.add_argument("--seed", type=seed, default=0, help="seed for row sampling and arrivals (default 0)")
    p.add_argument("--shared-prefix-tokens", type=positive_int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a system prompt; prefix caching shares them)")
    p.add_argument("--replicas", type=positive_int, default=SIMULATOR.replicas,
                   help=f"identical replicas behind the router (default {SIMULATOR.replicas})")
    p.add_argument("--router", default=SIMULATOR.router, metavar="NAME",
                   help=f"{', '.join(ROUTERS)} (default {SIMULATOR.router})")
    p.add_argument("--ingress-ms", type=non_negative_float, default=SIMULATOR.ingress_ms, metavar="MS",
                   help="milliseconds from a client's send to the server's receipt of a request across a network "
                        "(proxies included), added to every TTFT and E2EL (default 0: latencies from the server's "
                        "receipt; a client on the server's own host is in a served profile's arrivals term)")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="targets, e.g. ttft_p99=2s,tpot_p99=100ms[,goodput=99%%] (ttft/tpot/itl/e2el, pNN or mean)")
    p.add_argument("--find-replicas", action="store_true",
                   help=f"search the smallest --replicas that meets --slo (default SLO {DEFAULT_FIND_SLO})")
    g = p.add_argument_group("engine (vLLM flag names; defaults are vLLM's, as in plan)")
    add_block_size(g, default=SIMULATOR.block_size)
    add_max_num_seqs(g, default=SIMULATOR.max_num_seqs)
    add_max_num_batched_tokens(g, default=SIMULATOR.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=positive_int, default=SIMULATOR.max_model_len,
                   help="prompts are cut so prompt + output fits (default: the model's context, capped by the pool)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=SIMULATOR.enable_prefix_caching)
    add_kv_cache_dtype(g, default=SIMULATOR.kv_cache_dtype)
    add_gpu_memory_utilization(g, default=SIMULATOR.gpu_memory_utilization)
    g.add_argument("--kv-cache-memory", type=size, default=SIMULATOR.kv_cache_memory, metavar="SIZE",
                   help="KV pool bytes per replica")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=SIMULATOR.num_gpu_blocks_override,
                   metavar="N")
    add_tensor_parallel_size(g)
    g.add_argument("--vllm-version", metavar="X.Y", default=SIMULATOR.vllm_version,
                   help="hybrid models: the vLLM release whose pool rules to follow (default the newest modeled)")
    t = p.add_argument_group("second KV tier (host memory under each replica's pool)")
    add_kv_offloading_size(t, sweep=True, default=SIMULATOR.kv_offloading_size,
                           help="GiB (2^30 bytes) of a second KV tier per replica, vLLM's flag; a list sweeps it, one "
                                "run per size (0: no tier)")
    add_kv_offloading_bandwidth(t, help="bytes/s one way of the host link the tier's loads and stores cross, charged "
                                        "to the step that needs them (default: the card's, from the GPU catalog)")
    from kvledger.kvcache.offload import EVICTION_POLICIES, STORE_RULES

    t.add_argument("--kv-offloading-eviction-policy", choices=EVICTION_POLICIES,
                   default=SIMULATOR.kv_offloading_eviction_policy,
                   help=f"the tier's eviction policy, vLLM's (default {SIMULATOR.kv_offloading_eviction_policy})")
    t.add_argument("--kv-offloading-store", choices=STORE_RULES, default=SIMULATOR.kv_offloading_store,
                   help="what the tier stores: 'compute', a prompt's full blocks as computed (vLLM's), or 'evict', a "
                        f"block when the pool evicts it (default {SIMULATOR.kv_offloading_store})")
    p.add_argument("--json", action="store_true", help="print every number as one JSON object")
    p.add_argument("--plot", metavar="FILE", help="PNG: KV blocks vs the pool, running/waiting, TTFT and TPOT CDFs; "
                                                  "with several --kv-offloading-size, hit rate and TTFT against size")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr, shown once the run has lasted a second (default: on)")
    p.set_defaults(func=run)


def setup(args: argparse.Namespace, kv_offloading_size: float = 0) -> tuple[Any, Any, Any]:
    """(ModelSpec, Fleet, SLO or None) from the flags, with a second tier of ``kv_offloading_size``
    GiB (0: none); every bad value is a KVLedgerError."""
    from kvledger.sim.setup import setup_fleet

    return setup_fleet(SimulatorConfig.of(args), slo=args.slo, find_replicas=args.find_replicas,
                       kv_offloading_size=kv_offloading_size)


def run(args: argparse.Namespace) -> int:
    from kvledger.cli.common import print_json
    from kvledger.sim.setup import max_request_len
    from kvledger.sim.simulate import build_requests, find_replicas, simulate, summary
    from kvledger.workload.sampling import check_shared_prefix, mean_prompt_tokens, sample_requests
    from kvledger.workload.traces import read_trace

    plt = None
    if args.plot:
        from kvledger.plotting import pyplot

        plt = pyplot(args.plot)  # a bad name or a missing matplotlib fails before the run
    sizes = args.kv_offloading_size or (0,)
    if len(sizes) > 1 and args.find_replicas:
        from kvledger.errors import KVLedgerError

        raise KVLedgerError("--find-replicas takes one --kv-offloading-size")
    fleets = [setup(args, gib) for gib in sizes]  # every size refused before any run
    spec, fleet, slo = fleets[0]
    max_len = max_request_len(spec, fleet, args.max_model_len)
    trace = read_trace(args.workload)
    sampled, times = sample_requests(trace, args.num_prompts, seed=args.seed, sample=args.sample,
                                     length_scale=args.length_scale, request_rate=args.request_rate,
                                     burstiness=args.burstiness, time_scale=args.time_scale, max_model_len=max_len)
    check_shared_prefix(args.shared_prefix_tokens, mean_prompt_tokens([r.input_len for r in sampled]),
                        f"the mean prompt of the requests drawn from {trace.name}")

    def make():
        return build_requests(sampled, times, args.length_scale, args.shared_prefix_tokens)

    if args.find_replicas:
        n, res, below = find_replicas(make, fleet, slo, args.progress)
        import dataclasses

        fleet = dataclasses.replace(fleet, replicas=n)
        out = summary(res, fleet)
        out.update(replicas_needed=n, gpus_needed=n * fleet.tensor_parallel_size,
                   headroom=_headroom(res.extra["slo"]),
                   below={"replicas": n - 1, "slo_met": below.extra["slo"]["slo_met"],
                          "slo": below.extra["slo"]} if below is not None else None)
    elif len(sizes) > 1:
        runs = []
        for _, sized, _ in fleets:
            run_out = summary(simulate(make(), sized, progress=args.progress, slo=slo), sized)
            run_out.pop("series")
            runs.append(run_out)
        out = {"kv_offloading_sizes": list(sizes), "runs": runs}
    else:
        res = simulate(make(), fleet, progress=args.progress, slo=slo)
        out = summary(res, fleet)
    out.update(model=spec.name, step_model=fleet.timer_factory().source, trace=trace.name,
               num_prompts=len(sampled), length_scale=args.length_scale,
               request_rate=args.request_rate,
               seed=args.seed, max_model_len=max_len)
    if plt is not None:
        from kvledger.sim.plot import plot_offload_sweep, plot_run

        if "runs" in out:
            plot_offload_sweep(out, args.plot)
        else:
            plot_run(res, fleet, args.plot)
    if args.json:
        print_json(out)
    else:
        print(sweep_report(out) if "runs" in out else report(out))
    return 0


def sweep_report(out: dict[str, Any]) -> str:
    """The text report of a sweep of the second tier's size: one row per size."""
    from tabulate import tabulate

    first = out["runs"][0]
    lines = [f"{out['num_prompts']} requests from {out['trace']} (lengths x{out['length_scale']:g}, rate "
             f"{out['request_rate']}) on {first['replicas']} x {out['model']} ({out['step_model']}, TP "
             f"{first['tensor_parallel_size']}), router {first['router']}",
             f"pool {first['num_blocks']:,} blocks x {first['block_size']} tokens per replica; second tier per replica:", ""]
    rows = []
    for r in out["runs"]:
        rate = r["prefix_cache_hit_rate_by_source"]
        rows.append([f"{r['kv_offloading_size']:g}", f"{r.get('offload_capacity_blocks', 0):,}",
                     f"{rate['local_cache_hit']:.1%}", f"{rate['external_kv_transfer']:.1%}",
                     f"{rate['local_cache_hit'] + rate['external_kv_transfer']:.1%}",
                     f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p99']:.0f}", f"{r['tpot_ms']['p50']:.1f}",
                     f"{(r.get('offload_bytes_loaded', 0)) / 2**30:,.1f}", f"{(r.get('offload_bytes_stored', 0)) / 2**30:,.1f}",
                     f"{r['num_preemptions']}"])
    lines.append(tabulate(rows, headers=["GiB", "blocks", "pool hits", "tier hits", "all hits", "TTFT p50 ms",
                                         "TTFT p99 ms", "TPOT p50 ms", "GiB loaded", "GiB stored", "preemptions"],
                          disable_numparse=True, colalign=["right"] * 11))
    return "\n".join(lines)


def _headroom(slo: dict[str, Any]) -> dict[str, float]:
    """Per target, the share of its limit left unused at the chosen replica count."""
    return {name: 1 - t["value_ms"] / t["limit_ms"] for name, t in slo["targets"].items()}


def report(out: dict[str, Any]) -> str:
    """The text report of a run."""
    from tabulate import tabulate

    lines = [f"{out['num_prompts']} requests from {out['trace']} (lengths x{out['length_scale']:g}, rate "
             f"{out['request_rate']}) on {out['replicas']} x {out['model']} ({out['step_model']}, TP "
             f"{out['tensor_parallel_size']}), router {out['router']}",
             f"pool {out['num_blocks']:,} blocks x {out['block_size']} tokens per replica; "
             f"{out['num_steps']:,} steps, {out['duration_s']:.1f} s simulated in {out['wall_s']:.1f} s", ""]
    rows = [[name.upper()] + [f"{out[f'{name}_ms'][k]:.2f}" for k in ("mean", "p50", "p90", "p99")]
            for name in ("ttft", "tpot", "itl", "e2el")]
    lines.append(tabulate(rows, headers=["ms", "mean", "p50", "p90", "p99"], disable_numparse=True))
    lines += ["",
              f"request throughput {out['request_throughput']:.2f} req/s, output {out['output_throughput']:.1f} tok/s, "
              f"goodput {out['goodput']:.2f} req/s",
              f"preemptions {out['num_preemptions']}, prefix-cache hit rate {out['prefix_cache_hit_rate']:.1%}, "
              f"peak blocks allocated {out['peak_blocks_allocated']:,} of {out['num_blocks']:,}"]
    if "offload_capacity_blocks" in out:
        rate = out["prefix_cache_hit_rate_by_source"]
        lines.append(f"second tier {out['kv_offloading_size']:g} GiB ({out['offload_capacity_blocks']:,} blocks): "
                     f"{rate['external_kv_transfer']:.1%} of prompt tokens loaded from it; "
                     f"{out['offload_bytes_loaded'] / 2**30:,.1f} GiB loaded, "
                     f"{out['offload_bytes_stored'] / 2**30:,.1f} GiB stored, {out['offload_transfer_s']:.1f} s of copies")
    if len(out["per_replica"]) > 1:
        lines.append("per replica hit rate: " + ", ".join(f"{r['prefix_cache_hit_rate']:.1%}"
                                                          for r in out["per_replica"]))
    if out["saturated"]:
        lines.append(f"SATURATED: arrivals ({out['arrival_rate']:.2f} req/s) outpace service, the queue grows "
                     f"without bound; saturation starts at about {out['saturation_rate']:.2f} req/s")
    else:
        lines.append("not saturated: the queue stays bounded")
    if "slo_met" in out:
        lines.append(f"SLO {'met' if out['slo_met'] else 'missed'}: " + ", ".join(
            f"{k} {t['value_ms']:.1f} ms (limit {t['limit_ms']:.0f})" for k, t in out["slo"]["targets"].items())
            + f"; {out['goodput_fraction']:.1%} of requests good")
    if "replicas_needed" in out:
        lines.append(f"replicas needed: {out['replicas_needed']} ({out['gpus_needed']} GPUs); headroom "
                     + ", ".join(f"{k} {v:.0%}" for k, v in out["headroom"].items()))
    return "\n".join(lines)
