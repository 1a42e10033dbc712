"""Serving: ``kvledger serve`` beside ``transformers serve --continuous-batching``, same client, same run.

Both servers run the default model (SmolLM2-135M-Instruct, float32, CPU, the same weights: the
converted checkpoint kvledger caches) one after the other on loopback; the load client is
``kvledger bench serve`` (vLLM's metric definitions). Workload: requests drawn with a fixed seed
from the Azure conversation trace, lengths scaled, Poisson arrivals, greedy. transformers'
server takes text prompts only and has no ``ignore_eos``, so both get the same text prompts
(random token ids decoded) and stop at EOS or ``max_tokens``; token counts come from each
server's usage or, failing that, from the tokenizer, as vLLM counts them.

It prints the machine's ceilings (float32 matmul FLOP/s, copy bandwidth), both result tables
and the ratios, and appends them to BENCHMARKS.md with ``--markdown``.

    .venv/bin/python bench/bench_serve.py [--trace FILE] [--num-prompts 32] [--length-scale 0.125]
        [--request-rate 1] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import DEFAULT_TRACE, bandwidth, matmul_flops  # noqa: E402

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


@contextlib.contextmanager
def serving(cmd: list[str], url: str, *, log: Path | None = None, env: dict[str, str] | None = None,
            ready_s: float = 300, stop_s: float = 30) -> Iterator[subprocess.Popen]:
    """A server process started from ``cmd``, ready at ``url`` within ``ready_s``, stopped on exit;
    its output goes to ``log`` if given (else nowhere)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
                            env=env)
    try:
        wait_ready(proc, url, ready_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None:
            out.close()


def run_against(cmd: list[str], url: str, cfg) -> tuple:
    from kvledger.loadgen.serve import run_benchmark

    with serving(cmd, url):
        cfg.base_url = url
        return asyncio.run(run_benchmark(cfg))


def main() -> int:
    from kvledger.loader.resolve import converted_dir, resolve_model
    from kvledger.loadgen.serve import BenchConfig, format_report

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--length-scale", type=float, default=0.125)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", default=None, help="append the results to this file")
    args = p.parse_args()

    model_dir = str(converted_dir(resolve_model(None)))  # the HF-format copy kvledger makes of the GGUF
    flops, (_, bw) = matmul_flops(), bandwidth()

    def config() -> BenchConfig:
        return BenchConfig(base_url="", trace=args.trace, num_prompts=args.num_prompts,
                           length_scale=args.length_scale, request_rate=args.request_rate, seed=args.seed,
                           prompt_format="text", tokenizer=model_dir, ignore_eos=False)

    port = free_port()
    ours = run_against([str(BIN / "kvledger"), "serve", "--port", str(port), "--dtype", "float32",
                        "--kv-cache-memory", "1GiB", "--max-model-len", "4096"], f"http://127.0.0.1:{port}", config())
    port = free_port()
    cfg = config()
    cfg.model = model_dir
    peer = run_against([str(BIN / "transformers"), "serve", model_dir, "--continuous-batching", "--device", "cpu",
                        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                       f"http://127.0.0.1:{port}", cfg)

    (m_ours, info_ours), (m_peer, _) = ours, peer
    rows = [
        ("completed / failed", f"{m_ours.completed} / {m_ours.failed}", f"{m_peer.completed} / {m_peer.failed}", ""),
        ("output tokens", m_ours.total_output, m_peer.total_output, ""),
        ("output throughput (tok/s)", f"{m_ours.output_throughput:.2f}", f"{m_peer.output_throughput:.2f}",
         f"{m_ours.output_throughput / m_peer.output_throughput:.2f}x"),
        ("request throughput (req/s)", f"{m_ours.request_throughput:.3f}", f"{m_peer.request_throughput:.3f}",
         f"{m_ours.request_throughput / m_peer.request_throughput:.2f}x"),
    ]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for stat in ("mean", "p50", "p99"):
            a, b = m_ours.stats_ms[key][stat], m_peer.stats_ms[key][stat]
            rows.append((f"{name} {stat} (ms)", f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x faster" if a else ""))
    head = ["", "kvledger serve", "transformers serve --continuous-batching", "kvledger vs peer"]
    text = "\n".join([
        f"Machine ceilings (torch, measured in this run): float32 matmul {flops / 1e9:.1f} GFLOP/s, "
        f"copy bandwidth {bw / 1e9:.1f} GB/s.",
        "",
        format_report(m_ours, info_ours, tablefmt="github"),
        "",
        tabulate(rows, headers=head, tablefmt="github", disable_numparse=True),
    ])
    print(text)
    if args.markdown:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = " ".join(["bench/bench_serve.py"] + [a for a in sys.argv[1:]])
        with open(args.markdown, "a") as f:
            f.write(f"\nCommand: `.venv/bin/python {cmd}` ({stamp})\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
