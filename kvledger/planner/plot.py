"""Figures for ``kvledger plan --plot``: users vs context length, the memory wall, the length
histogram and, for a timed trace, the chapter's picture: the aggregate live tokens over the
trace against the pool, with its p50, p90 and p99 drawn and labelled. matplotlib is optional
(the ``plot`` extra; see ``kvledger.plotting``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvledger.plotting import pyplot, save_png
from kvledger.units import GiB

if TYPE_CHECKING:
    from kvledger.planner.memory_wall import MemoryWall
    from kvledger.planner.trace_sizing import Replay
    from kvledger.workload.traces import Trace
    from kvledger.spec import ModelSpec


def plot_plan(path: str | Path, spec: "ModelSpec", wall: "MemoryWall", trace: "Trace | None" = None,
              replay: "Replay | None" = None) -> Path:
    """Write a PNG with two panels (three with a trace, four with a timed one) and return its path."""
    plt = pyplot(path)
    from kvledger.planner.memory_wall import CONTEXTS, users_at

    panels = 2 + (trace is not None) + (replay is not None)
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
    if replay is not None:
        plot_live_tokens(axes[-1], replay, wall.kv_tokens)
    return save_png(fig, path)


LIVE_PERCENTILES = (50, 90, 99)
"""The percentile lines drawn over the live tokens."""


def plot_live_tokens(ax, replay: "Replay", pool_tokens: int) -> None:
    """The aggregate live tokens over the trace (every resident request's prompt and generated
    tokens, sampled on the replay's time grid) against the pool, with labelled percentile lines."""
    import numpy as np

    minutes = replay.times_s / 60
    ax.plot(minutes, replay.live_tokens, lw=0.8, label="live tokens")
    ax.axhline(pool_tokens, color="r", lw=1.5, label=f"KV pool: {pool_tokens:,} tokens")
    styles = {50: ":", 90: "-.", 99: "--"}
    for q in LIVE_PERCENTILES:
        value = float(np.percentile(replay.live_tokens, q))
        ax.axhline(value, color="k", lw=0.9, linestyle=styles.get(q, "--"), alpha=0.7)
        ax.annotate(f"p{q} {value:,.0f}", (minutes[-1], value), textcoords="offset points", xytext=(-4, 3),
                    ha="right", fontsize=8)
    over = float((replay.live_tokens > pool_tokens).mean())
    ax.set(xlabel="time in the trace (min)", ylabel="tokens",
           title=f"live tokens vs the pool ({over:.1%} of the time above)")
    ax.legend(loc="upper left", fontsize=8)
