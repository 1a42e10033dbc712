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


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1e-9), "temperature"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(top_k=2**63), "top_k"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(max_tokens=8, min_tokens=9), "min_tokens"),
])
def test_out_of_range_values_name_their_field(kwargs, param):
    from kvledger.errors import ParameterError

    with pytest.raises(ParameterError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value) and "\n" not in str(err.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_add(engine_llm):
    from kvledger.errors import ParameterError

    engine = engine_llm.llm_engine
    for bad in (engine.vocab_size, -1, 10**30):
        with pytest.raises(ParameterError) as err:
            engine.add_request("bad-stop", [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[bad]))
        assert err.value.param == "stop_token_ids" and str(bad) in str(err.value)
    assert "bad-stop" not in engine.requests


def test_extreme_but_valid_values_are_honoured(engine_llm):
    """A temperature below 1e-5 is greedy; a top_p too small for float32 keeps the top token (so it
    is greedy too); min_tokens keeps EOS out until it is reached."""
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=1e-40),
              SamplingParams(max_tokens=8, temperature=5e-324),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=1),
              SamplingParams(max_tokens=8, min_tokens=1, temperature=0)]
    outs = [o.outputs[0].token_ids for o in engine_llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    assert outs[1:] == [outs[0]] * (len(params) - 1)
    chat = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
    free, held = (o.outputs[0] for o in engine_llm.chat(
        [chat, chat], [SamplingParams(max_tokens=8, temperature=0),
                       SamplingParams(max_tokens=8, temperature=0, min_tokens=5)], use_tqdm=False))
    eos = engine_llm.llm_engine.eos_token_ids
    assert len(free.token_ids) < 5 and free.token_ids[-1] in eos
    assert len(held.token_ids) >= 5 and not eos & set(held.token_ids[:4])


def test_a_request_failing_in_its_own_sampling_ends_alone(engine_llm):
    """One request's sampling raises inside a step (its temperature made NaN after validation):
    it ends with finish_reason "error" and the cause; the greedy requests of the same steps give
    exactly the tokens they give alone; the pool is clean afterwards."""
    engine = engine_llm.llm_engine
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = [o.outputs[0].token_ids for o in engine_llm.generate([PROMPT, "Hello"], greedy, use_tqdm=False)]
    bad = SamplingParams(max_tokens=6, temperature=1.0)
    bad.temperature = float("nan")
    outs = engine_llm.generate([PROMPT, PROMPT, "Hello"], [greedy, bad, greedy], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    failed = outs[1]
    assert failed.finished and failed.finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "temperature=nan" in failed.error and "RuntimeError" in failed.error, failed.error
    assert engine.ledger().blocks_allocated == 0 and not engine.has_unfinished_requests()
    engine.check_integrity()
