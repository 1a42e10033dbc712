"""Figures for ``kvledger plan --plot``: users vs context length, the memory wall, the length
histogram. matplotlib is optional (the ``plot`` extra; see ``kvledger.plotting``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvledger.plotting import pyplot, save_png
from kvledger.units import GiB

if TYPE_CHECKING:
    from kvledger.planner.memory_wall import MemoryWall
    from kvledger.workload.traces import Trace
    from kvledger.spec import ModelSpec


def plot_plan(path: str | Path, spec: "ModelSpec", wall: "MemoryWall", trace: "Trace | None" = None) -> Path:
    """Write a PNG with two panels (three with a trace) and return its path."""
    plt = pyplot(path)
    from kvledger.planner.memory_wall import CONTEXTS, users_at

    panels = 3 if trace is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    ax = axes[0]
    contexts = sorted({*(2 ** k for k in range(9, 18)), *CONTEXTS})
    users = {t: users_at(spec, wall, t) for t in contexts}  # one count per point
    ax.plot(contexts, list(users.values()), marker="o")
    for t in CONTEXTS:
        ax.annotate(str(users[t]), (t, users[t]), textcoords="offset points", xytext=(4, 6))
    ax.set(xscale="log", yscale="log", xlabel="context per user (tokens)", ylabel="concurrent users",
           title=f"{spec.name} on {wall.gpu}: users vs context")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    parts = [("weights", wall.weights_bytes), ("overhead", wall.overhead_bytes), ("KV cache", wall.kv_pool_bytes)]
    free = wall.total_bytes - sum(v for _, v in parts)
    if free > 0:
        parts.append(("unclaimed", free))
    bottom = 0.0
    for name, value in parts:
        ax.bar(["memory"], [value / GiB], bottom=bottom, label=f"{name}: {value / GiB:.2f} GiB")
        bottom += value / GiB
    ax.set(ylabel="GiB", title=f"memory wall ({wall.kv_tokens:,} KV tokens)")
    ax.legend(loc="upper right", fontsize=8)

    if trace is not None:
        import numpy as np

        ax = axes[2]
        bins = np.logspace(0, np.log10(max(2, int(trace.total.max()))), 40)
        ax.hist(trace.prompt, bins=bins, alpha=0.6, label="prompt")
        ax.hist(np.maximum(trace.output, 1), bins=bins, alpha=0.6, label="output")
        for q in (50, 99):
            ax.axvline(float(np.percentile(trace.total, q)), linestyle="--", color="k", alpha=0.5)
        ax.set(xscale="log", xlabel="tokens", ylabel="requests", title=f"{trace.name}: lengths (p50, p99 dashed)")
        ax.legend(fontsize=8)
    return save_png(fig, path)
