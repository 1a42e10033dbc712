"""The ledger, measured on the real model: bytes equal Eq 2.2, waste, prefix hits, aborts, rejections."""

from __future__ import annotations

import pytest

from kvledger import SamplingParams
from kvledger.errors import KVLedgerError


def test_measured_cache_bytes_equal_eq_2_2(engine_llm):
    from kvledger.loader.gguf import config_from_gguf
    from kvledger.loader.resolve import smollm2_gguf_path
    from kvledger.spec import ModelSpec, kv_bytes

    engine = engine_llm.llm_engine
    ledger = engine_llm.ledger()
    config = config_from_gguf(smollm2_gguf_path())
    spec = ModelSpec.from_config_dict(config, name="smollm2-135m")
    tokens = ledger.num_blocks * ledger.block_size
    predicted = kv_bytes(spec, "float32", tokens=tokens).total_bytes
    by_hand = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4 * tokens
    storage = engine.cache.storage
    measured = storage.numel() * storage.element_size()
    assert predicted == by_hand == measured == ledger.measured_bytes == ledger.predicted_bytes
    assert ledger.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080


def test_waste_below_one_block_per_running_sequence(engine_llm):
    engine = engine_llm.llm_engine
    tokenizer = engine_llm.get_tokenizer()
    prompts = ["Hi", "Tell me about the moon and its phases in detail, please.", "1 2 3 4 5 6 7 8 9 10 11 12 13 14",
               "A" * 200, "The quick brown fox", "Why?"]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"waste-{i}", tokenizer.encode(p), sp)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        ledger = engine.ledger()
        engine.check_integrity()
        assert ledger.waste_tokens == ledger.blocks_allocated * ledger.block_size - ledger.tokens_used
        if ledger.num_running:
            assert 0 <= ledger.waste_tokens < ledger.num_running * ledger.block_size
            checked += 1
    assert checked > 10
    ledger = engine.ledger()
    assert ledger.blocks_allocated == 0 and ledger.tokens_used == 0 and ledger.num_running == 0
    assert ledger.blocks_allocated_peak > 0


def test_repeated_prompt_hits_the_prefix_cache(engine_llm):
    prompt = list(range(1000, 1000 + 50))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = engine_llm.generate([prompt], sp, use_tqdm=False)[0]
    before = engine_llm.ledger()
    second = engine_llm.generate([prompt], sp, use_tqdm=False)[0]
    after = engine_llm.ledger()
    assert second.num_cached_tokens == 48  # (50 - 1) // 16 full blocks
    assert after.prefix_cache_queries - before.prefix_cache_queries == 50
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert after.blocks_cached_free > 0 and after.blocks_allocated == 0


def test_abort_frees_blocks_at_once(engine_llm):
    engine = engine_llm.llm_engine
    engine.add_request("abort-me", list(range(200, 300)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.ledger().blocks_allocated > 0
    engine.abort_request("abort-me")
    assert engine.ledger().blocks_allocated == 0
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_requests_that_can_never_fit_are_rejected_with_numbers(engine_llm):
    engine = engine_llm.llm_engine
    limit = engine.max_model_len
    with pytest.raises(KVLedgerError, match=rf"{limit}"):
        engine.add_request("too-long", [1] * limit, SamplingParams(max_tokens=1))
    with pytest.raises(KVLedgerError, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=1))
    with pytest.raises(KVLedgerError, match="vocabulary"):
        engine.add_request("oov", [10**7], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


def test_pool_smaller_than_one_request_is_rejected():
    from kvledger import LLM

    llm = LLM(model="smollm2-135m", num_gpu_blocks_override=4, block_size=16, max_model_len=64)
    with pytest.raises(KVLedgerError, match="64"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(KVLedgerError, match="blocks"):
        LLM(model="smollm2-135m", num_gpu_blocks_override=4, block_size=16, max_model_len=100)
