"""The compiled model step (``torch.compile``, kvledger/engine/compile.py): greedy tokens identical to
transformers' in float32, no recompiles across decode steps, and ``enforce_eager`` turning it off.

The compiled step is opt-in (``KVLEDGER_COMPILE=1``); these tests set that for the engines they build.
"""

from __future__ import annotations

import pytest

from kvledger.engine.compile import COMPILE_ENV
from tests.engine_reference import NEW_TOKENS

pytestmark = pytest.mark.slow

PROMPTS = (3, 13)  # indices into the reference prompts: 10 and 46 tokens (46 > the 32-token chunk budget)


@pytest.fixture(scope="module")
def compiled_llm():
    from kvledger import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COMPILE_ENV, "1")
        llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=32)
    assert llm.llm_engine.runner.step.compiled
    return llm


def test_compiled_step_token_identical_to_transformers(compiled_llm, engine_reference):
    """Two prompts in one batch (a chunked prefill beside a decode, then batch-2 decodes, then one
    batch-1 decode: the 46-token prompt starts decoding a step later), compiled: the first step's
    graph serves every step up to the last, which builds the batch-1 graph; two graphs in all.
    The decodes read their K/V in place (the CPU kernel, called from the opaque attention operator)."""
    import torch._dynamo.utils

    from kvledger import SamplingParams

    prompts = [engine_reference.prompts[i] for i in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine = compiled_llm.llm_engine
    for i, prompt in zip(PROMPTS, prompts):
        engine.add_request(f"c{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"c{i}": [] for i in PROMPTS}
    assert engine.runner.decode_in_place
    base = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    frames: list[int] = []  # graphs of the decoder layer built so far, after each step
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - base)
    assert engine.runner.step.compiled, "compilation failed and the step fell back to eager"
    for i in PROMPTS:
        assert tokens[f"c{i}"] == engine_reference.outputs[i], f"prompt {i} differs from transformers"
    assert len(frames) == NEW_TOKENS + 1, f"steps: {len(frames)}"
    assert frames[:-1] == [1] * NEW_TOKENS and frames[-1] == 2, f"graphs built after each step: {frames}"


def test_enforce_eager_turns_compilation_off(monkeypatch):
    """Compiled only when asked for (KVLEDGER_COMPILE=1), and never under enforce_eager; an
    engine built with enforce_eager=True runs the eager step whatever the environment says."""
    from kvledger import LLM
    from kvledger.engine.compile import compile_enabled

    monkeypatch.setenv(COMPILE_ENV, "1")
    assert compile_enabled(enforce_eager=False)
    assert not compile_enabled(enforce_eager=True)
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not compile_enabled(enforce_eager=False)
    monkeypatch.delenv(COMPILE_ENV)
    assert not compile_enabled(enforce_eager=False)
    monkeypatch.setenv(COMPILE_ENV, "1")
    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="16MiB", enforce_eager=True)
    assert not llm.llm_engine.runner.step.compiled


def test_bfloat16_compiles_without_falling_back(engine_reference):
    """bfloat16 layers compile (their projections multiply by the plain weights inside the graph:
    the prepacked oneDNN weights cannot be traced); the engine stays compiled throughout, and its
    greedy tokens match the eager bfloat16 engine's."""
    from kvledger import LLM, SamplingParams

    prompts = [engine_reference.prompts[i] for i in PROMPTS]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COMPILE_ENV, "1")
        compiled = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory="16MiB")
    out = compiled.generate(prompts, [params] * len(prompts), use_tqdm=False)
    assert compiled.llm_engine.runner.step.compiled, "compilation failed and the step fell back to eager"
    eager = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory="16MiB", enforce_eager=True)
    ref = eager.generate(prompts, [params] * len(prompts), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
