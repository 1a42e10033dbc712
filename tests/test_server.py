"""The server through the official ``openai`` client over real sockets, against the real model.

Streamed text == non-streamed text == the offline engine's greedy output; stop strings end a
request and free its blocks; ``/metrics`` (parsed by prometheus_client) equals the engine's
own ledger, during a run and when idle; ``kvledger serve`` prints its URL and obeys --api-key.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli_helpers import stop
from tests.server_harness import (
    CHATS, MODEL, PROMPTS, check_integrity, greedy_chat_reference, greedy_reference, greedy_references,
    aborted_total, openai_client, parse_metrics, scrape, shared_server, start_together, wait_idle,
)

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _stream_completion(client, prompt: str, max_tokens: int, **kw) -> tuple[str, str | None, int]:
    text, reason, usage = "", None, 0
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, reason, usage


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_completion_stream_equals_nonstream_equals_offline(client, prompt):
    expected = greedy_references(PROMPTS[:4], MAX_TOKENS)[prompt]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    streamed, reason, n_streamed = _stream_completion(client, prompt, MAX_TOKENS)
    assert expected, "the offline reference produced no text"
    assert full.choices[0].text == expected
    assert streamed == expected
    assert reason == full.choices[0].finish_reason
    assert n_streamed == full.usage.completion_tokens
    from tests.server_harness import reference_llm

    assert full.usage.prompt_tokens == len(reference_llm().get_tokenizer().encode(prompt))


def test_token_id_prompt_equals_text_prompt(server, client):
    from kvledger import SamplingParams
    from tests.server_harness import reference_llm

    ids = reference_llm().get_tokenizer().encode(PROMPTS[1])
    expected = reference_llm().generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                        use_tqdm=False)[0].outputs[0].text
    wait_idle(server)
    before = scrape(server.url)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected == greedy_reference(PROMPTS[1], MAX_TOKENS)
    assert out.usage.prompt_tokens == len(ids)
    after = scrape(server.url)  # the token counters grew by exactly this request's tokens
    assert after["kvledger:prompt_tokens_total"] - before["kvledger:prompt_tokens_total"] == len(ids)
    assert (after["kvledger:generation_tokens_total"] - before["kvledger:generation_tokens_total"]
            == out.usage.completion_tokens)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_stream_equals_nonstream_equals_offline(client, messages):
    expected = greedy_chat_reference(messages, MAX_TOKENS)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    parts, roles, reason = [], [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        parts.append(delta.content or "")
        reason = chunk.choices[0].finish_reason or reason
    assert expected
    assert full.choices[0].message.content == expected
    assert full.choices[0].message.role == "assistant"
    assert "".join(parts) == expected
    assert roles[0] == "assistant"
    assert reason == full.choices[0].finish_reason


def test_sampled_completion_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b and a


def test_stop_string_ends_request_and_frees_blocks(server, client):
    prompt = PROMPTS[6]  # "1, 2, 3, 4," -> greedy continues the count
    free_run = greedy_reference(prompt, 32)
    stop = free_run.strip().split(",")[2].strip()  # a number the model is about to write
    assert stop and stop in free_run
    expected = free_run[:free_run.index(stop)]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
    streamed, reason, _ = _stream_completion(client, prompt, 32, stop=[stop])
    assert full.choices[0].text == expected == streamed
    assert full.choices[0].finish_reason == "stop" == reason
    assert full.usage.completion_tokens < 32
    ledger = wait_idle(server)
    assert ledger["blocks_allocated"] == 0
    check_integrity(server)


def _expected_from_ledger(ledger: dict) -> dict[str, float]:
    return {
        "kvledger:kv_blocks_allocated": ledger["blocks_allocated"],
        "kvledger:kv_blocks_total": ledger["num_blocks"],
        "kvledger:kv_blocks_cached_free": ledger["blocks_cached_free"],
        "kvledger:kv_cache_usage_perc": ledger["blocks_allocated"] / ledger["num_blocks"],
        "kvledger:kv_tokens_used": ledger["tokens_used"],
        "kvledger:kv_waste_tokens": ledger["waste_tokens"],
        "kvledger:kv_cache_bytes": ledger["measured_bytes"],
        "kvledger:num_requests_running": ledger["num_running"],
        "kvledger:num_requests_waiting": ledger["num_waiting"],
        "kvledger:prefix_cache_queries_total": ledger["prefix_cache_queries"],
        "kvledger:prefix_cache_hits_total": ledger["prefix_cache_hits"],
        "kvledger:num_preemptions_total": ledger["num_preemptions"],
    }


LONG_PREFIX = ("The history of the old river town begins in Roman times, when a small settlement at the ford "
               "grew into a market with a harbour, a bridge, two temples and a wall around the hill. ")


def test_metrics_equal_engine_ledger_during_a_run_and_when_idle(server):
    """Scrape /metrics while no step can run (the loop's lock held) and compare with engine.ledger()."""
    client = openai_client(server)
    prompts = [LONG_PREFIX + "Its oldest building is", LONG_PREFIX + "Today it is known for", PROMPTS[3]]
    before = scrape(server.url)

    def stream(p):
        for _ in client.completions.create(model=MODEL, prompt=p, max_tokens=64, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            pass

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    start_together(server, threads)

    async def consistent_view():
        async with server.aengine.hold():  # no step runs here
            ledger = asdict(server.aengine.engine.ledger())
            async with httpx.AsyncClient() as c:
                text = (await c.get(server.url + "/metrics")).text
        return ledger, text

    ledger, text = server.run(consistent_view())
    scraped = parse_metrics(text)
    assert ledger["blocks_allocated"] > 0 and ledger["num_running"] == len(prompts)
    assert ledger["tokens_used"] != ledger["blocks_allocated"] * ledger["block_size"]  # waste exists
    for name, value in _expected_from_ledger(ledger).items():
        assert scraped[name] == pytest.approx(value), name
    for t in threads:
        t.join(120)
    # the shared prefix is cached now: one more request with it hits (full blocks only)
    client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2, temperature=0)

    idle = wait_idle(server)
    scraped = scrape(server.url)
    for name, value in _expected_from_ledger(idle).items():
        assert scraped[name] == pytest.approx(value), name
    assert idle["blocks_allocated"] == 0 and idle["blocks_cached_free"] > 0
    hits = scraped["kvledger:prefix_cache_hits_total"] - before["kvledger:prefix_cache_hits_total"]
    assert hits >= 2 * idle["block_size"], hits
    delta = {k: scraped[k] - before[k] for k in ("kvledger:time_to_first_token_seconds_count",
                                                  "kvledger:e2e_request_latency_seconds_count",
                                                  "kvledger:inter_token_latency_seconds_count")}
    assert delta["kvledger:time_to_first_token_seconds_count"] == len(prompts) + 1
    assert delta["kvledger:e2e_request_latency_seconds_count"] == len(prompts) + 1
    assert delta["kvledger:inter_token_latency_seconds_count"] >= len(prompts) * 63  # one per step after the first


def test_the_step_log_keeps_when_the_server_received_each_request(server, client):
    """Both generation endpoints hand the engine the moment their handler began, before the body
    was read: a completion whose body ends 0.3 s after it began was received at least 0.3 s
    before the engine took it; each arrival lies within the client's call."""
    import json

    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}).encode()

    def slow_body():  # the first half at once, the rest 0.3 s later
        yield body[:20]
        time.sleep(0.3)
        yield body[20:]

    records: list = []
    server.run(server.aengine.call(lambda e: setattr(e, "step_records", records)))
    try:
        before = time.perf_counter()
        resp = httpx.post(server.url + "/v1/completions", content=slow_body(), timeout=60,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 200, resp.text
        client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2, temperature=0)
        after = time.perf_counter()
    finally:
        server.run(server.aengine.call(lambda e: setattr(e, "step_records", None)))
    slow, chat = [a for r in records for a in r.arrivals]
    assert slow.time_s - slow.received_s >= 0.3
    for a in (slow, chat):
        assert before < a.received_s < a.time_s < after, a


