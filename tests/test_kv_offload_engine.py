"""The second KV tier in the real engine (SmolLM2, float32 model): blocks the pool evicted come back
from host memory or disk byte for byte, count as ``external_kv_transfer``, and give the greedy
tokens of a cold run; a disk tier outlives its process; the tier's size is the planner's."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
import weakref

import httpx
import pytest
import torch

from kvledger import LLM, SamplingParams
from kvledger.errors import KVLedgerError
from kvledger.kvcache.block_pool import prefix_block_hashes
from tests.cli_helpers import assert_one_line_error, kvledger, stop

BS = 16
POOL = 8  # blocks of 16 tokens: 128 tokens, which PROMPT_B and its output fill
TIER_GIB = 0.01
GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT_A = "The history of the paged KV cache begins with virtual memory and its page tables. " * 5
PROMPT_B = "A completely different story about cooking fresh pasta in the mountains of northern Italy. " * 7


def _llm(kv_cache_dtype: str = "auto", **kw) -> LLM:
    return LLM("smollm2-135m", dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=BS,
               num_gpu_blocks_override=POOL, max_model_len=POOL * BS, max_num_batched_tokens=128,
               kv_offloading_size=TIER_GIB, **kw)


@pytest.fixture(scope="module", params=["auto", "bfloat16", "int8"])
def tiered(request) -> LLM:
    """An engine with a host tier per cache dtype, one at a time (pytest groups the tests by it)."""
    llm = _llm(request.param)
    yield llm
    llm.llm_engine.shutdown()


def _block_bytes(cache, block_id: int) -> bytes:
    """A pool block's bytes as the cache holds them (elements, and an int8 cache's scales)."""
    return b"".join(t[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in cache.block_tensors())


def _tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_blocks_the_pool_evicted_come_back_from_host_memory_byte_for_byte(tiered):
    llm = tiered
    engine = llm.llm_engine
    ids = llm.get_tokenizer().encode(PROMPT_A)
    hashes = prefix_block_hashes(ids, BS)[:(len(ids) - 1) // BS]  # the blocks a later hit can cover
    assert len(hashes) >= 4
    cold = llm.generate(PROMPT_A, GREEDY, use_tqdm=False)[0]
    stored = {h: _block_bytes(engine.cache, engine.pool.lookup(h)) for h in hashes}
    before = engine.ledger()
    llm.generate(PROMPT_B, GREEDY, use_tqdm=False)  # fills the pool: every block of A is evicted into tier 2
    assert all(engine.pool.lookup(h) is None for h in hashes)
    assert all(engine.kv_manager.offload.lookup(h) is not None for h in hashes)
    warm = llm.generate(PROMPT_A, GREEDY, use_tqdm=False)[0]
    assert _tokens(warm) == _tokens(cold)
    assert warm.num_cached_tokens == len(hashes) * BS
    assert {h: _block_bytes(engine.cache, engine.pool.lookup(h)) for h in hashes} == stored  # the round trip is exact
    after = engine.ledger()
    loaded = len(hashes) * BS
    gained = {k: after.prompt_tokens_by_source[k] - before.prompt_tokens_by_source[k] for k in before.prompt_tokens_by_source}
    assert gained["external_kv_transfer"] == loaded and gained["local_cache_hit"] == 0
    assert after.offload.hits - before.offload.hits == loaded
    assert after.offload.blocks_loaded - before.offload.blocks_loaded == len(hashes)
    assert after.offload.bytes == after.offload.stored_blocks * after.offload.block_bytes > 0
    assert after.offload.block_bytes == after.bytes_per_block
    engine.check_integrity()
    assert after.blocks_allocated == 0


def test_the_tiers_blocks_are_the_planners_to_the_block(tiered):
    engine = tiered.llm_engine
    plan = kvledger("plan", "smollm2-135m", "--gpu", "h100-80gb", "--block-size", str(BS), "--kv-cache-dtype",
                    engine.kv_cache_dtype, "--kv-offloading-size", str(TIER_GIB),
                    "--json").json()
    ledger = engine.ledger().offload
    assert plan["offload_capacity_blocks"] == ledger.capacity_blocks == engine.offload_tier.buffer.shape[0]
    assert plan["offload_slot_bytes"] == ledger.slot_bytes == engine.offload_tier.buffer.shape[1]
    assert plan["offload_bytes"] == ledger.capacity_bytes == engine.offload_tier.buffer.numel()
    assert ledger.block_bytes == engine.cache.measured_bytes // engine.num_blocks  # the real block, scales included


# ---- the disk tier ---------------------------------------------------------------------------------
ENGINE_FLAGS = ("--block-size", str(BS), "--num-gpu-blocks-override", str(POOL), "--max-model-len", str(POOL * BS),
                "--kv-offloading-size", str(TIER_GIB))
GENERATE = ("generate", PROMPT_A, "--max-tokens", "6", *ENGINE_FLAGS, "--json")


def test_a_restarted_server_serves_a_repeated_prompt_from_its_disk_tier(tmp_path):
    """``generate`` computes a prompt and its process ends; a ``serve`` process on the same directory
    answers the same prompt from the files: the same greedy text, tier-2 hits counted."""
    first = kvledger(*GENERATE, "--kv-offloading-path", str(tmp_path))
    assert first.returncode == 0, first.stderr
    first = first.json()
    files = sorted(p.name for p in tmp_path.glob("*.kv"))
    assert first["kv"]["offload"]["stored_blocks"] == len(files) >= 4  # the prompt's full blocks, written through
    assert first["kv"]["offload"]["hits"] == 0
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvledger.cli.main", "serve", *ENGINE_FLAGS, "--port", "0",
                                 "--kv-offloading-path", str(tmp_path)], stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            while not (found := re.search(r" on (http://127\.0\.0\.1:\d+) ", log_path.read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            assert f"{len(files)} found" in log_path.read_text()
            url = found.group(1)
            reply = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "smollm2-135m", "prompt": PROMPT_A, "max_tokens": 6, "temperature": 0}).json()
            ledger = httpx.get(url + "/ledger", timeout=30).json()
        finally:
            stop(proc)
    assert reply["choices"][0]["text"] == first["text"]
    assert ledger["prompt_tokens_by_source"]["external_kv_transfer"] == ledger["offload"]["hits"] == len(files) * BS
    assert ledger["prompt_tokens_by_source"]["local_cache_hit"] == 0
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == files
    # a directory written for another cache is refused, not read
    other = kvledger(*GENERATE, "--kv-offloading-path", str(tmp_path), "--kv-cache-dtype", "int8")
    assert_one_line_error(other, "--kv-offloading-path", "kv_cache_dtype 'float32' (now 'int8')")


def test_a_block_file_that_went_bad_ends_only_the_request_that_needed_it(tmp_path):
    llm = _llm(kv_offloading_path=str(tmp_path))
    engine = llm.llm_engine
    cold = llm.generate(PROMPT_A, GREEDY, use_tqdm=False)[0]
    llm.generate(PROMPT_B, GREEDY, use_tqdm=False)  # A's blocks leave the pool; their files stay
    files = sorted(tmp_path.glob("*.kv"))
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated behind the engine's back
    bad, other = llm.generate([PROMPT_A, "Hello there, how are you today?"], GREEDY, use_tqdm=False)
    assert bad.finish_reason == "error" and other.finish_reason in ("stop", "length")
    engine.check_integrity()
    again = llm.generate(PROMPT_A, GREEDY, use_tqdm=False)[0]  # the bad block was forgotten: computed anew
    assert _tokens(again) == _tokens(cold)
    engine.check_integrity()
    assert engine.ledger().blocks_allocated == 0
    ids = llm.get_tokenizer().encode("Counting slowly from one: one, two, three, four, five, six, seven, eight, nine.")
    engine.add_request("cut", ids, SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the prompt is computed; its blocks are stored into tier 2 at the next step ...
    engine.abort_request("cut")  # ... which never comes
    on_disk = len(list(tmp_path.glob("*.kv")))
    pool = weakref.ref(engine.cache.storage)
    engine.shutdown()  # writes them, then the tier lets go of the pool's tensors with the runner
    gc.collect()
    assert len(list(tmp_path.glob("*.kv"))) == on_disk + len(ids) // BS
    assert pool() is None and engine.ledger().offload.stored_blocks > 0


def test_offloading_refusals_are_one_line():
    with pytest.raises(KVLedgerError, match="lmcache"):
        LLM("smollm2-135m", kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(KVLedgerError, match="--kv-offloading-size"):
        LLM("smollm2-135m", kv_offloading_path="/nonexistent")
    result = kvledger(*GENERATE, "--no-enable-prefix-caching")
    assert_one_line_error(result, "prefix caching")
    result = kvledger(*GENERATE, "--kv-offloading-backend", "lmcache")
    assert_one_line_error(result, "lmcache")


# ---- the disk tier's files, without a model ----------------------------------------------------------
def test_a_disk_tier_rebuilt_over_its_capacity_keeps_the_newest_files(tmp_path):
    """Five blocks written by one tier; a tier of three slots on the same directory keeps the three
    written last (the store's LRU order is the files' age), deletes the others, and loads their bytes."""
    import os

    from kvledger.kvcache.offload import KVTransfers, LoadBlock, OffloadStore, StoreBlock
    from kvledger.kvcache.offload_storage import DiskKVTier
    from kvledger.kvcache.quantized_storage import Int8KVCache
    from kvledger.spec.offload import offload_capacity

    def tier(slots: int) -> tuple[Int8KVCache, OffloadStore, DiskKVTier]:
        cache = Int8KVCache(2, 6, 4, 1, 8, torch.float32)
        block_bytes = cache.measured_bytes // cache.num_blocks
        capacity = offload_capacity(slots * 4096 / 2**30, block_bytes, 4)
        store = OffloadStore(capacity.num_blocks)
        return cache, store, DiskKVTier(cache, capacity, tmp_path, {"model": "tiny"}, store)

    cache, store, disk = tier(5)
    for layer in range(2):  # int8 elements and their float16 scales, different in every slot
        cache.write(layer, torch.randn(24, 1, 8), torch.randn(24, 1, 8), torch.arange(24))
    hashes = [bytes([i]) * 32 for i in range(5)]
    disk.run(KVTransfers(stores=[StoreBlock(b, h, store.store(h)) for b, h in enumerate(hashes)]))
    for age, h in enumerate(hashes):  # written one after another: the first is the oldest
        os.utime(tmp_path / (h.hex() + ".kv"), ns=(10**18 + age, 10**18 + age))
    written = [_block_bytes(cache, b) for b in range(5)]

    cache, store, disk = tier(3)
    assert store.num_stored == 3 and sorted(p.stem for p in tmp_path.glob("*.kv")) == [h.hex() for h in hashes[2:]]
    assert store.match(hashes) == [] and len(store.match(hashes[2:])) == 3
    loads = [LoadBlock(store.lookup(h), b, h) for b, h in zip((5, 0, 3), hashes[2:])]
    disk.run(KVTransfers(loads=loads))
    assert [_block_bytes(cache, b) for b in (5, 0, 3)] == written[2:]
    with pytest.raises(KVLedgerError, match="model 'tiny' \\(now 'other'\\)"):
        DiskKVTier(cache, offload_capacity(1, cache.measured_bytes // 6, 4), tmp_path, {"model": "other"},
                   OffloadStore(3))
