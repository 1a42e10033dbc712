"""Per-request block tables on top of the :class:`BlockPool`, with prefix caching.

``allocate_slots`` gives a request the blocks for its next tokens and registers every block
that those tokens fill in the prefix cache right away: in a step, every layer writes all new
K/V before any attention reads, so a request admitted in the same step may already share
them (if the step fails, :meth:`KVCacheManager.uncache_unwritten` takes them back out). Only
full blocks are hashed and shared; a request's last, partly filled block is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvledger.engine.block_pool import BlockHash, BlockPool, blocks_for, hash_block
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
        self.stats = PrefixCacheStats()

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_full_blocks`` full blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, request.block_content(i, bs)))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request about to be admitted: (block ids, tokens they hold).

        At least one token is always left to compute, so the hit covers at most
        ``num_tokens - 1`` tokens, rounded down to whole blocks.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.cached_prefix(self._block_hashes(request, max_blocks))
        return hits, len(hits) * self.block_size

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
        blocks = self.pool.blocks
        free_hits = sum([blocks[b].ref_cnt == 0 for b in computed_blocks]) if computed_blocks else 0
        if need > self.pool.num_free_blocks - free_hits:
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
