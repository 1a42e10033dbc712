"""The simulator: its speed on full traces, and its accuracy against the real engine.

``scale``: ``kvledger simulate`` on the full Azure 2023 conversation trace (llama-3.1-8b on
h100-80gb, the trace's own arrivals) and on the full Mooncake conversation trace; wall seconds
and simulated seconds per wall second (targets: under 20 s and under 60 s).

``accuracy``: calibrate the real engine here (``kvledger calibrate``), then replay the same
workload (Azure conversation requests, lengths / 4, Poisson arrivals with a fixed seed) through
the real ``kvledger serve`` with ``kvledger bench serve`` and through ``kvledger simulate
--profile`` with the same requests, arrivals, engine flags and pool, at a rate below saturation
(half the simulator's service rate) and one above it (1.5 x); prints the Diff% table
(simulated vs measured) of TTFT, TPOT, ITL and E2EL (mean, p50, p90, p99), preemptions, peak
blocks allocated and the prefix-cache hit rate.

    .venv/bin/python bench/bench_simulator.py [scale|accuracy|all] [--num-prompts 64] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, serving  # noqa: E402
from ceilings import TRACES  # noqa: E402

BIN = Path(sys.executable).parent
STATS = ("mean", "p50", "p90", "p99")


def kvledger_json(*args: str) -> dict:
    proc = subprocess.run([str(BIN / "kvledger"), *args, "--json"], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip())
    return json.loads(proc.stdout)


def _children_cpu_s() -> float:
    """User plus system CPU seconds of the finished child processes (what a command cost, whatever
    the shared cores' load made its wall time)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def scale() -> str:
    rows = []
    for name, trace, target in (("Azure 2023 conversation", "azure2023_conv.csv", 20),
                                ("Mooncake conversation", "mooncake_conversation.jsonl", 60)):
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        out = kvledger_json("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(TRACES / trace),
                            "--no-progress")
        wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
        rows.append([name, out["num_prompts"], f"{out['num_steps']:,}", f"{out['duration_s']:,.0f}", f"{wall:.1f}",
                     f"{cpu:.1f}", f"{out['wall_s']:.1f}", f"{out['duration_s'] / wall:,.0f}", f"< {target}",
                     "yes" if wall < target else "NO", f"{os.getloadavg()[0]:.1f}", "yes" if out["saturated"] else "no"])
        print(rows[-1], file=sys.stderr)
    head = ["trace (llama-3.1-8b, h100-80gb, 1 replica)", "requests", "steps", "simulated s", "wall s (command)",
            "CPU s (command)", "wall s (run)", "simulated s / wall s", "target s", "met (wall)", "load average",
            "saturated"]
    return tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)


def _diff(sim: float, real: float) -> str:
    if real == 0:
        return "0.0" if sim == 0 else "n/a (real 0)"
    return f"{(sim - real) / real * 100:+.1f}"


def serve_and_bench(serve_flags: list[str], bench_flags: dict, rate: float) -> tuple[dict, dict]:
    """A fresh ``kvledger serve`` (so its counters are this run's), one ``bench serve`` run, its ledger;
    ``serve_flags`` may carry ``--step-log FILE`` (the run's own step records)."""
    import httpx

    from kvledger.bench.serve import BenchConfig, run_benchmark

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving([str(BIN / "kvledger"), "serve", "--port", str(port), *serve_flags], url):
        cfg = BenchConfig(base_url=url, request_rate=rate, ignore_eos=True, **bench_flags)
        metrics, _ = asyncio.run(run_benchmark(cfg))
        ledger = httpx.get(url + "/dashboard/ledger.json", timeout=30).json()["latest"]
    if metrics.failed:
        raise RuntimeError(f"{metrics.failed} requests failed: {metrics.errors[:1]}")
    return metrics.__dict__, ledger


def _table(real: dict, ledger: dict, sim: dict) -> str:
    rows = []
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in STATS:
            r, s = real["stats_ms"][metric][stat], sim[f"{metric}_ms"][stat]
            rows.append([f"{metric.upper()} {stat} (ms)", f"{r:.1f}", f"{s:.1f}", _diff(s, r)])
    hit_real = ledger["prefix_cache_hits"] / ledger["prefix_cache_queries"] if ledger["prefix_cache_queries"] else 0
    for name, r, s in (("preemptions", ledger["num_preemptions"], sim["num_preemptions"]),
                       ("peak blocks allocated", ledger["blocks_allocated_peak"], sim["peak_blocks_allocated"]),
                       ("prefix-cache hit rate", hit_real, sim["prefix_cache_hit_rate"]),
                       ("request throughput (req/s)", real["request_throughput"], sim["request_throughput"])):
        rows.append([name, f"{r:.4g}", f"{s:.4g}", _diff(s, r)])
    return tabulate(rows, headers=["", "kvledger serve (measured)", "simulate --profile", "Diff %"],
                    tablefmt="github", disable_numparse=True)


