"""Sampling and stopping on the real model: seeds, top-k/top-p, stop strings and ids, max_tokens, chat."""

from __future__ import annotations

import pytest

from kvledger import SamplingParams
from kvledger.errors import KVLedgerError

PROMPT = "The three most important inventions of the last century are"


def test_greedy_equals_top_k_1_sampling(engine_llm):
    greedy = engine_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    top1 = engine_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3),
                               use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids


def test_seed_reproducible_regardless_of_batch(engine_llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine_llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    batch = engine_llm.generate(["Hello", PROMPT, "Goodbye"], sp, use_tqdm=False)[1].outputs[0].token_ids
    other = engine_llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99),
                                use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batch
    assert alone != other


def test_stop_string_cuts_the_text_like_vllm(engine_llm):
    full = engine_llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = words[3]
    out = engine_llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop=[stop]),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = engine_llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(engine_llm):
    full = engine_llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_id = full.token_ids[5]
    out = engine_llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]),
                              use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(engine_llm):
    sp = SamplingParams(max_tokens=200, temperature=0)
    out = engine_llm.chat([{"role": "user", "content": "Say hello."}], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine_llm.llm_engine.eos_token_ids
    assert out.text.strip()
    ignored = engine_llm.chat([{"role": "user", "content": "Say hello."}],
                              SamplingParams(max_tokens=len(out.token_ids) + 5, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids[:len(out.token_ids)] == out.token_ids


def test_streamed_deltas_add_up_to_the_text(engine_llm):
    engine = engine_llm.llm_engine
    tokenizer = engine_llm.get_tokenizer()
    engine.add_request("stream", tokenizer.encode(PROMPT), SamplingParams(max_tokens=25, temperature=0, stop=["zzz"]))
    text, ids, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.text_delta
            ids += out.new_token_ids
            last = out
    assert last.finished and text == last.outputs[0].text and ids == last.outputs[0].token_ids


def test_bad_sampling_params_are_one_line_errors():
    with pytest.raises(KVLedgerError):
        SamplingParams(temperature=-1)
    with pytest.raises(KVLedgerError):
        SamplingParams(top_p=0)
    with pytest.raises(KVLedgerError):
        SamplingParams(max_tokens=0)


def test_greedy_and_sampled_rows_in_one_batch_match_their_runs_alone(engine_llm):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    alone = [engine_llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids for sp in (greedy, seeded)]
    mixed = engine_llm.generate([PROMPT, PROMPT, "Hello"], [greedy, seeded, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_every_step_output_keeps_what_that_step_saw(engine_llm):
    """Outputs read only after the request finished: each one's cumulative token ids and text are
    the deltas up to its own step (the stop string makes the text lag behind by its length - 1)."""
    engine = engine_llm.llm_engine
    tokenizer = engine_llm.get_tokenizer()
    engine.add_request("snapshots", tokenizer.encode(PROMPT), SamplingParams(max_tokens=12, temperature=0, stop=["zzz"]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 12 and outputs[-1].finished and not outputs[0].finished
    ids, text = [], ""
    for out in outputs:
        ids += out.new_token_ids
        text += out.text_delta
        assert (out.outputs[0].token_ids, out.outputs[0].text) == (ids, text)
    assert len(outputs[0].outputs[0].token_ids) == 1


def test_engine_seed_makes_unseeded_sampling_reproducible():
    """Two engines with the same --seed draw the same tokens for requests without a seed of their own."""
    from kvledger import LLM

    sp = SamplingParams(max_tokens=12, temperature=1.0)

    def draws(seed):
        llm = LLM(model="smollm2-135m", seed=seed, kv_cache_memory="16MiB")
        return [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], sp, use_tqdm=False)]

    first, second = draws(7), draws(7)
    assert first == second
    assert first[0] != first[1]  # one generator, two different draws: it does sample
