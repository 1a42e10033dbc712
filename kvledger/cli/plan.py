"""``kvledger plan``: how many users fit on a card, term by term, for any model, GPU and workload."""

from __future__ import annotations

import argparse
from typing import Any

from kvledger.cli.common import fraction, positive_int, print_json, rate, size, token_count
from kvledger.cli.flags import (add_block_size, add_gpu_memory_utilization, add_kv_cache_dtype,
                                add_kv_offloading_bandwidth, add_kv_offloading_path, add_kv_offloading_size,
                                add_max_num_batched_tokens, add_max_num_seqs, add_mamba_ssm_cache_dtype,
                                add_tensor_parallel_size)
from kvledger.config import (CUDA_BLOCK_SIZE, LARGE_CARD_MAX_NUM_BATCHED_TOKENS, LARGE_CARD_MAX_NUM_SEQS,
                             MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, VLLM_BLOCK_SIZES, PlannerConfig)
from kvledger.planner.bandwidth import CROSSOVER_CONTEXT, DEFAULT_BANDWIDTH_EFFICIENCY
from kvledger.planner.memory_wall import LARGE_CARD_BYTES
from kvledger.spec.hybrid import DEFAULT_VLLM_VERSION, OLDEST_VLLM_VERSION
from kvledger.spec.weights import MODEL_DTYPES, RUNTIME_QUANTIZATIONS, WEIGHT_DTYPE_BYTES
from kvledger.units import GiB

