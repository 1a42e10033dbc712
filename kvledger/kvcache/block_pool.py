"""The block pool: every KV block is either free or owned, and full blocks can be shared.

A block holds ``block_size`` tokens of K/V for every layer. The pool keeps

* a reference count per block: the number of requests whose block table holds it;
* a free queue of blocks with a zero count, in eviction order (front = reused first). A free
  block may still hold a cached prefix: it keeps its hash until it is reused (LRU eviction);
* the prefix cache: chained block hash -> block id, for full blocks only.

A block's hash chains its parent's hash, its token ids and any extra keys (e.g. an adapter),
so two blocks are equal only if everything before them is equal too.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from kvledger.errors import KVLedgerError

from kvledger.kvcache.interface import BlockHash
_ROOT_HASH = b"kvledger-prefix-root"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``num_tokens`` tokens (rounded up)."""
    return -(-num_tokens // block_size)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys): the identity of a full block and its prefix."""
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained :func:`hash_block` of every full block of ``token_ids``, first block first: the
    keys a pool caches this prompt's blocks under (a router compares them without the pool)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


def leading_run(hashes: Iterable[BlockHash], lookup: Callable[[BlockHash], int | None]) -> list[int]:
    """What ``lookup`` gives for each of the leading ``hashes``, up to the first it has not: the
    longest cached prefix, in blocks (of the pool) or slots (of the second tier)."""
    found: list[int] = []
    for block_hash in hashes:
        index = lookup(block_hash)
        if index is None:
            break
        found.append(index)
    return found


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Free queue, reference counts and the hash -> block map of prefix caching."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.check_size(num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._num_cached_free = 0  # free blocks that still carry a hash, kept up to date by every change
        self._changed: list[int] = []  # blocks that lost their prefix or entered/left the free queue (bounded)
        self._changed_base = 0  # changes before _changed[0]
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        """Called with (block id, hash) when :meth:`allocate` reuses a block that still holds a cached
        prefix, before the prefix is forgotten (a second tier that stores what the pool evicts)."""

    @staticmethod
    def check_size(num_blocks: int) -> None:
        """Refuse a pool without a block (before anything is allocated for it)."""
        if num_blocks < 1:
            raise KVLedgerError(f"the KV cache has room for {num_blocks} blocks; give it more memory (--kv-cache-memory)")

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including those still holding a cached prefix."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable on a hit, evictable on demand)."""
        return self._num_cached_free

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, if cached."""
        return self._cached.get(block_hash) if self.enable_caching else None

    @property
    def num_changes(self) -> int:
        """Changes so far to blocks' cached prefixes (dropped) or free state: a mark for :meth:`changed_since`."""
        return self._changed_base + len(self._changed)

    def changed_since(self, mark: int) -> list[int] | None:
        """Blocks that lost their cached prefix or entered or left the free queue after ``mark`` (a
        :attr:`num_changes` value); None if the log no longer reaches back that far. While none of a
        lookup's hits is among them, its hits are still cached (a hash only leaves the cache by a
        drop) and as many of them are free."""
        start = mark - self._changed_base
        return self._changed[start:] if start >= 0 else None

    def _trim_log(self) -> None:
        """Keep the change log bounded (called after the changes of one call); older marks read None."""
        log = self._changed
        if len(log) > 4 * self.num_blocks + 1024:
            half = len(log) // 2
            del log[:half]
            self._changed_base += half

    def cached_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks holding the longest run of leading ``hashes`` that is cached (a tight loop:
        the scheduler asks it for the head of the waiting queue every step)."""
        if not self.enable_caching:
            return []
        return leading_run(hashes, self._cached.get)

    # ---- ownership ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue, evicting their cached prefixes."""
        if n > len(self._free):
            raise KVLedgerError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        out = []
        log = self._changed
        on_evict = self.on_evict
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if on_evict is not None:
                    on_evict(block_id, block.block_hash)
                self._num_cached_free -= 1
                del self._cached[block.block_hash]
                block.block_hash = None
            log.append(block_id)
            block.ref_cnt = 1
            out.append(block_id)
        self._trim_log()
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each (cache hits); a free block leaves the free queue."""
        log = self._changed
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                log.append(block_id)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1
        self._trim_log()

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each, in the given order; blocks reaching zero join the free queue.

        Blocks without a cached prefix go to the front (reused first); cached ones go to the
        back in the given order, so callers pass a request's blocks tail first and the
        shared beginnings of prompts are evicted last.
        """
        log = self._changed
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block_id} freed with reference count {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                log.append(block_id)
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._num_cached_free += 1
        self._trim_log()

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, owned block under ``block_hash``; False if that prefix is already cached."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        if block.ref_cnt == 0:
            self._num_cached_free += 1
        return True

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Forget the cached prefixes of these blocks (their K/V is not what the hash says); a
        free one moves to the front of the free queue, like any block without a prefix."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            del self._cached[block.block_hash]
            block.block_hash = None
            self._changed.append(block_id)
            if block.ref_cnt == 0:
                self._num_cached_free -= 1
                self._free.move_to_end(block_id, last=False)
        self._trim_log()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by a free block."""
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self._changed.append(block_id)
        self._num_cached_free = 0
        self._trim_log()

    # ---- checks -----------------------------------------------------------------------------
    def check_integrity(self, owners: Mapping[str, Sequence[int]]) -> None:
        """Raise AssertionError unless the pool is consistent with ``owners`` (request id -> block table).

        Every block is free xor owned; each reference count equals the number of block tables
        that hold it; no table holds a block twice; every cache entry points at a block that
        carries that hash, and every hashed block is in the cache; the count of cached free
        blocks is right.
        """
        counts = [0] * self.num_blocks
        for request_id, table in owners.items():
            assert len(set(table)) == len(table), f"request {request_id} holds a block twice: {table}"
            for block_id in table:
                assert 0 <= block_id < self.num_blocks, f"request {request_id} holds unknown block {block_id}"
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt == counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {counts[block.block_id]} owners")
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id}: ref_cnt {block.ref_cnt}, free={in_free}"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, f"block {block.block_id} hash not in cache"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache entry for block {block_id} is stale"
        cached_free = sum(1 for i in self._free if self.blocks[i].block_hash is not None)
        assert self._num_cached_free == cached_free, (
            f"{self._num_cached_free} cached free blocks counted, {cached_free} in the free queue")
