"""The prefix-affinity request router for Ray Serve: the replica that recently took the longest run
of this prompt's leading block hashes, unless it is overloaded.

The ingress computes each prompt's chained block hashes (:func:`~kvledger.kvcache.block_pool.prefix_block_hashes`,
the keys the replicas' pools cache blocks under) and passes them as the ``block_hashes`` keyword of
the call; this router remembers, per replica, the hashes it sent there (the newest
``memory_blocks``, about a pool's worth) as its estimate of that replica's prefix cache. The choice
itself is the simulator's (:func:`kvledger.sim.routers.affinity_pick`): longest run among the
replicas whose load is within ``AFFINITY_LOAD_FACTOR`` x the least + ``AFFINITY_LOAD_SLACK``,
then the lighter load; with no run anywhere, the replica it has sent the fewest remembered blocks
(new prefixes spread evenly). Load is the requests this router sent to the replica that have not
completed (Ray Serve's ``on_request_routed`` and ``on_request_completed`` hooks): exact, where a
replica's periodic report would be up to a period stale. A call without hashes (``/metrics``,
``/v1/models``) goes to the least-loaded replica.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvledger.sim.routers import affinity_pick

DEFAULT_MEMORY_BLOCKS = 4096
"""Block hashes remembered per replica (about one pool's worth of blocks)."""


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: prefix affinity within a load margin (see the module)."""

    def initialize_state(self, memory_blocks: int = DEFAULT_MEMORY_BLOCKS, **kwargs: Any) -> None:
        self.memory_blocks = memory_blocks
        self._seen: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self._in_flight: dict[ReplicaID, set[str]] = {}  # internal request ids routed, not completed

    def _load(self, replica: RunningReplica) -> int:
        return len(self._in_flight.get(replica.replica_id, ()))

    def _run(self, replica_id: ReplicaID, hashes: list[bytes]) -> int:
        seen = self._seen.get(replica_id, {})
        run = 0
        for h in hashes:
            if h not in seen:
                break
            run += 1
        return run

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = (pending_request.kwargs.get("block_hashes") if pending_request is not None else None) or []
        candidate_replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)  # stable ties
        loads = [self._load(r) for r in candidate_replicas]
        runs = [self._run(r.replica_id, hashes) for r in candidate_replicas]
        held = [len(self._seen.get(r.replica_id, ())) for r in candidate_replicas]
        best = affinity_pick(runs, loads, held)
        rest = sorted((i for i in range(len(candidate_replicas)) if i != best), key=lambda i: loads[i])
        return [[candidate_replicas[best]]] + [[candidate_replicas[i]] for i in rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight.setdefault(replica_id, set()).add(pending_request.metadata.internal_request_id)
        hashes = pending_request.kwargs.get("block_hashes") or []
        seen = self._seen.setdefault(replica_id, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.memory_blocks:
            seen.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)  # also called for rejected ones
