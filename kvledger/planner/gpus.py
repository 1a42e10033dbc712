"""The GPU catalog: one entry per card in ``gpus.json``, each with its source.

``memory_bytes`` is what the device reports to the framework (``torch.cuda`` total memory),
not the marketing figure: an "80 GB" H100 reports about 79.19 GiB. Bandwidth is bytes per
second of HBM/GDDR; FLOP/s are dense (no sparsity) vendor peaks; the host link is bytes per
second in one direction.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvledger.errors import KVLedgerError

CATALOG = Path(__file__).with_name("gpus.json")
FP8_KV_MIN_SM = (8, 9)
"""FP8 KV cache needs SM 8.9 or newer (Ada, Hopper, Blackwell)."""


@dataclass(frozen=True)
class GPU:
    """One accelerator. Sizes in bytes, rates in bytes/s and FLOP/s."""

    name: str
    full_name: str
    vendor: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    compute_capability: str | None
    """NVIDIA SM version ("8.0", "9.0"); ``None`` on AMD (see ``arch``)."""
    arch: str | None
    fp8_kv: bool
    """FP8 in hardware: NVIDIA SM >= 8.9, AMD CDNA 3."""
    memory_source: str
    spec_source: str
    host_link: str
    """The link to host memory, e.g. ``PCIe Gen5 x16``."""
    host_link_bytes_per_s: float
    """One direction of :attr:`host_link` (the datasheet's bidirectional figure halved): the rate of
    loads from, and of stores to, a KV offloading tier in host memory."""
    host_link_source: str

    @property
    def sm(self) -> str:
        """``SM 8.0`` or the AMD architecture name."""
        return f"SM {self.compute_capability}" if self.compute_capability else (self.arch or "unknown")

    def with_overrides(self, memory_bytes: int | None = None, bandwidth_bytes_per_s: float | None = None) -> "GPU":
        """This card with ``--gpu-memory`` / ``--bandwidth`` applied."""
        changes = {k: v for k, v in (("memory_bytes", memory_bytes), ("bandwidth_bytes_per_s", bandwidth_bytes_per_s))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


@lru_cache(maxsize=1)
def gpus() -> dict[str, GPU]:
    """Catalog name -> GPU."""
    data = json.loads(CATALOG.read_text())
    return {g["name"]: GPU(**{f.name: g[f.name] for f in dataclasses.fields(GPU)}) for g in data["gpus"]}


def get_gpu(name: str) -> GPU:
    """The card called ``name`` (case-insensitive; ``_`` and spaces read as ``-``)."""
    table = gpus()
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=4, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(table)}"
    raise KVLedgerError(f"unknown GPU {name!r}; {hint}")


def kv_dtype_warning(gpu: GPU, kv_cache_dtype: str) -> str | None:
    """A warning for an fp8 KV cache on a card without FP8 in hardware (below SM 8.9), else None.
    vLLM accepts it there (the attention kernels convert fp8 to the compute dtype), so the plan
    stands; the chapter's advice is int8 on Ampere, which keeps per-token scales."""
    if kv_cache_dtype.startswith("fp8") and not gpu.fp8_kv:
        return (f"--kv-cache-dtype {kv_cache_dtype} on {gpu.name} ({gpu.sm}, below SM 8.9): vLLM accepts it and converts "
                "fp8 in its kernels, so the capacity stands, but there is no FP8 hardware to speed it up; the chapter's "
                "advice for Ampere is an int8 cache with per-token scales (--kv-cache-dtype int8_per_token_head in vLLM), "
                "validated on long-context data")
    return None


def list_catalog() -> str:
    """The catalog as a table: name, card, device-reported memory, bandwidth, SM, FP8."""
    from tabulate import tabulate

    rows = [(g.name, g.full_name, f"{g.memory_bytes / (1 << 30):.2f}", f"{g.bandwidth_bytes_per_s / 1e12:.2f}",
             g.sm, "yes" if g.fp8_kv else "no") for g in gpus().values()]
    return tabulate(rows, headers=["name", "card", "GiB (device)", "TB/s", "arch", "FP8"],
                    colalign=("left", "left", "right", "right", "left", "left"), disable_numparse=True)
