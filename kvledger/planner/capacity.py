"""The capacity plan: every number ``kvledger plan`` reports, assembled from the planner's parts.

:func:`plan` takes a model, a card and the engine's settings (:class:`kvledger.config.PlannerConfig`)
and returns a :class:`Plan`: the memory wall term by term, the KV blocks and tokens it leaves,
users per context, the decode-step bandwidth model (for ``users`` x ``context`` when given), the
sizing from a real trace (``workload``), and the verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvledger.config import PlannerConfig
from kvledger.errors import KVLedgerError
from kvledger.planner import bandwidth as bw
from kvledger.planner.bandwidth import CROSSOVER_CONTEXT, DEFAULT_BANDWIDTH_EFFICIENCY
from kvledger.planner.gpus import GPU
from kvledger.planner.memory_wall import (CONTEXTS, MemoryWall, Verdict, check_max_model_len, max_concurrency,
                                          max_fitting_length, plan_memory, request_held_bytes, sequence_blocks,
                                          startup_max_model_len, useful_work, users_at, verdict)
from kvledger.spec import ModelSpec
from kvledger.units import GiB


@dataclass
class Plan:
    """A capacity plan: the objects it stands on and its numbers."""

    spec: ModelSpec
    gpu: GPU
    wall: MemoryWall
    numbers: dict[str, Any]
    """Every number of the plan, JSON-ready (what ``kvledger plan --json`` prints)."""
    trace: Any = None
    """The workload's :class:`kvledger.workload.traces.Trace`, when one was given."""
    replay: Any = None
    """Its replay against the pool (``planner.trace_sizing.Replay``), when it has timestamps."""


