"""Two SmolLM2 replicas on a local Ray Serve (2 CPUs, one cluster for the module), behind one
OpenAI endpoint: the official client streamed and not, completions and chat; then a workload of
requests sharing a few long prefixes, under the prefix-affinity router and under Ray Serve's
default, the hit rates read from the fleet's ``/metrics``.

The pool is sized so that one replica holds half the prefixes and no more: routed by affinity
each replica keeps its half cached; spread by the default router each replica sees every prefix,
and the interleaved order evicts most before they come back. The requests go one at a time, so
that which replica holds what depends on the router alone (two concurrent requests for a new
prefix would both compute it, and the copy would evict another). Routed at random, the default's
hit rate reaches 1/1.5 of affinity's in fewer than 1 run in 3,000 (a Monte Carlo of this order and
pool, with one more prefix's room than the pool has).
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.memory import release_freed_memory

ray = pytest.importorskip("ray")

PREFIXES, PREFIX_TOKENS, REQUESTS = 16, 128, 96
BLOCKS = 65  # per replica: its half of the prefixes (8 x 8 blocks) and the own block of the one request in flight
ENGINE = dict(model="smollm2-135m", dtype="float32", num_gpu_blocks_override=BLOCKS, max_num_batched_tokens=512,
              max_model_len=512, max_num_seqs=8, block_size=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet():
    from kvledger.cluster import launch
    from kvledger.cluster.deployment import NAMESPACE

    release_freed_memory()  # what the test process freed before: Ray's memory monitor counts it
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20)  # bytes: the fleet passes small objects only
    port = _free_port()
    started = launch.deploy(ENGINE, {}, 2, "prefix-affinity", port=port)
    yield started
    launch.shutdown()


def _dead_actors() -> str:
    """Every dead actor of the cluster and why it died (Ray's own words): what a failure here needs."""
    import psutil
    from ray._private.state import actors

    def why(cause) -> str:  # type: ignore[no-untyped-def]
        for _, context in cause.ListFields():  # the one context set: died, OOM-killed, failed to start, ...
            text = getattr(context, "error_message", "") or getattr(context, "formatted_exception_string", "")
            return " ".join(str(text or context).split())
        return "no cause given"

    dead = [f"{a['Name'] or a['ActorClassName']}: {why(a['DeathCause'])}" for a in actors().values()
            if a["State"] == "DEAD"]
    return (f"memory {psutil.virtual_memory().percent:.0f}% used; dead actors: "
            + ("; ".join(dead) if dead else "none"))


@pytest.fixture(autouse=True)
def _say_what_died():  # type: ignore[no-untyped-def]
    """After each test, the cluster's dead actors: printed, so a failing test's report shows them."""
    yield
    print(_dead_actors())


def _metrics(url: str) -> dict[tuple[str, str], float]:
    import httpx

    from kvledger.cluster.deployment import read_fleet_metrics

    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200, f"{response.text}; {_dead_actors()}"
    return read_fleet_metrics(response.text)


def _wait_published(url: str, replicas: int, done) -> dict[tuple[str, str], float]:  # type: ignore[no-untyped-def]
    """The fleet's metrics once every replica has published a state for which ``done`` holds."""
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(url)
        names = {r for (_, r) in m if r != "fleet"}
        if len(names) == replicas and done(m, names):
            return m
        assert time.monotonic() < deadline, f"replicas never published a settled state: {sorted(names)}"
        time.sleep(0.5)


def test_openai_client_streamed_and_not(fleet):
    from openai import OpenAI

    client = OpenAI(base_url=fleet.url + "/v1", api_key="none")
    done = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=5,
                                     temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert streamed == done.choices[0].text
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=6, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=6, temperature=0, stream=True) if c.choices]
    assert chat.choices[0].message.content and "".join(pieces) == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data][0] == "smollm2-135m"


