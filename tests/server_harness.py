"""Shared pieces of the server tests: one real server per test file, and offline references.

``shared_server()`` starts the real app (real engine, real model, uvicorn on a free loopback
port) in a background thread of the test process on first use; the tests of one file share it.
``reference_llm()`` is a separate offline :class:`LLM` with the same engine arguments, whose greedy
output the server must reproduce token for token. Both live until :func:`release`, which the
suite's conftest calls after each test file: a worker that kept them for the whole run held
about 4 GB beside the next file's models (weights in three layouts, see ``layers/linear.py``).
"""

from __future__ import annotations

import atexit
import time
from dataclasses import asdict

# A pool of 192 MiB (~270 blocks of 16 tokens for SmolLM2-135M in fp32) holds 100+ short requests at once.
ENGINE_ARGS = dict(model="smollm2-135m", dtype="float32", kv_cache_memory="192MiB", max_model_len=1024, block_size=16)
MODEL = "smollm2-135m"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "The capital of France is a city that",  # shares a prefix with the first
    "1, 2, 3, 4,",
    "Q: What is the largest planet?\nA:",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}],
]


_SHARED: dict[str, object] = {}
"""The running server (``"server"``) and the offline reference (``"reference"``), until :func:`release`."""


def shared_server():
    """The test file's server (a :class:`BackgroundServer`), started on first use."""
    if "server" not in _SHARED:
        from kvledger.config import EngineConfig
        from kvledger.engine.llm_engine import LLMEngine
        from kvledger.server.launcher import BackgroundServer, build_app

        engine = LLMEngine(EngineConfig(**ENGINE_ARGS))
        server = BackgroundServer(build_app(engine)).start()
        atexit.register(server.stop)
        _SHARED["server"] = server
    return _SHARED["server"]


def reference_llm():
    """The offline :class:`LLM` with the server's engine arguments, built on first use."""
    if "reference" not in _SHARED:
        from kvledger import LLM

        _SHARED["reference"] = LLM(**ENGINE_ARGS)
    return _SHARED["reference"]


def release() -> None:
    """Stop the shared server, shut its engine down (which lets go of the weights and the pool: the
    stopped app's routes, and so its engine, stay in FastAPI's caches) and drop the offline
    reference. The greedy texts stay cached."""
    server = _SHARED.pop("server", None)
    if server is not None:
        server.stop()
        atexit.unregister(server.stop)
        server.aengine.engine.shutdown()
    _SHARED.pop("reference", None)


_GREEDY: dict[tuple[str, int], str] = {}


def greedy_references(prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Offline greedy texts of completion prompts (computed in one batch, cached)."""
    from kvledger import SamplingParams

    todo = [p for p in dict.fromkeys(prompts) if (p, max_tokens) not in _GREEDY]
    if todo:
        outs = reference_llm().generate(todo, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        for p, out in zip(todo, outs):
            _GREEDY[(p, max_tokens)] = out.outputs[0].text
    return {p: _GREEDY[(p, max_tokens)] for p in prompts}


def greedy_reference(prompt: str, max_tokens: int) -> str:
    """Offline greedy text of one completion prompt."""
    return greedy_references([prompt], max_tokens)[prompt]


def greedy_chat_reference(messages: list[dict], max_tokens: int) -> str:
    from kvledger import SamplingParams

    out = reference_llm().chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return out[0].outputs[0].text


def openai_client(server, api_key: str = "unused", **kwargs):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


def async_openai_client(server, api_key: str = "unused", **kwargs):
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=300, **kwargs)


def wait_idle(server, timeout: float = 60.0) -> dict:
    """Wait until no request runs or waits; returns the engine's ledger as a dict, taken between steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ledger = server.run(server.aengine.call(lambda e: asdict(e.ledger())))
        if ledger["num_running"] == 0 and ledger["num_waiting"] == 0 and server.aengine.num_waiting() == 0:
            return ledger
        time.sleep(0.05)
    raise AssertionError(f"the server did not become idle in {timeout} s: {ledger}")


def start_together(server, threads: list) -> None:
    """Start ``threads`` (one request each) and wait until the engine runs all of them at once."""
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.aengine.snapshot()["num_running"] < len(threads):
        assert time.monotonic() < deadline, f"{len(threads)} requests never ran together"
        time.sleep(0.02)


def check_integrity(server) -> None:
    server.run(server.aengine.call(lambda e: e.check_integrity()))


def ledger_history(server) -> list[dict]:
    """The dashboard's samples, copied on the server's loop (which appends to them)."""

    async def copy():
        return list(server.aengine.history)

    return server.run(copy())


def parse_metrics(text: str) -> dict[str, float]:
    """``/metrics`` text as {sample name: value} for kvledger's own samples (histogram buckets and
    per-reason request counts left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("kvledger:") and not s.labels.get("le") and "finished_reason" not in s.labels}


def scrape(url: str) -> dict[str, float]:
    """The server's metrics now, as :func:`parse_metrics` gives them."""
    import httpx

    return parse_metrics(httpx.get(url + "/metrics").text)


def aborted_total(url: str) -> float:
    """Requests the server has counted as aborted (``request_success_total{finished_reason="abort"}``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvledger:request_success_total" and s.labels.get("finished_reason") == "abort")