PLANNER = PlannerConfig()
"""The planner's defaults, which the flags take."""


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The memory-wall flags, shared by ``plan`` and ``advise`` (vLLM's names where it has one)."""
    p.add_argument("model", nargs="?", help="preset name (e.g. llama-3.1-8b), Hugging Face id with a bundled config "
                                            "(meta-llama/Llama-3.1-8B), config.json or model directory")
    p.add_argument("--gpu", required=True, metavar="NAME",
                   help="GPU from the catalog, e.g. a100-80gb, h100-80gb, l4 ('--gpu list' lists the catalog)")
    p.add_argument("--gpu-memory", type=size, metavar="SIZE",
                   help="override the card's memory (bytes or e.g. 80GiB); default: what the device reports")
    add_gpu_memory_utilization(p, default=PLANNER.gpu_memory_utilization, metavar="F",
                               help=f"share of the card the engine may claim (default {PLANNER.gpu_memory_utilization}, "
                                    "vLLM's)")
    p.add_argument("--overhead", type=size, metavar="SIZE",
                   help="replaces the sum of activation peak, non-torch and CUDA-graph memory")
    p.add_argument("--activation-memory", type=size, metavar="SIZE", help="override the activation-peak estimate")
    p.add_argument("--non-torch-memory", type=size, metavar="SIZE",
                   help="override non-torch memory (default 0.25 GiB; 2 GiB + 0.035 GiB x TP at TP>=2)")
    p.add_argument("--cuda-graph-memory", type=size, metavar="SIZE",
                   help="override the CUDA-graph estimate (outside the pool in vLLM 0.19; checked against the headroom)")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=size, metavar="SIZE",
                   help="KV pool per card, replacing the whole wall (vLLM's kv_cache_memory_bytes)")
    add_kv_cache_dtype(p)
    add_tensor_parallel_size(p, help="tensor-parallel ranks; weights and KV heads split, numbers are per card "
                                     f"(default {PLANNER.tensor_parallel_size})")
    p.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=PLANNER.pipeline_parallel_size,
                   metavar="N", help="pipeline stages; layers split, numbers are the last stage's card "
                                     f"(default {PLANNER.pipeline_parallel_size})")
    add_block_size(p, default=PLANNER.block_size, vllm_sizes=True,
                   help=f"tokens per KV block: {', '.join(map(str, VLLM_BLOCK_SIZES))} (default {CUDA_BLOCK_SIZE}; "
                        "a hybrid model's block is raised until one page holds a layer's state, as vLLM does)")
    p.add_argument("--dtype", default=PLANNER.dtype, choices=("auto", *MODEL_DTYPES), metavar="D",
                   help=f"vLLM's --dtype for weights and activations: auto, {', '.join(MODEL_DTYPES)} "
                        "(default auto: the config's torch_dtype)")
    p.add_argument("--quantization", "-q", choices=RUNTIME_QUANTIZATIONS, metavar="METHOD",
                   help="vLLM's runtime quantization of an unquantized checkpoint: fp8 (linear layers 1 byte)")
    p.add_argument("--weights-dtype", choices=tuple(WEIGHT_DTYPE_BYTES), metavar="D",
                   help=f"what-if: every weight at this size: {', '.join(WEIGHT_DTYPE_BYTES)}")
    add_max_num_batched_tokens(p, default=PLANNER.max_num_batched_tokens, metavar="N",
                               help="tokens in the profiling pass that sets the activation peak (default vLLM's for "
                                    f"the card: {LARGE_CARD_MAX_NUM_BATCHED_TOKENS} on {LARGE_CARD_BYTES // GiB} GiB+ "
                                    f"cards but the A100, else {MAX_NUM_BATCHED_TOKENS})")
    add_max_num_seqs(p, default=PLANNER.max_num_seqs, metavar="N",
                     help="concurrency cap; sizes the sampler in the profiling pass (default vLLM's for the card: "
                          f"{LARGE_CARD_MAX_NUM_SEQS} on {LARGE_CARD_BYTES // GiB} GiB+ cards but the A100, "
                          f"else {MAX_NUM_SEQS})")
    p.add_argument("--bandwidth", type=rate, metavar="RATE",
                   help="sustained memory bandwidth, e.g. 1.5TB/s (default: the card's peak x --bandwidth-efficiency)")
    p.add_argument("--bandwidth-efficiency", type=fraction, default=DEFAULT_BANDWIDTH_EFFICIENCY, metavar="F",
                   help=f"share of the peak bandwidth a decode step sustains (default {DEFAULT_BANDWIDTH_EFFICIENCY})")
    add_mamba_ssm_cache_dtype(p)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="hybrid models: prefix caching on or off (vLLM's flag); on, a request holds 2 state blocks "
                        "per state group (3 for Mamba2 in vLLM 0.32) instead of 1 (default: the release's, off "
                        "before 0.28, on after)")
    p.add_argument("--vllm-version", metavar="X.Y", default=None,
                   help=f"the vLLM release whose rules to follow where they changed (the hybrid token line, state "
                        f"blocks under prefix caching, the max_num_seqs refusal): {'.'.join(map(str, OLDEST_VLLM_VERSION))}"
                        f" to {DEFAULT_VLLM_VERSION} (default {DEFAULT_VLLM_VERSION}, the newest modeled)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every number")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="capacity plan: the memory wall, KV tokens, users per context, bandwidth, workload",
        description="How many users fit on a card: vLLM's memory wall term by term, the KV blocks and tokens it "
                    "leaves, users at 2K/8K/32K/128K, the decode-step bandwidth model, and sizing from a real trace.")
    add_memory_arguments(p)
    p.add_argument("--max-model-len", type=token_count, metavar="N",
                   help="per-sequence context ceiling; an error (as vLLM's) when the pool cannot hold one "
                        "or it exceeds the model's max_position_embeddings")
    p.add_argument("--users", type=token_count, metavar="N", help="concurrent sequences for the bandwidth model")
    p.add_argument("--context", type=token_count, metavar="T",
                   help=f"live tokens per sequence for the bandwidth model and the crossover (default {CROSSOVER_CONTEXT})")
    p.add_argument("--workload", metavar="FILE", help="trace to size from: Azure CSV, Mooncake JSONL, or generic "
                                                      "CSV/JSONL with prompt_tokens,output_tokens[,timestamp]")
    p.add_argument("--shared-prefix-tokens", type=positive_int, metavar="N",
                   help="tokens of system prompt every request shares (prefix-caching savings)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG: users vs context, the memory wall and, with --workload, "
                                                  "the length histogram and the live tokens over the trace against the pool")
    t = p.add_argument_group("second KV tier (vLLM's KV offloading)")
    add_kv_offloading_size(t, help="GiB (2^30 bytes) of a second KV tier, all ranks together (vLLM's flag): its "
                                   "blocks and tokens, the memory it takes, and loading a prefix of --context tokens "
                                   f"(default {CROSSOVER_CONTEXT}) from it against computing it again")
    add_kv_offloading_path(t)
    add_kv_offloading_bandwidth(t)
    p.set_defaults(func=run)


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    """The planner's settings from the parsed flags."""
    return PlannerConfig(
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        block_size=args.block_size, weights_dtype=args.weights_dtype, dtype=args.dtype, quantization=args.quantization,
        overhead=args.overhead, kv_cache_memory=args.kv_cache_memory, activation=args.activation_memory,
        non_torch=args.non_torch_memory, cuda_graph=args.cuda_graph_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
        vllm_version=args.vllm_version, max_model_len=getattr(args, "max_model_len", None),
    )


