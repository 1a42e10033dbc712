"""Planner speed: ``kvledger plan`` start-up (target < 0.5 s) and a 20,000-request trace (target < 2 s).

Each target is measured end to end, as a user runs it (a fresh ``kvledger`` process), beside a
peer doing the least the same job needs in the same run:

* start-up: the peer is a bare interpreter importing the one library a plan without a trace
  loads (``python -c "import tabulate"``); the ratio is what the planner adds on top.
* trace: the peer is numpy reading the same CSV and taking its percentiles
  (``np.loadtxt`` + ``np.percentile``); the planner also replays it over time.

It prints the machine's ceilings too (float32 matmul FLOP/s, copy bandwidth), measured here.

    .venv/bin/python bench/bench_plan.py [--traces DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import TRACES, bandwidth, matmul_flops  # noqa: E402
PLAN = ["plan", "llama-3.1-8b", "--gpu", "a100-80gb"]


def wall(cmd: list[str], repeat: int) -> float:
    """Median wall-clock seconds of ``cmd`` over ``repeat`` runs (after one warm-up)."""
    subprocess.run(cmd, check=True, capture_output=True)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_trace(traces: Path, out: Path, rows: int = 20_000) -> Path:
    """A 20,000-request Azure-format CSV: the conversation trace, topped up from the code trace."""
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        n = 0
        for name in ("azure2023_conv.csv", "azure2023_code.csv"):
            with (traces / name).open(newline="") as src:
                reader = csv.reader(src)
                next(reader)
                for row in reader:
                    if n == rows:
                        return out
                    writer.writerow(row)
                    n += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of the shared traces")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    py = sys.executable
    cli = [py, "-m", "kvledger.cli.main"]

    flops, (_, copy_bw) = matmul_flops(), bandwidth()
    print(f"machine: float32 matmul {flops / 1e9:.1f} GFLOP/s, copy bandwidth {copy_bw / 1e9:.1f} GB/s")

    peer = wall([py, "-c", "import tabulate"], args.repeat)
    ours = wall([*cli, *PLAN], args.repeat)
    print(f"start-up: kvledger {' '.join(PLAN)}: {ours:.3f} s (median of {args.repeat}); "
          f"peer (python + tabulate): {peer:.3f} s; ratio {ours / peer:.2f}x; "
          f"target < 0.5 s: {'PASS' if ours < 0.5 else 'FAIL'}")

    with tempfile.TemporaryDirectory() as tmp:
        trace = make_trace(args.traces, Path(tmp) / "trace20k.csv")
        rows = sum(1 for _ in trace.open()) - 1
        peer_code = (f"import numpy as np; a = np.loadtxt({str(trace)!r}, delimiter=',', skiprows=1, usecols=(1, 2)); "
                     "[np.percentile(a[:, i], (50, 90, 99)) for i in (0, 1)]")
        peer = wall([py, "-c", peer_code], max(3, args.repeat // 2))
        ours = wall([*cli, *PLAN, "--workload", str(trace), "--json"], max(3, args.repeat // 2))
        print(f"trace: {rows:,} requests, plan --workload (read, histogram, percentiles, replay): {ours:.3f} s; "
              f"peer (numpy loadtxt + percentiles): {peer:.3f} s; ratio {ours / peer:.2f}x; "
              f"target < 2 s: {'PASS' if ours < 2 else 'FAIL'}")
        for name in ("mooncake_conversation.jsonl", "mooncake_synthetic.jsonl", "azure2023_code.csv"):
            t = wall([*cli, *PLAN, "--workload", str(args.traces / name), "--json"], 3)
            print(f"trace: {name}: {t:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
