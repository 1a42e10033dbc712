"""No request can fail another: every documented sampling parameter works, hostile values get a 400
naming the field, and a request that fails inside a step fails alone.

Each probe runs while a normal greedy stream is in flight on the same server (so in the same
engine steps); that stream must still end with its offline reference text. The parameters are
sent through the official ``openai`` client (vLLM's extras in ``extra_body``), to completions and
chat, streamed and not, and must give what the offline engine gives for the same
:class:`SamplingParams`.
"""

from __future__ import annotations

import asyncio
import math
import threading

import openai
import pytest

from kvledger import SamplingParams
from tests.server_harness import (
    MODEL, PROMPTS, check_integrity, greedy_reference, openai_client, reference_llm, shared_server, wait_idle,
)

OTHER_PROMPT = PROMPTS[0]
OTHER_TOKENS = 16  # still running when the probe (8 tokens at most) has been answered
PROBE_PROMPT = "Hello"
PROBE_TOKENS = 8
# greedy stops at EOS after 2 tokens ("No") on this question
SHORT_CHAT = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


class OtherRequest:
    """A normal greedy completion streamed in a thread; ``start()`` returns once its first chunk came."""

    def __init__(self, client) -> None:
        self.client = client
        self.text = ""
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            for chunk in self.client.completions.create(model=MODEL, prompt=OTHER_PROMPT, max_tokens=OTHER_TOKENS,
                                                        temperature=0, stream=True):
                self.text += chunk.choices[0].text
                self.started.set()
        except BaseException as err:  # reported by finish()
            self.error = err
        finally:
            self.started.set()

    def start(self) -> "OtherRequest":
        self.thread.start()
        assert self.started.wait(60), "the other request never produced a token"
        return self

    def finish(self) -> str:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the other request hung"
        if self.error is not None:
            raise self.error
        return self.text


# The table: each probe (prompt "Hello", max_tokens 8, plus these fields) crashed the step
# of every request in flight. Now: 400 naming the field, or 200 and honoured.
REFUSED = {
    "min_tokens-2-stop-id-vocab-size": ({"min_tokens": 2, "stop_token_ids": [49152]}, "stop_token_ids"),
    "min_tokens-2-stop-id-huge": ({"min_tokens": 2, "stop_token_ids": [10**30]}, "stop_token_ids"),
    "min_tokens-huge": ({"min_tokens": 10**30}, "min_tokens"),
    "min_tokens-over-max_tokens": ({"min_tokens": 9}, "min_tokens"),
    "seed-2**64": ({"seed": 2**64}, "seed"),
}


@pytest.mark.parametrize("extra,field", list(REFUSED.values()), ids=list(REFUSED))
def test_probe_is_400_naming_the_field_and_the_other_request_is_untouched(server, client, extra, field):
    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    other = OtherRequest(client).start()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS, extra_body=extra)
    assert other.finish() == reference
    body = err.value.body
    assert body["param"] == field and field in body["message"] and "\n" not in body["message"], body
    assert wait_idle(server)["blocks_allocated"] == 0
    check_integrity(server)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 0.0, 9.9e-6], ids=lambda t: f"temperature-{t:g}")
def test_probe_tiny_temperature_is_greedy(server, client, temperature):
    """vLLM's rule: a temperature below 1e-5 is greedy, so the text is the greedy reference."""
    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    other = OtherRequest(client).start()
    out = client.completions.create(model=MODEL, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS, temperature=temperature)
    assert other.finish() == reference
    assert out.choices[0].text == greedy_reference(PROBE_PROMPT, PROBE_TOKENS)
    assert wait_idle(server)["blocks_allocated"] == 0


def test_probe_top_p_below_float32_keeps_the_top_token(server, client):
    """top_p 1e-300 (0 in float32) keeps only the most likely token: sampling at temperature 1 gives
    the greedy text."""
    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    other = OtherRequest(client).start()
    out = client.completions.create(model=MODEL, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS, top_p=1e-300,
                                    temperature=1.0)
    assert other.finish() == reference
    assert out.choices[0].text == greedy_reference(PROBE_PROMPT, PROBE_TOKENS)