def _within_targets(real: dict, ledger: dict, sim: dict) -> list[str]:
    """The Done-when targets this comparison misses (empty: all met)."""
    missed = []
    limits = [("tpot", "mean", 5), ("tpot", "p50", 5), ("e2el", "mean", 5), ("e2el", "p50", 5), ("ttft", "p50", 10),
              ("ttft", "p90", 10)] + [(m, "p99", 15) for m in ("ttft", "tpot", "itl", "e2el")]
    for metric, stat, pct in limits:
        r, s = real["stats_ms"][metric][stat], sim[f"{metric}_ms"][stat]
        if r and abs(s - r) / r * 100 > pct:
            missed.append(f"{metric.upper()} {stat} ({(s - r) / r * 100:+.0f}% vs {pct}%)")
    for name, r, s in (("preemptions", ledger["num_preemptions"], sim["num_preemptions"]),
                       ("peak blocks", ledger["blocks_allocated_peak"], sim["peak_blocks_allocated"])):
        if (r and abs(s - r) / r > 0.05) or (not r and s):
            missed.append(f"{name} ({s} vs {r})")
    return missed


def accuracy(num_prompts: int, profile: Path, quick: bool, rates: list[float] | None = None) -> str:
    """Each rate: a served run that writes its own step log, a profile fitted from that log
    (``calibrate --step-log``), the same workload through ``simulate`` with it; the Diff% table.
    The profile of the other rate's run is tried as well (the fit out of sample)."""
    trace = TRACES / "azure2023_conv.csv"
    pool, max_len, batched = "256", "4096", "2048"
    engine_flags = ["--num-gpu-blocks-override", pool, "--max-model-len", max_len, "--max-num-batched-tokens", batched,
                    "--block-size", "16", "--max-num-seqs", "256"]
    sim_common = ["simulate", "smollm2-135m", "--workload", str(trace), "--num-prompts",
                  str(num_prompts), "--length-scale", "0.25", "--seed", "0", *engine_flags]
    sections = []
    if rates is None:
        if not profile.exists():
            proc = subprocess.run([str(BIN / "kvledger"), "calibrate", "--out", str(profile),
                                   "--max-num-batched-tokens", batched, *(["--quick"] if quick else [])],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(proc.stderr.strip())
            print(proc.stdout, file=sys.stderr)
        service = kvledger_json(*sim_common, "--profile", str(profile), "--request-rate", "50")["saturation_rate"]
        rates = [round(service * 0.5, 4), round(service * 1.5, 4)]
        sections.append(f"Rates from the grid profile {profile.name}: simulated service rate {service:.3f} req/s; "
                        "half and 1.5 x that.")
    bench_flags = dict(trace=str(trace), num_prompts=num_prompts, length_scale=0.25, seed=0, max_model_len=int(max_len))
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-sim-accuracy-"))
    runs = []
    for label, rate in zip(("lower rate", "higher rate"), rates):
        log, prof = tmp / f"steps-{rate}.jsonl", tmp / f"profile-{rate}.json"
        t0 = time.perf_counter()
        real, ledger = serve_and_bench([*engine_flags, "--step-log", str(log)], bench_flags, rate)
        load = os.getloadavg()[0]
        proc = subprocess.run([str(BIN / "kvledger"), "calibrate", "--step-log", str(log), "--out", str(prof)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr.strip())
        print(f"{label}: real run {time.perf_counter() - t0:.0f} s, load average {load:.1f}\n{proc.stdout}",
              file=sys.stderr)
        runs.append((label, rate, real, ledger, prof, load, proc.stdout))
    for i, (label, rate, real, ledger, prof, load, fit_text) in enumerate(runs):
        sim = kvledger_json(*sim_common, "--profile", str(prof), "--request-rate", str(rate))
        missed = _within_targets(real, ledger, sim)
        fit_line = next((ln for ln in fit_text.splitlines() if ln.startswith("fit error")), "")
        sections.append(f"**{label}**: {rate} req/s (load average {load:.1f} at the end of the served run); profile "
                        f"fitted from this run's {fit_text.split(' steps', 1)[0].rsplit(' ', 1)[-1]} steps "
                        f"({fit_line}); simulator says saturated = {sim['saturated']}\n\n{_table(real, ledger, sim)}"
                        f"\n\nTargets missed: {', '.join(missed) if missed else 'none'}.")
        other = runs[1 - i] if len(runs) == 2 else None
        if other is not None:
            cross = kvledger_json(*sim_common, "--profile", str(other[4]), "--request-rate", str(rate))
            sections.append(f"Same run, the profile of the {other[0]} run (out of sample):\n\n{_table(real, ledger, cross)}")
    return "\n\n".join(sections)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", nargs="?", default="all", choices=["scale", "accuracy", "all"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--profile", default=str(Path(tempfile.gettempdir()) / "kvledger-profile-cpu.json"),
                   help="profile to use (calibrated here first if the file is missing)")
    p.add_argument("--quick", action="store_true", help="calibrate with --quick")
    p.add_argument("--rates", default=None, help="two request rates (req/s, comma-separated) instead of ones "
                   "from the grid profile")
    p.add_argument("--markdown", default=None, help="append the tables to this file")
    args = p.parse_args()
    parts = []
    if args.part in ("scale", "all"):
        parts.append("### Simulator speed on full traces\n\n" + scale())
    if args.part in ("accuracy", "all"):
        parts.append("### Simulator against the real engine (SmolLM2-135M, CPU)\n\n"
                     + accuracy(args.num_prompts, Path(args.profile), args.quick,
                                [float(r) for r in args.rates.split(",")] if args.rates else None))
    text = "\n\n".join(parts)
    print(text)
    if args.markdown:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = " ".join(["bench/bench_simulator.py"] + sys.argv[1:])
        with open(args.markdown, "a") as f:
            f.write(f"\nCommand: `.venv/bin/python {cmd}` ({stamp})\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
