"""Hybrid models held against vLLM's own start-up logs: block size, padding, blocks, tokens, refusals.

A row of ``tests/data/vllm_hybrid_startup_logs.json`` is one public vLLM start-up of a hybrid
(linear-attention or state-space) model: its config, the flags the log states, the vLLM
release, and what vLLM printed. ``check_hybrid_row`` sizes the same flags from the config with
the spec's arithmetic (``kvledger.spec.hybrid``) at the logged pool: the pool is vLLM's own
measurement, so the row holds the hybrid layout, not the memory wall. vLLM prints the pool with
two decimals of GiB, so a row's block count is checked against every count a pool within 0.005
GiB of the printed one gives; the token line and the concurrency against the printed values
within ``WITHIN``. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.spec import kv_bytes, load_model_spec
from kvledger.spec.hybrid import HybridLayout, layout_for
from kvledger.units import GiB

WITHIN = 0.005
"""The issue's bar for the token line and the maximum concurrency: 0.5%."""
PRINTED_GIB_HALF_STEP = 0.005
"""vLLM prints the pool in GiB with two decimals: the true pool is within this of the printed one."""
ROOT = Path(__file__).resolve().parents[2]
"""The checkout: configs under ``tests/data`` are named relative to it."""


@dataclass
class HybridRowCheck:
    """One logged start-up sized from its config. ``predicted`` and ``logged`` share keys."""

    source: str
    model: str
    vllm_version: str
    indexed_only: bool
    tensor_parallel_size: int = 1
    predicted: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, Any] = field(default_factory=dict)
    blocks_range: tuple[int, int] | None = None
    """Blocks a pool within ``PRINTED_GIB_HALF_STEP`` of the printed one holds (low, high)."""
    implied_blocks: list[int] = field(default_factory=list)
    """Rows without a pool: every block count both printed lines allow."""

    def error(self, key: str) -> float | None:
        """(predicted - logged) / logged for a numeric key both have."""
        if self.logged.get(key) in (None, 0) or self.predicted.get(key) is None:
            return None
        return self.predicted[key] / self.logged[key] - 1

    @property
    def failures(self) -> list[str]:
        """What does not reproduce, one line each (empty: the row reproduces)."""
        out = []
        for key in ("block_size", "padding_layers", "refused_max_num_seqs", "estimated_max_model_len"):
            if key in self.logged and self.predicted.get(key) != self.logged[key]:
                out.append(f"{key}: predicted {self.predicted.get(key)}, logged {self.logged[key]}")
        if "mamba_padding_pct" in self.logged and round(self.predicted["mamba_padding_pct"], 2) != \
                self.logged["mamba_padding_pct"]:
            out.append(f"padding: predicted {self.predicted['mamba_padding_pct']:.4f}%, logged "
                       f"{self.logged['mamba_padding_pct']}%")
        if "num_blocks" in self.logged and self.blocks_range and \
                not self.blocks_range[0] <= self.logged["num_blocks"] <= self.blocks_range[1]:
            out.append(f"blocks: the printed pool gives {self.blocks_range}, logged {self.logged['num_blocks']}")
        if "num_blocks_implied" in self.logged and self.implied_blocks != [self.logged["num_blocks_implied"]]:
            out.append(f"the printed lines allow blocks {self.implied_blocks}, the row says "
                       f"{self.logged['num_blocks_implied']}")
        for key in ("kv_tokens", "max_concurrency"):
            err = self.error(key)
            if key in self.logged and (err is None or abs(err) > WITHIN):
                out.append(f"{key}: predicted {self.predicted.get(key)}, logged {self.logged[key]}")
        return out


