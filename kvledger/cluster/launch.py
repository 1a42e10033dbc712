"""Start and stop a fleet: a local Ray (or the one ``RAY_ADDRESS`` names), Ray Serve's HTTP proxy on
``host:port``, the metrics board, the N engine replicas and the ingress.

``ROUTERS`` are the choices of ``--router``: ``prefix-affinity`` (:mod:`kvledger.cluster.router`)
and ``default``, Ray Serve's own (power of two choices over queue lengths), for comparison.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

from kvledger.errors import KVLedgerError

ROUTERS = ("prefix-affinity", "default")
APP_NAME = "kvledger"
_board: Any = None


def ray_serve() -> tuple[Any, Any]:
    """``(ray, ray.serve)``, or a KVLedgerError saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise KVLedgerError("--data-parallel-size needs Ray Serve: pip install 'kvledger[cluster]'") from None
    return ray, serve


@dataclass
class Fleet:
    """A running fleet's address and size."""

    url: str
    num_replicas: int
    router: str


def deploy(engine_kwargs: dict[str, Any], app_kwargs: dict[str, Any], num_replicas: int, router: str,
           host: str = "127.0.0.1", port: int = 8000, cpus_per_replica: float = 0) -> Fleet:
    """Deploy (or redeploy, replacing the replicas and their pools) the fleet on the Ray this
    process is connected to (connecting to a local one if none); returns once it serves."""
    if router not in ROUTERS:
        raise KVLedgerError(f"--router {router!r} is not one of {', '.join(ROUTERS)}")
    ray, serve = ray_serve()
    from ray.serve.config import RequestRouterConfig

    from kvledger.cluster.deployment import BOARD_NAME, NAMESPACE, EngineReplica, Ingress, MetricsBoard
    from kvledger.cluster.router import PrefixAffinityRouter
    from kvledger.config import default_block_size
    from kvledger.engine.model_runner import pick_device

    if not ray.is_initialized():
        ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    global _board  # created once and held here: Ray ends an actor once its creator's handle is gone
    if _board is None:
        _board = ray.remote(num_cpus=0)(MetricsBoard).options(name=BOARD_NAME, namespace=NAMESPACE).remote()
    board = _board
    routing = (RequestRouterConfig(request_router_class=PrefixAffinityRouter) if router == "prefix-affinity"
               else RequestRouterConfig())
    max_ongoing = int(engine_kwargs.get("max_num_seqs", 256)) + int(app_kwargs.get("max_waiting") or 0) + 64
    replicas = serve.deployment(EngineReplica, name="engine", num_replicas=num_replicas,
                                ray_actor_options={"num_cpus": cpus_per_replica}, max_ongoing_requests=max_ongoing,
                                request_router_config=routing, health_check_period_s=2, health_check_timeout_s=30,
                                graceful_shutdown_timeout_s=5)
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4 * max_ongoing)
    import os

    threads = max(1, (os.cpu_count() or 1) // num_replicas)
    # the router hashes prompts in the replicas' blocks: the size they will take when none is given
    block_size = engine_kwargs.get("block_size") or default_block_size(pick_device(engine_kwargs.get("device") or "auto").type)
    app = ingress.bind(replicas.bind(engine_kwargs, app_kwargs, threads), engine_kwargs.get("model"),
                       engine_kwargs.get("tokenizer"), block_size, num_replicas)
    serve.run(app, name=APP_NAME, route_prefix="/")
    ray.get(board.clear.remote())  # the replicas a redeployment replaced publish no more
    return Fleet(f"http://{host}:{port}", num_replicas, router)


def shutdown() -> None:
    """Stop Serve (replicas, ingress, proxy) and this process's Ray. What Ray prints meanwhile goes
    to stderr, so that stdout carries the CLI's own lines only: Ray's driver prints the errors its
    raylet reports on stdout, in colour, and Serve's own shutdown makes one (it kills the controller
    while that actor's ``graceful_shutdown`` task is still retrying)."""
    global _board
    ray, serve = ray_serve()
    _board = None
    if ray.is_initialized():
        with contextlib.redirect_stdout(sys.stderr):
            serve.shutdown()
            ray.shutdown()