def plan(spec: ModelSpec, gpu: GPU, config: PlannerConfig | None = None, *, users: int | None = None,
         context: int | None = None, workload: str | None = None, shared_prefix_tokens: int | None = None,
         bandwidth: float | None = None, bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY,
         gpu_memory_given: bool = False) -> Plan:
    """The plan of ``spec`` on ``gpu`` (its memory as given) under ``config``. ``users`` sequences of
    ``context`` tokens (default ``CROSSOVER_CONTEXT``) load the bandwidth model; ``workload`` is a
    trace file to size from, with ``shared_prefix_tokens`` of system prompt in every request;
    ``bandwidth`` replaces the card's peak x ``bandwidth_efficiency``. ``gpu_memory_given`` says
    that ``gpu``'s memory is the user's, not the device's. Raises KVLedgerError for a plan that
    cannot start (the wall, ``max_model_len``) or inputs that do not go together."""
    config = config or PlannerConfig()
    max_model_len = config.max_model_len
    if users is not None and context is None:
        context = CROSSOVER_CONTEXT
    if context is not None and users is None:
        raise KVLedgerError("--context needs --users: the bandwidth model is for N users of T tokens each")
    check_context(spec, context, "--context")
    wall = plan_memory(spec, gpu, config)
    if max_model_len:
        error = check_max_model_len(spec, wall, max_model_len)
        if error:
            raise KVLedgerError(error)
    ceiling = max_model_len or spec.max_position_embeddings
    contexts = [t for t in CONTEXTS if not ceiling or t <= ceiling]
    contexts += [max_model_len] if max_model_len and max_model_len not in contexts else []
    if not contexts:
        contexts = [ceiling]
    per_context = {str(t): users_at(spec, wall, t) for t in contexts}
    bandwidth = bw.effective_bandwidth(gpu, bandwidth, bandwidth_efficiency)
    conversation = context or CROSSOVER_CONTEXT
    token_bytes = bw.live_token_bytes(spec, wall.kv_cache_dtype, conversation, wall.tensor_parallel_size)
    crossover = bw.crossover_for(wall, token_bytes, conversation)
    out: dict[str, Any] = {
        "model": spec.name, "gpu": gpu.name, "gpu_full_name": gpu.full_name, "compute_capability": gpu.compute_capability,
        "gpu_memory_given": gpu_memory_given,
        **{k: v for k, v in asdict(wall).items() if k not in ("model", "gpu")},
        "kv_pool_gib": wall.kv_pool_bytes / GiB, "weights_gib": wall.weights_bytes / GiB,
        "users_per_context": per_context,
        "useful_work": {t: useful_work(n) for t, n in per_context.items()},
        "held_bytes_per_context": {str(t): request_held_bytes(spec, wall, t) for t in contexts},
        "blocks_per_context": {str(t): sequence_blocks(spec, wall, t) for t in contexts},
        "bandwidth_bytes_per_s": bandwidth,
        "crossover_tokens": crossover,
        "crossover_context": conversation,
        "crossover_conversations": crossover / conversation,
        "max_fitting_length": max_fitting_length(spec, wall),
        "vllm_max_model_len": startup_max_model_len(spec, wall),
        "weight_bytes_read_per_step": bw.weight_bytes_read_per_step(wall, users or 1),
        "weight_bytes_read_batch": users or 1,
        "notes": list(spec.notes),
        "warnings": list(wall.warnings),
    }
    model_max = spec.max_position_embeddings
    refused_at_default = bool(not max_model_len and model_max and check_max_model_len(spec, wall, model_max))
    if refused_at_default:
        out["notes"].append(f"vLLM would refuse to start with the model's default max_model_len ({model_max:,}): "
                            f"the pool holds {out['max_fitting_length']:,} tokens for one decoding sequence, and vLLM's "
                            f"start-up check (sliding layers at their prefill worst case) allows "
                            f"{out['vllm_max_model_len']:,}; set --max-model-len")
    max_len = max_model_len or model_max
    if max_len:
        out["max_model_len"] = max_len
        out["max_concurrency"] = max_concurrency(spec, wall, max_len)
    if wall.hybrid:
        out["notes"].append(
            f"vLLM {wall.vllm_version}'s hybrid pool: each state layer keeps {wall.state_page_bytes:,} bytes per "
            f"request (per rank); vLLM sets the attention block "
            f"to {wall.block_size} tokens so a page holds one, pads the state page by {wall.state_padding_pct:.2f}%, "
            f"and groups layers {wall.group_size} at a time ({wall.attention_groups} attention + {wall.state_groups} "
            f"state groups); a request holds {wall.state_blocks_per_request} block(s) in each state group"
            f" (prefix caching {'on' if wall.prefix_caching else 'off'})")
    if users:
        kv = bw.kv_read_bytes(spec, wall.kv_cache_dtype, users, context, wall.tensor_parallel_size)
        step = bw.decode_step(bw.weight_bytes_read_per_step(wall, users), kv, users, context, bandwidth)
        out.update({k: v for k, v in asdict(step).items() if k not in ("users", "context")})
        out.update(users=users, context=context, load_fits=users <= users_at(spec, wall, context),
                   request_held_bytes=request_held_bytes(spec, wall, context))
    result = Plan(spec, gpu, wall, out)
    if workload:
        out["workload"], result.trace, result.replay = workload_report(workload, spec, gpu, wall, bandwidth,
                                                                       shared_prefix_tokens)
    # vLLM starts with --max-model-len, or else the model's own context: the verdict holds it to that
    v = verdict(spec, wall, max_model_len=max_model_len or spec.max_position_embeddings, users=users, context=context)
    if v.verdict == "does not fit" and v.term == "KV pool" and refused_at_default:
        v = type(v)(v.verdict, "max-model-len",
                    f"vLLM starts with the model's context ({spec.max_position_embeddings:,} tokens) unless told "
                    f"otherwise, and its start-up check allows {out['vllm_max_model_len']:,} for one request",
                    f"set --max-model-len {out['vllm_max_model_len']} or less")
    if workload and v.verdict != "does not fit":
        v = workload_verdict(out["workload"], spec) or v
    out.update(verdict=v.verdict, verdict_term=v.term, verdict_reason=v.reason, verdict_advice=v.advice)
    return result


