"""Workload sizing from a real request trace: lengths, live tokens over time, and the limits to set.

The trace itself comes from ``kvledger.workload.traces`` (one reader for the planner, the
benchmark client and the simulator).

The replay: each request arrives at its timestamp and stays resident for its prefill
(``prompt x 2 x active parameters`` FLOPs at the card's dense bf16 rate times
``bandwidth.PREFILL_EFFICIENCY``) and then its decode (``output`` steps at the modelled step time),
holding its prompt and the tokens generated so far. The step time depends on the load, so it
is solved by fixed-point iteration on the time-averaged live tokens. Nothing queues: the
result is the demand on the pool over time, to be read against the pool.
Lengths are tokens, times seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvledger.workload.traces import MOONCAKE_BLOCK_TOKENS, Trace

REPLAY_SAMPLES = 4096
"""Points of the time grid on which live tokens are sampled."""
HISTOGRAM_EDGES = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
PERCENTILES = (50, 90, 99)


# ------------------------------------------------------------------------------ lengths
def percentiles(values: np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99 and max of ``values``."""
    out = {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}}
    out["max"] = float(values.max())
    return out


def histogram(trace: Trace, edges: tuple[int, ...] = HISTOGRAM_EDGES) -> list[dict[str, Any]]:
    """Counts of prompt, output and total lengths per bin ``[lo, hi)``; the last bin is open."""
    bounds = np.asarray([*edges, np.iinfo(np.int64).max])
    rows = []
    counts = {k: np.histogram(v, bins=bounds)[0] for k, v in
              (("prompt", trace.prompt), ("output", trace.output), ("total", trace.total))}
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        rows.append({"lo": lo, "hi": hi, **{k: int(c[i]) for k, c in counts.items()}})
    return rows


def mean_live_tokens(trace: Trace) -> float:
    """Live tokens of an average request over its decode: its prompt plus half its output."""
    return float((trace.prompt + trace.output / 2).mean())


# ------------------------------------------------------------------------------ replay
@dataclass
class Replay:
    """Live tokens and resident sequences over the trace, sampled on a uniform time grid."""

    times_s: np.ndarray
    live_tokens: np.ndarray
    sequences: np.ndarray
    step_time_s: float
    prefill_s_per_token: float
    iterations: int

    def stats(self, pool_tokens: int) -> dict[str, Any]:
        busy = self.sequences > 0
        per_seq = float(self.live_tokens[busy].sum() / self.sequences[busy].sum()) if busy.any() else 0.0
        return {
            "live_tokens": percentiles(self.live_tokens),
            "sequences": percentiles(self.sequences),
            "live_tokens_per_sequence": per_seq,
            "time_over_pool": float((self.live_tokens > pool_tokens).mean()),
            "step_time_s": self.step_time_s,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def replay(trace: Trace, step_time_of: Callable[[float], float], prefill_s_per_token: float,
           samples: int = REPLAY_SAMPLES, iterations: int = 4) -> Replay | None:
    """Replay the arrivals; ``step_time_of(live_tokens)`` gives the decode step time (s).
    ``None`` when the trace has no timestamps."""
    if trace.arrival_s is None:
        return None
    step = step_time_of(0.0)
    for it in range(1, iterations + 1):
        times, live, seqs = _sample(trace, step, prefill_s_per_token, samples)
        new_step = step_time_of(float(live.mean()))
        converged = abs(new_step - step) <= 1e-3 * step
        step = new_step
        if converged:
            break
    times, live, seqs = _sample(trace, step, prefill_s_per_token, samples)
    return Replay(times, live, seqs, step, prefill_s_per_token, it)


def _sample(trace: Trace, step: float, prefill_s_per_token: float, samples: int):
    """Live tokens and sequences on a time grid, summed from difference arrays in O(n + samples).

    A request holds ``prompt`` tokens from arrival ``a`` to its end ``e`` and, from the end of
    its prefill ``d`` on, ``(t - d) / step`` generated tokens more."""
    a = trace.arrival_s
    d = a + trace.prompt * prefill_s_per_token
    e = d + trace.output * step
    times = np.linspace(float(a[0]), float(e.max()), samples)
    ia, id_, ie = (np.searchsorted(times, x, side="left") for x in (a, d, e))
    n = samples + 1
    level = np.zeros(n)
    count = np.zeros(n)
    slope = np.zeros(n)
    offset = np.zeros(n)
    np.add.at(level, ia, trace.prompt)
    np.add.at(level, ie, -trace.prompt)
    np.add.at(count, ia, 1)
    np.add.at(count, ie, -1)
    np.add.at(slope, id_, 1 / step)
    np.add.at(slope, ie, -1 / step)
    np.add.at(offset, id_, -d / step)
    np.add.at(offset, ie, d / step)
    live = (np.cumsum(level) + np.cumsum(slope) * np.append(times, 0) + np.cumsum(offset))[:samples]
    seqs = np.cumsum(count)[:samples]
    return times, np.maximum(np.rint(live), 0.0), np.rint(seqs)


# ------------------------------------------------------------------------------ prefixes
def prefix_savings(trace: Trace, shared_prefix_tokens: int | None = None) -> dict[str, Any] | None:
    """Prompt tokens prefix caching would not recompute (unbounded cache, trace order).

    With Mooncake ``hash_ids``: a request reuses its leading blocks already seen in an earlier
    request. With ``shared_prefix_tokens`` N: every request shares its first ``min(N, prompt)``
    tokens with the first request."""
    prompt_total = int(trace.prompt.sum())
    if shared_prefix_tokens:
        shared = np.minimum(trace.prompt, shared_prefix_tokens)
        saved = max(int(shared.sum()) - int(shared[0]), 0)
        source = f"--shared-prefix-tokens {shared_prefix_tokens}"
    elif trace.hash_ids is not None:
        saved, seen = 0, set()
        for length, ids in zip(trace.prompt.tolist(), trace.hash_ids):
            for i, block in enumerate(ids):
                if block not in seen:
                    break
                saved += min(MOONCAKE_BLOCK_TOKENS, length - i * MOONCAKE_BLOCK_TOKENS)
            seen.update(ids)
        source = f"hash_ids ({MOONCAKE_BLOCK_TOKENS}-token blocks)"
    else:
        return None
    return {"source": source, "prompt_tokens": prompt_total, "saved_tokens": saved,
            "saved_share": saved / prompt_total if prompt_total else 0.0}


# ------------------------------------------------------------------------------ limits
P99_RULE_REJECTS = 0.02
"""The most requests the p99 rule of :func:`recommend` turns away by itself: those above the 99th
percentile of prompts or of outputs, 1% each. A recommendation that rejects more was cut by the
model's context, and the plan's verdict says so."""


def recommend(trace: Trace, block_size: int, pool_tokens: int, live_per_sequence: float | None,
              model_max_len: int | None = None) -> dict[str, Any]:
    """``--max-model-len`` (p99 prompt + p99 output, rounded up to a block, at most the model's
    maximum) with the share of requests it rejects, and ``--max-num-seqs`` (the pool over the
    live tokens of an average resident sequence)."""
    p99 = float(np.percentile(trace.prompt, 99)) + float(np.percentile(trace.output, 99))
    max_len = math.ceil(p99 / block_size) * block_size
    if model_max_len:
        max_len = min(max_len, int(model_max_len))
    rejected = float((trace.total > max_len).mean())
    per_seq = live_per_sequence or mean_live_tokens(trace)
    return {"max_model_len": int(max_len), "rejected_share": rejected,
            "max_num_seqs": max(1, int(pool_tokens // max(per_seq, 1.0))), "live_tokens_per_sequence": per_seq}