def resolve(args: argparse.Namespace):
    """(ModelSpec, GPU with overrides)."""
    from kvledger.planner.gpus import get_gpu
    from kvledger.spec import load_model_spec

    spec = load_model_spec(args.model)
    gpu = get_gpu(args.gpu).with_overrides(memory_bytes=args.gpu_memory)
    return spec, gpu


def run(args: argparse.Namespace) -> int:
    import sys

    if args.gpu.strip().lower() == "list":
        from kvledger.planner.gpus import list_catalog

        print(list_catalog())
        return 0
    if not args.model:
        from kvledger.errors import KVLedgerError

        raise KVLedgerError("give a MODEL: a preset (kvledger kv-bytes --list), a Hugging Face id, a config.json or a "
                            "model directory")
    from kvledger import planner

    spec, gpu = resolve(args)
    # with a second tier, --context alone is the prefix to load (the bandwidth model takes it with --users)
    context = None if args.kv_offloading_size and args.users is None else args.context
    plan = planner.plan(spec, gpu, planner_config(args), users=args.users, context=context,
                        workload=args.workload, shared_prefix_tokens=args.shared_prefix_tokens,
                        bandwidth=args.bandwidth, bandwidth_efficiency=args.bandwidth_efficiency,
                        gpu_memory_given=args.gpu_memory is not None)
    if args.kv_offloading_size:
        from kvledger.planner.offload import plan_offload

        from kvledger.sim.step_model import StepModel

        wall = plan.wall
        model = StepModel.from_gpu(spec, gpu, wall.kv_cache_dtype, wall.tensor_parallel_size)
        plan.numbers.update(plan_offload(
            spec, gpu, wall, args.kv_offloading_size, prefix_tokens=args.context or CROSSOVER_CONTEXT,
            recompute_seconds=lambda t: model.prefill_seconds(t, wall.max_num_batched_tokens),
            path=args.kv_offloading_path, bandwidth=args.kv_offloading_bandwidth))
    for warning in plan.numbers["warnings"]:
        print(f"kvledger plan: warning: {warning}", file=sys.stderr)
    if args.plot:
        from kvledger.planner.plot import plot_plan

        plot_plan(args.plot, plan.spec, plan.wall, plan.trace, plan.replay)
        plan.numbers["plot"] = args.plot
    if args.json:
        print_json(plan.numbers)
    else:
        print_plan(plan)
    return 0