def test_probe_min_tokens_1_is_honoured(server, client):
    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    other = OtherRequest(client).start()
    out = client.completions.create(model=MODEL, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS,
                                    extra_body={"min_tokens": 1})
    assert other.finish() == reference
    assert 1 <= out.usage.completion_tokens <= PROBE_TOKENS and out.choices[0].finish_reason in ("stop", "length")
    assert wait_idle(server)["blocks_allocated"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_min_tokens_holds_back_eos(server, client, stream):
    """Greedy answers this question in 2 tokens (a word, then EOS); with min_tokens 5 it writes at
    least 5, beside a request in flight that stays as it was."""
    free = reference_llm().chat(SHORT_CHAT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(free.token_ids) < 5 and free.finish_reason == "stop"
    expected = reference_llm().chat(SHORT_CHAT, SamplingParams(max_tokens=8, temperature=0, min_tokens=5),
                                    use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) >= 5
    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    other = OtherRequest(client).start()
    text, n_out = _chat(client, SHORT_CHAT, stream, dict(max_tokens=8, temperature=0, extra_body={"min_tokens": 5}))
    assert other.finish() == reference
    assert n_out is None or n_out >= 5
    assert text == expected.text and text != free.text


# --- every documented parameter, in completions and chat, streamed and not ----------------------

def _chat(client, messages: list[dict], stream: bool, kw: dict) -> tuple[str, int | None]:
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=messages, **kw)
        return out.choices[0].message.content, out.usage.completion_tokens
    text, n = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return text, n


VLLM_EXTRAS = ("min_tokens", "stop_token_ids", "ignore_eos", "top_k", "skip_special_tokens",
               "include_stop_str_in_output")
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: 8 tokens, the last EOS


def _cases(greedy_ids: list[int], greedy_text: str) -> dict[str, dict]:
    """SamplingParams fields per case; the stop token and string come from the greedy output."""
    word = greedy_text.split()[2]
    return {
        "temperature-0": dict(temperature=0),
        "seed": dict(temperature=0.9, seed=1234),
        "top_k": dict(temperature=1.0, top_k=5, seed=7),
        "top_p": dict(temperature=1.0, top_p=0.5, seed=7),
        "min_tokens": dict(temperature=0, min_tokens=10),
        "stop_token_ids": dict(temperature=0, stop_token_ids=[greedy_ids[3]]),
        "min_tokens-masks-stop_token_ids": dict(temperature=0, stop_token_ids=[greedy_ids[0]], min_tokens=2),
        "ignore_eos": dict(temperature=0, ignore_eos=True),
        "stop": dict(temperature=0, stop=[word]),
        "include_stop_str_in_output": dict(temperature=0, stop=[word], include_stop_str_in_output=True),
        "skip_special_tokens-false": dict(temperature=0, skip_special_tokens=False),
    }


def _request_kwargs(fields: dict) -> dict:
    kw = {k: v for k, v in fields.items() if k not in VLLM_EXTRAS}
    extra = {k: v for k, v in fields.items() if k in VLLM_EXTRAS}
    return {"max_tokens": MAX_TOKENS, **kw, **({"extra_body": extra} if extra else {})}


async def _server_text(client, endpoint: str, stream: bool, kw: dict) -> tuple[str, int | None]:
    """Text and completion tokens of one request through the async ``openai`` client."""
    if endpoint == "chat":
        create, args = client.chat.completions.create, {"messages": CHAT}
        piece = lambda c: c.delta.content or ""  # noqa: E731
    else:
        create, args = client.completions.create, {"prompt": PROMPTS[2]}
        piece = lambda c: c.text  # noqa: E731
    if not stream:
        out = await create(model=MODEL, **args, **kw)
        choice = out.choices[0]
        return (choice.message.content if endpoint == "chat" else choice.text), out.usage.completion_tokens
    text, n = "", None
    async for chunk in await create(model=MODEL, **args, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += piece(chunk.choices[0])
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return text, n


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_documented_parameter_equals_the_offline_engine(server, endpoint):
    """Each parameter, streamed and not, all at once: the text and token count the offline engine
    gives for the same SamplingParams, and the parameter's own effect."""
    from tests.server_harness import async_openai_client

    llm = reference_llm()

    def offline(params: list[SamplingParams]):
        if endpoint == "chat":
            return [o.outputs[0] for o in llm.chat([CHAT] * len(params), params, use_tqdm=False)]
        return [o.outputs[0] for o in llm.generate([PROMPTS[2]] * len(params), params, use_tqdm=False)]

    greedy = offline([SamplingParams(max_tokens=MAX_TOKENS, temperature=0)])[0]
    cases = _cases(greedy.token_ids, greedy.text)
    expected = dict(zip(cases, offline([SamplingParams(max_tokens=MAX_TOKENS, **f) for f in cases.values()])))
    client = async_openai_client(server)

    async def everything():
        jobs = [(name, stream) for name in cases for stream in (False, True)]
        outs = await asyncio.gather(*(_server_text(client, endpoint, stream, _request_kwargs(cases[name]))
                                      for name, stream in jobs))
        return dict(zip(jobs, outs))

    got = asyncio.run(everything())
    for (name, stream), (text, n_out) in got.items():
        assert (text, n_out) == (expected[name].text, len(expected[name].token_ids)), (name, stream)
    # and each parameter did what it says
    e = expected
    assert e["seed"].token_ids != greedy.token_ids or e["top_p"].token_ids != greedy.token_ids
    assert len(e["min_tokens"].token_ids) >= 10 and len(e["ignore_eos"].token_ids) == MAX_TOKENS
    assert e["stop_token_ids"].finish_reason == "stop" and e["stop_token_ids"].token_ids == greedy.token_ids[:4]
    assert greedy.token_ids[0] not in e["min_tokens-masks-stop_token_ids"].token_ids[:2]
    word = cases["stop"]["stop"][0]
    assert e["stop"].text == greedy.text[:greedy.text.index(word)]
    assert e["include_stop_str_in_output"].text == greedy.text[:greedy.text.index(word) + len(word)]
    if endpoint == "chat":  # the reply ends in EOS: with skip_special_tokens=False its text shows
        assert greedy.finish_reason == "stop" and len(greedy.token_ids) < MAX_TOKENS
        assert e["min_tokens"].text.startswith(greedy.text) and e["min_tokens"].text != greedy.text
        eos = llm.get_tokenizer().eos_token
        assert e["skip_special_tokens-false"].text == greedy.text + eos
    assert wait_idle(server)["blocks_allocated"] == 0
    check_integrity(server)


# --- fault isolation inside a step --------------------------------------------------------------

def test_a_request_failing_in_its_own_sampling_fails_alone(server, client):
    """A request whose sampling raises inside the step (a temperature made NaN after validation,
    handed to the engine loop directly) ends with the cause; the greedy request in the same steps
    ends with its reference text, and the pool is empty afterwards."""
    from kvledger.server.async_engine import RequestFailedError

    reference = greedy_reference(OTHER_PROMPT, OTHER_TOKENS)
    ids = reference_llm().get_tokenizer().encode(PROBE_PROMPT)
    bad = SamplingParams(max_tokens=PROBE_TOKENS, temperature=1.0)
    bad.temperature = math.nan  # past SamplingParams' own check, as a caller's bug would be

    async def failing_request() -> str:
        stream = await server.aengine.add("bad-sampling", ids, bad)
        with pytest.raises(RequestFailedError) as err:
            async for _ in stream:
                pass
        return str(err.value)

    other = OtherRequest(client).start()
    message = server.run(failing_request())
    assert other.finish() == reference
    assert "bad-sampling" in message and "temperature=nan" in message and "sampling" in message, message
    assert wait_idle(server)["blocks_allocated"] == 0
    check_integrity(server)


def test_a_model_failure_is_a_500_with_its_cause_and_the_server_goes_on(server, client):
    """The model forward raising (a bug, not a request; fault injected into this engine's runner for
    one step) keeps today's behaviour: the step's requests end, each with a 500 naming the cause,
    the blocks they were to write leave the prefix cache, and the next request is served."""
    engine = server.aengine.engine
    wait_idle(server)
    real = engine.runner.execute

    def fail_once(*args, **kwargs):
        engine.runner.execute = real
        raise RuntimeError("injected model fault")

    engine.runner.execute = fail_once  # the loop is idle: the next step is this request's
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=4, temperature=0)
    finally:
        engine.runner.__dict__.pop("execute", None)
    assert err.value.status_code == 500
    assert "injected model fault" in err.value.body["message"] and "RuntimeError" in err.value.body["message"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_reference(PROMPTS[4], 8)
    assert wait_idle(server)["blocks_allocated"] == 0
    check_integrity(server)


def test_concurrent_probes_and_greedy_requests(server):
    """All the table's probes at once beside greedy requests: each probe its answer, each greedy
    request its reference text."""
    from tests.server_harness import async_openai_client, greedy_references

    client = async_openai_client(server)
    expected = greedy_references(PROMPTS, PROBE_TOKENS)

    async def probe(extra: dict) -> int:
        try:
            await client.completions.create(model=MODEL, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS,
                                            extra_body=extra)
            return 200
        except openai.APIStatusError as err:
            return err.status_code

    async def greedy(p: str) -> str:
        out = await client.completions.create(model=MODEL, prompt=p, max_tokens=PROBE_TOKENS, temperature=0)
        return out.choices[0].text

    probes = [{"min_tokens": 1}, {"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-300},
              *[extra for extra, _ in REFUSED.values()]]

    async def everything():
        return await asyncio.gather(*(probe(e) for e in probes), *(greedy(p) for p in PROMPTS))

    results = asyncio.run(everything())
    assert results[:len(probes)] == [200] * 4 + [400] * len(REFUSED)
    assert results[len(probes):] == [expected[p] for p in PROMPTS]
    assert wait_idle(server)["blocks_allocated"] == 0
