"""Prometheus metrics under vLLM's names with a ``kvledger:`` prefix.

The KV numbers are read from the engine's ledger snapshot (taken after every engine step)
when ``/metrics`` is scraped, so gauges and counters are exactly the engine's own numbers:

- ``kvledger:kv_cache_usage_perc``: blocks allocated over total blocks, a fraction in [0, 1]
  (vLLM's meaning: 1 means 100 percent).
- ``kvledger:kv_blocks_allocated``: blocks referenced by requests. Free blocks that only keep a
  cached prefix are ``kvledger:kv_blocks_cached_free``, not allocated.
- ``kvledger:kv_tokens_used`` / ``kvledger:kv_waste_tokens``: tokens with K/V in allocated
  blocks, and the empty slots of allocated blocks (tokens).
- ``kvledger:prefix_cache_queries_total`` / ``..._hits_total``: in tokens, as vLLM counts (the
  pool, tier 1). ``kvledger:external_prefix_cache_queries_total`` / ``..._hits_total``: the tokens
  then asked of the second KV tier and those loaded from it (vLLM's names for its connector).
- ``kvledger:prompt_tokens_by_source_total{source=...}``: admitted prompt tokens by vLLM's sources,
  ``local_compute``, ``local_cache_hit`` (the pool) and ``external_kv_transfer`` (the second tier).
- With a second KV tier (``--kv-offloading-size``): ``kvledger:kv_offload_blocks_stored`` and
  ``kvledger:kv_offload_blocks_total`` (tier 2's blocks against its capacity, beside tier 1's
  ``kv_blocks_allocated`` and ``kv_blocks_total``), ``kvledger:kv_offload_bytes`` (stored blocks x
  block bytes), vLLM's ``kvledger:kv_offload_cpu_cache_usage_perc`` (stored over capacity, a
  fraction) and ``kvledger:kv_offload_stores_skipped_total``, and the blocks copied each way
  (``kvledger:kv_offload_store_blocks_total``, ``..._load_blocks_total``, ``..._evicted_blocks_total``).

Latency histograms (seconds) are observed by the server per request: time to first token,
inter-token latency (per engine step that produced tokens) and end-to-end latency. Token
counters grow as tokens are produced, so a request that is aborted still counts what it used.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvledger.kvcache.manager import PROMPT_TOKEN_SOURCES

PREFIX = "kvledger:"

# Buckets follow vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_GAUGES = {
    # name: (ledger key or callable, help)
    "kv_cache_usage_perc": (lambda s: s["blocks_allocated"] / s["num_blocks"] if s["num_blocks"] else 0.0,
                            "KV-cache usage: blocks allocated over total blocks. 1 means 100 percent."),
    "kv_blocks_allocated": ("blocks_allocated", "KV blocks referenced by requests (cached free blocks excluded)."),
    "kv_blocks_total": ("num_blocks", "KV blocks in the pool (the capacity line)."),
    "kv_blocks_cached_free": ("blocks_cached_free", "Free KV blocks that still hold a cached prefix."),
    "kv_tokens_used": ("tokens_used", "Tokens whose K/V sit in allocated blocks."),
    "kv_waste_tokens": ("waste_tokens", "Empty token slots in allocated blocks."),
    "kv_cache_capacity_tokens": (lambda s: s["num_blocks"] * s["block_size"], "Tokens the whole pool holds."),
    "kv_cache_bytes": ("measured_bytes", "Bytes of the KV cache tensors (equals Eq 2.2's prediction)."),
    "num_requests_running": ("num_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled (engine queue and admission)."),
}
_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prefix-cache queries, in tokens."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prefix-cache hits, in tokens."),
    "external_prefix_cache_queries": (lambda s: (s["offload"] or {}).get("queries", 0),
                                      "Tokens asked of the second KV tier (past the pool's hit)."),
    "external_prefix_cache_hits": (lambda s: (s["offload"] or {}).get("hits", 0),
                                   "Tokens loaded from the second KV tier."),
    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed) for lack of KV blocks."),
}
_OFFLOAD_GAUGES = {
    # name: (key of the ledger's ``offload`` or callable, help)
    "kv_offload_blocks_stored": ("stored_blocks", "Blocks held in the second KV tier."),
    "kv_offload_blocks_total": ("capacity_blocks", "Blocks the second KV tier holds at most (its capacity line)."),
    "kv_offload_bytes": ("bytes", "Bytes of the blocks in the second KV tier (stored blocks x block bytes)."),
    "kv_offload_cpu_cache_usage_perc": (lambda o: o["stored_blocks"] / o["capacity_blocks"],
                                        "Second KV tier usage: stored blocks over capacity. 1 means 100 percent."),
}
_OFFLOAD_COUNTERS = {
    "kv_offload_stores_skipped": ("stores_skipped", "Stores into the second KV tier skipped (every slot pinned)."),
    "kv_offload_store_blocks": ("blocks_stored", "Blocks copied into the second KV tier."),
    "kv_offload_load_blocks": ("blocks_loaded", "Blocks copied from the second KV tier into the pool."),
    "kv_offload_evicted_blocks": ("blocks_evicted", "Blocks the second KV tier dropped to make room."),
}


class LedgerCollector(Collector):
    """Turns the latest ledger snapshot (a dict of :class:`KVLedger` fields) into metric families."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self._snapshot = snapshot
        self._labels = {"model_name": model_name}

    def _families(self, specs: dict, values: dict, kind: type) -> Iterator:
        """One family of ``kind`` per entry of ``specs`` (name -> (key of ``values`` or callable, help))."""
        for name, (key, doc) in specs.items():
            family = kind(PREFIX + name, doc, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), key(values) if callable(key) else values[key])
            yield family

    def collect(self) -> Iterator:
        snap = self._snapshot()
        yield from self._families(_GAUGES, snap, GaugeMetricFamily)
        yield from self._families(_COUNTERS, snap, CounterMetricFamily)
        by_source = CounterMetricFamily(PREFIX + "prompt_tokens_by_source", "Prompt tokens of admitted requests by "
                                        "source: computed, pool hit, loaded from the second KV tier.",
                                        labels=[*self._labels, "source"])
        for source in PROMPT_TOKEN_SOURCES:
            by_source.add_metric([*self._labels.values(), source], snap["prompt_tokens_by_source"].get(source, 0))
        yield by_source
        offload = snap["offload"]
        if offload is not None:
            yield from self._families(_OFFLOAD_GAUGES, offload, GaugeMetricFamily)
            yield from self._families(_OFFLOAD_COUNTERS, offload, CounterMetricFamily)


class ServerMetrics:
    """One registry per server (so several servers can live in one process, as in tests)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(LedgerCollector(snapshot, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (s).", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output steps of a request (s).",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish of a request (s).", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests whose prefill completed (aborted ones included).", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (aborted requests included).", labels,
                                         registry=self.registry).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