# ---------------------------------------------------------------------------------- text
def _gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def print_plan(result) -> None:
    """The text report of a :class:`kvledger.planner.capacity.Plan`."""
    from tabulate import tabulate

    from kvledger.units import format_bytes, format_rate

    spec, gpu, wall, plan = result.spec, result.gpu, result.wall, result.numbers
    tp = wall.tensor_parallel_size
    print(f"{spec.describe()}")
    if wall.hybrid:  # the version rules are the hybrid pool's; other models' numbers are the same in every release
        print(f"vLLM {wall.vllm_version}'s hybrid pool (--vllm-version)")
    print(f"on {gpu.name} ({gpu.full_name}, {gpu.sm}, {_gib(gpu.memory_bytes)} GiB, "
          f"{format_rate(gpu.bandwidth_bytes_per_s)})" + (f", TP {tp}: numbers are per card" if tp > 1 else ""))
    print()
    label = "total memory (--gpu-memory)" if plan["gpu_memory_given"] else "total memory (as the device reports)"
    rows = [(label, f"{wall.total_bytes:,}", _gib(wall.total_bytes))]
    if wall.kv_pool_given:
        rows.append(("- weights", f"{wall.weights_bytes:,}", _gib(wall.weights_bytes)))
        rows.append(("= KV cache pool (--kv-cache-memory)", f"{wall.kv_pool_bytes:,}", _gib(wall.kv_pool_bytes)))
    else:
        rows.append((f"x gpu-memory-utilization {wall.gpu_memory_utilization}", f"{wall.requested_bytes:,}",
                     _gib(wall.requested_bytes)))
        rows.append((f"- weights{' per rank' if tp > 1 else ''}", f"{wall.weights_bytes:,}", _gib(wall.weights_bytes)))
        if wall.overhead_given:
            rows.append(("- overhead (--overhead)", f"{wall.overhead_bytes:,}", _gib(wall.overhead_bytes)))
        else:
            rows += [("- activation peak (profiling pass)", f"{wall.activation_bytes:,}", _gib(wall.activation_bytes)),
                     ("- non-torch memory", f"{wall.non_torch_bytes:,}", _gib(wall.non_torch_bytes))]
        rows.append(("= KV cache pool", f"{wall.kv_pool_bytes:,}", _gib(wall.kv_pool_bytes)))
    if not wall.overhead_given:
        rows += [(f"outside the pool: 1 - {wall.gpu_memory_utilization}", f"{wall.headroom_bytes:,}",
                  _gib(wall.headroom_bytes)),
                 ("- CUDA context" + (" and communicators" if wall.comm_init_bytes else ""),
                  f"{wall.cuda_context_bytes + wall.comm_init_bytes:,}", _gib(wall.cuda_context_bytes + wall.comm_init_bytes)),
                 ("- CUDA graphs (captured after the pool)", f"{wall.cuda_graph_bytes:,}", _gib(wall.cuda_graph_bytes)),
                 (f"- sampler warm-up ({wall.max_num_seqs:,} requests)", f"{wall.sampler_warmup_bytes:,}",
                  _gib(wall.sampler_warmup_bytes)),
                 ("= left", f"{wall.headroom_left_bytes:,}", _gib(wall.headroom_left_bytes))]
    print(tabulate(rows, headers=["memory wall", "bytes", "GiB"], colalign=("left", "right", "right"), disable_numparse=True))
    print()
    rows = [(f"bytes per token (Eq 2.2, {wall.kv_cache_dtype})", f"{wall.bytes_per_token:,}",
             format_bytes(wall.bytes_per_token))]
    if wall.scale_bytes_per_token:
        rows.append(("scale bytes per token", f"{wall.scale_bytes_per_token:,}", format_bytes(wall.scale_bytes_per_token)))
    if wall.hybrid:
        rows += [(f"state per request ({spec.num_state_layers} {spec.state.family} layers, fixed)",
                  f"{wall.state_bytes_per_request:,}", format_bytes(wall.state_bytes_per_request)),
                 (f"attention block size ({'set by vLLM to hold a state' if wall.block_size_raised else '--block-size'})",
                  f"{wall.block_size:,} tokens", ""),
                 (f"page (one layer), state padded by {wall.state_padding_pct:.2f}%", f"{wall.page_bytes:,}",
                  format_bytes(wall.page_bytes)),
                 (f"groups of {wall.group_size} layers", f"{wall.attention_groups} attention + {wall.state_groups} state", ""),
                 (f"state blocks per request (prefix caching {'on' if wall.prefix_caching else 'off'})",
                  f"{wall.state_groups * wall.state_blocks_per_request}", "")]
    rows += [(f"block ({wall.block_size} tokens)", f"{wall.block_bytes:,}", format_bytes(wall.block_bytes)),
             ("blocks", f"{wall.num_blocks:,}", ""),
             *([(f"engine block (one KV group: {wall.engine_group_layers} layers x {wall.block_size} tokens)",
                 f"{wall.engine_block_bytes:,}", format_bytes(wall.engine_block_bytes)),
                ("engine blocks", f"{wall.engine_num_blocks:,}", ""),
                ("engine pool (its cache tensors)", f"{wall.engine_pool_bytes:,}", format_bytes(wall.engine_pool_bytes))]
               if wall.engine_block_bytes != wall.block_bytes else []),
             ("GPU KV cache size (tokens)", f"{wall.kv_tokens:,}", ""),
             *([(f"maximum concurrency for {plan['max_model_len']:,} tokens per request",
                 f"{plan['max_concurrency']:.2f}x", "")] if "max_concurrency" in plan else []),
             ("crossover: KV traffic = weight traffic (live tokens)", f"{plan['crossover_tokens']:,}",
              f"{plan['crossover_conversations']:.1f} x {plan['crossover_context']:,}-token conversations")]
    print(tabulate(rows, headers=["KV cache", "", ""], colalign=("left", "right", "right"), disable_numparse=True))
    print()
    rows = [(f"{int(t):,}", f"{n:,}", format_bytes(plan["held_bytes_per_context"][t]), plan["useful_work"][t])
            for t, n in plan["users_per_context"].items()]
    headers = ["context per user", "concurrent users", "KV held per user", "useful work?"]
    if wall.hybrid:  # a hybrid user's blocks: its attention blocks and its state blocks
        rows = [(*row[:3], f"{plan['blocks_per_context'][t]:,}", row[3])
                for row, t in zip(rows, plan["users_per_context"])]
        headers = headers[:3] + ["blocks per user (state + tokens)"] + headers[3:]
    print(tabulate(rows, headers=headers, colalign=("right",) * (len(headers) - 1) + ("left",), disable_numparse=True))
    if "step_time_s" in plan:
        print()
        print(f"bandwidth model: {plan['users']} users x {plan['context']:,} tokens at "
              f"{format_rate(plan['bandwidth_bytes_per_s'])}" + ("" if plan["load_fits"] else "  (does NOT fit the pool)"))
        rows = [("weights read per step" + (" (touched experts only)" if wall.num_experts else ""),
                 _gib(plan["weights_bytes_per_step"]) + " GiB"),
                ("KV read per step", _gib(plan["kv_bytes_per_step"]) + " GiB"),
                ("total per step", _gib(plan["total_bytes_per_step"]) + " GiB"),
                ("step time", f"{plan['step_time_s'] * 1e3:.1f} ms"),
                ("aggregate", f"{plan['tokens_per_s']:,.0f} tok/s"),
                ("per user", f"{plan['tokens_per_s_per_user']:.1f} tok/s"),
                ("KV share of bytes moved", f"{plan['kv_byte_share']:.0%}")]
        print(tabulate(rows, colalign=("left", "right")))
    if "workload" in plan:
        print_workload(plan["workload"], wall)
    if "offload_capacity_blocks" in plan:
        print_offload(plan)
    print()
    print(f"verdict: {plan['verdict']}" + (f" ({plan['verdict_term']})" if plan["verdict_term"] else "")
          + f": {plan['verdict_reason']}")
    if plan["verdict_advice"]:
        print(f"  {plan['verdict_advice']}")
    for note in plan["notes"]:
        print(f"note: {note}")
    if plan.get("plot"):
        print(f"plot written to {plan['plot']}")


