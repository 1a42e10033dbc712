"""This process's place in the tensor-parallel group, and the one collective the layers use.

Layers read :func:`tp_rank` and :func:`tp_size` when they are built (inside :func:`building`)
and keep them, so a TP-1 model built in the same process as a TP group's rank 0 stays whole and
never joins a collective. Inside a group (:func:`init_group`) the compute collectives run on the
default process group: gloo on CPU, NCCL on CUDA, both with a bounded timeout so that a rank
that hangs ends the step with an error instead of a hang. The step broadcast uses a second,
gloo group (``dispatch_group``) whose timeout is long: ranks wait on it while the engine idles.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 15.0
"""Seconds a compute collective (an all-reduce) may wait for the other ranks before it fails."""
DISPATCH_TIMEOUT_S = 7 * 24 * 3600.0
"""Seconds a rank waits for the next step's inputs: the engine may idle between requests."""


@dataclass(frozen=True)
class GroupInfo:
    """Where the ranks meet: rank 0's TCP store at ``host:port``, and the backend."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S


STARTUP_TIMEOUT_S = 300.0
"""Seconds the ranks may take to start (import torch, join the store) on a loaded machine."""

_rank = 0
_size = 1
_dispatch_group: dist.ProcessGroup | None = None


def tp_rank() -> int:
    """The rank a layer being built belongs to (0 outside :func:`building`)."""
    return _rank


def tp_size() -> int:
    """Ranks of the group a layer being built is split over (1 outside :func:`building`)."""
    return _size


@contextmanager
def building(rank: int, size: int) -> Iterator[None]:
    """Layers built inside take their slice for ``rank`` of ``size``."""
    global _rank, _size
    saved = _rank, _size
    _rank, _size = rank, size
    try:
        yield
    finally:
        _rank, _size = saved


def dispatch_group() -> dist.ProcessGroup | None:
    """The gloo group the step's inputs are broadcast on (None outside a group)."""
    return _dispatch_group


def init_group(info: GroupInfo, rank: int, store: dist.Store, alive: Callable[[], None] | None = None) -> None:
    """Join the group as ``rank`` through ``store`` (the rendezvous); returns once every rank has
    joined. One group per process."""
    global _dispatch_group
    # Everyone checks in first, with no deadline but ``alive`` (rank 0 polls its ranks' processes):
    # the group's own set-up then waits only ``collective_timeout_s``, and ranks start slowly.
    store.add("kvledger/ready", 1)
    while store.add("kvledger/ready", 0) < info.world_size:
        if alive is not None:
            alive()
        time.sleep(0.05)
    dist.init_process_group(info.backend, store=store, rank=rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=info.collective_timeout_s))
    _dispatch_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=DISPATCH_TIMEOUT_S))


def destroy_group() -> None:
    """Leave the group (idempotent)."""
    global _dispatch_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _dispatch_group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of the group, in place (the row-parallel layers' one collective)."""
    dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (the pool's block count), over the gloo group."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_dispatch_group)
    return int(t.item())


def all_gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, by rank (each rank's measured cache bytes)."""
    t = torch.tensor([value], dtype=torch.long)
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t, group=_dispatch_group)
    return [int(x.item()) for x in out]
