"""Bad input and overload: each gets its status code and a message naming the problem, at once,
and the server keeps serving the next request.

A small server of its own: max-model-len 512, a 64 MiB pool (91 blocks x 16 = 1,456 tokens),
one running request at a time, one waiting, an API key, and a 64 KiB body limit. Property
tests (hypothesis) feed the request parser arbitrary JSON and bytes: a request or a 400.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

from kvledger.server.errors import APIError
from kvledger.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tests.server_harness import MODEL, PROMPTS, check_integrity, wait_idle

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.server.launcher import BackgroundServer, build_app

    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_memory="64MiB",
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=1))
    srv = BackgroundServer(build_app(engine, api_key=KEY, max_waiting=1, max_body_bytes=BODY_LIMIT)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, body, path="/v1/completions", headers=AUTH, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def assert_still_serving(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 2


GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


def test_over_max_model_len_is_400_with_the_numbers(server, client):
    ids = [42] * 500
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=20)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "512" in msg and "520" in msg and "500 in the prompt" in msg and "20 for the completion" in msg
    assert err.value.body["param"] == "max_tokens"
    assert_still_serving(client)


def test_chat_over_max_model_len_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}],
                                       max_tokens=10)
    assert "512" in str(err.value) and "in the messages" in str(err.value)
    assert_still_serving(client)


def test_request_larger_than_the_whole_pool_is_400_at_once(server, client):
    """The pool (91 blocks of 16 tokens) holds at least max_model_len (512) tokens, so the length
    check answers first, with the numbers, and nothing waits for blocks that cannot come."""
    t0 = time.monotonic()
    err = error_of(post(server, {"model": MODEL, "prompt": [7] * 600, "max_tokens": 1000}), 400)
    assert time.monotonic() - t0 < 5
    assert "maximum context length is 512 tokens" in err["message"] and "1600 tokens" in err["message"], err["message"]
    assert_still_serving(client)


def test_malformed_json_is_400(server, client):
    err = error_of(post(server, b'{"model": "smollm2-135m", "prompt": "x",'), 400)
    assert "not valid JSON" in err["message"]
    err = error_of(post(server, b'["not", "an", "object"]'), 400)
    assert "JSON object" in err["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("field,value", [("max_tokens", "5"), ("temperature", "hot"), ("stream", "yes"),
                                         ("prompt", 12), ("stop", 3), ("seed", 1.5)])
def test_wrong_type_is_400_naming_the_field(server, client, field, value):
    err = error_of(post(server, {**GOOD, field: value}), 400)
    assert f"'{field}'" in err["message"] and err["param"] == field
    assert_still_serving(client)


def test_wrong_type_in_chat_messages_is_400(server, client):
    err = error_of(post(server, {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
                        path="/v1/chat/completions"), 400)
    assert "messages[0].content" in err["message"] and err["param"] == "messages"
    err = error_of(post(server, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
                        path="/v1/chat/completions"), 400)
    assert "messages[0].role" in err["message"]
    err = error_of(post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "user"}]},
                        path="/v1/chat/completions"), 400)
    assert "messages[1].content" in err["message"] and err["param"] == "messages"
    assert_still_serving(client)


def test_temperature_beyond_a_double_is_400(server):
    """``1e400`` parses as infinity: refused, naming the field."""
    err = error_of(post(server, '{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": 1e400}' % MODEL), 400)
    assert err["param"] == "temperature" and "temperature" in err["message"]


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9], "max_tokens": 2}, "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}, "one prompt per request"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "'messages'"),
])
def test_bad_prompts_are_400(server, client, path, body, needle):
    err = error_of(post(server, body, path=path), 400)
    assert needle in err["message"], err["message"]
    assert_still_serving(client)


def test_missing_field_is_400(server, client):
    err = error_of(post(server, {"model": MODEL}), 400)
    assert "'prompt' is required" in err["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_not_positive_is_400(server, client, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=value)
    assert "'max_tokens'" in str(err.value) and err.value.body["param"] == "max_tokens"
    assert_still_serving(client)


def test_negative_temperature_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-0.5)
    assert "'temperature'" in str(err.value) and err.value.body["param"] == "temperature"
    assert_still_serving(client)


@pytest.mark.parametrize("value", [0.0, 1.5, -1.0])
def test_top_p_outside_0_1_is_400(server, client, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, top_p=value)
    assert "'top_p'" in str(err.value) and err.value.body["param"] == "top_p"
    assert_still_serving(client)


@pytest.mark.parametrize("kwargs,field", [
    (dict(logprobs=2), "logprobs"),
    (dict(n=2), "n"),
    (dict(echo=True), "echo"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
])
def test_unsupported_parameter_is_400_naming_it(server, client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **kwargs)
    assert f"'{field}'" in str(err.value) and err.value.body["param"] == field
    assert_still_serving(client)


def test_per_chunk_usage_is_400_not_silently_ignored(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert "'stream_options.continuous_usage_stats'" in str(err.value) and err.value.body["param"] == "stream_options"
    assert_still_serving(client)


def test_unsupported_chat_tools_is_400(server, client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert "'tools'" in str(err.value)
    assert_still_serving(client)


def test_max_tokens_and_max_completion_tokens_disagreeing_is_400_naming_both(server, client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    err = error_of(post(server, {**chat, "max_tokens": 3, "max_completion_tokens": 5}, "/v1/chat/completions"), 400)
    assert err["param"] == "max_completion_tokens"
    assert err["message"].startswith("'max_tokens' (3) and 'max_completion_tokens' (5) disagree; send one")
    agree = post(server, {**chat, "max_tokens": 2, "max_completion_tokens": 2, "temperature": 0}, "/v1/chat/completions")
    assert agree.status_code == 200 and agree.json()["usage"]["completion_tokens"] == 2
    assert_still_serving(client)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-nonexistent", prompt="Hello", max_tokens=2)
    assert "gpt-nonexistent" in str(err.value) and MODEL in str(err.value)
    assert_still_serving(client)


def test_missing_or_wrong_api_key_is_401(server, client):
    err = error_of(httpx.post(server.url + "/v1/completions", json=GOOD), 401)
    assert "missing API key" in err["message"]
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(**GOOD)
    assert "invalid API key" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/metrics").status_code == 200  # no key for metrics
    assert_still_serving(client)


def test_body_over_the_limit_is_413(server, client):
    body = {"model": MODEL, "prompt": "word " * (BODY_LIMIT // 4), "max_tokens": 2}
    err = error_of(post(server, body), 413)
    assert str(BODY_LIMIT) in err["message"]
    assert_still_serving(client)


def test_full_queue_is_503_with_retry_after(server, client):
    """One request runs (max-num-seqs 1), one waits (max-waiting 1): the third is turned away."""
    engine = server.aengine
    body_long = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    waiting_result: dict = {}

    def waiting_request():
        waiting_result["resp"] = post(server, {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 3})

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body_long, headers=AUTH) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is running
            t = threading.Thread(target=waiting_request)
            t.start()
            deadline = time.monotonic() + 30
            while engine.snapshot()["num_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            resp = post(server, GOOD)
            err = error_of(resp, 503)
            assert resp.headers["Retry-After"].isdigit()
            assert "overloaded" in err["message"] and "--max-waiting-requests 1" in err["message"]
        # leaving the block closed the running stream: it is aborted, and the waiting one runs
        t.join(60)
    assert waiting_result["resp"].status_code == 200
    assert waiting_result["resp"].json()["usage"]["completion_tokens"] == 3
    ledger = wait_idle(server)
    assert ledger["blocks_allocated"] == 0
    check_integrity(server)
    assert_still_serving(client)


def test_unknown_route_is_404_json(server):
    err = error_of(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert "/v1/nothing-here" in err["message"]


def test_bad_query_parameter_is_400(server):
    err = error_of(httpx.get(server.url + "/dashboard/ledger.json?since=yesterday"), 400)
    assert "'since'" in err["message"]
    assert httpx.get(server.url + "/dashboard/ledger.json?since=0").status_code == 200


# --- any body at all: a request model or a 400 naming the problem, never anything else ----------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
           "stream_options", "logprobs", "top_k", "ignore_eos", "echo", "tools", "response_format", "bogus"]


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6) | _json,
       chat=st.booleans())
def test_any_json_body_parses_or_is_a_400_naming_something(body, chat):
    cls = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = parse_request(cls, json.dumps(body).encode())
    except APIError as err:
        assert err.status == 400 and err.message and "\n" not in err.message
        if isinstance(body, dict) and err.param is not None:
            assert err.param in body or err.param in ("model", "prompt", "messages")
        return
    assert isinstance(req, cls) and isinstance(body, dict)
    assert req.n == 1 and (req.max_tokens is None or req.max_tokens >= 1)
    assert req.temperature is None or req.temperature >= 0
    assert req.top_p is None or 0 < req.top_p <= 1


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_400(raw):
    try:
        parse_request(CompletionRequest, raw)
    except APIError as err:
        assert err.status == 400 and err.message
