"""The KV cache's interface, in one page: read this file first.

Two halves, one vocabulary (a *block* is ``block_size`` tokens of K and V for the layers of
one KV-cache group; a *slot* is one token's place in a block: ``block * block_size + offset``):

**Bookkeeping** (torch-free; the engine and the simulator run the same code):

* :class:`~kvledger.kvcache.block_pool.BlockPool`: every block free or held, reference
  counts, the free queue in eviction order (LRU), and the prefix cache (chained block hash ->
  block). ``cached_prefix`` matches, ``allocate``/``touch`` lock, ``free`` unlocks, ``cache``
  inserts, ``uncache``/``reset_prefix_cache`` evict, ``check_integrity`` checks.
* :class:`~kvledger.kvcache.manager.KVCacheManager`: per request and per group, the block
  table; it speaks to the scheduler in requests (:class:`SequenceLike` below), never in
  tensors. Its operations are :class:`PrefixCacheManager`'s.
* :mod:`~kvledger.kvcache.groups`: which layers share a block table (sliding windows).
* :class:`~kvledger.kvcache.offload.OffloadStore`: the second tier (host memory or disk) under
  the pool, slots keyed by the same block hashes, LRU or ARC. With one, the manager matches a
  prefix in the pool, then in the tier, and each :class:`~kvledger.engine.scheduler.SchedulerOutput`
  carries the step's :class:`~kvledger.kvcache.offload.KVTransfers`: ``StoreBlock(block_id,
  block_hash, slot)`` and ``LoadBlock(slot, block_id, block_hash)``, to run (stores, then loads)
  before the step's model run. Tier-2 sizes come from :func:`kvledger.spec.offload.tier_capacity`.

**Storage** (torch): :class:`~kvledger.kvcache.storage.KVCache` and its 8-bit variants
(:mod:`~kvledger.kvcache.quantized_storage`, formats in :mod:`~kvledger.kvcache.quantization`)
hold the pool tensors; attention writes by slot and reads by block table
(:class:`PagedKVStorage`). The bytes they allocate are Eq 2.2's, from :mod:`kvledger.spec`. The
second tier's bytes (:mod:`~kvledger.kvcache.offload_storage`: host memory, or one file per block on
disk) run each step's :class:`~kvledger.kvcache.offload.KVTransfers`, copying a block exactly as
:meth:`~kvledger.kvcache.storage.KVCache.block_tensors` holds it.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

BlockHash = bytes
"""A full block's identity: the SHA-256 of its parent's hash and its own token ids."""


class SequenceLike(Protocol):
    """What the cache reads of a request: its id, its length and its prompt's, how much of it is in
    the cache, and the key of each full block. The engine's :class:`~kvledger.engine.sequence.Request`
    and the simulator's length-only requests are both this."""

    request_id: str
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def block_hash(self, parent: BlockHash | None, index: int, block_size: int) -> BlockHash: ...


@runtime_checkable
class PrefixCacheManager(Protocol):
    """The manager's side of the scheduler's seam (match, lock, insert, unlock, evict, check)."""

    def get_computed_blocks(self, request: SequenceLike) -> tuple[list[int], int]:
        """Match: the cached blocks of the request's prefix and their token count."""
        ...

    def allocate_slots(self, request: SequenceLike, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Lock the matched blocks and allocate the rest for ``num_new_tokens``; insert every block
        they fill into the prefix cache. False (nothing changed) when the pool is short."""
        ...

    def free(self, request: SequenceLike) -> None:
        """Unlock every block of the request; full ones stay cached until evicted."""
        ...

    def tokens_used(self, running: Iterable[SequenceLike]) -> int:
        """Tokens with K/V in held blocks, a shared block counted once."""
        ...

    def check_integrity(self) -> None:
        """Assert the pool's counts agree with every block table."""
        ...


@runtime_checkable
class PagedKVStorage(Protocol):
    """The pool tensors as attention sees them (see :class:`~kvledger.kvcache.storage.KVCache`)."""

    num_blocks: int
    block_size: int

    @property
    def measured_bytes(self) -> int:
        """Bytes of the tensors allocated (elements and scales), all layers, K and V."""
        ...

    def write(self, layer: int, k: object, v: object, slot_mapping: object) -> None:
        """Store a layer's new K and V at their slots."""
        ...

    def gather(self, layer: int, block_tables: object, num_tokens: int | None = None) -> tuple[object, object]:
        """K and V of the blocks a table names, in the compute dtype."""
        ...

    def layer_pools(self, layer: int) -> object:
        """A layer's pools as stored, for kernels that read in place."""
        ...


__all__: Sequence[str] = ("BlockHash", "SequenceLike", "PrefixCacheManager", "PagedKVStorage")
