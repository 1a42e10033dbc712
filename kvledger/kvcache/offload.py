"""The second KV tier's bookkeeping: full blocks kept in host memory (or on disk) behind the pool.

Tier 1 is the :class:`~kvledger.kvcache.block_pool.BlockPool`; tier 2 is an :class:`OffloadStore`
of ``capacity_blocks`` *slots*, each the size of one tier-1 block (vLLM's default of one GPU
block per offload chunk). A slot is keyed by the same chained block hash the prefix cache uses,
so a prompt's prefix is matched in tier 1, then, from the first block tier 1 misses, in tier 2.

The store only keeps the books: which hash sits in which slot, which slots a step is loading
(pinned: never evicted under a load), and the eviction order. The bytes are copied by whoever
holds the tensors (the engine) or priced (the simulator), from the per-step :class:`KVTransfers`
that :class:`~kvledger.kvcache.manager.KVCacheManager` emits.

Eviction policies are vLLM's (``vllm/v1/kv_offload/cpu/policies/``): ``lru`` and ``arc``
(adaptive replacement: a recency list, a frequency list and their ghost lists).
Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Container, Iterable, Sequence

from kvledger.errors import KVLedgerError
from kvledger.kvcache.block_pool import leading_run
from kvledger.kvcache.interface import BlockHash

EVICTION_POLICIES = ("lru", "arc")
"""Tier-2 eviction policies (vLLM's ``eviction_policy`` names)."""
STORE_ON_COMPUTE = "compute"
"""Store rule of vLLM's native offloading: a prompt's full blocks are written to tier 2 as soon as
they are computed (write-through), whether tier 1 keeps them or not."""
STORE_ON_EVICT = "evict"
"""Store rule of a victim cache: a block is written to tier 2 only when tier 1 evicts it
(write-back), so the two tiers hold different blocks."""
STORE_RULES = (STORE_ON_EVICT, STORE_ON_COMPUTE)
"""The first is the default: on Mooncake's conversation trace it found more hits at every tier size
(a write-through tier repeats the pool's blocks; one no larger than the pool adds no hit)."""


@dataclass(frozen=True)
class StoreBlock:
    """Copy tier-1 block ``block_id`` (holding ``block_hash``) into tier-2 slot ``slot``."""

    block_id: int
    block_hash: BlockHash
    slot: int


@dataclass(frozen=True)
class LoadBlock:
    """Copy tier-2 slot ``slot`` (holding ``block_hash``) into tier-1 block ``block_id``."""

    slot: int
    block_id: int
    block_hash: BlockHash


@dataclass
class KVTransfers:
    """One step's copies between the tiers. All of them run before the step's model run, in this
    order: every store (its tier-1 block still holds what its hash says), then every load (into
    blocks allocated for the step, which the model run must not write before the load is done)."""

    stores: list[StoreBlock] = field(default_factory=list)
    loads: list[LoadBlock] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)

    @property
    def num_blocks(self) -> int:
        """Blocks copied, both directions."""
        return len(self.stores) + len(self.loads)


@dataclass
class OffloadStats:
    """Counts since start, in blocks: copied into tier 2 (``stored``), out of it (``loaded``),
    dropped to make room (``evicted``), and stores skipped because every slot was pinned."""

    stored: int = 0
    loaded: int = 0
    evicted: int = 0
    skipped: int = 0


class _LRU:
    """Least recently used first: one ordered map hash -> slot, front = next victim."""

    def __init__(self, capacity: int) -> None:
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()

    def get(self, key: BlockHash) -> int | None:
        return self.entries.get(key)

    def insert(self, key: BlockHash, slot: int) -> None:
        self.entries[key] = slot

    def hit(self, key: BlockHash) -> None:
        self.entries.move_to_end(key)

    def offered(self, key: BlockHash) -> None:
        self.entries.move_to_end(key)

    def victim(self, pinned: Container[int]) -> BlockHash | None:
        for key, slot in self.entries.items():
            if slot not in pinned:
                return key
        return None

    def evict(self, key: BlockHash) -> int:
        return self.entries.pop(key)

    def remove(self, key: BlockHash) -> int:
        return self.entries.pop(key)

    def items(self) -> Iterable[tuple[BlockHash, int]]:
        return self.entries.items()

    def clear(self) -> None:
        self.entries.clear()

    def check(self, capacity: int) -> None:
        pass


