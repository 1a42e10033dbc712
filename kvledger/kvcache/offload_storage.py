"""The second KV tier's bytes: the copies of :class:`~kvledger.kvcache.offload.KVTransfers`
between the block pool's tensors and host memory or files on disk.

:class:`~kvledger.kvcache.offload.OffloadStore` keeps the books (which block hash sits in which
slot); this module holds the slots' bytes and runs a step's copies, stores first, then loads,
before the step's model run. A block is copied as the cache holds it
(:meth:`~kvledger.kvcache.storage.KVCache.block_tensors`: the elements, and an int8 cache's
per-token scales with them), so a load gives back exactly the bytes that were stored.

* :class:`HostKVTier`: one region of ``num_blocks x slot_bytes`` bytes apart from the pool,
  ``slot_bytes`` being a block's bytes rounded up to the host page (vLLM's layout). On CUDA the
  region is pinned host memory; the copies are synchronous (no side stream): a step waits for its
  loads and stores.
* :class:`DiskKVTier`: one file per block in a directory, named by the block's chained hash
  (SHA-256 of the token ids, the same in every process), written whole (a temporary file renamed)
  and read back on a hit. At start-up the store's index is rebuilt from the files, oldest first,
  so a restarted engine still finds what an earlier one computed. A ``manifest.json`` names the
  model and the cache's layout: a directory written for another model, dtype or block size is
  refused in one line, never read.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from kvledger.errors import KVLedgerError
from kvledger.kvcache.interface import BlockHash
from kvledger.kvcache.offload import KVTransfers, OffloadStats, OffloadStore
from kvledger.kvcache.storage import KVCache
from kvledger.spec.offload import OffloadCapacity

log = logging.getLogger("kvledger.engine")

MANIFEST = "manifest.json"
"""The disk tier's description of what its files hold (model, dtypes, block layout)."""
BLOCK_SUFFIX = ".kv"
"""A block file: ``<hex of the block hash>.kv``, holding the block's bytes and nothing else."""
DISK_FORMAT = 1
"""Version of the block files' layout, in the manifest."""


