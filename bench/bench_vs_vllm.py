"""kvledger beside real vLLM (its CPU build, the peer of ``../shared/peers/vllm-cpu``) in one run.

Both engines get the same token-id prompts through the same call, ``generate(prompts,
max_tokens)`` (greedy, ``ignore_eos``): kvledger's ``LLM`` in this process, vLLM's ``LLM`` in
the peer's own venv as a subprocess (``bench/vllm_peer.py``), loaded once per dtype and kept
alive. Measurements alternate between the two (the first engine changes each round), so a busy
moment on shared cores hits both. Both get both cores: kvledger 2 torch threads, vLLM
``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0``; both a 2 GiB KV cache.

Rows, float32 and bfloat16:

* useful output tok/s on ``bench_engine.py``'s workload (64 Azure-conv requests, lengths / 4,
  random ids): each request's own output tokens over the wall time of one ``generate``;
* batch-1 decode step at a 512-token context: ``(t(1 + n) - t(1)) / n`` for ``n`` = 32 new
  tokens after a 512-token prompt (fresh random prompts, so no prefix-cache hit), median over
  rounds;
* prefill of 512 tokens: one ``generate`` of a fresh 512-token prompt with ``max_tokens=1``
  (time to the first token), median over rounds.

The ceilings are measured at the start and the end, the better of each kept: matmul FLOP/s per
dtype with the best kernel available (``torch.matmul`` and oneDNN prepacked,
``ceilings.matmul_kernels``) and read bandwidth. The greedy tokens of the workload's first 8
requests are compared between the engines in float32 and the result printed.

    .venv/bin/python bench/bench_vs_vllm.py [--peer PREFIX] [--rounds 3] [--requests 64]

Without the peer installed it prints how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # as the engine sets it; see kvledger/engine/__init__.py

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import draw_workload  # noqa: E402
from ceilings import DEFAULT_TRACE, ROOT, bandwidth, matmul_kernels  # noqa: E402

THREADS = 2
KV_CACHE_GIB = 2
DEFAULT_PEER = Path.home() / ".cache" / "kvledger-peers" / "vllm"
INSTALL_SCRIPT = ROOT.parent / "shared" / "peers" / "vllm-cpu" / "install.sh"
DTYPES = ("float32", "bfloat16")
CONTEXT = 512
DECODE_TOKENS = 32

Generate = Callable[[list[list[int]], list[int]], tuple[float, list[list[int]]]]
"""``generate(prompts, max_tokens)`` -> (wall seconds, generated token ids per prompt)."""


class VllmPeer:
    """vLLM's ``LLM`` in the peer's venv, one ``generate`` per JSON line (``bench/vllm_peer.py``)."""

    def __init__(self, prefix: Path, dtype: str, max_model_len: int, log: Path) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
        env.pop("GOMP_SPINCOUNT", None)  # kvledger's setting, not the peer's
        command = (f"source {shlex.quote(str(prefix / 'env.sh'))} && exec {shlex.quote(str(prefix / 'venv/bin/python'))} "
                   f"{shlex.quote(str(HERE / 'vllm_peer.py'))} {shlex.quote(str(prefix / 'smollm2-hf'))} {dtype} "
                   f"{max_model_len}")
        self.log = open(log, "a")
        self.proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self._read()  # {"ready": true} once the model is loaded (and compiled)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"the vLLM peer exited (code {self.proc.wait()}); see {self.log.name}")

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        return answer["seconds"], answer["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def kvledger_generate(llm) -> Generate:  # type: ignore[no-untyped-def]
    from kvledger import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(o.outputs[0].token_ids) for o in outs]

    return generate


def decode_step(generate: Generate, rng: random.Random) -> float:
    """Seconds per batch-1 decode step at a ``CONTEXT``-token context (fresh prompts, no cache hit)."""
    def prompt() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(CONTEXT)]

    one, _ = generate([prompt()], [1])
    many, _ = generate([prompt()], [1 + DECODE_TOKENS])
    return (many - one) / DECODE_TOKENS


def prefill(generate: Generate, rng: random.Random) -> float:
    """Seconds to the first token of a fresh ``CONTEXT``-token prompt."""
    seconds, _ = generate([[rng.randrange(1000, 40000) for _ in range(CONTEXT)]], [1])
    return seconds


def ceilings() -> dict[str, float]:
    """Best matmul FLOP/s per dtype (over the available kernels) and read bandwidth (bytes/s)."""
    out = {}
    for dtype in DTYPES:
        rates = matmul_kernels(dtype=getattr(torch, dtype))
        kernel = max(rates, key=rates.__getitem__)
        out[f"{dtype} matmul"] = rates[kernel]
        out[f"{dtype} kernel"] = kernel  # type: ignore[assignment]
        out[f"{dtype} rates"] = rates  # type: ignore[assignment]
    out["read"], _ = bandwidth()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, default=Path(os.environ.get("KVLEDGER_VLLM_PEER", DEFAULT_PEER)),
                        help=f"the vLLM peer's install prefix (default {DEFAULT_PEER})")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the decode and prefill rows")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_vs_vllm.vllm.log",
                        help="vLLM's output goes here (default: in the temporary directory)")
    args = parser.parse_args(argv)
    if not (args.peer / "venv" / "bin" / "python").exists() or not (args.peer / "smollm2-hf" / "config.json").exists():
        print(f"The vLLM peer is not installed at {args.peer}. Install it (about 1.5 GB, a few minutes, outside the "
              f"repository) with:\n    bash {INSTALL_SCRIPT} {args.peer}\nthen run this again (or pass --peer PREFIX).")
        return 0
    torch.set_num_threads(THREADS)
    start_ceilings = ceilings()
    from kvledger import LLM

    rng = random.Random(7)
    rows: list[tuple[str, float, float, str]] = []  # (measurement, kvledger, vLLM, unit) ; unit "tok/s" or "ms"
    identity = ""
    for dtype in args.dtypes:
        llm = LLM(model="smollm2-135m", dtype=dtype, kv_cache_memory=f"{KV_CACHE_GIB}GiB")
        max_len = llm.llm_engine.max_model_len
        config = llm.llm_engine.hf_config
        workload = draw_workload(args.trace, args.requests, config["vocab_size"], max_len)
        prompts, outs = [p for p, _ in workload], [o for _, o in workload]
        useful = sum(outs)
        print(f"\n{dtype}: starting the vLLM peer (log: {args.log})", flush=True)
        peer = VllmPeer(args.peer, dtype, max_len, args.log)
        engines: dict[str, Generate] = {"kvledger": kvledger_generate(llm), "vLLM": peer.generate}
        try:
            for gen in engines.values():  # warm-up: a few requests and a decode run
                gen(prompts[:4], outs[:4])
                decode_step(gen, rng)
            times: dict[str, dict[str, list[float]]] = {e: {"decode": [], "prefill": [], "run": []} for e in engines}
            tokens: dict[str, list[list[int]]] = {}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    times[name]["decode"].append(decode_step(engines[name], rng))
                    times[name]["prefill"].append(prefill(engines[name], rng))
                if r == 0:  # the whole workload once per engine, in this round's order
                    for name in order:
                        seconds, toks = engines[name](prompts, outs)
                        assert [len(t) for t in toks] == outs, f"{name} did not generate every requested token"
                        times[name]["run"].append(seconds)
                        tokens[name] = toks
                print(f"  round {r + 1}: " + ", ".join(
                    f"{n} decode {times[n]['decode'][-1] * 1e3:.1f} ms, prefill {times[n]['prefill'][-1] * 1e3:.0f} ms"
                    for n in engines), flush=True)
        finally:
            peer.close()
        kv, vl = times["kvledger"], times["vLLM"]
        rows.append((f"{dtype}: useful output tok/s", useful / kv["run"][0], useful / vl["run"][0], "tok/s"))
        rows.append((f"{dtype}: batch-1 decode step at a {CONTEXT}-token context", statistics.median(kv["decode"]) * 1e3,
                     statistics.median(vl["decode"]) * 1e3, "ms"))
        rows.append((f"{dtype}: prefill of {CONTEXT} tokens", statistics.median(kv["prefill"]) * 1e3,
                     statistics.median(vl["prefill"]) * 1e3, "ms"))
        print(f"  workload: {len(workload)} requests, {sum(map(len, prompts))} prompt + {useful} output tokens; "
              f"kvledger {kv['run'][0]:.1f} s, vLLM {vl['run'][0]:.1f} s", flush=True)
        if dtype == "float32":
            first = [i for i in range(min(8, len(workload))) if tokens["kvledger"][i] != tokens["vLLM"][i]]
            identity = ("greedy tokens of the first 8 requests, float32: identical to vLLM's" if not first else
                        f"greedy tokens of the first 8 requests, float32: requests {first} differ from vLLM's")
            print("  " + identity, flush=True)
        del llm
    end_ceilings = ceilings()

    print("\n| measurement | kvledger | vLLM | kvledger speed over vLLM's |\n|---|---|---|---|")
    for name, ours, theirs, unit in rows:
        ratio = ours / theirs if unit == "tok/s" else theirs / ours
        fmt = "{:.1f}" if unit != "ms" or ours < 100 else "{:.0f}"
        print(f"| {name} | {fmt.format(ours)} {unit} | {fmt.format(theirs)} {unit} | {ratio:.2f}x |")
    if identity:
        print(f"\n{identity}")
    print(f"\nceilings ({THREADS} threads), start / end:")
    for dtype in DTYPES:
        for when, c in (("start", start_ceilings), ("end", end_ceilings)):
            rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in c[f"{dtype} rates"].items())  # type: ignore[union-attr]
            print(f"  {dtype} matmul (2048-cube), {when}: {rates} GFLOP/s")
    print(f"  read bandwidth: {start_ceilings['read'] / 1e9:.1f} / {end_ceilings['read'] / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
