"""The block pool: free queue order, reference counts, chained hashes, LRU eviction, integrity."""

from __future__ import annotations

import pytest

from kvledger.kvcache.block_pool import BlockPool, hash_block
from kvledger.errors import KVLedgerError


def test_chained_hash_depends_on_parent_tokens_and_extra_keys():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6])
    assert hash_block(a, [5, 6]) != hash_block(a, [5, 6], extra_keys=("lora-1",))


def test_allocate_free_and_reference_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.check_integrity({"r": blocks})
    pool.touch(blocks[:1])  # a second owner shares the first block
    pool.check_integrity({"r": blocks, "s": blocks[:1]})
    pool.free(reversed(blocks))
    pool.check_integrity({"s": blocks[:1]})
    assert pool.num_free_blocks == 3
    pool.free(blocks[:1])
    pool.check_integrity({})
    assert pool.num_free_blocks == 4
    with pytest.raises(KVLedgerError):
        pool.allocate(5)


def test_integrity_catches_wrong_counts():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity({"r": blocks[:1]})
    with pytest.raises(AssertionError):
        pool.check_integrity({"r": blocks, "s": blocks})


def test_cached_free_blocks_are_evicted_last_and_lru():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    assert pool.cache(a, ha) and pool.cache(b, hb)
    assert not pool.cache(c, ha)  # that prefix is already cached in another block
    pool.free([b, a])  # tail first: b is evicted before a
    pool.free([c, d])  # uncached blocks are reused before any cached one
    assert pool.num_cached_free_blocks == 2
    assert pool.lookup(ha) == a
    order = pool.allocate(3)
    assert order[:2] in ([c, d], [d, c]) and order[2] == b
    assert pool.lookup(hb) is None and pool.lookup(ha) == a  # b evicted, a kept
    pool.check_integrity({"x": order})


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, hash_block(None, [7]))
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([pool.lookup(hash_block(None, [7]))])
    assert pool.num_free_blocks == 1
    pool.check_integrity({"r": [a]})


def test_prefix_caching_off_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache(a, hash_block(None, [1]))
    assert pool.lookup(hash_block(None, [1])) is None


def test_empty_pool_is_an_error():
    with pytest.raises(KVLedgerError):
        BlockPool(0)


def test_uncache_and_reset_keep_the_cached_free_count():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    ha, hb, hc = (hash_block(None, [t]) for t in (1, 2, 3))
    assert pool.cache(a, ha) and pool.cache(b, hb) and pool.cache(c, hc)
    pool.free([d, c, b, a])  # free queue: d (no prefix, front), then c, b, a
    assert pool.num_cached_free_blocks == 3
    pool.uncache([b, d])  # d has no prefix: nothing to forget
    assert pool.num_cached_free_blocks == 2 and pool.lookup(hb) is None
    pool.check_integrity({})
    assert pool.allocate(2) == [b, d]  # b lost its prefix, so it is reused first
    pool.touch([pool.lookup(ha)])  # a hit takes a out of the free queue
    assert pool.num_cached_free_blocks == 1  # c
    pool.reset_prefix_cache()
    assert pool.num_cached_free_blocks == 0 and pool.lookup(hc) is None
    assert pool.lookup(ha) == a  # owned blocks keep their prefix
    pool.check_integrity({"x": [b, d], "y": [a]})
