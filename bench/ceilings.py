"""What this machine can do at best, measured with torch as the engines use it; and where the shared
traces are. Every benchmark prints these ceilings beside its results, so a number reads as a
fraction of the limit measured in the same run."""

from __future__ import annotations

import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "data" / "traces"
DEFAULT_TRACE = TRACES / "azure2023_conv.csv"


def _best_seconds(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(n: int = 2048, repeat: int = 8, dtype: torch.dtype = torch.float32) -> float:
    """Best ``torch.matmul`` rate (FLOP/s) of an n x n x n product in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeat)


def matmul_kernels(n: int = 2048, repeat: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The n x n x n product's best rate (FLOP/s) in ``dtype`` per CPU kernel: ``torch.matmul``
    (MKL for float32) and oneDNN with the weight prepacked once (the product
    :mod:`kvledger.layers.linear` runs in bfloat16), measured in every dtype this CPU's oneDNN packs, whether
    or not the engine uses it there. The machine's ceiling is the larger of the two."""
    from kvledger.layers.linear import linear, pack_weight, packs

    x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    rates = {"torch.matmul": 2 * n**3 / _best_seconds(lambda: x @ w.t(), repeat)}
    if packs(dtype):  # oneDNN on an AVX2-only CPU has no bfloat16 reorder
        packed = pack_weight(w)  # n rows take oneDNN's product, not the panels
        rates["oneDNN prepacked"] = 2 * n**3 / _best_seconds(lambda: linear(x, w, packed=packed), repeat)
    return rates


def bandwidth(nbytes: int = 1 << 30, repeat: int = 6) -> tuple[float, float]:
    """Best read bandwidth (a sum over ``nbytes``) and copy bandwidth (read + write bytes), bytes/s."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    read, copy = float("inf"), float("inf")
    src.sum()
    dst.copy_(src)
    for _ in range(repeat):
        start = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return nbytes / read, 2 * nbytes / copy


def print_ceilings() -> tuple[float, float, float]:
    """Measure and print the float32 matmul rate and the read and copy bandwidths; returns them
    (FLOP/s, bytes/s, bytes/s)."""
    flops = matmul_flops()
    read_bw, copy_bw = bandwidth()
    print(f"ceilings: float32 matmul {flops / 1e9:.1f} GFLOP/s, read {read_bw / 1e9:.1f} GB/s, "
          f"copy {copy_bw / 1e9:.1f} GB/s")
    return flops, read_bw, copy_bw