class _ARC:
    """Adaptive replacement (Megiddo and Modha), as vLLM's ``ARCCachePolicy``: ``t1`` holds blocks
    seen once, ``t2`` blocks loaded again; ``b1``/``b2`` remember the hashes each evicted, and a
    store of a remembered hash moves the target size of ``t1`` (``p``) toward the list it came from."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[BlockHash, int] = OrderedDict()
        self.t2: OrderedDict[BlockHash, int] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()

    def get(self, key: BlockHash) -> int | None:
        slot = self.t1.get(key)
        return slot if slot is not None else self.t2.get(key)

    def insert(self, key: BlockHash, slot: int) -> None:
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            del self.b1[key]
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
        self.t1[key] = slot

    def hit(self, key: BlockHash) -> None:
        if key in self.t1:
            self.t2[key] = self.t1.pop(key)
        else:
            self.t2.move_to_end(key)

    def offered(self, key: BlockHash) -> None:
        (self.t1 if key in self.t1 else self.t2).move_to_end(key)

    def victim(self, pinned: Container[int]) -> BlockHash | None:
        first, second = (self.t1, self.t2) if len(self.t1) >= int(self.p) else (self.t2, self.t1)
        for entries in (first, second):
            for key, slot in entries.items():
                if slot not in pinned:
                    return key
        return None

    def evict(self, key: BlockHash) -> int:
        if key in self.t1:
            slot, ghost = self.t1.pop(key), self.b1
        else:
            slot, ghost = self.t2.pop(key), self.b2
        ghost[key] = None
        if len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return slot

    def remove(self, key: BlockHash) -> int:
        return self.t1.pop(key) if key in self.t1 else self.t2.pop(key)

    def items(self) -> Iterable[tuple[BlockHash, int]]:
        yield from self.t1.items()
        yield from self.t2.items()

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.p = 0.0

    def check(self, capacity: int) -> None:
        assert self.t1.keys().isdisjoint(self.t2), "a hash is in both ARC lists"
        assert len(self.b1) <= capacity and len(self.b2) <= capacity, "an ARC ghost list outgrew the capacity"
        assert 0 <= self.p <= capacity, f"ARC target {self.p} outside [0, {capacity}]"


class OffloadStore:
    """Tier 2: ``capacity_blocks`` slots keyed by chained block hash, evicted by ``policy``.

    ``store`` gives a hash a slot (evicting the policy's victim when full, never a pinned slot);
    ``match`` finds the longest run of leading hashes stored; ``load`` counts a hit and pins its
    slots until ``unpin_all`` (the step's transfers are done)."""

    def __init__(self, capacity_blocks: int, policy: str = "lru") -> None:
        if capacity_blocks < 1:
            raise KVLedgerError(f"the KV offloading tier has room for {capacity_blocks} blocks; give it more "
                                "memory (--kv-offloading-size)")
        if policy not in EVICTION_POLICIES:
            raise KVLedgerError(f"unknown KV offloading eviction policy {policy!r}; use one of "
                                f"{', '.join(EVICTION_POLICIES)}")
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self._policy: _LRU | _ARC = _LRU(capacity_blocks) if policy == "lru" else _ARC(capacity_blocks)
        self._next_fresh = 0  # slots [_next_fresh, capacity) were never used
        self._free: list[int] = []  # slots given back (reset), reused first
        self._pinned: dict[int, int] = {}  # slot -> loads in flight this step
        self.stats = OffloadStats()

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_stored(self) -> int:
        """Slots holding a block."""
        return self._next_fresh - len(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash``, if stored."""
        return self._policy.get(block_hash)

    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The slots of the longest run of leading ``hashes`` that is stored."""
        return leading_run(hashes, self._policy.get)

    # ---- changes ---------------------------------------------------------------------------
    def store(self, block_hash: BlockHash) -> int | None:
        """A slot for ``block_hash``, to be copied into: None when it is stored already (then it
        counts as used now) or when every slot is pinned (the store is skipped)."""
        policy = self._policy
        if policy.get(block_hash) is not None:
            policy.offered(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        elif self._next_fresh < self.capacity_blocks:
            slot = self._next_fresh
            self._next_fresh += 1
        else:
            victim = policy.victim(self._pinned)
            if victim is None:
                self.stats.skipped += 1
                return None
            slot = policy.evict(victim)
            self.stats.evicted += 1
        policy.insert(block_hash, slot)
        self.stats.stored += 1
        return slot

    def load(self, hashes: Sequence[BlockHash]) -> None:
        """Count a load of these stored hashes: each is used now and pinned until :meth:`unpin_all`."""
        policy, pinned = self._policy, self._pinned
        for block_hash in hashes:
            slot = policy.get(block_hash)
            if slot is None:
                raise AssertionError("a load of a block that tier 2 does not hold")
            policy.hit(block_hash)
            pinned[slot] = pinned.get(slot, 0) + 1
        self.stats.loaded += len(hashes)

    def unpin_all(self) -> None:
        """The step's loads are done: no slot is protected any more."""
        self._pinned.clear()

    def drop(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (its slot's bytes are not what the hash says: a failed copy)."""
        if self._policy.get(block_hash) is not None:
            self._free.append(self._policy.remove(block_hash))

    def reset(self) -> None:
        """Forget every stored block (vLLM's reset of the prefix cache reaches the offload tier too)."""
        self._policy.clear()
        self._next_fresh = 0
        self._free.clear()
        self._pinned.clear()

    # ---- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is free xor holds exactly one hash, no more blocks
        are stored than there are slots, and every pinned slot holds a block."""
        seen: dict[int, BlockHash] = {}
        for block_hash, slot in self._policy.items():
            assert 0 <= slot < self._next_fresh, f"tier-2 slot {slot} outside the {self._next_fresh} used"
            assert slot not in seen, f"tier-2 slot {slot} holds two blocks"
            seen[slot] = block_hash
        assert not seen.keys() & set(self._free), "a free tier-2 slot holds a block"
        assert len(set(self._free)) == len(self._free), "a tier-2 slot is free twice"
        assert len(seen) + len(self._free) == self._next_fresh <= self.capacity_blocks, (
            f"{len(seen)} stored + {len(self._free)} free != {self._next_fresh} slots used (capacity "
            f"{self.capacity_blocks})")
        assert set(self._pinned) <= seen.keys(), "a pinned tier-2 slot holds no block"
        self._policy.check(self.capacity_blocks)