def load_hybrid_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The rows of the hybrid log table (default: the checkout's ``tests/data`` file)."""
    path = Path(path) if path else ROOT / "tests" / "data" / "vllm_hybrid_startup_logs.json"
    return json.loads(path.read_text())["runs"]


def row_layout(row: dict[str, Any]) -> HybridLayout:
    """vLLM's hybrid pool layout for the row's config and flags."""
    config = row["config"]
    spec = load_model_spec(ROOT / config if config.startswith("tests/") else config)
    kvb = kv_bytes(spec, row.get("kv_cache_dtype", "auto"), tensor_parallel_size=row.get("tensor_parallel_size", 1),
                   model_dtype=row.get("dtype"), mamba_ssm_cache_dtype=row.get("mamba_ssm_cache_dtype", "auto"))
    return layout_for(kvb, mla=spec.is_mla, block_size=row.get("block_size_flag"),
                      prefix_caching=row.get("enable_prefix_caching"), vllm_version=row["vllm_version"])


def check_hybrid_row(row: dict[str, Any]) -> HybridRowCheck:
    """Size ``row``'s flags from its config and compare with what vLLM printed."""
    layout = row_layout(row)
    logged = row["logged"]
    length = row["max_model_len"]
    check = HybridRowCheck(source=row["source"], model=row["model"], vllm_version=row["vllm_version"],
                           indexed_only=bool(row.get("indexed_only")),
                           tensor_parallel_size=row.get("tensor_parallel_size", 1), logged=dict(logged))
    p = check.predicted
    p.update(block_size=layout.block_size, mamba_padding_pct=layout.padding_pct, padding_layers=layout.padding_layers,
             group_size=layout.group_size, groups=(layout.attention_groups, layout.state_groups),
             state_blocks_per_request=layout.state_blocks_per_request, prefix_caching=layout.prefix_caching)
    blocks = None
    if "kv_memory_gib" in logged:
        pool = logged["kv_memory_gib"] * GiB
        blocks = layout.num_blocks(int(pool))
        check.blocks_range = (layout.num_blocks(int(pool - PRINTED_GIB_HALF_STEP * GiB)),
                              layout.num_blocks(int(pool + PRINTED_GIB_HALF_STEP * GiB)))
        if "num_blocks" in logged and check.blocks_range[0] <= logged["num_blocks"] <= check.blocks_range[1]:
            blocks = logged["num_blocks"]  # the count vLLM named, where the printed pool allows it
    elif "num_blocks_implied" in logged:
        check.implied_blocks = implied_blocks(layout, length, logged)
        blocks = logged["num_blocks_implied"]
    if blocks is not None:
        p.update(num_blocks=blocks, kv_tokens=layout.kv_tokens(blocks, length),
                 max_concurrency=layout.max_concurrency(blocks, length))
        refuses = layout.rules.refuses_max_num_seqs_above_blocks
        p["refused_max_num_seqs"] = bool(refuses and row.get("max_num_seqs") and row["max_num_seqs"] > blocks)
        p["estimated_max_model_len"] = min(layout.attention_tokens(blocks), length)
    return check


def implied_blocks(layout: HybridLayout, max_model_len: int, logged: dict[str, Any]) -> list[int]:
    """Every block count whose token line and two-decimal concurrency print as ``logged`` does."""
    hi = int(logged["max_concurrency"] * layout.blocks_per_request(max_model_len)) + 2
    return [n for n in range(1, 2 * hi)
            if layout.kv_tokens(n, max_model_len) == logged["kv_tokens"]
            and f"{layout.max_concurrency(n, max_model_len):.2f}" == f"{logged['max_concurrency']:.2f}"]


def hybrid_table(rows: list[dict[str, Any]] | None = None) -> list[HybridRowCheck]:
    return [check_hybrid_row(r) for r in (rows if rows is not None else load_hybrid_rows())]


def markdown(checks: list[HybridRowCheck]) -> str:
    """The table for BENCHMARKS.md: each row's printed numbers against the planner's."""
    head = ("| model | vLLM | TP | block (vLLM / kvledger) | padding % | pool GiB | blocks | GPU KV cache size "
            "(vLLM / kvledger) | concurrency (vLLM / kvledger) | other | source |")
    lines = [head, "|" + "---|" * 11]
    for c in checks:
        lg, pr = c.logged, c.predicted

        def pair(key: str, fmt: str = "{:,}") -> str:
            if key not in lg:
                return ""
            return f"{fmt.format(lg[key])} / {fmt.format(pr[key]) if pr.get(key) is not None else '-'}"

        pad = f"{lg['mamba_padding_pct']} / {pr['mamba_padding_pct']:.2f}" if "mamba_padding_pct" in lg else ""
        other = []
        if "refused_max_num_seqs" in lg:
            other.append(f"max_num_seqs refusal: vLLM {'refused' if lg['refused_max_num_seqs'] else 'started'}, "
                         f"kvledger {'refuses' if pr.get('refused_max_num_seqs') else 'starts'}")
        if "estimated_max_model_len" in lg:
            other.append(f"estimated max model len {lg['estimated_max_model_len']:,} / "
                         f"{pr.get('estimated_max_model_len', 0):,}")
        if "padding_layers" in lg:
            other.append(f"padding layers {lg['padding_layers']} / {pr['padding_layers']}")
        blocks = ""
        if c.blocks_range:
            blocks = (f"{c.blocks_range[0]:,}" if c.blocks_range[0] == c.blocks_range[1]
                      else f"{c.blocks_range[0]:,}-{c.blocks_range[1]:,}")
            if "num_blocks" in lg:
                blocks += f" (vLLM {lg['num_blocks']:,})"
        elif c.implied_blocks:
            blocks = f"{', '.join(map(str, c.implied_blocks))} (implied)"
        source = c.source if c.source.startswith("http") else "indexed file, no address"
        lines.append(f"| {c.model} | {c.vllm_version} | {c.tensor_parallel_size} | {pair('block_size')} | {pad} | "
                     f"{lg.get('kv_memory_gib', '')} | {blocks} | {pair('kv_tokens')} | "
                     f"{pair('max_concurrency', '{:.2f}')} | {'; '.join(other)} | {source} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m kvledger.planner.hybrid_validation: the BENCHMARKS.md table
    table = hybrid_table()
    print(markdown(table))
    bad = [(c.model, c.failures) for c in table if c.failures]
    print(f"\n{len(table) - len(bad)} of {len(table)} rows reproduce" + (f"; failing: {bad}" if bad else ""))