def _hit_rate(url: str) -> tuple[float, dict[tuple[str, str], float]]:
    """Run the shared-prefix workload; the fleet's prefix-cache hit rate (tokens) it added."""
    import httpx

    from kvledger.workload.shared_prefix import shared_prefix_workload

    before = _wait_published(url, 2, lambda m, names: True)
    prompts = shared_prefix_workload(PREFIXES, PREFIX_TOKENS, REQUESTS).prompts

    def send(prompt: list[int]) -> None:
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, f"{r.status_code} {r.text}; {_dead_actors()}"

    for p in prompts:  # one at a time: the hit rate is the router's, not the race's
        send(p)
    queried = sum(len(p) for p in prompts)  # tokens: each prompt is looked up once (nothing is preempted)
    after = _wait_published(url, 2, lambda m, names: all(
        m[("kvledger:num_requests_running", r)] == 0 and m[("kvledger:kv_blocks_allocated", r)] == 0 for r in names)
        and m[("kvledger:prefix_cache_queries_total", "fleet")]
        - before.get(("kvledger:prefix_cache_queries_total", "fleet"), 0) >= queried)  # published after the last
    hits = after[("kvledger:prefix_cache_hits_total", "fleet")] - before.get(("kvledger:prefix_cache_hits_total", "fleet"), 0)
    queries = (after[("kvledger:prefix_cache_queries_total", "fleet")]
               - before.get(("kvledger:prefix_cache_queries_total", "fleet"), 0))
    return hits / queries, after


@pytest.mark.slow
def test_prefix_affinity_keeps_the_hit_rate_the_default_router_loses(fleet):
    from kvledger.cluster import launch

    port = int(fleet.url.rsplit(":", 1)[1])
    affinity, after = _hit_rate(fleet.url)
    for r in {r for (_, r) in after if r != "fleet"}:  # every block back in each replica's pool
        assert after[("kvledger:kv_blocks_allocated", r)] == 0
        assert after[("kvledger:kv_blocks_total", r)] == BLOCKS
    import httpx

    pools = httpx.get(fleet.url + "/fleet/ledger", timeout=30).json()  # the same pools, ledger by ledger
    assert sorted(p["replica"] for p in pools) == sorted({r for (_, r) in after if r != "fleet"})
    assert all(p["blocks_allocated"] == 0 and p["num_blocks"] == BLOCKS and p["prefix_cache_hits"] > 0 for p in pools), pools
    launch.deploy(ENGINE, {}, 2, "default", port=port)
    default, after = _hit_rate(fleet.url)
    print(f"prefix-cache hit rate: prefix-affinity {affinity:.3f}, default {default:.3f}")
    assert affinity >= 1.5 * default and affinity > 0.5, (affinity, default)
    for r in {r for (_, r) in after if r != "fleet"}:
        assert after[("kvledger:kv_blocks_allocated", r)] == 0


def test_a_replica_that_dies_mid_request_answers_503_with_retry_after(fleet):
    """Last in the module: it kills a replica (Ray Serve restarts it)."""
    import threading

    import httpx

    result: dict = {}

    def long_request() -> None:
        result["response"] = httpx.post(fleet.url + "/v1/completions", timeout=60, json={
            "model": "smollm2-135m", "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True})

    client = threading.Thread(target=long_request)
    client.start()
    busy = _wait_published(fleet.url, 2, lambda m, names: any(m[("kvledger:num_requests_running", r)] for r in names))
    (victim,) = [r for (n, r), v in busy.items() if n == "kvledger:num_requests_running" and r != "fleet" and v]
    start = time.monotonic()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::kvledger#engine#{victim}", namespace="serve"), no_restart=False)
    client.join(30)
    assert not client.is_alive(), "the request hung after its replica died"
    response = result["response"]
    assert response.status_code == 503 and int(response.headers["Retry-After"]) > 0, response.text
    assert "unavailable" in response.json()["error"]["message"] and time.monotonic() - start < 30
