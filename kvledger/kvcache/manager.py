"""Per-request block tables on top of the :class:`BlockPool`, with prefix caching.

``allocate_slots`` gives a request the blocks for its next tokens and registers every block
that those tokens fill in the prefix cache right away: in a step, every layer writes all new
K/V before any attention reads, so a request admitted in the same step may already share
them (if the step fails, :meth:`KVCacheManager.uncache_unwritten` takes them back out). Only
full blocks are hashed and shared; a request's last, partly filled block is its own.

**KV-cache groups** (hybrid models such as Gemma-3): layers of one attention type are cut into
groups of equal size (:func:`kvledger.kvcache.groups.kv_cache_groups`), every group has its own block table per request,
and all of them draw on the one pool, whose block is a page of one group's layers. A
sliding-window group holds only the blocks that still hold one of the last ``window`` tokens
(:meth:`KVCacheManager.free_out_of_window`); the slots of the blocks it gave back read
:data:`NULL_BLOCK`. Prefix caching keys a block by its hash and its group, and a hit must be
present in every group: all of the prefix for a full-attention group, only the blocks the
window still needs for a sliding one. A model without sliding layers has one full group and
takes the single-group paths unchanged.

**The second tier** (:mod:`kvledger.kvcache.offload`): with an :class:`OffloadStore`, a prefix is
matched in the pool, then, from the first block the pool misses, in tier 2. Tier-2 hits are loaded
into blocks allocated for them at admission, count as cached tokens (``external_kv_transfer``)
and enter the pool's prefix cache like any computed block. What is stored when is the store rule
(:data:`~kvledger.kvcache.offload.STORE_RULES`). Every copy between the tiers is an event of the
step's :class:`KVTransfers` (:meth:`KVCacheManager.take_transfers`), which the engine executes and
the simulator prices. Single-group models only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Sequence

from kvledger.errors import KVLedgerError
from kvledger.kvcache.block_pool import BlockHash, BlockPool, blocks_for
from kvledger.kvcache.groups import FULL_ATTENTION, NULL_BLOCK, KVCacheGroup, first_live_block
from kvledger.kvcache.interface import SequenceLike as Request
from kvledger.kvcache.offload import (STORE_ON_COMPUTE, STORE_ON_EVICT, STORE_RULES, KVTransfers, LoadBlock,
                                      OffloadStore, StoreBlock)

LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"
EXTERNAL_KV_TRANSFER = "external_kv_transfer"
PROMPT_TOKEN_SOURCES = (LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER)
"""vLLM's ``source`` labels of ``vllm:prompt_tokens_by_source`` (``v1/metrics/stats.py``,
``PromptTokenStats.ALL_SOURCES``): computed here, found in the pool (tier 1), loaded from
the offloading tier (tier 2)."""


@dataclass
class PrefixCacheStats:
    """vLLM's counting: ``queries`` = tokens of admitted requests, ``hits`` = of those found in the
    pool; ``offload_queries`` = the tokens then asked of tier 2 (all past the pool's hit),
    ``offload_hits`` = of those loaded from it (vLLM's ``external_prefix_cache_*``)."""

    queries: int = 0
    hits: int = 0
    offload_queries: int = 0
    offload_hits: int = 0

    def by_source(self) -> dict[str, int]:
        """Tokens of admitted requests per vLLM ``prompt_tokens_by_source`` label."""
        return {LOCAL_COMPUTE: self.queries - self.hits - self.offload_hits, LOCAL_CACHE_HIT: self.hits,
                EXTERNAL_KV_TRANSFER: self.offload_hits}


class KVCacheManager:
    """Block tables, chained block hashes and allocation for the scheduler."""

    def __init__(self, pool: BlockPool, block_size: int, groups: Sequence[KVCacheGroup] | None = None,
                 offload: OffloadStore | None = None, store_rule: str = STORE_ON_EVICT) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups: tuple[KVCacheGroup, ...] = tuple(groups) if groups else (KVCacheGroup(FULL_ATTENTION, ()),)
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in self.groups]
        """Per group: request id -> block table (logical block ``i`` of the request at index ``i``)."""
        self.block_tables = self.group_tables[0]
        """The first group's tables: every table of a model with a single group."""
        self.hybrid = len(self.groups) > 1
        self._windows = [g.sliding_window for g in self.groups]
        self._first_live: list[dict[str, int]] = [{} for _ in self.groups]  # blocks given back, per request
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int, list[int], set[int], int]] = {}
        """Memoised prefix lookups of waiting requests: (pool mark, blocks looked up, hits, their
        set, how many of them are free)."""
        self.blocks_allocated_peak = [0] * len(self.groups)
        self.stats = PrefixCacheStats()
        self.offload = offload
        """Tier 2, or None."""
        self.store_rule = store_rule
        self._offload_hits: dict[str, tuple[int, list[BlockHash]]] = {}
        """Per request being admitted: (pool hits, the tier-2 hashes after them) of its last lookup."""
        self._admitted_split: dict[str, tuple[int, int]] = {}
        """Per request just admitted: (tokens from the pool, tokens loaded from tier 2)."""
        self._pending_stores: list[tuple[int, BlockHash]] = []
        """Blocks hashed for the step being run, stored into tier 2 when it has run (store on compute)."""
        self._transfers = KVTransfers()
        if offload is not None:
            if self.hybrid:
                raise KVLedgerError("KV offloading is not supported for models with sliding-window layers")
            if not pool.enable_caching:
                raise KVLedgerError("KV offloading needs prefix caching (--enable-prefix-caching)")
            if store_rule not in STORE_RULES:
                raise KVLedgerError(f"unknown KV offloading store rule {store_rule!r}; use one of "
                                    f"{', '.join(STORE_RULES)}")
            if store_rule == STORE_ON_EVICT:
                pool.on_evict = self._store_evicted

    @staticmethod
    def _key(block_hash: BlockHash, group: int) -> BlockHash:
        """The prefix-cache key of a block of ``group``: its hash, tagged by the group past the first."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

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
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.hybrid:
            return self._hybrid_hit(self._block_hashes(request, max_blocks))
        hits, tokens = self._pool_hit(request, max_blocks)
        if self.offload is None:
            return hits, tokens
        hashes = self._block_hashes(request, max_blocks)
        more = hashes[len(hits):len(hits) + len(self.offload.match(islice(hashes, len(hits), None)))]
        self._offload_hits[request.request_id] = (len(hits), more)
        return hits, tokens + len(more) * self.block_size

    def _pool_hit(self, request: Request, max_blocks: int) -> tuple[list[int], int]:
        """:meth:`get_computed_blocks` in the pool alone (memoised)."""
        pool, rid = self.pool, request.request_id
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

    def _hybrid_hit(self, hashes: list[BlockHash]) -> tuple[list[list[int]], int]:
        """The longest prefix of ``hashes`` every group can resume from: per group its block ids
        (:data:`NULL_BLOCK` where a sliding group needs no block), and the tokens they cover.

        A full group needs every block of the prefix cached; a sliding group only the blocks
        from :func:`first_live_block` of the hit on. Shortening the hit for one group moves the
        window of the others, so the lengths are narrowed until every group agrees (vLLM's
        coordinator does the same)."""
        bs, lookup = self.block_size, self.pool.lookup
        cached = [[lookup(self._key(h, g)) for h in hashes] for g in range(len(self.groups))]
        n = len(hashes)
        while True:
            agreed = n
            for g, window in enumerate(self._windows):
                blocks = cached[g]
                m = agreed
                if window is None:
                    m = next((i for i in range(m) if blocks[i] is None), m)
                else:
                    while m > 0 and any(b is None for b in blocks[first_live_block(m * bs, window, bs):m]):
                        m -= 1
                agreed = m
            if agreed == n:
                break
            n = agreed
        hits = [[b if i >= first_live_block(n * bs, w, bs) else NULL_BLOCK for i, b in enumerate(cached[g][:n])]
                for g, w in enumerate(self._windows)]
        return hits, n * bs

    def num_blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Blocks for tokens up to ``num_computed_tokens (+ cached) + num_new_tokens``; False if the pool is short.

        ``computed_blocks`` are prefix-cache hits of a request being admitted (its
        ``num_computed_tokens`` already counts them). Nothing changes when it returns False.
        """
        total_tokens = request.num_computed_tokens + num_new_tokens
        if self.hybrid:
            return self._allocate_hybrid(request, total_tokens, computed_blocks)  # type: ignore[arg-type]
        table = self.block_tables.get(request.request_id)
        if table is not None and not computed_blocks and -(-total_tokens // self.block_size) <= len(table):
            # the common decode step: its blocks already hold the new tokens (the simulator's hot path)
            if total_tokens // self.block_size > self._num_cached[request.request_id]:
                self._cache_full_blocks(request, total_tokens)
            return True
        computed_blocks = computed_blocks or []
        loads = self._offload_hits.pop(request.request_id, None) if table is None and self.offload is not None else None
        if loads is not None and (loads[0] != len(computed_blocks) or request.num_computed_tokens
                                  != (loads[0] + len(loads[1])) * self.block_size):
            loads = None  # not the lookup this admission was given
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
        if loads is not None and loads[1]:
            self.offload.load(loads[1])  # pinned before the allocation below can evict from tier 2
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self._num_cached[request.request_id] = len(computed_blocks)
        if need > 0:
            fresh = self.pool.allocate(need)
            table.extend(fresh)
            if loads is not None and loads[1]:
                lookup = self.offload.lookup
                self._transfers.loads.extend(LoadBlock(lookup(h), b, h) for h, b in zip(loads[1], fresh))
        if loads is not None:
            self._admitted_split[request.request_id] = (len(computed_blocks) * self.block_size,
                                                        len(loads[1]) * self.block_size)
        self._cache_full_blocks(request, total_tokens)
        return True

    def _allocate_hybrid(self, request: Request, total_tokens: int, computed_blocks: list[list[int]] | None) -> bool:
        """:meth:`allocate_slots` over every group: a sliding group first gives back the blocks
        that left its window (always safe: no later token attends to them), then every group
        gets the blocks up to ``total_tokens``, or none of them does."""
        rid = request.request_id
        self.free_out_of_window(request)
        needed = blocks_for(total_tokens, self.block_size)
        hits = computed_blocks or [[] for _ in self.groups]
        blocks = self.pool.blocks
        need = free_hits = 0
        for g, tables in enumerate(self.group_tables):
            table = tables.get(rid)
            need += max(0, needed - (len(table) if table is not None else 0) - len(hits[g]))
            free_hits += sum(1 for b in hits[g] if b != NULL_BLOCK and blocks[b].ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits:
            return False
        if rid not in self.block_tables:
            self._num_cached[rid] = 0
        for g, tables in enumerate(self.group_tables):  # every hit taken before any allocation evicts one
            table = tables.setdefault(rid, [])
            if hits[g]:
                real = [b for b in hits[g] if b != NULL_BLOCK]
                self.pool.touch(real)
                self._first_live[g][rid] = len(hits[g]) - len(real)
                table.extend(hits[g])
                self._num_cached[rid] = len(hits[g])
            else:
                self._first_live[g].setdefault(rid, 0)
        for tables in self.group_tables:
            table = tables[rid]
            if needed > len(table):
                table.extend(self.pool.allocate(needed - len(table)))
        self._cache_full_blocks(request, total_tokens)
        return True

    def free_out_of_window(self, request: Request) -> None:
        """Give back, in every sliding group, the request's blocks that no longer hold any of its
        last ``window`` computed tokens (oldest first, to the back of the free queue: a cached
        one stays a prefix-cache entry until it is reused)."""
        rid = request.request_id
        for g, window in enumerate(self._windows):
            if window is None:
                continue
            table = self.group_tables[g].get(rid)
            if not table:
                continue
            start = self._first_live[g].get(rid, 0)
            end = min(first_live_block(request.num_computed_tokens, window, self.block_size), len(table))
            if end > start:
                self.pool.free(table[start:end])
                table[start:end] = [NULL_BLOCK] * (end - start)
                self._first_live[g][rid] = end

    def note_peaks(self) -> None:
        """Update :attr:`blocks_allocated_peak` (per group) with the blocks held now."""
        for g, held in enumerate(self.blocks_held()):
            if held > self.blocks_allocated_peak[g]:
                self.blocks_allocated_peak[g] = held

    def blocks_held(self) -> list[int]:
        """Per group: distinct blocks its tables hold (a block belongs to one group at a time)."""
        return [len({b for table in tables.values() for b in table if b != NULL_BLOCK}) for tables in self.group_tables]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        full = num_tokens // self.block_size
        done = self._num_cached[rid]
        if full <= done:
            return
        hashes = self._block_hashes(request, full)
        if self.hybrid:
            for g, tables in enumerate(self.group_tables):
                table = tables[rid]
                for i in range(done, full):
                    if table[i] != NULL_BLOCK:
                        self.pool.cache(table[i], self._key(hashes[i], g))
            self._num_cached[rid] = full
            return
        table = self.block_tables[rid]
        if self.offload is not None and self.store_rule == STORE_ON_COMPUTE:
            prompt_blocks = min(full, request.num_prompt_tokens // self.block_size)  # vLLM: the prompt only
            for i in range(done, full):
                if self.pool.cache(table[i], hashes[i]) and i < prompt_blocks:
                    self._pending_stores.append((table[i], hashes[i]))
        else:
            for i in range(done, full):
                self.pool.cache(table[i], hashes[i])
        self._num_cached[rid] = full

    # ---- the second tier -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step is scheduled: the blocks the previous step computed are written now, so
        (store on compute) each gets a tier-2 slot and a store event, ahead of any allocation that
        could reuse its block. A block that lost its hash since (a failed step) is skipped."""
        if not self._pending_stores:
            return
        blocks, store, stores = self.pool.blocks, self.offload.store, self._transfers.stores
        for block_id, block_hash in self._pending_stores:
            if blocks[block_id].block_hash == block_hash:
                slot = store(block_hash)
                if slot is not None:
                    stores.append(StoreBlock(block_id, block_hash, slot))
        self._pending_stores.clear()

    def _store_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """Store on evict: the pool is about to reuse a cached block; copy it to tier 2 first."""
        slot = self.offload.store(block_hash)
        if slot is not None:
            self._transfers.stores.append(StoreBlock(block_id, block_hash, slot))

    def take_transfers(self) -> KVTransfers | None:
        """The copies the step just scheduled needs, stores first (None without tier 2). Taking them
        unpins the slots their loads read: the caller runs them before anything is scheduled again."""
        if self.offload is None:
            return None
        out, self._transfers = self._transfers, KVTransfers()
        self.offload.unpin_all()
        return out

    def abort_transfers(self, transfers: KVTransfers) -> None:
        """A step's copies failed: forget what they would have made true (the loaded blocks' pool
        entries, the stored slots' tier-2 entries). The requests the loads were for hold blocks
        without their K/V: the caller ends or preempts them."""
        self.pool.uncache(load.block_id for load in transfers.loads)
        for store in transfers.stores:
            self.offload.drop(store.block_hash)

    def reset_offload(self) -> None:
        """Forget every block of tier 2 (with :meth:`BlockPool.reset_prefix_cache`, as vLLM does)."""
        if self.offload is not None:
            self.offload.reset()
            self._pending_stores.clear()

    def uncache_unwritten(self, request: Request, num_new_tokens: int) -> None:
        """Drop the prefix-cache entries of the blocks that the request's next ``num_new_tokens``
        tokens fill: for a step that failed before writing their K/V.

        Those are the blocks ``[num_computed_tokens // block_size, (num_computed_tokens +
        num_new_tokens) // block_size)`` of its table, hashed when the step was scheduled (the
        first may hold tokens of earlier steps, but only became full now); the blocks before
        them were full and written already (earlier steps, or prefix-cache hits).
        """
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        for tables in self.group_tables:
            table = tables.get(request.request_id, [])
            self.pool.uncache(b for b in table[first:end] if b != NULL_BLOCK)

    def record_admission(self, request: Request, num_hit_tokens: int) -> int:
        """Count an admission in the prefix-cache stats (queries and hits in tokens); returns how
        many of its ``num_hit_tokens`` were loaded from tier 2."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        if not self.enable_caching:
            return 0
        local, offloaded = self._admitted_split.pop(rid, (num_hit_tokens, 0))
        assert local + offloaded == num_hit_tokens, (rid, local, offloaded, num_hit_tokens)
        stats = self.stats
        stats.queries += request.num_tokens
        stats.hits += local
        if self.offload is not None:
            stats.offload_queries += request.num_tokens - local
            stats.offload_hits += offloaded
        return offloaded

    def free(self, request: Request) -> None:
        """Return a request's blocks to the pool, tail first so shared prefixes are evicted last.

        Its memoised block hashes stay (a preempted request is admitted again); :meth:`forget`
        drops them when it leaves the engine."""
        rid = request.request_id
        for g, tables in enumerate(self.group_tables):
            table = tables.pop(rid, [])
            self.pool.free(reversed(table) if not self.hybrid else [b for b in reversed(table) if b != NULL_BLOCK])
            self._first_live[g].pop(rid, None)
        self._num_cached.pop(rid, None)
        self._offload_hits.pop(rid, None)
        self._admitted_split.pop(rid, None)

    def forget(self, request_id: str) -> None:
        """Drop memoised hashes of a request that left the engine."""
        self._hashes.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self._offload_hits.pop(request_id, None)

    def tokens_used(self, running: Iterable[Request]) -> int:
        """Tokens with K/V in allocated blocks, a shared block counted once; O(running requests).

        The running requests are the ones holding blocks, and each one's table covers exactly
        its computed tokens. A block is shared only as a full prefix-cache hit, which lies within
        the computed tokens of every holder, so the sum of computed tokens counts each extra
        reference to a block once, ``block_size`` tokens each time."""
        if self.hybrid:
            return sum(self.group_tokens_used(running))
        tables = self.block_tables
        computed = references = 0
        for request in running:
            computed += request.num_computed_tokens
            references += len(tables[request.request_id])
        allocated = self.pool.num_blocks - self.pool.num_free_blocks
        return computed - (references - allocated) * self.block_size

    def group_tokens_used(self, running: Iterable[Request]) -> list[int]:
        """Per group, :meth:`tokens_used`: the token slots with K/V in the group's blocks, from each
        request's first kept block to its computed tokens, a shared block counted once."""
        running = list(running)
        bs, out = self.block_size, []
        for g, (tables, held) in enumerate(zip(self.group_tables, self.blocks_held())):
            computed = references = 0
            for request in running:
                first = self._first_live[g].get(request.request_id, 0)
                computed += request.num_computed_tokens - first * bs
                references += len(tables[request.request_id]) - first
            out.append(computed - (references - held) * bs)
        return out

    def request_token_slots(self, request: Request) -> list[int]:
        """Per group: the token slots request ``request`` holds (its computed tokens from its
        first kept block on): the measured side of :func:`kvledger.spec.kv_bytes.sliding_held_tokens`."""
        rid, bs = request.request_id, self.block_size
        out = []
        for g, tables in enumerate(self.group_tables):
            table = tables.get(rid)
            live = 0 if table is None else sum(1 for b in table if b != NULL_BLOCK)
            first = 0 if table is None else len(table) - live
            out.append(min(request.num_computed_tokens - first * bs, live * bs) if table is not None else 0)
        return out

    def check_integrity(self) -> None:
        """The pool agrees with every table of every group; in a sliding group, the blocks given
        back are exactly the leading :data:`NULL_BLOCK` entries and no block sits in two groups."""
        if not self.hybrid:
            self.pool.check_integrity(self.block_tables)
            if self.offload is not None:
                self.offload.check_integrity()
                for load in self._transfers.loads:  # a pending load reads the slot of its hash into a held block
                    assert self.offload.lookup(load.block_hash) == load.slot, f"load from a reused slot {load}"
                    assert self.pool.blocks[load.block_id].ref_cnt > 0, f"load into a free block {load}"
            return
        owners: dict[str, list[int]] = {}
        seen: dict[int, int] = {}
        for g, tables in enumerate(self.group_tables):
            for rid, table in tables.items():
                first = self._first_live[g].get(rid, 0)
                assert all(b == NULL_BLOCK for b in table[:first]), f"group {g}, {rid}: a given-back slot holds a block"
                assert NULL_BLOCK not in table[first:], f"group {g}, {rid}: a hole after the first kept block {table}"
                for b in table[first:]:
                    assert seen.setdefault(b, g) == g, f"block {b} is in groups {seen[b]} and {g}"
                owners[f"{rid}/{g}"] = table[first:]
        assert all(set(t) == set(self.block_tables) for t in self.group_tables), "groups hold different requests"
        self.pool.check_integrity(owners)
