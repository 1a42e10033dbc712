"""Decode step with an 8-bit KV cache versus the unquantized cache, at a 4K context.

One run, same machine, float32 model, 2 threads: one engine per ``--kv-cache-dtype``, each
holding one sequence with a 4,096-token context, decoding in turn: step k of every engine runs
back to back (in a rotating order), so a noisy moment on a shared machine hits all of them
alike. Reported per kind: the median step, the median of the per-round ratios to the
unquantized cache (the peer), and the step's memory floor (weights plus the KV bytes the step
reads, over the measured read bandwidth). Target: an 8-bit step no slower than the
unquantized one.

    .venv/bin/python bench/bench_kv_quant.py [--context 4096] [--steps 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import THREADS  # noqa: E402
from ceilings import print_ceilings  # noqa: E402

import torch  # noqa: E402

KINDS = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    from kvledger import LLM, SamplingParams

    _, read_bw, _ = print_ceilings()
    prompt = [random.Random(1).randrange(1000, 40000) for _ in range(args.context)]
    engines = {}
    for kind in KINDS:
        llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_dtype=kind, kv_cache_memory="256MiB",
                  max_model_len=args.context + args.steps + 8, max_num_batched_tokens=args.context + 8)
        engine = llm.llm_engine
        engine.add_request("decode", prompt, SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True))
        engine.step()  # prefill
        engines[kind] = engine
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for k in range(args.steps):
        order = KINDS[k % len(KINDS):] + KINDS[:k % len(KINDS)]
        for kind in order:
            start = time.perf_counter()
            engines[kind].step()
            times[kind].append(time.perf_counter() - start)
    base = times[KINDS[0]]
    print(f"\nbatch-1 decode step at a {args.context:,}-token context, {args.steps} rounds")
    print("| --kv-cache-dtype | median step (ms) | vs float32 cache (median of per-round ratios) | "
          "KV read per step | memory floor (ms) | step / floor |")
    print("|---|---|---|---|---|---|")
    for kind, engine in engines.items():
        ledger = engine.ledger()
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv_read = (ledger.bytes_per_token + ledger.scale_bytes_per_token) * args.context
        floor = (weights + kv_read) / read_bw
        step = statistics.median(times[kind])
        ratio = statistics.median(t / b for t, b in zip(times[kind], base))
        print(f"| {kind} | {step * 1e3:.1f} | {ratio:.2f}x | {kv_read / 2**20:.1f} MiB | {floor * 1e3:.1f} | "
              f"{step / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
