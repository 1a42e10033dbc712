"""The second KV tier behind ``kvledger serve``: a multi-turn chat replay whose conversations do not fit
the pool finds at least twice the prefix hits with the tier, with the same texts; ``/metrics``,
``/ledger`` and the dashboard show both tiers."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import MODEL, check_integrity, wait_idle

BS = 16
POOL = 20  # blocks of 16 tokens: fewer than three of the four conversations, even at their first turn
TIER_GIB = 0.05  # 72 blocks of float32 SmolLM2: every conversation
TURNS = 3
SYSTEMS = [
    "You are a patient tutor who explains physics to high-school students with short everyday examples.",
    "You are a travel agent who plans trips through the Alps by train, with times and prices in euros.",
    "You are a chef who answers questions about Italian home cooking in a few plain sentences.",
    "You are a librarian who recommends novels from the nineteenth century to curious readers.",
]
PREAMBLE = ("Every assistant of this service follows the same house rules: keep every answer short, friendly and "
            "concrete, never use lists, tables or headings, and say so when you do not know. ")
"""The start of every conversation's system prompt: the prefix the pool alone can share."""
QUESTIONS = ["Where should we start?", "Can you give one more detail?", "Summarise that in a sentence."]


def _server(**tier):
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.server.launcher import BackgroundServer, build_app

    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", block_size=BS, num_gpu_blocks_override=POOL,
                                    max_model_len=POOL * BS, **tier))
    return BackgroundServer(build_app(engine)).start()


def replay(server) -> tuple[list[str], list[dict]]:
    """The conversations turn by turn, round robin (every conversation's turn 1, then turn 2, ...),
    one request at a time; the replies and the ledger after each."""
    history = [[{"role": "system", "content": PREAMBLE + s * 3}] for s in SYSTEMS]
    texts, ledgers = [], []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for turn in range(TURNS):
            for conversation in history:
                conversation.append({"role": "user", "content": QUESTIONS[turn]})
                r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": conversation,
                                                              "max_tokens": 16, "temperature": 0})
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["message"]["content"]
                conversation.append({"role": "assistant", "content": text})
                texts.append(text)
                ledgers.append(client.get("/ledger").json())
    return texts, ledgers


def hit_rate(ledger: dict) -> float:
    """Prefix-cache hits of both tiers over queried tokens."""
    offload = ledger["offload"]["hits"] if ledger["offload"] else 0
    return (ledger["prefix_cache_hits"] + offload) / ledger["prefix_cache_queries"]


def metrics(url: str) -> dict[tuple[str, str | None], float]:
    """kvledger's samples: (name, source label or None) -> value."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, s.labels.get("source")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("kvledger:") and "le" not in s.labels}


@pytest.fixture(scope="module")
def runs():
    """The replay without a tier, then with one (one server at a time), and the tier's server."""
    out = {}
    for name, tier in (("pool only", {}), ("with tier", {"kv_offloading_size": TIER_GIB})):
        server = _server(**tier)
        try:
            texts, ledgers = replay(server)
            idle = wait_idle(server)
            check_integrity(server)
            out[name] = (texts, ledgers, idle, metrics(server.url) if tier else None)
        finally:
            if tier:
                out["server"] = server  # kept for the dashboard test, stopped below
            else:
                server.stop()
    yield out
    out["server"].stop()


def test_the_tier_doubles_the_hit_rate_of_a_chat_replay_with_the_same_texts(runs):
    texts0, ledgers0, idle0, _ = runs["pool only"]
    texts1, ledgers1, idle1, _ = runs["with tier"]
    assert texts1 == texts0
    assert ledgers0[-1]["prefix_cache_queries"] == ledgers1[-1]["prefix_cache_queries"]  # the same prompts
    assert ledgers1[-1]["offload"]["hits"] > 0
    assert hit_rate(ledgers1[-1]) >= 2 * hit_rate(ledgers0[-1]) > 0, (hit_rate(ledgers1[-1]), hit_rate(ledgers0[-1]))
    assert idle0["blocks_allocated"] == idle1["blocks_allocated"] == 0
    capacity = ledgers1[-1]["offload"]["capacity_blocks"]
    assert all(0 <= ld["offload"]["stored_blocks"] <= capacity for ld in ledgers1)
    assert max(ld["offload"]["stored_blocks"] for ld in ledgers1) > POOL // 2  # the tier held what the pool let go
    assert idle1["offload"]["bytes"] == idle1["offload"]["stored_blocks"] * idle1["offload"]["block_bytes"]


def test_metrics_count_prompt_tokens_by_source_and_both_tiers_blocks(runs):
    _, _, idle, m = runs["with tier"]
    by_source = {s: m[("kvledger:prompt_tokens_by_source_total", s)]
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert by_source == idle["prompt_tokens_by_source"]
    assert sum(by_source.values()) == m[("kvledger:prefix_cache_queries_total", None)] == idle["prefix_cache_queries"]
    assert by_source["local_cache_hit"] == m[("kvledger:prefix_cache_hits_total", None)]
    assert by_source["external_kv_transfer"] == m[("kvledger:external_prefix_cache_hits_total", None)] > 0
    assert m[("kvledger:external_prefix_cache_queries_total", None)] == idle["offload"]["queries"]
    assert m[("kvledger:kv_offload_blocks_stored", None)] == idle["offload"]["stored_blocks"] > 0
    assert m[("kvledger:kv_offload_blocks_total", None)] == idle["offload"]["capacity_blocks"]
    assert m[("kvledger:kv_offload_bytes", None)] == idle["offload"]["bytes"]
    assert m[("kvledger:kv_offload_load_blocks_total", None)] * BS == by_source["external_kv_transfer"]
    assert m[("kvledger:kv_blocks_allocated", None)] == 0 and m[("kvledger:kv_blocks_total", None)] == POOL


def test_the_dashboard_charts_tier_2_against_its_capacity_and_hits_by_source(runs):
    from tests.test_dashboard import body_data, run_chromium

    server = runs["server"]
    data = body_data(run_chromium(server.url + "/dashboard", "--dump-dom"))
    idle = runs["with tier"][2]
    assert int(data["offload-capacity"]) == idle["offload"]["capacity_blocks"]
    assert 0 < int(data["max-offload-stored"]) <= int(data["offload-capacity"])
    assert int(data["sum-offload-hits"]) > 0 and int(data["sum-computed"]) > 0
    assert float(data["hit-rate"]) == pytest.approx(100 * hit_rate(idle))  # both tiers' hits, not the pool's alone
