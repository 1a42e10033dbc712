"""Decode step with an 8-bit KV cache versus the unquantized cache, at a 4K context.

One run, same machine, float32 model, 2 threads: for each ``--kv-cache-dtype`` a batch-1
decode step at a 4,096-token context (median over the steps), beside the unquantized cache
(the peer) and the step's memory floor (weights plus the KV bytes the step reads, over the
measured read bandwidth). Target: an 8-bit step no slower than the unquantized one.

    .venv/bin/python bench/bench_kv_quant.py [--context 4096] [--steps 24]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import THREADS, bandwidth, kvledger_decode_step, matmul_flops  # noqa: E402

import torch  # noqa: E402

KINDS = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    from kvledger import LLM

    flops = matmul_flops()
    read_bw, copy_bw = bandwidth()
    print(f"ceilings: float32 matmul {flops / 1e9:.1f} GFLOP/s, read {read_bw / 1e9:.1f} GB/s, "
          f"copy {copy_bw / 1e9:.1f} GB/s")
    rows = []
    for kind in KINDS:
        llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_dtype=kind, kv_cache_memory="512MiB",
                  max_model_len=args.context + args.steps + 8, max_num_batched_tokens=args.context + 8)
        ledger = llm.llm_engine.ledger()
        weights = sum(p.numel() * p.element_size() for p in llm.llm_engine.model.parameters())
        kv_read = (ledger.bytes_per_token + ledger.scale_bytes_per_token) * args.context
        floor = (weights + kv_read) / read_bw
        step = kvledger_decode_step(llm, context=args.context, steps=args.steps)
        rows.append((kind, step, floor, kv_read))
        del llm
    base = rows[0][1]
    print(f"\nbatch-1 decode step at a {args.context:,}-token context (median of {args.steps} steps)")
    print("| --kv-cache-dtype | step (ms) | vs float32 cache | KV read per step | memory floor (ms) | step / floor |")
    print("|---|---|---|---|---|---|")
    for kind, step, floor, kv_read in rows:
        print(f"| {kind} | {step * 1e3:.1f} | {step / base:.2f}x | {kv_read / 2**20:.1f} MiB | {floor * 1e3:.1f} | "
              f"{step / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