def workload_verdict(report: dict[str, Any], spec: ModelSpec) -> Verdict | None:
    """"does not fit" when the recommended ``--max-model-len`` (cut to the model's context) turns away
    more of the trace's requests than the p99 rule alone would: the model cannot serve them, however
    the pool is sized. ``None`` when the recommendation holds the trace."""
    from kvledger.planner.trace_sizing import P99_RULE_REJECTS

    rec = report["recommend"]
    if rec["rejected_share"] <= P99_RULE_REJECTS:
        return None
    return Verdict("does not fit", "workload",
                   f"{rec['rejected_share']:.2%} of the requests of {report['file']} are longer than the model's "
                   f"context, max_position_embeddings = {spec.max_position_embeddings:,}, which --max-model-len "
                   "cannot exceed", "shorten those requests (or check the trace's lengths), or plan a model with a "
                                    "longer context")


def check_context(spec: ModelSpec, tokens: int | None, flag: str) -> None:
    """A one-line error for a per-sequence length above the model's context."""
    model_max = spec.max_position_embeddings
    if tokens is not None and model_max and tokens > model_max:
        raise KVLedgerError(f"{flag} {tokens:,} is greater than the model's context, max_position_embeddings = "
                            f"{model_max:,} in {spec.name}'s config; lower {flag}")


def check_fits_context(trace: Any, spec: ModelSpec) -> None:
    """Refuse a trace none of whose requests (prompt + output tokens) fits the model's context: no
    ``--max-model-len`` serves it, so there is nothing to recommend or to plan."""
    model_max = spec.max_position_embeddings
    shortest = int(trace.total.min())
    if model_max and shortest > model_max:
        raise KVLedgerError(f"every request of {trace.name} is longer than {spec.name}'s context (the shortest has "
                            f"{shortest:,} tokens, max_position_embeddings = {model_max:,}): no --max-model-len "
                            "serves it; check the trace's lengths, or plan a model with a longer context")


def workload_report(path: str, spec: ModelSpec, gpu: GPU, wall: MemoryWall, bandwidth: float,
                    shared_prefix_tokens: int | None = None) -> tuple[dict[str, Any], Any, Any]:
    """(report, trace, replay): the trace's lengths, its replay against the pool, the limits to set
    and the prefix savings. The replay reads each live token at its cost in a sequence of the
    trace's mean live length (exact for full-attention models; see ``bandwidth``)."""
    from kvledger.planner import trace_sizing as wl
    from kvledger.workload.sampling import check_shared_prefix, mean_prompt_tokens
    from kvledger.workload.traces import read_trace

    trace = read_trace(path)
    check_fits_context(trace, spec)
    check_shared_prefix(shared_prefix_tokens, mean_prompt_tokens(trace.prompt), f"the mean prompt of {trace.name}")
    context = max(1, round(wl.mean_live_tokens(trace)))
    token_bytes = bw.live_token_bytes(spec, wall.kv_cache_dtype, context, wall.tensor_parallel_size)
    rep = wl.replay(trace, lambda live: bw.step_time(bw.weight_bytes_read_per_step(wall, max(1, round(live / context))),
                                                     live, token_bytes, bandwidth),
                    bw.prefill_seconds_per_token(spec, gpu, wall.tensor_parallel_size))
    stats = rep.stats(wall.kv_tokens) if rep else None
    out = {
        "file": trace.name, "format": trace.format, "requests": len(trace), "duration_s": trace.duration_s,
        "prompt_tokens": wl.percentiles(trace.prompt), "output_tokens": wl.percentiles(trace.output),
        "total_tokens": wl.percentiles(trace.total), "histogram": wl.histogram(trace),
        "replay": stats,
        "recommend": wl.recommend(trace, wall.block_size, wall.kv_tokens,
                                  stats["live_tokens_per_sequence"] if stats else None, spec.max_position_embeddings),
        "prefix_caching": wl.prefix_savings(trace, shared_prefix_tokens),
    }
    return out, trace, rep
