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
