"""Build an engine + app and run it under uvicorn, in the foreground or in a background thread.

``kvledger serve`` uses :func:`serve_async`; tests use :class:`BackgroundServer`, which runs
the same app on a free loopback port in a thread of the current process (so a test can look
at the engine itself: its ledger, its block pool).

Two things are added to uvicorn here. Slow senders: a connection must deliver a request's line
and headers within ``HEADER_TIMEOUT_S`` of connecting (or of its first byte, on a kept-alive
connection), else it gets a 408 and is closed; bodies have their own timeouts in the app.
Shutdown (SIGTERM, SIGINT, or ``stop()``): the listening socket closes at once, the requests in
flight get ``shutdown_timeout_s`` seconds to finish (vLLM's ``--shutdown-timeout``: 0 ends them
at once), those left end with an error (an SSE error event and ``[DONE]`` when streamed), and
the process exits normally (a second signal cuts the wait short).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import h11
import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvledger.errors import KVLedgerError
from kvledger.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig, create_app
from kvledger.server.async_engine import AsyncEngine
from kvledger.server.errors import error_body

DEFAULT_HOST = "127.0.0.1"
HEADER_TIMEOUT_S = 5.0  # a request's line and headers must arrive within this (seconds)
DEFAULT_SHUTDOWN_TIMEOUT_S = 0.0  # vLLM's default: end requests in flight at once
UVICORN_GRACE_S = 5.0  # after the drain, for responses already ended to reach their clients (seconds)

log = logging.getLogger("kvledger.server")


def build_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
    """The app around an already-built :class:`LLMEngine`. ``max_waiting`` (requests allowed to
    wait behind the ``max_num_seqs`` running ones) defaults to 4 x max_num_seqs."""
    names = [served_model_name or engine.model_name]
    if engine.model_name not in names:
        names.append(engine.model_name)
    aengine = AsyncEngine(engine, max_waiting=max_waiting or 4 * engine.config.max_num_seqs)
    config = ServerConfig(served_model_names=names, max_model_len=engine.max_model_len, api_key=api_key,
                          max_body_bytes=max_body_bytes, shutdown_timeout_s=shutdown_timeout_s)
    return create_app(aengine, config)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (its h11 implementation, the one it picks when httptools is not
    installed) with a deadline on request headers (``HEADER_TIMEOUT_S``).

    The clock starts when the connection opens, and on a kept-alive connection when the next
    request's first byte arrives; it stops once the request line and headers are complete. Past
    it the client gets a 408 and the connection closes, so a client trickling its headers holds
    nothing. (Idle kept-alive connections are closed by uvicorn's keep-alive timeout.)"""

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        client = "%s:%d" % self.client if self.client else "a client"
        log.info("408 %s sent no complete request headers within %g s; connection closed", client,
                 self.header_timeout_s)
        body = json.dumps(error_body(408, f"the request headers did not arrive within {self.header_timeout_s:g} s"
                                          )).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class KVLedgerServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring."""

    def __init__(self, config: uvicorn.Config, aengine: AsyncEngine, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.aengine = aengine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ended_by_shutdown = 0  # requests in flight that the shutdown ended unfinished

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT start the shutdown (a second one cuts the drain short). Unlike
        uvicorn's, these handlers do not re-raise the signal afterwards: the process exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.handle_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def handle_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.info("%s again: ending the requests in flight now", name)
            self.aengine.end_drain()
            return
        log.info("%s: shutting down; requests in flight get %g s to finish", name, self.shutdown_timeout_s)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first
            server.close()
        for sock in sockets or []:
            sock.close()
        self.ended_by_shutdown = await self.aengine.drain(self.shutdown_timeout_s)
        if self.ended_by_shutdown:
            log.info("shutdown: ended %d unfinished requests", self.ended_by_shutdown)
        await super().shutdown(sockets)


def _log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging, with kvledger's own loggers on the same stream at the same level."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["kvledger"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config


def _uvicorn_server(app, host: str, port: int, log_level: str, own_logging: bool = False) -> KVLedgerServer:
    kwargs: dict[str, Any] = {"log_config": _log_config(log_level)} if own_logging else {}
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            http=HeaderTimeoutProtocol, timeout_graceful_shutdown=UVICORN_GRACE_S, backlog=2048,
                            **kwargs)
    return KVLedgerServer(config, app.state.aengine, app.state.config.shutdown_timeout_s)


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


async def serve_async(app, sock: socket.socket, on_ready: Callable[[str], None],
                      log_level: str = "warning") -> KVLedgerServer:
    """Serve on a bound socket until stopped (SIGTERM, SIGINT); ``on_ready(url)`` runs once it
    accepts requests. Returns the stopped server (``ended_by_shutdown``)."""
    host = sock.getsockname()[0]
    server = _uvicorn_server(app, host, sock.getsockname()[1], log_level, own_logging=True)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task  # startup failed: raise its error
            raise KVLedgerError("the server did not start (see the log above)")
        await asyncio.sleep(0.05)
    on_ready(bound_url(server, host))
    await task
    return server


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
