"""``kvledger advise``: the levers that buy more users, ranked by expected gain for a scenario."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from kvledger.cli.common import non_negative_int, positive_int, print_json
from kvledger.cli.plan import add_memory_arguments, planner_config, resolve


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "advise", help="rank the capacity levers for a scenario: prefix caching, admission control, ...",
        description="Which lever buys more users: says whether capacity or concurrency binds, then ranks prefix "
                    "caching, admission control, --max-model-len, KV quantization, tensor parallelism and shorter "
                    "contexts by expected gain, each with its cost. FP8 KV is never offered below SM 8.9.")
    add_memory_arguments(p)
    p.add_argument("--prompt-tokens", type=positive_int, metavar="N", help="average prompt length (or --workload)")
    p.add_argument("--output-tokens", type=non_negative_int, metavar="N", help="average response length (or --workload)")
    p.add_argument("--shared-prefix-tokens", type=non_negative_int, default=0, metavar="N",
                   help="system-prompt tokens every request shares (default 0)")
    p.add_argument("--users", type=positive_int, required=True, metavar="N", help="concurrent users served today")
    p.add_argument("--workload", metavar="FILE", help="size the users from a trace (as plan does): its mean prompt "
                                                      "and output lengths replace --prompt-tokens/--output-tokens")
    p.add_argument("--target-users", type=positive_int, required=True, metavar="N", help="concurrent users wanted")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from kvledger.planner.advise import advise
    from kvledger.planner.bandwidth import effective_bandwidth

    from kvledger.errors import KVLedgerError

    if args.gpu.strip().lower() == "list":
        from kvledger.planner.gpus import list_catalog

        print(list_catalog())
        return 0
    if args.workload:
        from kvledger.workload.sampling import mean_prompt_tokens
        from kvledger.workload.traces import read_trace

        trace = read_trace(args.workload)
        args.prompt_tokens = mean_prompt_tokens(trace.prompt)
        args.output_tokens = max(0, round(float(trace.output.mean())))
    if args.prompt_tokens is None or args.output_tokens is None:
        raise KVLedgerError("give --prompt-tokens and --output-tokens, or a --workload to take them from")
    if not args.model:
        raise KVLedgerError("give a MODEL: a preset (kvledger kv-bytes --list), a Hugging Face id, a config.json or a "
                            "model directory")
    spec, gpu = resolve(args)
    result = advise(spec, gpu, planner_config(args), prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens, users=args.users, target_users=args.target_users,
                    shared_prefix_tokens=args.shared_prefix_tokens,
                    bandwidth=effective_bandwidth(gpu, args.bandwidth, args.bandwidth_efficiency))
    if args.json:
        print_json(asdict(result))
        return 0
    print(f"{spec.name} on {gpu.name}: {result.kv_tokens:,} KV tokens; a user holds {result.tokens_per_user:,} "
          f"({args.prompt_tokens:,} prompt + {args.output_tokens:,} output)")
    print(f"today {result.users:,} users hold {result.live_tokens_now:,} tokens = {result.pool_share_now:,.0%} of the "
          f"pool, which holds {result.capacity_users:,} such users; target {result.target_users:,}")
    verdict = ("capacity binds: the pool is full, free memory or shrink tokens" if result.binding == "capacity" else
               "concurrency, not capacity, binds: the pool has room; admission control is the limit, and levers "
               "that only grow the pool add users once it is lifted")
    print(verdict)
    print()
    if result.target_met:
        print(f"the target is met: {min(result.users, result.capacity_users):,} users served, "
              f"{result.target_users:,} wanted")
    rows = [(i, lv.name, lv.flag, f"{lv.users_after:,}", f"{lv.gain:+,d}", f"{lv.users_after_with_admission:,}", lv.cost,
             lv.detail)
            for i, lv in enumerate(result.levers, start=1)]
    print(tabulate(rows, headers=["#", "lever", "flag", "users after", "gain", "with admission", "cost", "why"],
                   colalign=("right", "left", "left", "right", "right", "right", "left", "left"),
                   maxcolwidths=[None] * 7 + [56]))
    for note in result.notes:
        print(f"note: {note}")
    return 0
