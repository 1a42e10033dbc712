"""Routers of a fleet of identical replicas: which replica a new request goes to.

* ``round-robin``: replica ``i mod N`` for the ``i``-th request.
* ``least-loaded``: the fewest running + waiting requests (lowest index on ties).
* ``prefix-affinity``: the replica whose prefix cache holds the longest run of the request's
  leading block hashes, unless that replica is overloaded: more than
  ``AFFINITY_LOAD_FACTOR`` x the least load + ``AFFINITY_LOAD_SLACK`` requests. Among the
  replicas that are not, the longest run wins, then the lighter load; with no hit anywhere it
  goes to the replica whose cache holds the fewest blocks (so new prefixes spread evenly), the
  lighter load breaking ties.
"""

from __future__ import annotations

import itertools

from kvledger.kvcache.block_pool import BlockPool
from kvledger.kvcache.manager import KVCacheManager
from kvledger.errors import KVLedgerError
from kvledger.sim.driver import Replica, Router
from kvledger.sim.requests import SimRequest

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")
AFFINITY_LOAD_FACTOR = 1.5
"""prefix-affinity: a replica with more than this times the least load (plus the slack) is overloaded."""
AFFINITY_LOAD_SLACK = 4
"""prefix-affinity: requests of load any replica may carry above the least before it counts as overloaded."""


def least_loaded(request: SimRequest, replicas: list[Replica]) -> int:
    return min(range(len(replicas)), key=lambda r: replicas[r].load)


def make_router(name: str, block_size: int) -> Router:
    """The router called ``name`` (one of :data:`ROUTERS`)."""
    if name == "round-robin":
        counter = itertools.count()
        return lambda request, replicas: next(counter) % len(replicas)
    if name == "least-loaded":
        return least_loaded
    if name == "prefix-affinity":
        return PrefixAffinity(block_size)
    raise KVLedgerError(f"unknown router {name!r}; use one of {', '.join(ROUTERS)}")


class PrefixAffinity:
    """Longest cached run of leading block hashes, within a load margin (see the module)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._kv = KVCacheManager(BlockPool(1), block_size)  # its hashing only: one chaining, the engine's

    def hashes(self, request: SimRequest) -> list:
        """The chained hashes of the request's full prompt blocks, as every replica's cache keys them."""
        hashes = self._kv._block_hashes(request, request.prompt_len // self.block_size)
        self._kv.forget(request.request_id)
        return hashes

    def __call__(self, request: SimRequest, replicas: list[Replica]) -> int:
        if len(replicas) == 1:
            return 0
        hashes = self.hashes(request) if request.hash_ids or request.prompt_token_ids else []
        runs = []
        for replica in replicas:
            hits = 0
            for h in hashes:
                if replica.pool.lookup(h) is None:
                    break
                hits += 1
            runs.append(hits)
        held = [r.pool.num_blocks - r.pool.num_free_blocks + r.pool.num_cached_free_blocks for r in replicas]
        return affinity_pick(runs, [r.load for r in replicas], held)


def affinity_pick(runs: list[int], loads: list[int], held: list[int] | None = None) -> int:
    """prefix-affinity's choice (see the module), shared by the simulator's fleet and the Ray Serve
    router (:mod:`kvledger.cluster.router`): the index of the replica with the longest cached run
    ``runs[i]`` (leading blocks) among those not overloaded, then the lighter ``loads[i]``
    (running + waiting requests), then the lower index. With no run anywhere and ``held`` (blocks
    of content each replica caches), the one holding least: new prefixes spread so that each
    replica's share of them fits its pool."""
    limit = min(loads) * AFFINITY_LOAD_FACTOR + AFFINITY_LOAD_SLACK
    if held is not None and not any(runs):
        keys = [(held[r], load, r) for r, load in enumerate(loads) if load <= limit]
    else:
        keys = [(-run, load, r) for r, (run, load) in enumerate(zip(runs, loads)) if load <= limit]
    return min(keys)[2]
