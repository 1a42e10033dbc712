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


def matmul_flops(n: int = 2048, repeat: int = 8) -> float:
    """Best float32 matmul rate (FLOP/s) of an n x n x n product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


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
