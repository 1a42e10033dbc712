"""Clean edges, on a real ``kvledger serve`` process whose log the tests read.

A client that hangs up (streamed or not), a body shorter than its Content-Length, clients that
trickle their headers or their body, an admission burst, and SIGTERM with streams in flight:
each is an info-level log line (499, 408, a shutdown summary) and never a traceback; the KV pool
is empty afterwards; a burst into an idle server accepts exactly max-num-seqs +
max-waiting-requests; SIGTERM stops accepting, lets requests in flight finish for
``--shutdown-timeout`` seconds, ends each remaining stream with an SSE error event and
``[DONE]``, and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_harness import MODEL, PROMPTS, greedy_reference, parse_metrics

MAX_NUM_SEQS = 4
MAX_WAITING = 8
SHUTDOWN_TIMEOUT_S = 8.0
HEADER_TIMEOUT_S = 5.0  # kvledger.server.launcher.HEADER_TIMEOUT_S, as the README states it
BODY_IDLE_TIMEOUT_S = 5.0  # kvledger.server.app.BODY_IDLE_TIMEOUT_S
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}  # never finishes within a test


class Served:
    """A ``kvledger serve`` process on a free port, its log in a file."""

    def __init__(self, tmp: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "serve.log"
        self.log_file = self.log_path.open("w")
        cmd = [sys.executable, "-m", "kvledger.cli.main", "serve", "--port", str(self.port),
               "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-waiting-requests", str(MAX_WAITING), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
               "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 180
        while self.url not in self.log():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """The metrics once no request runs or waits and no KV block is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["kvledger:num_requests_running"] == m["kvledger:num_requests_waiting"] == 0 \
                    and m["kvledger:kv_blocks_allocated"] == 0:
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve"))
    yield s
    s.close()


def new_log(served: Served, since: int, expect: str, timeout: float = 30) -> str:
    """The log written after offset ``since``, once it contains ``expect``; it must hold no traceback."""
    deadline = time.monotonic() + timeout
    while expect not in served.log()[since:]:
        assert time.monotonic() < deadline, f"{expect!r} never logged:\n{served.log()[since:]}"
        time.sleep(0.05)
    text = served.log()[since:]
    assert "Traceback" not in text and "ERROR" not in text, text
    return text


def test_abandoned_nonstreaming_request_is_a_quiet_499(served):
    since = len(served.log())
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": PROMPTS[2], **LONG})
    text = new_log(served, since, "499 client closed request")
    assert "hung up before the answer" in text and "INFO" in text
    served.wait_idle()


def test_abandoned_stream_is_a_quiet_499(served):
    since = len(served.log())
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, extra_body={"ignore_eos": True},
                                       max_tokens=900, temperature=0)
    next(iter(stream))
    stream.close()
    text = new_log(served, since, "hung up during the stream")
    assert "499 client closed request" in text
    served.wait_idle()


def test_truncated_body_then_half_close_is_a_quiet_close(served):
    since = len(served.log())
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        assert s.recv(1000) == b""  # nobody is left to answer: the connection just closes
    text = new_log(served, since, "hung up after 10 bytes of the request body")
    assert "499" in text
    served.wait_idle()


def test_slow_header_senders_are_cut_off_and_others_are_served(served):
    """Twenty connections trickling their request line and headers: each gets a 408 and is closed
    after the header timeout, while a normal request is served at once."""
    reference = greedy_reference(PROMPTS[0], 4)
    since = len(served.log())
    socks = []
    t0 = time.monotonic()
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", served.port))
        s.sendall(b"POST /v1/compl")
        socks.append(s)
    out = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == reference
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S  # served while the slow ones are still held
    answers = []
    for i, s in enumerate(socks):
        s.sendall(b"e")  # still trickling: a byte now and then does not reset the clock
        s.settimeout(HEADER_TIMEOUT_S + 10)
        answers.append(s.recv(1000))
        s.close()
    elapsed = time.monotonic() - t0
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[:2]
    assert HEADER_TIMEOUT_S - 1 <= elapsed <= HEADER_TIMEOUT_S + 5, elapsed
    assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
    text = new_log(served, since, "sent no complete request headers")
    # one line per connection, the status right after the level (a client port such as 59408 must not count)
    assert len(re.findall(r"^\S+:\s+408 ", text, flags=re.M)) == 20, text
    served.wait_idle()


