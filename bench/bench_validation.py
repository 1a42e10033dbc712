"""The validation table: every vLLM start-up log of tests/data/vllm_startup_logs.json planned from
scratch, each term and the token count against what vLLM printed.

    .venv/bin/python bench/bench_validation.py [--markdown] [--errors]

``--errors`` prints instead the error of every number each log prints (weights, activation,
non-torch, CUDA graphs, KV pool, tokens, maximum concurrency) and the worst of each column.

No network, no GPU: the logs' numbers are in the data file (see its ``_about``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from kvledger.planner.validation import (ERROR_COLUMNS, TERMS, check_row, error_table, load_rows, summary,
                                        worst_errors)

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_startup_logs.json"
_SHORT = {"--gpu h100-80gb ": "", "--gpu-memory-utilization": "util", "--tensor-parallel-size": "tp",
          "--pipeline-parallel-size": "pp", "--max-model-len": "len", "--kv-cache-dtype": "kv", "--quantization": "q",
          "--dtype": "dtype"}


def _flags(text: str) -> str:
    for long, short in _SHORT.items():
        text = text.replace(long, short)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print GitHub markdown (for BENCHMARKS.md)")
    parser.add_argument("--errors", action="store_true", help="the error of each printed number on every row")
    args = parser.parse_args()
    fmt = "github" if args.markdown else "simple"
    checks = [check_row(row) for row in load_rows(DATA)]
    if args.errors:
        _print_errors(checks, fmt)
        return
    rows = []
    for c in checks:
        if not c.usable:
            continue
        terms = [f"{c.predicted[t]:.2f} / {c.measured[t]:.2f}" if c.predicted and c.measured.get(t) is not None else "-"
                 for t in TERMS]
        err = f"{c.token_error:+.2%}" if c.token_error is not None else "-"
        tokens = f"{c.tokens_predicted:,} / {c.tokens_measured:,}" if c.tokens_predicted and c.tokens_measured else "-"
        outcome = "started" if c.started else f"failed: {c.failure}"
        rows.append((c.model + (f" (config: {c.config})" if c.config else ""), _flags(c.flags), outcome, c.verdict + (f" ({c.verdict_term})" if c.verdict_term else ""),
                     *terms, tokens, err))
    print(tabulate(rows, headers=["model", "flags", "vLLM", "planner", "weights GiB", "activation GiB",
                                  "non-torch GiB", "KV pool GiB", "KV tokens (plan / vLLM)", "token error"],
                   tablefmt=fmt, disable_numparse=True))
    s = summary(checks)
    print()
    print(f"{s.usable} usable runs of {s.rows} logs ({s.started} started, {s.failed} failed): "
          f"{s.within} of {s.started} started runs within 3% on tokens ({s.within_share:.0%}), worst "
          f"{s.worst_token_error:.2%}, mean |error| {s.mean_abs_token_error:.2%}; {s.failed_predicted} of {s.failed} "
          f"failed runs predicted 'tight' or 'does not fit'; {s.started_refused} started runs predicted 'does not fit'; "
          f"{s.tight_started} started runs 'tight'. Bar met: {'yes' if s.passes else 'NO'}")
    left = [(c.model, _flags(c.flags), c.reason) for c in checks if not c.usable]
    print()
    print(tabulate(left, headers=["left out", "flags", "why"], tablefmt=fmt, disable_numparse=True))


def _print_errors(checks, fmt: str) -> None:
    """(plan - vLLM) / vLLM of every number a log prints, per row, then the worst of each column."""
    rows = [(r["model"], _flags(r["flags"]), "started" if r["started"] else "failed",
             *(f"{r[col]:+.1%}" if col in r else "-" for col in ERROR_COLUMNS)) for r in error_table(checks)]
    print(tabulate(rows, headers=["model", "flags", "vLLM", *ERROR_COLUMNS], tablefmt=fmt, disable_numparse=True))
    print()
    for label, started_only in (("started runs", True), ("every planned run", False)):
        worst = worst_errors(checks, started_only=started_only)
        print(f"worst |error| over {label}: " + ", ".join(f"{col} {worst[col]:.1%}" for col in ERROR_COLUMNS if col in worst))


if __name__ == "__main__":
    main()
