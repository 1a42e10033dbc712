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

from dataclasses import dataclass, field
from typing import Any

import numpy as np

@dataclass
class RequestResult:
    """What a client saw of one request (or what the simulator predicts it sees); times in seconds.

    ``ttft`` and ``latency`` (E2EL) count from the request's send time; ``itl`` holds the gaps
    between successive output chunks."""

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