@dataclass(frozen=True)
class _Part:
    """One tensor of a block in a slot: ``nbytes`` bytes from ``offset``, viewed as ``dtype`` of ``shape``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _BlockBytes:
    """The cache tensors of a block and where each lies in a slot of bytes (one after the other)."""

    def __init__(self, cache: KVCache) -> None:
        self.tensors = cache.block_tensors()
        parts, offset = [], 0
        for t in self.tensors:
            one = t[:, :, 0]
            nbytes = one.numel() * t.element_size()
            parts.append(_Part(offset, nbytes, t.dtype, tuple(one.shape)))
            offset += nbytes
        self.parts: list[_Part] = parts
        self.block_bytes = offset
        """Bytes of one block, scales included."""

    def views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of a slot's bytes (``row``: uint8, at least :attr:`block_bytes` long)."""
        return [row[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts]

    def to_row(self, block_id: int, row: torch.Tensor) -> None:
        for t, view in zip(self.tensors, self.views(row)):
            view.copy_(t[:, :, block_id])

    def from_row(self, row: torch.Tensor, block_id: int) -> None:
        for t, view in zip(self.tensors, self.views(row)):
            t[:, :, block_id].copy_(view)


def _host_bytes(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uninitialised host bytes (pinned when the cache is on CUDA, so copies need no staging)."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")


class _Tier:
    """What both tiers share: the cache's block layout, checked against the size the tier was given,
    and :meth:`close`."""

    def __init__(self, cache: KVCache, capacity: OffloadCapacity) -> None:
        self.block = _BlockBytes(cache)
        if self.block.block_bytes != capacity.rank_block_bytes:
            raise AssertionError(f"a cache block holds {self.block.block_bytes} bytes but the tier was sized for "
                                 f"{capacity.rank_block_bytes}")
        self.closed = False

    def close(self) -> None:
        """Let go of the cache's tensors and the tier's memory (the engine was shut down); no copy runs after."""
        self.closed = True
        self.block.tensors = []
        for name in ("buffer", "_staging"):
            self.__dict__.pop(name, None)

    def _check_open(self) -> None:
        if self.closed:
            raise KVLedgerError("the engine was shut down; its KV offloading tier copies nothing more")


class HostKVTier(_Tier):
    """Tier-2 slots in host memory: ``capacity.num_blocks`` rows of ``capacity.slot_bytes`` bytes."""

    backend = "host"
    path: str | None = None

    def __init__(self, cache: KVCache, capacity: OffloadCapacity) -> None:
        super().__init__(cache, capacity)
        self.buffer = _host_bytes((capacity.num_blocks, capacity.slot_bytes), cache.storage.device)
        """The region: its bytes are ``num_blocks x slot_bytes`` (untouched pages cost no memory until stored to)."""

    def run(self, transfers: KVTransfers) -> None:
        """Every store, then every load (synchronous copies)."""
        self._check_open()
        for st in transfers.stores:
            self.block.to_row(st.block_id, self.buffer[st.slot])
        for ld in transfers.loads:
            self.block.from_row(self.buffer[ld.slot], ld.block_id)

    def forget(self, entries: Iterable[tuple[int, BlockHash]]) -> None:
        """(slot, hash) pairs the store dropped after a failed copy: nothing to undo in memory."""


class DiskKVTier(_Tier):
    """Tier-2 slots as files under ``path``, one per stored block (see the module's docstring)."""

    backend = "disk"

    def __init__(self, cache: KVCache, capacity: OffloadCapacity, path: str | os.PathLike[str],
                 identity: dict[str, Any], store: OffloadStore) -> None:
        super().__init__(cache, capacity)
        self.dir = Path(path)
        self.path = str(path)
        self._staging = _host_bytes((capacity.slot_bytes,), cache.storage.device)
        self._slot_hash: dict[int, BlockHash] = {}
        manifest = {"format": DISK_FORMAT, **identity, "block_bytes": self.block.block_bytes}
        _open_directory(self.dir, manifest)
        self._rebuild(store)

    def _file(self, block_hash: BlockHash) -> Path:
        return self.dir / (block_hash.hex() + BLOCK_SUFFIX)

    def _rebuild(self, store: OffloadStore) -> None:
        """Give every complete block file a slot, oldest first (the store's LRU order is the files'
        age); files beyond the capacity are the oldest and are deleted as their slots are reused."""
        files = []
        for f in self.dir.glob("*" + BLOCK_SUFFIX):
            try:
                block_hash = bytes.fromhex(f.name[:-len(BLOCK_SUFFIX)])
                stat = f.stat()
            except (ValueError, OSError):
                continue
            if len(block_hash) == 32 and stat.st_size == self.block.block_bytes:
                files.append((stat.st_mtime_ns, f.name, block_hash))
        for _, _, block_hash in sorted(files):
            slot = store.store(block_hash)
            if slot is not None:
                self._take_slot(slot, block_hash)
        store.stats = OffloadStats()  # the counts are of this engine's copies, not of the directory's history
        if files:
            log.info("KV offloading: %d blocks found in %s", store.num_stored, self.dir)

    def _take_slot(self, slot: int, block_hash: BlockHash) -> None:
        """``slot`` holds ``block_hash`` from now on: the file of the block it held before goes."""
        old = self._slot_hash.get(slot)
        if old is not None and old != block_hash:
            self._file(old).unlink(missing_ok=True)
        self._slot_hash[slot] = block_hash

    def run(self, transfers: KVTransfers) -> None:
        """Every store (a file written whole, then renamed), then every load (a file read back)."""
        self._check_open()
        row, size = self._staging, self.block.block_bytes
        for st in transfers.stores:
            self._take_slot(st.slot, st.block_hash)
            self.block.to_row(st.block_id, row)
            target = self._file(st.block_hash)
            tmp = target.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(row[:size].numpy().data)
            os.replace(tmp, target)
        for ld in transfers.loads:
            with open(self._file(ld.block_hash), "rb") as f:
                got = f.readinto(row[:size].numpy().data)
            if got != size:
                raise OSError(f"KV block file {self._file(ld.block_hash).name} holds {got} bytes, not {size}")
            self.block.from_row(row, ld.block_id)

    def forget(self, entries: Iterable[tuple[int, BlockHash]]) -> None:
        """(slot, hash) pairs the store dropped after a failed copy: their files may be partial or
        bad, and their slots are free again; the files are deleted."""
        for slot, block_hash in entries:
            if self._slot_hash.get(slot) == block_hash:
                del self._slot_hash[slot]
            self._file(block_hash).unlink(missing_ok=True)


def _open_directory(directory: Path, manifest: dict[str, Any]) -> None:
    """Create the tier's directory and manifest, or check that an existing manifest describes the
    same blocks (a mismatch is refused in one line: the files would be read as another model's K/V)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST
        if path.exists():
            try:
                found = json.loads(path.read_text())
            except ValueError:
                raise KVLedgerError(f"--kv-offloading-path {directory}: {MANIFEST} is not JSON; give an empty "
                                    "directory or one this engine wrote") from None
            differ = [f"{k} {found.get(k)!r} (now {v!r})" for k, v in manifest.items() if found.get(k) != v]
            if differ:
                raise KVLedgerError(f"--kv-offloading-path {directory} holds KV blocks of another cache: "
                                    f"{', '.join(differ)}; give another directory")
        elif any(directory.glob("*" + BLOCK_SUFFIX)):
            raise KVLedgerError(f"--kv-offloading-path {directory} holds block files but no {MANIFEST}; "
                                "give another directory")
        else:
            path.write_text(json.dumps(manifest, indent=1) + "\n")
    except OSError as err:
        raise KVLedgerError(f"--kv-offloading-path {directory}: {err.strerror or err}") from None


def make_offload_tier(cache: KVCache, capacity: OffloadCapacity, store: OffloadStore, path: str | None,
                      identity: dict[str, Any]) -> HostKVTier | DiskKVTier:
    """The tier's storage: files under ``path``, else host memory. ``identity`` (model, dtypes,
    block size) goes into a disk tier's manifest."""
    if path is None:
        return HostKVTier(cache, capacity)
    return DiskKVTier(cache, capacity, path, identity, store)
