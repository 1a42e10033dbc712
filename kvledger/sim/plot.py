"""``simulate --plot``: KV blocks against the pool, running and waiting requests over time, and the
CDFs of TTFT and TPOT (one PNG, four panels; replica 0's time series in a fleet)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvledger.metrics.serving import request_values
from kvledger.plotting import pyplot, save_png


def plot_run(res: Any, fleet: Any, path: str) -> None:
    plt = pyplot(path)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    s = res.replicas[0].series
    ax = axes[0][0]
    ax.plot(s.time_s, s.blocks_allocated, label="blocks allocated")
    ax.plot(s.time_s, s.token_blocks, label="tokens held (as blocks)")
    ax.plot(s.time_s, s.cached_free_blocks, label="cached free blocks")
    ax.axhline(fleet.num_blocks, color="black", linestyle="--", label=f"pool ({fleet.num_blocks:,} blocks)")
    ax.set(title="KV blocks" + (" (replica 0)" if fleet.replicas > 1 else ""), xlabel="time (s)", ylabel="blocks")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(s.time_s, s.running, label="running")
    ax.plot(s.time_s, s.waiting, label="waiting")
    ax.set(title="requests" + (" (replica 0)" if fleet.replicas > 1 else ""), xlabel="time (s)", ylabel="requests")
    ax.legend(fontsize=8)
    for ax, metric, name in ((axes[1][0], "ttft", "TTFT"), (axes[1][1], "tpot", "TPOT")):
        values = np.sort([v for r in res.results for v in request_values(r, metric)]) * 1e3
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="share of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(res.requests)} requests, {fleet.replicas} replica(s), router {fleet.router}")
    save_png(fig, path)


def plot_offload_sweep(out: dict[str, Any], path: str) -> None:
    """``simulate --kv-offloading-size A,B,... --plot``: the prefix-cache hit rate by source (pool,
    second tier) and TTFT p50/p99 against the second tier's size in GiB."""
    plt = pyplot(path)
    runs = out["runs"]
    gib = [r["kv_offloading_size"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    pool = np.array([r["prefix_cache_hit_rate_by_source"]["local_cache_hit"] for r in runs]) * 100
    tier = np.array([r["prefix_cache_hit_rate_by_source"]["external_kv_transfer"] for r in runs]) * 100
    left.stackplot(gib, pool, tier, labels=["pool (local_cache_hit)", "second tier (external_kv_transfer)"], alpha=0.8)
    left.set(title="prefix-cache hit rate by source", xlabel="--kv-offloading-size (GiB per replica)",
             ylabel="% of prompt tokens looked up")
    left.legend(fontsize=8, loc="upper left")
    for q in ("p50", "p99"):
        right.plot(gib, [r["ttft_ms"][q] / 1e3 for r in runs], marker="o", label=f"TTFT {q}")
    right.set(title="TTFT", xlabel="--kv-offloading-size (GiB per replica)", ylabel="seconds")
    right.legend(fontsize=8)
    right.set_yscale("log")
    positive = [g for g in gib if g > 0]
    for ax in (left, right):
        if positive:  # sizes grow by factors: a log axis, linear below the smallest size so 0 (no tier) shows
            ax.set_xscale("symlog", linthresh=min(positive))
        ax.set_xticks(gib, [f"{g:g}" for g in gib])
        ax.set_xlim(min(gib), max(gib))
        ax.grid(alpha=0.3)
    fig.suptitle(f"{out['model']} ({out['step_model']}), {out['num_prompts']} requests from {out['trace']}")
    save_png(fig, path)
