"""Greedy output of the engine is token-identical to transformers' greedy ``generate`` (float32).

Twenty prompts from 1 token to 230 (past two 32-token blocks and past the 64- and 128-token chunk budgets used),
36 new tokens each, past EOS. Run alone, in one mixed batch, with prefix caching on and off,
with block sizes 1, 16 and 32, and with a pool small enough to force preemption by recompute.
Per-step logits agree with transformers' within 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_reference import LOGIT_PROMPTS, NEW_TOKENS

pytestmark = pytest.mark.slow


def _params():
    from kvledger import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _assert_identical(outputs, reference):
    mismatches = []
    for i, (out, expected) in enumerate(zip(outputs, reference.outputs)):
        got = list(out.outputs[0].token_ids)
        if got != expected:
            first = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b) if len(got) == len(expected) else -1
            mismatches.append(f"prompt {i} ({len(reference.prompts[i])} tokens): first difference at token {first}")
    assert not mismatches, "; ".join(mismatches)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_prompt_lengths_cover_blocks_and_chunks(engine_reference):
    lengths = sorted(len(p) for p in engine_reference.prompts)
    assert lengths[0] == 1 and lengths[-1] > 2 * 32 and lengths[-1] > 64
    assert len(lengths) >= 20


def test_alone_token_identical_with_logits(engine_llm, engine_reference):
    """Each prompt alone in the engine; per-step logits checked for a few."""
    engine = engine_llm.llm_engine
    for i, prompt in enumerate(engine_reference.prompts):
        engine.add_request(f"alone-{i}", prompt, _params())
        tokens, step_logits = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                step_logits.append(engine.runner.last_logits[0].clone())
        assert tokens == engine_reference.outputs[i], f"prompt {i} ({len(prompt)} tokens) differs"
        if i in LOGIT_PROMPTS:
            ours = torch.stack(step_logits)
            theirs = engine_reference.logits[i]
            assert ours.shape == theirs.shape
            diff = (ours - theirs).abs().max().item()
            assert diff < 1e-3, f"prompt {i}: max logit difference {diff}"
    engine.check_integrity()


def test_mixed_batch_prefix_caching_on(engine_llm, engine_reference):
    before = engine_llm.ledger()
    outputs = engine_llm.generate(engine_reference.prompts, _params(), use_tqdm=False)
    _assert_identical(outputs, engine_reference)
    after = engine_llm.ledger()
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the shared system prompt and the earlier runs hit
    assert after.blocks_allocated == 0


@pytest.mark.parametrize("block_size,prefix", [(1, True), (16, False), (32, True)])
def test_mixed_batch_block_sizes_and_prefix_off(engine_reference, block_size, prefix):
    from kvledger import LLM

    llm = LLM(model="smollm2-135m", dtype="float32", block_size=block_size, enable_prefix_caching=prefix,
              kv_cache_memory="128MiB", max_num_batched_tokens=128)
    outputs = llm.generate(engine_reference.prompts, _params(), use_tqdm=False)
    _assert_identical(outputs, engine_reference)
    ledger = llm.ledger()
    assert (ledger.prefix_cache_hits > 0) == prefix
    llm.llm_engine.check_integrity()


def test_small_pool_preempts_and_recomputes(engine_reference):
    from kvledger import LLM

    longest = max(len(p) for p in engine_reference.prompts) + NEW_TOKENS
    llm = LLM(model="smollm2-135m", dtype="float32", block_size=16, num_gpu_blocks_override=-(-longest // 16) + 4,
              max_model_len=longest, max_num_batched_tokens=128)
    outputs = llm.generate(engine_reference.prompts, _params(), use_tqdm=False)
    _assert_identical(outputs, engine_reference)
    ledger = llm.ledger()
    assert ledger.num_preemptions > 0
    assert ledger.blocks_allocated == 0
    llm.llm_engine.check_integrity()
