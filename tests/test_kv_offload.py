"""The second KV tier: its store (slots, LRU and ARC, pins), vLLM's capacity arithmetic, and the
manager's match across both tiers with the per-step transfer events, checked byte for byte by
a model of the copies (every block a request attends to holds what its hash says)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.config import EngineConfig
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Request
from kvledger.errors import KVLedgerError
from kvledger.kvcache.block_pool import BlockPool
from kvledger.kvcache.manager import KVCacheManager
from kvledger.kvcache.offload import KVTransfers, LoadBlock, OffloadStore, StoreBlock
from kvledger.spec.offload import offload_capacity

A, B, C, D, E = (bytes([i]) * 4 for i in range(1, 6))


# ---- the store ----------------------------------------------------------------------------------
def test_lru_store_match_and_eviction():
    tier = OffloadStore(2)
    assert tier.store(A) == 0 and tier.store(B) == 1
    assert tier.store(A) is None  # already stored: used now, no copy
    assert tier.store(C) == 1  # full: B is the least recently used
    assert tier.lookup(B) is None and tier.match([A, C, B, A]) == [0, 1]
    assert tier.num_stored == 2 and tier.stats.evicted == 1
    tier.check_integrity()


def test_a_pinned_slot_is_never_evicted_and_a_store_with_every_slot_pinned_is_skipped():
    tier = OffloadStore(2)
    tier.store(A), tier.store(B)
    tier.load([A])  # A is being loaded this step
    assert tier.store(C) == 1 and tier.lookup(A) == 0  # B goes, not A
    tier.load([C])
    assert tier.store(D) is None and tier.stats.skipped == 1
    tier.unpin_all()
    assert tier.store(D) == 0  # A, then C was used: A is the older
    tier.check_integrity()


def test_arc_keeps_a_reused_block_through_a_scan_that_lru_loses():
    kept = {}
    for policy in ("lru", "arc"):
        tier = OffloadStore(3, policy)
        tier.store(A)
        tier.load([A])  # used a second time: ARC's frequency list
        tier.unpin_all()
        for h in (B, C, D, E):  # a scan of blocks seen once
            tier.store(h)
        tier.check_integrity()
        kept[policy] = tier.lookup(A) is not None
    assert kept == {"lru": False, "arc": True}


def test_drop_and_reset_free_slots():
    tier = OffloadStore(2, "arc")
    tier.store(A), tier.store(B)
    tier.drop(A)
    assert tier.lookup(A) is None and tier.num_stored == 1 and tier.store(C) == 0
    tier.reset()
    assert tier.num_stored == 0 and tier.match([B, C]) == []
    tier.check_integrity()


def test_bad_tier_is_one_line():
    with pytest.raises(KVLedgerError, match="--kv-offloading-size"):
        OffloadStore(0)
    with pytest.raises(KVLedgerError, match="lru, arc"):
        OffloadStore(4, "fifo")


# ---- vLLM's arithmetic ----------------------------------------------------------------------------
def test_capacity_is_vllms_arithmetic():
    # llama-3.1-8b in bfloat16, blocks of 16: 2 MiB a block, already whole host pages
    cap = offload_capacity(10, 16 * 131_072, 16)
    assert (cap.num_blocks, cap.num_tokens, cap.slot_bytes, cap.bytes) == (5120, 81_920, 2 * 2**20, 10 * 2**30)
    # a block of 5,000 bytes takes two 4,096-byte pages; half a GiB is int(0.5 * 2^30) bytes
    cap = offload_capacity(0.5, 5000, 4)
    assert (cap.slot_bytes, cap.num_blocks, cap.budget_bytes) == (8192, 65_536, 2**29)
    # tensor parallelism: the GiB are summed over ranks, one copy per rank; an MLA latent once
    assert offload_capacity(1, 4096, 16, tensor_parallel_size=2).num_blocks == 2**30 // 8192
    mla = offload_capacity(1, 4096, 16, tensor_parallel_size=2, replicated=True)
    assert mla.num_blocks == 2**30 // 4096 and mla.rank_block_bytes == 4096
    with pytest.raises(KVLedgerError, match="positive"):
        offload_capacity(0, 4096, 16)


# ---- the manager across both tiers ---------------------------------------------------------------
BS = 4


def engine(num_blocks: int, slots: int, store_rule: str = "compute", policy: str = "lru", budget: int = 64):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, BS, offload=OffloadStore(slots, policy), store_rule=store_rule)
    return pool, kv, Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=4), kv)


def request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), 0)


def run_one(sched: Scheduler, r: Request) -> list[KVTransfers]:
    """Admit ``r`` and run it to its end; the transfers of each step."""
    sched.add(r)
    seen = []
    while not r.is_finished:
        out = sched.schedule()
        seen.append(out.kv_transfers)
        samplers = [s.request for s in out.scheduled if s.samples]
        sched.update(out)
        for s_request in samplers:
            s_request.output_token_ids.append(0)
            if len(s_request.output_token_ids) >= s_request.sampling_params.max_tokens:
                sched.finish(s_request, "length")
        sched.kv.check_integrity()
    return seen


PROMPT_A = list(range(100, 113))  # 13 tokens: 3 full blocks
PROMPT_B = list(range(200, 213))


def test_store_on_compute_writes_a_prompts_blocks_as_they_are_computed_and_a_later_request_loads_them():
    pool, kv, sched = engine(num_blocks=4, slots=8)
    steps = run_one(sched, request("a", PROMPT_A))
    assert steps[0] == KVTransfers()  # nothing computed before the first step
    table_a = [0, 1, 2]  # the pool hands out blocks in order
    hashes = kv._block_hashes(request("a", PROMPT_A), 3)
    out = sched.schedule()  # the next step (idle) writes what the last one computed
    assert out.kv_transfers.stores == [StoreBlock(b, h, s) for s, (b, h) in enumerate(zip(table_a, hashes))]
    run_one(sched, request("b", PROMPT_B))  # evicts a's blocks from the pool
    assert pool.lookup(hashes[0]) is None
    c = request("c", PROMPT_A + [7, 7, 7])  # a's prompt again, then more
    steps = run_one(sched, c)
    loads = steps[0].loads
    assert [(ld.slot, ld.block_hash) for ld in loads] == [(0, hashes[0]), (1, hashes[1]), (2, hashes[2])]
    assert c.num_cached_tokens == 12 and c.num_offloaded_tokens == 12
    assert kv.stats.by_source() == {"local_compute": 13 + 13 + 4, "local_cache_hit": 0, "external_kv_transfer": 12}
    assert kv.stats.offload_hits == 12 and kv.stats.offload_queries == 16 + 13 + 13


def test_store_on_evict_writes_only_what_the_pool_evicts_and_a_pool_hit_comes_first():
    pool, kv, sched = engine(num_blocks=4, slots=8, store_rule="evict")
    run_one(sched, request("a", PROMPT_A))
    assert sched.schedule().kv_transfers == KVTransfers()  # nothing stored while the pool keeps it
    hashes = kv._block_hashes(request("a", PROMPT_A), 3)
    first_b = run_one(sched, request("b", PROMPT_B))[0]
    # the pool evicts a request's blocks tail first: the prefix's head stays in the pool longest
    assert [(st.block_hash, st.slot) for st in first_b.stores] == [(hashes[2], 0), (hashes[1], 1), (hashes[0], 2)]
    c = request("c", PROMPT_A + [1])
    run_one(sched, c)
    assert c.num_offloaded_tokens == 12
    d = request("d", PROMPT_A + [2])  # c's loaded blocks are pool blocks now: a pool hit
    run_one(sched, d)
    assert d.num_cached_tokens == 12 and d.num_offloaded_tokens == 0


def test_a_load_lands_in_the_blocks_allocated_for_it_and_failed_copies_are_forgotten():
    pool, kv, sched = engine(num_blocks=4, slots=8)
    run_one(sched, request("a", PROMPT_A))
    sched.schedule()
    run_one(sched, request("b", PROMPT_B))
    c = request("c", PROMPT_A + [3])
    sched.add(c)
    out = sched.schedule()
    table = kv.block_tables["c"]
    assert [ld.block_id for ld in out.kv_transfers.loads] == table[:3]
    kv.abort_transfers(out.kv_transfers)  # the engine could not copy: the pool must not offer those blocks
    assert all(pool.blocks[b].block_hash is None for b in table[:3])
    kv.check_integrity()


def test_a_step_that_failed_stores_nothing_it_was_to_compute():
    pool, kv, sched = engine(num_blocks=4, slots=8)
    a = request("a", PROMPT_A)
    sched.add(a)
    out = sched.schedule()
    kv.uncache_unwritten(a, out.scheduled[0].num_new_tokens)  # the model run failed: its blocks hold nothing
    sched.finish(a, "error")
    assert sched.schedule().kv_transfers == KVTransfers() and kv.offload.num_stored == 0
    kv.check_integrity()


def test_preemption_and_abort_leave_both_tiers_consistent():
    pool, kv, sched = engine(num_blocks=6, slots=4, budget=8)
    rs = [request(f"r{i}", PROMPT_A[:9] + [i] * 6, max_tokens=6) for i in range(3)]
    for r in rs:
        sched.add(r)
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        kv.check_integrity()
        samplers = [s.request for s in out.scheduled if s.samples]
        sched.update(out)
        for r in samplers:
            r.output_token_ids.append(1)
            if len(r.output_token_ids) >= 6:
                sched.finish(r, "length")
        if rs[2].status.name == "RUNNING" and not rs[2].is_finished:
            sched.finish(rs[2], "abort")
        kv.check_integrity()
    assert sched.num_preemptions > 0 and not sched.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks and 0 < kv.offload.num_stored <= 4
    kv.check_integrity()
    kv.reset_offload()
    assert kv.offload.num_stored == 0 and kv.offload.match(kv._block_hashes(rs[0], 2)) == []
    kv.check_integrity()


def test_the_tier_refuses_sliding_groups_and_a_pool_without_prefix_caching():
    from kvledger.kvcache.groups import kv_cache_groups

    groups = kv_cache_groups(["sliding_attention", "full_attention"], 8)
    with pytest.raises(KVLedgerError, match="sliding-window"):
        KVCacheManager(BlockPool(8), BS, groups, offload=OffloadStore(4))
    with pytest.raises(KVLedgerError, match="prefix caching"):
        KVCacheManager(BlockPool(8, enable_caching=False), BS, offload=OffloadStore(4))


# ---- random traffic, the copies modelled byte for byte ---------------------------------------------
class Bytes:
    """What each tier-1 block and tier-2 slot holds, as the engine's copies and writes leave it."""

    def __init__(self) -> None:
        self.block: dict[int, object] = {}
        self.slot: dict[int, object] = {}

    def run(self, t: KVTransfers) -> None:
        for st_ in t.stores:
            assert self.block.get(st_.block_id) == st_.block_hash, f"store of a block that does not hold its hash {st_}"
            self.slot[st_.slot] = st_.block_hash
        for ld in t.loads:
            assert self.slot.get(ld.slot) == ld.block_hash, f"load of a slot that does not hold its hash {ld}"
            self.block[ld.block_id] = ld.block_hash


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["compute", "evict"]), st.sampled_from(["lru", "arc"]))
def test_random_traffic_every_attended_block_holds_its_hash(data, store_rule, policy):
    num_blocks = data.draw(st.integers(5, 10), label="pool blocks")
    slots = data.draw(st.integers(1, 8), label="tier-2 slots")
    pool, kv, sched = engine(num_blocks, slots, store_rule, policy, budget=data.draw(st.integers(4, 12)))
    memory = Bytes()
    stems = [[7] * 8, [8] * 4 + [9] * 4, [7] * 4 + [6] * 8]
    live: dict[str, Request] = {}
    for step in range(60):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            stem = stems[data.draw(st.integers(0, 2))]
            prompt = stem[:data.draw(st.integers(1, len(stem)))] + [step % 5]
            r = request(f"r{step}-{len(live)}", prompt, max_tokens=data.draw(st.integers(1, 6)))
            live[r.request_id] = r
            sched.add(r)
        if live and data.draw(st.booleans(), label="abort?") and data.draw(st.booleans()):
            rid = sorted(live)[0]
            sched.finish(live.pop(rid), "abort")
            kv.check_integrity()
        out = sched.schedule()
        kv.check_integrity()
        memory.run(out.kv_transfers)
        for s in out.scheduled:  # the model writes the blocks the new tokens fill
            r, table = s.request, kv.block_tables[s.request.request_id]
            end = (r.num_computed_tokens + s.num_new_tokens) // BS
            hashes = kv._block_hashes(r, end)
            for i in range(r.num_computed_tokens // BS, end):
                memory.block[table[i]] = hashes[i]
            if (r.num_computed_tokens + s.num_new_tokens) % BS:
                memory.block[table[end]] = ("partial", r.request_id)
        # every layer writes the step's new K/V before attention reads: a block another request of
        # the same step fills counts as written
        for s in out.scheduled:  # attention reads every computed block of the request
            r, table = s.request, kv.block_tables[s.request.request_id]
            hashes = kv._block_hashes(r, r.num_computed_tokens // BS)
            assert [memory.block.get(b) for b in table[:len(hashes)]] == hashes, "a block attended holds other K/V"
        samplers = [s.request for s in out.scheduled if s.samples]
        sched.update(out)
        for r in samplers:
            r.output_token_ids.append(step % 3)
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                sched.finish(r, "length")
                live.pop(r.request_id, None)
        kv.check_integrity()
        assert kv.offload.num_stored <= slots
    for rid in list(live):
        sched.finish(live.pop(rid), "abort")
    assert pool.num_free_blocks == pool.num_blocks
    kv.check_integrity()