def print_offload(plan: dict[str, Any]) -> None:
    """The second tier's section of the text report."""
    from tabulate import tabulate

    from kvledger.units import format_bytes, format_rate

    print()
    rows = [(f"block ({plan['offload_copies']} rank{'s' if plan['offload_copies'] > 1 else ''}), "
             "rounded up to the host page", f"{plan['offload_slot_bytes']:,}", format_bytes(plan["offload_slot_bytes"])),
            ("blocks", f"{plan['offload_capacity_blocks']:,}", ""),
            ("tokens", f"{plan['offload_capacity_tokens']:,}", ""),
            (f"{plan['offload_medium']} it takes", f"{plan['offload_bytes']:,}", format_bytes(plan["offload_bytes"])),
            (f"load {plan['offload_prefix_tokens']:,} tokens at {format_rate(plan['offload_bandwidth_bytes_per_s'])} "
             f"({plan['offload_link']})", f"{plan['offload_load_s'] * 1e3:,.1f} ms", ""),
            ("compute them again (step model, chunked prefill)", f"{plan['offload_recompute_s'] * 1e3:,.1f} ms",
             f"{plan['offload_load_speedup']:.1f}x the load" if plan["offload_load_speedup"] else "")]
    print(tabulate(rows, headers=[f"second KV tier: --kv-offloading-size {plan['offload_size_gib']:g} GiB", "", ""],
                   colalign=("left", "right", "right"), disable_numparse=True))
    for note in plan["offload_notes"]:
        print(f"note: {note}")


