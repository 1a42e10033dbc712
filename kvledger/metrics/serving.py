"""Serving metrics with the definitions of vLLM's ``vllm bench serve``: one implementation,
used by ``kvledger bench serve`` (measured) and ``kvledger simulate`` (predicted).

- TTFT: request sent -> first output chunk (per request).
- ITL: the gaps between successive chunks of a request, all requests pooled.
- TPOT: per request ``(E2EL - TTFT) / (output_tokens - 1)``, requests with more than one token.
- E2EL: request sent -> last output chunk.
- Throughput: completed requests, output tokens and input + output tokens, each over the
  run's duration.

Means, medians, standard deviations and percentiles (``numpy.percentile``) in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvledger.errors import KVLedgerError

@dataclass
class RequestResult:
    """What a client saw of one request (or what the simulator predicts it sees); times in seconds.

    ``ttft`` and ``latency`` (E2EL) count from the request's send time, ``start_time`` (the
    client's ``time.perf_counter()``, as vLLM's benchmark client records it; the simulator's
    virtual seconds); ``itl`` holds the gaps between successive output chunks."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    start_time: float = 0.0



@dataclass
class ServingMetrics:
    """Serving metrics of one run; times in milliseconds in ``stats_ms``, throughputs per second."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    stats_ms: dict[str, dict[str, float]]  # metric -> {"mean", "median", "std", "p50", ...}
    errors: list[str] = field(default_factory=list)


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values or [0.0]) * 1000.0
    out = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      percentiles: list[float] = (50, 90, 99), tokenizer: Any = None) -> ServingMetrics:
    """vLLM's ``calculate_metrics``: per-request TTFT, TPOT and E2EL; ITL pooled over all requests."""
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = completed = 0
    for r in results:
        if not r.success:
            continue
        n_out = r.output_tokens
        if not n_out:  # no usage from the server: count the text's tokens, else one per chunk
            n_out = (len(tokenizer(r.generated_text, add_special_tokens=False).input_ids) if tokenizer is not None
                     else len(r.itl) + 1)
        completed += 1
        total_input += r.prompt_len
        total_output += n_out
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        if n_out > 1:
            tpots.append((r.latency - r.ttft) / (n_out - 1))
    pct = list(percentiles)
    return ServingMetrics(
        completed=completed, failed=len(results) - completed, duration_s=duration_s,
        total_input=total_input, total_output=total_output,
        request_throughput=completed / duration_s, output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats_ms={"ttft": _stats(ttfts, pct), "tpot": _stats(tpots, pct), "itl": _stats(itls, pct),
                  "e2el": _stats(e2els, pct)},
        errors=[r.error for r in results if not r.success],
    )


# ------------------------------------------------------------------------------ SLOs and goodput
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_GOODPUT_FRACTION = 0.99
"""Share of requests that must meet every per-request target when the SLO names no ``goodput``."""


@dataclass(frozen=True)
class SLOTarget:
    """``metric`` (ttft, tpot, itl or e2el) at ``stat`` (``p99``, ``p50``, ``mean``...) at most ``seconds``."""

    metric: str
    stat: str
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"


@dataclass(frozen=True)
class SLO:
    """Targets on the run's statistics plus the share of requests that must meet them one by one."""

    targets: tuple[SLOTarget, ...]
    goodput_fraction: float = DEFAULT_GOODPUT_FRACTION


def _duration_s(text: str, where: str) -> float:
    t = text.strip().lower()
    scale = 1.0
    for unit, factor in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], factor
            break
    else:
        scale = 1e-3  # a bare number is milliseconds, as vLLM's --goodput takes them
    try:
        value = float(t) * scale
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise KVLedgerError(f"--slo {where}: {text!r} is not a positive duration (e.g. 2s, 100ms)")
    return value


def parse_slo(text: str) -> SLO:
    """``ttft_p99=2s,tpot_p99=100ms[,goodput=99%]``: any of ttft/tpot/itl/e2el at ``pNN`` or ``mean``
    (``median`` = ``p50``), durations in s, ms or us (a bare number: ms)."""
    targets: list[SLOTarget] = []
    fraction = DEFAULT_GOODPUT_FRACTION
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise KVLedgerError(f"--slo {text!r}: expected METRIC_STAT=DURATION items like ttft_p99=2s,tpot_p99=100ms")
        if key == "goodput":
            v = value.strip()
            try:
                fraction = float(v[:-1]) / 100 if v.endswith("%") else float(v)
            except ValueError:
                fraction = math.nan
            if not 0 < fraction <= 1:
                raise KVLedgerError(f"--slo goodput={value}: give a share of requests in (0, 1] or (0, 100]%")
            continue
        metric, _, stat = key.partition("_")
        stat = "p50" if stat == "median" else stat
        ok_stat = stat == "mean" or (stat.startswith("p") and _percentile_ok(stat[1:]))
        if metric not in SLO_METRICS or not ok_stat:
            raise KVLedgerError(f"--slo {key!r}: use ttft, tpot, itl or e2el with _pNN or _mean, e.g. ttft_p99")
        targets.append(SLOTarget(metric, stat, _duration_s(value, key)))
    if not targets:
        raise KVLedgerError(f"--slo {text!r} names no latency target")
    return SLO(tuple(targets), fraction)


def _percentile_ok(text: str) -> bool:
    try:
        return 0 <= float(text) <= 100
    except ValueError:
        return False


def _stat(values: np.ndarray, stat: str) -> float:
    if not len(values):
        return 0.0
    return float(np.mean(values)) if stat == "mean" else float(np.percentile(values, float(stat[1:])))


def request_values(r: RequestResult, metric: str) -> list[float]:
    """The values of ``metric`` one request contributes, in seconds (vLLM's definitions)."""
    if metric == "ttft":
        return [r.ttft]
    if metric == "e2el":
        return [r.latency]
    if metric == "tpot":
        return [(r.latency - r.ttft) / (r.output_tokens - 1)] if r.output_tokens > 1 else []
    return list(r.itl)


def evaluate_slo(results: list[RequestResult], metrics: ServingMetrics, slo: SLO) -> dict[str, Any]:
    """Each target's value against its limit, the goodput (requests/s meeting every target on
    their own values: TTFT, TPOT and E2EL; for ITL, the request's gaps at the target's statistic)
    and ``slo_met``: every target met and at least ``goodput_fraction`` of requests good."""
    done = [r for r in results if r.success]
    targets = {}
    met = True
    for t in slo.targets:
        value = _stat(np.concatenate([np.asarray(request_values(r, t.metric), float) for r in done])
                      if done else np.zeros(0), t.stat)
        ok = value <= t.seconds
        met &= ok
        targets[t.name] = {"value_ms": value * 1e3, "limit_ms": t.seconds * 1e3, "met": ok}
    good = 0
    for r in done:
        good += all(_stat(np.asarray(request_values(r, t.metric), float), t.stat) <= t.seconds
                    if t.metric == "itl" else all(v <= t.seconds for v in request_values(r, t.metric))
                    for t in slo.targets)
    fraction = good / len(results) if results else 0.0
    return {"targets": targets, "goodput": good / metrics.duration_s if metrics.duration_s else 0.0,
            "goodput_fraction": fraction, "goodput_fraction_needed": slo.goodput_fraction,
            "slo_met": bool(met and fraction >= slo.goodput_fraction)}
