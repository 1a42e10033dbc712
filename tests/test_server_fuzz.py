"""Fuzzed sampling parameters beside fixed greedy requests: a bad request is the bad request's problem.

Hypothesis draws every sampling field over its documented range and beyond (extremes, wrong
types, integers past 64 bits, subnormal and non-finite floats) and sends each batch of drawn
requests at once, to completions and chat, streamed and not, beside a fixed set of greedy
requests. Each drawn request gets 200 or a 400 naming one of its fields, never a 500 (a 200
stream carries no error event); every greedy request's text equals its offline reference; the
block pool is empty afterwards. ``max_tokens`` is always drawn and never null (mostly small,
so the run stays short on CPU: chat's default is the whole context).
"""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from tests.server_harness import (
    MODEL, PROMPTS, async_openai_client, check_integrity, greedy_references, shared_server, wait_idle,
)

BATCH = 20  # drawn requests per batch
BATCHES = 15  # hypothesis examples: BATCH x BATCHES = 300 drawn requests
GREEDY_TOKENS = 6
GREEDY_PROMPTS = PROMPTS[:4]
VOCAB = 49152

_wrong_type = st.one_of(st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2),
                        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_wrong = st.none() | _wrong_type
_huge = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(10**30)])
_tiny = st.sampled_from([5e-324, 1e-320, 1e-300, 1e-45, 1e-40, 1e-6, 9.99e-6, 1e-5])
_any_float = st.floats(allow_nan=True, allow_infinity=True)


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values, then extremes, huge integers, tiny or non-finite floats, wrong types."""
    return st.one_of(valid, valid, _huge, _tiny, _any_float, _wrong, st.booleans())


FIELDS = {
    "temperature": _field(st.floats(0, 2)),
    "top_p": _field(st.floats(0, 1)),
    "top_k": _field(st.integers(-2, 60) | st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1])),
    "seed": _field(st.integers(-(2**64), 2**64)),
    "min_tokens": _field(st.integers(-1, 8)),
    "stop_token_ids": _field(st.lists(st.integers(-2, VOCAB + 1) | _huge, max_size=3)),
    "stop": _field(st.text(max_size=3) | st.lists(st.text(max_size=4), max_size=3)),
    "ignore_eos": _field(st.booleans()),
    "include_stop_str_in_output": _field(st.booleans()),
    "skip_special_tokens": _field(st.booleans()),
}
_request = st.fixed_dictionaries(
    {"chat": st.booleans(), "stream": st.booleans(), "prompt": st.sampled_from(PROMPTS),
     "max_tokens": st.one_of(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6),
                             st.integers(-2, 0), _huge, _tiny, _wrong_type, st.booleans(), st.just(5000))},
    optional=FIELDS)

_counts = {"drawn": 0, "200": 0, "400": 0}


def _body(draw: dict) -> dict:
    body = {"model": MODEL, "stream": draw["stream"], "max_tokens": draw["max_tokens"]}
    if draw["chat"]:
        body["messages"] = [{"role": "user", "content": draw["prompt"]}]
    else:
        body["prompt"] = draw["prompt"]
    body.update({k: v for k, v in draw.items() if k in FIELDS})
    return body


async def _send(http: httpx.AsyncClient, draw: dict) -> tuple[dict, int, dict | str]:
    """POST one drawn request as raw JSON (NaN and Infinity as their JS literals, as clients send them)."""
    body = _body(draw)
    path = "/v1/chat/completions" if draw["chat"] else "/v1/completions"
    raw = json.dumps(body, allow_nan=True)
    headers = {"Content-Type": "application/json"}
    if not draw["stream"]:
        resp = await http.post(path, content=raw, headers=headers)
        return body, resp.status_code, resp.json()
    async with http.stream("POST", path, content=raw, headers=headers) as resp:
        if resp.status_code != 200:
            return body, resp.status_code, json.loads(await resp.aread())
        events = [line[len("data: "):] async for line in resp.aiter_lines() if line.startswith("data: ")]
        return body, 200, events


def _check(body: dict, status: int, answer) -> None:
    assert status in (200, 400), (status, body, answer)
    if status == 400:
        err = answer["error"]
        assert err["message"] and "\n" not in err["message"], err
        assert err["param"] in body, (err, body)  # it names one of the fields sent
        return
    if body["stream"]:
        assert answer[-1] == "[DONE]", answer
        chunks = [json.loads(e) for e in answer[:-1]]
        assert not any("error" in c for c in chunks), chunks
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] in ("stop", "length"), chunks
        return
    assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    n_out = answer["usage"]["completion_tokens"]
    assert body.get("min_tokens", 0) <= n_out <= body["max_tokens"], (body, answer)


def test_fuzzed_sampling_parameters_never_hurt_anyone():
    server = shared_server()
    expected = greedy_references(GREEDY_PROMPTS, GREEDY_TOKENS)

    async def greedy(client, prompt: str) -> str:
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0)
        return out.choices[0].text

    async def batch(draws: list[dict]):  # one event loop per batch, so fresh clients each time
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http, async_openai_client(server) as client:
            return await asyncio.gather(asyncio.gather(*(_send(http, d) for d in draws)),
                                        asyncio.gather(*(greedy(client, p) for p in GREEDY_PROMPTS)))

    # no shrinking: each example is a live batch; a failure reports the batch as drawn
    @settings(max_examples=BATCHES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(draws=st.lists(_request, min_size=BATCH, max_size=BATCH))
    def run_batch(draws: list[dict]) -> None:
        fuzzed, greedy_texts = asyncio.run(batch(draws))
        _counts["drawn"] += len(draws)
        for body, status, answer in fuzzed:
            _counts[str(status)] = _counts.get(str(status), 0) + 1
            _check(body, status, answer)
        assert greedy_texts == [expected[p] for p in GREEDY_PROMPTS]

    run_batch()
    assert _counts["drawn"] >= 300, _counts
    assert _counts["200"] >= 30 and _counts["400"] >= 30, _counts  # both answers were exercised
    ledger = wait_idle(server)
    assert ledger["blocks_allocated"] == 0 and ledger["num_running"] == 0, ledger
    check_integrity(server)
