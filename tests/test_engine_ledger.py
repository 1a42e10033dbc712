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
    with pytest.raises(KVLedgerError, match=rf"prompt {limit:,} tokens \+ max_tokens 1 = {limit + 1:,} exceeds "
                                            rf"--max-model-len {limit:,}"):
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


def test_shared_prefix_blocks_count_once_in_tokens_used(engine_llm):
    """Two identical 40-token prompts admitted in one step: the second hits the first's two full
    blocks (hashed that step) and computes its last 8 tokens itself. By hand: blocks 2 shared + 1 + 1
    = 4 allocated; tokens 32 shared + 8 + 8 = 48; waste 4 * 16 - 48 = 16."""
    engine = engine_llm.llm_engine
    prompt = list(range(4000, 4040))
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("shared-a", prompt, sp)
    engine.add_request("shared-b", prompt, sp)
    engine.step()
    ledger = engine.ledger()
    assert (ledger.num_running, ledger.blocks_allocated, ledger.tokens_used, ledger.waste_tokens) == (2, 4, 48, 16)
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def test_failed_step_aborts_its_requests_and_leaves_no_unwritten_prefix(engine_llm):
    """A step whose model run raises: its requests are aborted, the blocks it hashed but never
    wrote leave the prefix cache, a request it did not schedule carries on, and the same prompts
    afterwards give the tokens they gave before (computed afresh, no cache hit)."""
    engine = engine_llm.llm_engine
    p, q, r = list(range(3000, 3040)), list(range(3100, 3140)), list(range(3200, 3220))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine_llm.generate([p, q, r], sp, use_tqdm=False)]
    engine.pool.reset_prefix_cache()  # the failing step hashes these prompts' blocks anew

    def fail_once(*args, **kwargs):
        del engine.runner.execute  # back to the real method for the next step
        raise RuntimeError("injected fault")

    # budget 64 tokens: p (40) and the first 24 of q (one full block) are scheduled, r waits
    for rid, prompt in (("fail-p", p), ("fail-q", q), ("fail-r", r)):
        engine.add_request(rid, prompt, sp)
    engine.runner.execute = fail_once
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            engine.step()
    finally:
        engine.runner.__dict__.pop("execute", None)
    assert set(engine.requests) == {"fail-r"}
    engine.check_integrity()
    assert engine.ledger().blocks_allocated == 0
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_integrity()
    assert tokens == before[2]
    after = engine_llm.generate([p, q], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in after] == [0, 0]
    assert [o.outputs[0].token_ids for o in after] == before[:2]
    engine.check_integrity()


def test_block_size_defaults_to_vllms_for_the_device():
    """No block size given: 128 tokens on CPU (vLLM's CPU platform default), 16 on CUDA; an
    explicit one is kept, and the CLI reports the size the engine took."""
    from kvledger import LLM
    from kvledger.config import EngineConfig, default_block_size
    from tests.cli_helpers import kvledger

    assert (default_block_size("cpu"), default_block_size("cuda"), default_block_size("cuda:1")) == (128, 16, 16)
    assert EngineConfig().block_size is None
    llm = LLM(model="smollm2-135m", num_gpu_blocks_override=4, device="cpu")
    assert llm.llm_engine.block_size == llm.llm_engine.ledger().block_size == 128
    assert llm.llm_engine.max_model_len == 4 * 128
    del llm  # one model at a time
    explicit = LLM(model="smollm2-135m", num_gpu_blocks_override=4, block_size=32, device="cpu")
    assert explicit.llm_engine.ledger().block_size == 32
    cli = kvledger("generate", "hi", "--max-tokens", "1", "--device", "cpu", "--num-gpu-blocks-override", "4", "--json")
    assert cli.returncode == 0, cli.stderr
    assert cli.json()["kv"]["block_size"] == 128
