"""Gemma-3 270M's KV-cache groups in the engine's state machine: bytes and concurrency.

No model runs here: the scheduler and the block manager are driven by token counts alone (as
the simulator drives them), with the groups, the pool and the per-token bytes of the real
Gemma-3 270M config. What is checked is what the engine's ledger reports: per-request bytes
measured from the block tables equal ``kv-bytes gemma-3-270m --tokens T`` to the byte, the pool
equals ``kv-bytes``' page arithmetic, and at a 4,096-token context the same memory holds at least
3.5 times the requests it would if every layer kept every token.
"""

from __future__ import annotations

import pytest

from kvledger.kvcache.block_pool import BlockPool
from kvledger.config import EngineConfig
from kvledger.kvcache.groups import kv_cache_groups
from kvledger.kvcache.manager import KVCacheManager
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Request
from kvledger.spec import kv_bytes, load_model_spec
from tests.cli_helpers import kvledger

BS = 16
SPEC = load_model_spec("gemma-3-270m")
GROUPS = kv_cache_groups(SPEC.layer_types, SPEC.sliding_window)


def _machine(num_blocks: int, groups=GROUPS, budget: int = 2048, caching: bool = False):
    pool = BlockPool(num_blocks, caching)
    kv = KVCacheManager(pool, BS, groups)
    sched = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=1024,
                                   enable_prefix_caching=caching), kv)
    return pool, kv, sched


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.output_token_ids.append(7)


def test_groups_follow_the_five_to_one_pattern():
    """3 full layers in one group, 15 sliding layers in five groups of three, window 512."""
    assert [(g.attention, g.layers) for g in GROUPS][:2] == [("full_attention", (5, 11, 17)),
                                                            ("sliding_attention", (0, 1, 2))]
    assert len(GROUPS) == 6 and all(len(g.layers) == 3 for g in GROUPS)
    assert {g.sliding_window for g in GROUPS[1:]} == {512} and GROUPS[0].sliding_window is None


@pytest.mark.parametrize("tokens", [100, 512, 513, 1000, 4096])
def test_request_bytes_equal_kv_bytes_to_the_byte(tokens):
    """A request with T computed tokens holds, in bytes measured from its block tables, exactly
    what ``kvledger kv-bytes gemma-3-270m --tokens T --json`` and ``kvledger plan ... --context T
    --json`` (``request_held_bytes``) print (float32 cache), and the
    formula the issue states: 3 full layers x T + 15 sliding layers x the window's blocks."""
    import json

    per_layer_token = 2 * 1 * 256 * 4  # K and V, one KV head of 256 float32
    pool, kv, sched = _machine(2000)
    request = Request("r", list(range(tokens)), SamplingParams(max_tokens=1), 0)
    sched.add(request)
    while request.num_computed_tokens < tokens:
        _step(sched)
    kv.check_integrity()
    slots = kv.request_token_slots(request)
    measured = sum(slots) * 3 * per_layer_token  # each group pages 3 layers
    kb = kv_bytes(SPEC, "float32", tokens=tokens, block_size=BS)
    out = json.loads(kvledger("kv-bytes", "gemma-3-270m", "--tokens", str(tokens), "--kv-cache-dtype", "float32",
                              "--json").stdout)
    plan = json.loads(kvledger("plan", "gemma-3-270m", "--gpu", "a100-80gb", "--kv-cache-memory", "64MiB", "--dtype",
                               "float32", "--users", "1", "--context", str(tokens), "--json").stdout)
    held = tokens - 16 * (max(0, tokens - 512) // 16)
    assert measured == kb.held_bytes == out["held_bytes"] == out["total_bytes"] == plan["request_held_bytes"]
    assert measured == per_layer_token * (3 * tokens + 15 * min(tokens, held))
    assert slots == [tokens] + [held] * 5
    # the pool: blocks of one group's three layers, the bytes kv-bytes' page arithmetic gives
    assert kb.page_bytes(BS) == BS * 3 * per_layer_token
    assert kb.pages_bytes(2000, BS) == 2000 * BS * 3 * per_layer_token


def _resident_requests(num_blocks: int, groups) -> int:
    """How many requests with a 4,096-token context the pool holds at once: requests are
    prefilled one after another in 512-token chunks, as the scheduler's chunked prefill does
    (allocate the chunk's slots, advance, let the sliding groups give back what left the window),
    until a chunk no longer fits."""
    pool, kv, _ = _machine(num_blocks, groups)
    resident = 0
    while True:
        request = Request(f"r{resident}", [resident] * 4096, SamplingParams(max_tokens=1), resident)
        while request.num_computed_tokens < 4096:
            if not kv.allocate_slots(request, 512):
                kv.check_integrity()
                return resident
            request.num_computed_tokens += 512
            kv.free_out_of_window(request)
        resident += 1


def test_sliding_groups_hold_three_and_a_half_times_the_requests():
    """Same KV memory (what 8 requests of 4,096 tokens take when every layer keeps every token):
    the grouped pool holds at least 3.5x as many 4,096-token requests at once (the arithmetic:
    18 x 4096 / (3 x 4096 + 15 x 528) = 3.65)."""
    kb = kv_bytes(SPEC, "float32")
    memory = 8 * 4096 * kb.bytes_per_token  # every layer keeping every token: 8 requests
    hybrid_blocks = kb.num_pages(memory, BS)
    uniform_blocks = memory // (BS * kb.bytes_per_token)
    assert hybrid_blocks == 6 * uniform_blocks  # the same bytes, in pages of 3 layers instead of 18
    uniform = _resident_requests(uniform_blocks, kv_cache_groups(("full_attention",) * 18, None))
    hybrid = _resident_requests(hybrid_blocks, GROUPS)
    assert uniform == 8
    assert hybrid >= 3.5 * uniform, (hybrid, uniform)
