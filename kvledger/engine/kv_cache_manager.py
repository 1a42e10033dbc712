"""Per-request block tables on top of the :class:`BlockPool`, with prefix caching.

``allocate_slots`` gives a request the blocks for its next tokens and registers every block
that those tokens fill in the prefix cache right away: in a step, every layer writes all new
K/V before any attention reads, so a request admitted in the same step may already share
them (if the step fails, :meth:`KVCacheManager.uncache_unwritten` takes them back out). Only
full blocks are hashed and shared; a request's last, partly filled block is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Iterable

from kvledger.engine.block_pool import BlockHash, BlockPool, blocks_for
from kvledger.engine.sequence import Request


@dataclass
class PrefixCacheStats:
    """vLLM's counting: ``queries`` = tokens of admitted requests, ``hits`` = of those found cached."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Block tables, chained block hashes and allocation for the scheduler."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int, list[int], set[int], int]] = {}
        """Memoised prefix lookups of waiting requests: (pool mark, blocks looked up, hits, their
        set, how many of them are free)."""
        self.stats = PrefixCacheStats()

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_full_blocks`` full blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs, key = self.block_size, request.block_hash
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(key(hashes[-1] if hashes else None, i, bs))
        return hashes if len(hashes) == num_full_blocks else hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request about to be admitted: (block ids, tokens they hold).

        At least one token is always left to compute, so the hit covers at most
        ``num_tokens - 1`` tokens, rounded down to whole blocks. The lookup is memoised until one
        of its hits changes (leaves the cache, or the free queue, or joins it): the head of a full
        engine's waiting queue is asked every step.
        """
        if not self.enable_caching:
            return [], 0
        pool, rid = self.pool, request.request_id
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        memo = self._lookups.get(rid)
        blocks = pool.blocks
        if memo is not None and memo[1] == max_blocks:
            changed = pool.changed_since(memo[0])
            if changed is not None and memo[3].isdisjoint(changed):
                hits, hit_set, free_hits = memo[2], memo[3], memo[4]
                more = pool.cached_prefix(islice(hashes, len(hits), None))  # prefixes cached since
                hits.extend(more)
                hit_set.update(more)
                free_hits += sum([blocks[b].ref_cnt == 0 for b in more])
                self._lookups[rid] = (pool.num_changes, max_blocks, hits, hit_set, free_hits)
                return list(hits), len(hits) * self.block_size
        hits = pool.cached_prefix(hashes)
        free_hits = sum([blocks[b].ref_cnt == 0 for b in hits])
        self._lookups[rid] = (pool.num_changes, max_blocks, hits, set(hits), free_hits)
        return list(hits), len(hits) * self.block_size

    def _num_free_hits(self, request: Request, computed_blocks: list[int]) -> int:
        """How many of a lookup's hits are free (they leave the free queue when taken): the
        memoised count while the pool is as the lookup left it, else counted."""
        memo = self._lookups.get(request.request_id)
        if memo is not None and memo[0] == self.pool.num_changes and len(memo[2]) == len(computed_blocks):
            return memo[4]
        blocks = self.pool.blocks
        return sum([blocks[b].ref_cnt == 0 for b in computed_blocks])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Blocks for tokens up to ``num_computed_tokens (+ cached) + num_new_tokens``; False if the pool is short.

        ``computed_blocks`` are prefix-cache hits of a request being admitted (its
        ``num_computed_tokens`` already counts them). Nothing changes when it returns False.
        """
        total_tokens = request.num_computed_tokens + num_new_tokens
        table = self.block_tables.get(request.request_id)
        if table is not None and not computed_blocks and -(-total_tokens // self.block_size) <= len(table):
            # the common decode step: its blocks already hold the new tokens (the simulator's hot path)
            if total_tokens // self.block_size > self._num_cached[request.request_id]:
                self._cache_full_blocks(request, total_tokens)
            return True
        computed_blocks = computed_blocks or []
        table = table if table is not None else []
        need = self.num_blocks_needed(total_tokens) - len(table) - len(computed_blocks)
        # hits that are currently free leave the free queue when touched
        num_free = self.pool.num_free_blocks
        if need > num_free:  # short even if no hit were free: skip counting them
            return False
        free_hits = self._num_free_hits(request, computed_blocks) if computed_blocks else 0
        if need > num_free - free_hits:
            return False
        if request.request_id not in self.block_tables:
            self.block_tables[request.request_id] = table
            self._num_cached[request.request_id] = 0
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self._num_cached[request.request_id] = len(computed_blocks)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self._cache_full_blocks(request, total_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        full = num_tokens // self.block_size
        done = self._num_cached[rid]
        if full <= done:
            return
        hashes = self._block_hashes(request, full)
        table = self.block_tables[rid]
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i])
        self._num_cached[rid] = full

    def uncache_unwritten(self, request: Request, num_new_tokens: int) -> None:
        """Drop the prefix-cache entries of the blocks that the request's next ``num_new_tokens``
        tokens fill: for a step that failed before writing their K/V.

        Those are the blocks ``[num_computed_tokens // block_size, (num_computed_tokens +
        num_new_tokens) // block_size)`` of its table, hashed when the step was scheduled (the
        first may hold tokens of earlier steps, but only became full now); the blocks before
        them were full and written already (earlier steps, or prefix-cache hits).
        """
        table = self.block_tables.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        self.pool.uncache(table[first:end])

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admission in the prefix-cache stats (queries and hits in tokens)."""
        self._lookups.pop(request.request_id, None)
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Return a request's blocks to the pool, tail first so shared prefixes are evicted last.

        Its memoised block hashes stay (a preempted request is admitted again); :meth:`forget`
        drops them when it leaves the engine."""
        table = self.block_tables.pop(request.request_id, [])
        self.pool.free(reversed(table))
        self._num_cached.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop memoised hashes of a request that left the engine."""
        self._hashes.pop(request_id, None)
        self._lookups.pop(request_id, None)

    def tokens_used(self, running: Iterable[Request]) -> int:
        """Tokens with K/V in allocated blocks, a shared block counted once; O(running requests).

        The running requests are the ones holding blocks, and each one's table covers exactly
        its computed tokens. A block is shared only as a full prefix-cache hit, which lies within
        the computed tokens of every holder, so the sum of computed tokens counts each extra
        reference to a block once, ``block_size`` tokens each time."""
        tables = self.block_tables
        computed = references = 0
        for request in running:
            computed += request.num_computed_tokens
            references += len(tables[request.request_id])
        allocated = self.pool.num_blocks - self.pool.num_free_blocks
        return computed - (references - allocated) * self.block_size

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.block_tables)