def test_metrics_need_no_api_key_and_name_vllm_metrics(server):
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200
    names = {fam.name for fam in text_string_to_metric_families(resp.text)}
    for name in ["kvledger:kv_cache_usage_perc", "kvledger:kv_blocks_allocated", "kvledger:kv_tokens_used",
                 "kvledger:kv_waste_tokens", "kvledger:num_requests_running", "kvledger:num_requests_waiting",
                 "kvledger:prefix_cache_queries", "kvledger:prefix_cache_hits", "kvledger:num_preemptions",
                 "kvledger:time_to_first_token_seconds", "kvledger:inter_token_latency_seconds",
                 "kvledger:e2e_request_latency_seconds"]:
        assert name in names, name


def test_nonstreaming_client_disconnect_aborts(server):
    """A client that gives up on a non-streamed request: the request leaves the engine."""
    wait_idle(server)
    before = aborted_total(server.url)
    generated_before = scrape(server.url)["kvledger:generation_tokens_total"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.5,
                   json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
                         "ignore_eos": True})
    ledger = wait_idle(server, timeout=30)  # 400 tokens would take far longer: it was aborted
    assert ledger["blocks_allocated"] == 0
    assert aborted_total(server.url) - before == 1
    assert scrape(server.url)["kvledger:generation_tokens_total"] > generated_before  # its tokens still count
    check_integrity(server)


@pytest.mark.slow
def test_cli_serve_prints_url_and_checks_api_key(tmp_path):
    """``kvledger serve --model smollm2-135m --port N --api-key K --max-model-len N --kv-cache-memory SIZE``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvledger.cli.main", "serve", "--model", "smollm2-135m", "--port", str(port),
           "--api-key", "sekret", "--max-model-len", "256", "--kv-cache-memory", "32MiB"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if f"http://127.0.0.1:{port}" in line:
                break
        assert any(f"http://127.0.0.1:{port}" in ln for ln in lines), "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/metrics").status_code == 200  # no key needed
        assert httpx.get(url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        out = good.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert out.choices[0].text == greedy_reference(PROMPTS[0], 8)
        with pytest.raises(openai.BadRequestError) as err:
            good.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=300)
        from tests.server_harness import reference_llm

        n_prompt = len(reference_llm().get_tokenizer().encode(PROMPTS[0]))
        assert "256" in str(err.value) and f"{n_prompt + 300} tokens" in str(err.value)
    finally:
        stop(proc)


def test_async_clients_share_steps(server):
    """Several clients at once run in the same engine steps (continuous batching across clients)."""
    from tests.server_harness import async_openai_client

    client = async_openai_client(server)
    steps_before = server.aengine.num_steps

    async def one(p):
        r = await client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    counts = asyncio.run(all_of_them())
    steps = server.aengine.num_steps - steps_before
    assert counts == [16] * len(PROMPTS)
    assert steps < 16 * len(PROMPTS) / 2, f"{steps} steps for {len(PROMPTS)} x 16 tokens: not batched together"
