"""The KV offloading tier in the simulator: its size (vLLM's arithmetic), its rules, and the price of
the copies a step makes between the tiers.

Each replica keeps its own :class:`~kvledger.kvcache.offload.OffloadStore` under its pool, driven
by the engine's own :class:`~kvledger.kvcache.manager.KVCacheManager`; a step's
:class:`~kvledger.kvcache.offload.KVTransfers` run before its model run, so the step takes
``max(blocks loaded, blocks stored) x block bytes per rank / host-link bytes per second`` more:
loads cross the link host to device, stores device to host, each direction at the link's rate
at once (PCIe is full duplex), every rank over its own link.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.kvcache.offload import STORE_ON_EVICT, KVTransfers
from kvledger.spec.offload import OffloadCapacity


@dataclass(frozen=True)
class OffloadTier:
    """One replica's second tier: its ``capacity`` (blocks, bytes), eviction ``policy``, store rule,
    and the host link's ``bandwidth_bytes_per_s`` one way (None: the copies are already in the
    step times, as in a replay of recorded ones)."""

    capacity: OffloadCapacity
    bandwidth_bytes_per_s: float | None
    policy: str = "lru"
    store_rule: str = STORE_ON_EVICT

    def seconds(self, transfers: KVTransfers) -> float:
        """What a step's copies add to it (0 when the step times already hold them)."""
        if self.bandwidth_bytes_per_s is None:
            return 0.0
        blocks = max(len(transfers.loads), len(transfers.stores))
        return blocks * self.capacity.rank_block_bytes / self.bandwidth_bytes_per_s


@dataclass
class OffloadTraffic:
    """Blocks copied between the tiers over a run, and the seconds the steps spent on them."""

    blocks_loaded: int = 0
    blocks_stored: int = 0
    seconds: float = 0.0

    def add(self, transfers: KVTransfers, seconds: float) -> None:
        self.blocks_loaded += len(transfers.loads)
        self.blocks_stored += len(transfers.stores)
        self.seconds += seconds
