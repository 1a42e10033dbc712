"""Build an engine + app and run it under uvicorn, in the foreground or in a background thread.

``kvledger serve`` uses :func:`serve_forever`; tests use :class:`BackgroundServer`, which runs
the same app on a free loopback port in a thread of the current process (so a test can look
at the engine itself: its ledger, its block pool).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable

import uvicorn

from kvledger.errors import KVLedgerError
from kvledger.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig, create_app
from kvledger.server.async_engine import AsyncEngine

DEFAULT_HOST = "127.0.0.1"


def build_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The app around an already-built :class:`LLMEngine`. ``max_waiting`` defaults to 4 x max_num_seqs."""
    names = [served_model_name or engine.model_name]
    if engine.model_name not in names:
        names.append(engine.model_name)
    aengine = AsyncEngine(engine, max_waiting=max_waiting or 4 * engine.config.max_num_seqs)
    config = ServerConfig(served_model_names=names, max_model_len=engine.max_model_len, api_key=api_key,
                          max_body_bytes=max_body_bytes)
    return create_app(aengine, config)


def _uvicorn_server(app, host: str, port: int, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, backlog=2048)
    return uvicorn.Server(config)


def bound_url(server: uvicorn.Server, host: str) -> str:
    port = server.servers[0].sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0 = a free port), or a one-line error if that is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise KVLedgerError(f"cannot listen on {host}:{port}: {err.strerror}; pick another --port or --host") from None
    return sock


async def serve_async(app, sock: socket.socket, on_ready: Callable[[str], None], log_level: str = "warning") -> None:
    """Serve on a bound socket until stopped; ``on_ready(url)`` runs once it accepts requests."""
    host = sock.getsockname()[0]
    server = _uvicorn_server(app, host, sock.getsockname()[1], log_level)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task  # startup failed: raise its error
            raise KVLedgerError("the server did not start (see the log above)")
        await asyncio.sleep(0.05)
    on_ready(bound_url(server, host))
    await task


class BackgroundServer:
    """Run an app on ``host:port`` (0 = a free port) in a daemon thread. ``url`` once started."""

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        self.server = _uvicorn_server(app, host, port, log_level)
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="kvledger-server", daemon=True)

    @property
    def aengine(self) -> AsyncEngine:
        return self.app.state.aengine

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = bound_url(self.server, self.host)
        return self

    def run(self, coro, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's event loop (e.g. ``aengine.call(...)``) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