def _percentile_table(first: str, named: list[tuple[str, dict[str, float]]]) -> str:
    """One row per (label, ``workload.percentiles`` dict), one column per statistic (mean, p50, ...)."""
    from tabulate import tabulate

    keys = list(named[0][1])
    rows = [(label, *(f"{stats[k]:,.0f}" for k in keys)) for label, stats in named]
    return tabulate(rows, headers=[first, *keys], colalign=("left",) + ("right",) * len(keys))


def print_workload(w: dict[str, Any], wall) -> None:
    from tabulate import tabulate

    print()
    span = f" over {w['duration_s'] / 60:.1f} min" if w["duration_s"] else ""
    print(f"workload {w['file']} ({w['format']}): {w['requests']:,} requests{span}")
    print(_percentile_table("tokens", [("prompt", w["prompt_tokens"]), ("output", w["output_tokens"]),
                                       ("prompt+output", w["total_tokens"])]))
    print()
    rows = [(f"{h['lo']:,}-{h['hi']:,}" if h["hi"] else f"{h['lo']:,}+", f"{h['prompt']:,}", f"{h['output']:,}",
             f"{h['total']:,}")
            for h in w["histogram"] if h["prompt"] or h["output"] or h["total"]]
    print(tabulate(rows, headers=["length", "prompts", "outputs", "prompt+output"], colalign=("right",) * 4))
    r = w["replay"]
    if r:
        print()
        print(f"live tokens over the trace (replayed, step {r['step_time_s'] * 1e3:.1f} ms) against the pool "
              f"of {wall.kv_tokens:,} tokens:")
        print(_percentile_table("", [("live tokens", r["live_tokens"]), ("sequences", r["sequences"])]))
        print(f"time with demand above the pool: {r['time_over_pool']:.1%}")
    else:
        print("no timestamps in the trace: live tokens over time are not replayed")
    rec = w["recommend"]
    print(f"recommend --max-model-len {rec['max_model_len']:,} (rejects {rec['rejected_share']:.2%} of requests) "
          f"and --max-num-seqs {rec['max_num_seqs']:,} ({rec['live_tokens_per_sequence']:,.0f} live tokens per sequence)")
    pc = w["prefix_caching"]
    if pc:
        print(f"prefix caching ({pc['source']}): {pc['saved_tokens']:,} of {pc['prompt_tokens']:,} prompt tokens "
              f"reused ({pc['saved_share']:.1%})")