def test_slow_body_sender_gets_408(served):
    since = len(served.log())
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        s.settimeout(BODY_IDLE_TIMEOUT_S + 10)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower(), answer
    assert BODY_IDLE_TIMEOUT_S - 1 <= elapsed <= BODY_IDLE_TIMEOUT_S + 5, elapsed
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "request body did not arrive in time" in err["message"] and err["code"] == 408
    new_log(served, since, "408 request body")
    served.wait_idle()


def test_a_burst_into_an_idle_server_accepts_max_num_seqs_plus_max_waiting(served):
    """30 streams at once into the idle server: exactly MAX_NUM_SEQS + MAX_WAITING are accepted
    (the others get 503 with Retry-After); the accepted ones are then closed."""
    served.wait_idle()
    n = 30
    statuses: list[int] = []

    async def one(http: httpx.AsyncClient, i: int, all_answered: asyncio.Event) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True, **LONG}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            statuses.append(resp.status_code)
            if resp.status_code == 503:
                assert resp.headers["Retry-After"].isdigit()
            if len(statuses) == n:
                all_answered.set()
            await asyncio.wait_for(all_answered.wait(), 120)  # every accepted stream stays open until then

    async def burst() -> None:
        all_answered = asyncio.Event()
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(one(http, i, all_answered) for i in range(n)))

    asyncio.run(burst())
    assert sorted(statuses) == [200] * (MAX_NUM_SEQS + MAX_WAITING) + [503] * (n - MAX_NUM_SEQS - MAX_WAITING)
    served.wait_idle()


def test_sigterm_drains_then_ends_streams_with_an_error_event_and_exits_0(served):
    """Last in this file: one short request that finishes within --shutdown-timeout, and ten streams
    that cannot. SIGTERM: new connections are refused at once, the short one completes with its
    reference text, each stream ends with an SSE error event (503) and [DONE], the process exits
    0 within the timeout and a few seconds, with no traceback and no KV block left."""
    short_prompt, short_tokens = PROMPTS[4], 8
    reference = greedy_reference(short_prompt, short_tokens)
    served.wait_idle()
    since = len(served.log())
    events: dict[int, list[str]] = {}
    short: dict = {}

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True, **LONG}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as resp:
            events[i] = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]

    def short_request() -> None:
        resp = httpx.post(served.url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": short_prompt, "max_tokens": short_tokens, "temperature": 0})
        short.update(status=resp.status_code, body=resp.json())

    threads = [threading.Thread(target=short_request)] + [threading.Thread(target=stream, args=(i,))
                                                          for i in range(10)]
    threads[0].start()
    deadline = time.monotonic() + 60  # a wait that cannot end fails the test instead of hanging it
    while served.metrics()["kvledger:num_requests_running"] < 1:  # the short one runs first
        assert time.monotonic() < deadline, "the short request never ran"
        time.sleep(0.02)
    for t in threads[1:]:
        t.start()
    # all ten streams in the engine (the short one may have finished by now: it is not waited for)
    while served.metrics()["kvledger:num_requests_running"] + served.metrics()["kvledger:num_requests_waiting"] < 10 + (not short):
        assert time.monotonic() < deadline, (short, served.metrics()["kvledger:num_requests_running"],
                                             served.metrics()["kvledger:num_requests_waiting"])
        time.sleep(0.05)
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(served.url + "/health", timeout=5)
    for t in threads:
        t.join(60)
    rc = served.proc.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert rc == 0
    assert elapsed <= SHUTDOWN_TIMEOUT_S + 8, elapsed
    assert short["status"] == 200 and short["body"]["choices"][0]["text"] == reference, short
    assert sorted(events) == list(range(10))
    for lines in events.values():
        assert lines[-1] == "[DONE]", lines[-3:]
        assert "error" in json.loads(lines[-2]), (short, lines[-3:])
        err = json.loads(lines[-2])["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        assert all("error" not in json.loads(x) for x in lines[:-2])
    text = new_log(served, since, "kvledger serve: stopped")
    assert "SIGTERM: shutting down" in text and "ended 10 unfinished requests" in text, text
    assert "requests in flight were ended by the shutdown; KV blocks allocated 0 of" in text, text
    assert "CancelledError" not in text and "499" not in text, text
