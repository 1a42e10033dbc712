"""``kvledger serve``: the OpenAI-compatible server with metrics and the KV-ledger dashboard."""

from __future__ import annotations

import argparse
import os

from kvledger.cli.common import non_negative_float, positive_int, size


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvledger.cli.engine_args import add_engine_args

    p = subparsers.add_parser(
        "serve", help="serve a model over OpenAI's API, with /metrics and a live /dashboard",
        description="Serve a model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models), "
                    "with Prometheus metrics at /metrics and a live KV-ledger dashboard at /dashboard. "
                    "Prints the URL once it accepts requests.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as vLLM's 'vllm serve MODEL' takes it (same as --model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("KVLEDGER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVLEDGER_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the model's name)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=None,
                   help="requests allowed to wait behind the --max-num-seqs running ones; a burst into an idle "
                        "server accepts max-num-seqs + max-waiting-requests, the rest get 503 + Retry-After "
                        "(default 4 x --max-num-seqs)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=0.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are ended "
                        "with an error (default 0: at once)")
    p.add_argument("--max-request-body-bytes", type=size, default="4MiB",
                   help="largest request body accepted, e.g. 64KiB; beyond it 413 (default 4MiB)")
    fleet = p.add_argument_group("replicas (Ray Serve; needs kvledger[cluster])")
    fleet.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, metavar="N",
                       help="run N engine replicas (each with --tensor-parallel-size ranks) behind this one endpoint "
                            "on Ray Serve (default 1: no Ray)")
    fleet.add_argument("--router", default="prefix-affinity", choices=["prefix-affinity", "default"],
                       help="which replica takes a request: prefix-affinity (the longest shared run of leading block "
                            "hashes, within a load margin) or Ray Serve's default (default prefix-affinity)")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="write every engine step (batch, tokens, wall and model seconds) to FILE as JSON lines, "
                        "for 'kvledger calibrate --step-log FILE'")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log level (default warning)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvledger.cli.engine_args import engine_config_from_args
    from kvledger.engine.limits import check_before_loading
    from kvledger.errors import KVLedgerError
    from kvledger.spec.names import resolve_name

    if args.model_tag:
        if args.model and args.model != args.model_tag:
            raise KVLedgerError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise KVLedgerError(f"--port must be in 0..65535, got {args.port}")
    config = engine_config_from_args(args)
    check_before_loading(config)  # the model's name and --max-model-len, before Ray, the socket or the weights
    if args.served_model_name is None and config.model and resolve_name(config.model).kind == "hub id":
        args.served_model_name = config.model  # as vLLM serves ORG/NAME: under that name (and the model's own)
    if args.data_parallel_size > 1:
        return _run_fleet(args)
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.server.engine_thread import on_engine_thread
    from kvledger.server.launcher import bind_socket, build_app, serve_async

    sock = bind_socket(args.host, args.port)  # fail fast, before the model loads
    engine = on_engine_thread(LLMEngine, config)  # the thread that runs its steps
    app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                    max_waiting=args.max_waiting_requests, max_body_bytes=int(args.max_request_body_bytes),
                    shutdown_timeout_s=args.shutdown_timeout)
    name = app.state.config.served_model_names[0]
    ledger = engine.ledger()
    step_log = None
    if args.step_log:
        from kvledger.cli.calibrate import device_name
        from kvledger.engine.step_log import StepLog

        step_log = engine.step_records = StepLog(args.step_log, {
            "model": engine.spec.name, "hf_config": engine.hf_config, "device": device_name(engine),
            "dtype": str(engine.config.dtype),
            "kv_cache_dtype": engine.kv_cache_dtype, "block_size": ledger.block_size,
            "num_blocks": ledger.num_blocks, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "max_num_seqs": engine.config.max_num_seqs})

    tier = ""
    if ledger.offload is not None:
        off = ledger.offload
        where = f"files under {off.path}, {off.stored_blocks} found" if off.backend == "disk" else "host memory"
        tier = f"; KV offloading tier {off.capacity_blocks} blocks ({where})"

    def ready(url: str) -> None:
        print(f"kvledger serve: {name} on {url} (OpenAI API at {url}/v1, metrics at {url}/metrics, "
              f"dashboard at {url}/dashboard); KV pool {ledger.num_blocks} blocks x {ledger.block_size} tokens, "
              f"max-model-len {engine.max_model_len}{tier}", flush=True)

    try:
        server = asyncio.run(serve_async(app, sock, ready, log_level=args.log_level))
    finally:
        engine.shutdown()  # the tensor-parallel ranks, if any
        if step_log is not None:
            step_log.close()
    after = engine.ledger()
    print(f"kvledger serve: stopped; {server.ended_by_shutdown} requests in flight were ended by the shutdown; "
          f"KV blocks allocated {after.blocks_allocated} of {after.num_blocks}", flush=True)
    return 0


def _run_fleet(args: argparse.Namespace) -> int:
    """``--data-parallel-size N``: the replicas on Ray Serve until SIGINT/SIGTERM."""
    import dataclasses
    import signal
    import threading

    from kvledger.cluster import launch
    from kvledger.cli.engine_args import engine_config_from_args
    from kvledger.server.launcher import bind_socket

    launch.ray_serve()  # the install hint before anything starts
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # the port must be free (0: pick one) for Ray Serve's proxy
    port = sock.getsockname()[1]
    sock.close()
    app_kwargs = dict(served_model_name=args.served_model_name, api_key=args.api_key,
                      max_waiting=args.max_waiting_requests, max_body_bytes=int(args.max_request_body_bytes),
                      shutdown_timeout_s=args.shutdown_timeout)
    stop = threading.Event()
    try:
        fleet = launch.deploy(dataclasses.asdict(config), app_kwargs, args.data_parallel_size, args.router,
                              host=args.host, port=port)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start-up, which installs handlers of its own
            signal.signal(sig, lambda *_: stop.set())
        print(f"kvledger serve: {args.data_parallel_size} replicas of {config.model or 'smollm2-135m'} on {fleet.url} "
              f"(router {args.router}; OpenAI API at {fleet.url}/v1, metrics with a replica label at "
              f"{fleet.url}/metrics)", flush=True)
        stop.wait()
    finally:
        launch.shutdown()
    print("kvledger serve: stopped", flush=True)
    return 0
