"""The HTTP face of the engine: OpenAI's API, Prometheus metrics and the ledger dashboard.

``create_app(aengine, ...)`` builds a FastAPI app around one :class:`AsyncEngine`.

Order of checks on ``/v1/*`` (each a one-line OpenAI error object naming the problem):
API key (401) -> body size (413) -> JSON and fields (400) -> model name (404) ->
a request larger than the whole KV pool (400, with the numbers) -> prompt + max_tokens
against ``max_model_len`` (400, with the numbers) -> the engine's own admission check
(400) -> the waiting queue (503 + ``Retry-After``). ``/metrics``, ``/health``, ``/ledger`` (the engine's
KV ledger as JSON) and ``/dashboard`` (where ``/`` redirects) need no key.

A request the engine accepted and then could not complete is a 500 naming the cause (503 while
the server shuts down); streamed, the same error object arrives as a last event before
``[DONE]``. A client that hangs up, streamed or not, is logged at info level as a 499 and its
request aborted; a body that stops arriving is cut off after ``BODY_IDLE_TIMEOUT_S`` without a
byte (``BODY_TIMEOUT_S`` in all) with a 408.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvledger.errors import KVLedgerError
from kvledger.server.async_engine import AsyncEngine, QueueFullError, RequestFailedError, RequestStream
from kvledger.server.errors import APIError, error_body, error_response
from kvledger.server.prometheus import ServerMetrics
from kvledger.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    DEFAULT_COMPLETION_MAX_TOKENS, ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse,
    DeltaMessage, ModelCard, ModelList, UsageInfo, new_id, now, parse_request,
)

log = logging.getLogger("kvledger.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: far above a max-length prompt as JSON
RETRY_AFTER_S = 1
BODY_IDLE_TIMEOUT_S = 5.0  # longest wait for the next piece of a request body (seconds)
BODY_TIMEOUT_S = 60.0  # longest time a whole request body may take to arrive (seconds)
VENDOR_FILES = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css",
                "uPlot.LICENSE.txt": "text/plain"}


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine. Sizes in bytes, lengths in tokens."""

    served_model_names: list[str]
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 0.0  # how long a shutdown lets requests in flight finish (seconds)
    created: int = field(default_factory=now)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready (or its body had arrived)."""


def log_client_gone(request_id: str | None, what: str) -> None:
    """The one log line of a client that hung up: info level, HTTP 499, no traceback."""
    log.info("499 client closed request%s: %s", f" {request_id}" if request_id else "", what)


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends (finished, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # the client hung up mid-write; on_close logs it
        finally:
            self._on_close()


def sse(obj: BaseModel) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {obj.model_dump_json()}\n\n"


class Serving:
    """Request handling shared by the two generation endpoints."""

    def __init__(self, aengine: AsyncEngine, config: ServerConfig) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.engine.tokenizer
        self.config = config

    # --- checks ----------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            what = "missing" if not header else "invalid"
            raise APIError(401, f"{what} API key: send 'Authorization: Bearer <key>' with the server's --api-key")

    async def read_body(self, request: Request) -> bytes:
        """The whole body, within ``max_body_bytes`` (else 413) and the body timeouts (else 408,
        and the connection closes). A client that hangs up before it has sent it all (a body
        shorter than its Content-Length, then a close) is :class:`ClientGone`."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes "
                                "(--max-request-body-bytes)")
        chunks, size = [], 0
        stream = request.stream()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TIMEOUT_S
        try:
            while True:
                wait = min(BODY_IDLE_TIMEOUT_S, deadline - loop.time())
                try:
                    async with asyncio.timeout(max(wait, 0.0)):
                        chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes (--max-request-body-bytes)")
                chunks.append(chunk)
        except TimeoutError:
            log.info("408 request body of %s: %d bytes after %.0f s; connection closed",
                     request.url.path, size, BODY_TIMEOUT_S - (deadline - loop.time()))
            raise APIError(408, f"the request body did not arrive in time (got {size} bytes; each part must come "
                                f"within {BODY_IDLE_TIMEOUT_S:g} s, the whole body within {BODY_TIMEOUT_S:g} s)",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            log_client_gone(None, f"hung up after {size} bytes of the request body to {request.url.path}")
            raise ClientGone() from None
        return b"".join(chunks)

    def check_model(self, name: str) -> str:
        if name not in self.config.served_model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.config.served_model_names)}", param="model")
        return name

    def check_length(self, num_prompt: int, max_tokens: int, what: str = "prompt") -> None:
        """Prompt plus completion within ``max_model_len``. The engine starts only with a pool of at
        least ``max_model_len`` tokens, so a request that passes also fits in the pool."""
        limit = self.config.max_model_len
        if num_prompt + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} for the "
                                "completion); shorten the prompt or lower max_tokens", param="max_tokens")

    def sampling_params(self, req: Any, max_tokens: int) -> Any:
        from kvledger.engine.sampling_params import SamplingParams

        try:
            return SamplingParams(**req.sampling_kwargs(max_tokens))
        except KVLedgerError as err:
            raise APIError(400, str(err), param=getattr(err, "param", None)) from None

    async def submit(self, request_id: str, ids: list[int], params: Any, received: float) -> RequestStream:
        """Hand the request to the engine; ``received``: when its handler began (perf_counter s)."""
        try:
            return await self.aengine.add(request_id, ids, params, arrival_time=received)
        except KVLedgerError as err:
            raise APIError(400, str(err), param=getattr(err, "param", None)) from None
        except QueueFullError as err:
            raise APIError(503, f"the server is overloaded: {err}",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RequestFailedError as err:
            raise APIError(err.status, str(err)) from None

    # --- answering ------------------------------------------------------------------------------

    def stream_response(self, stream: RequestStream, chunks: Callable[[Any], Iterator[str]],
                        usage: Callable[[int], str] | None, first: str | None = None) -> EngineStreamingResponse:
        """Server-sent events: ``first`` (if any), ``chunks(delta)`` for every engine delta, the
        ``usage(completion_tokens)`` event when asked for, then ``[DONE]``. A request the engine
        could not complete gets an error event (its status and cause) before ``[DONE]``; the
        request is aborted however the stream ends, and a client gone first is logged as a 499."""
        sent_all = False

        async def events() -> AsyncIterator[str]:
            nonlocal sent_all
            n_out = 0
            if first is not None:
                yield first
            try:
                async for d in stream:
                    n_out = d.num_output_tokens
                    for event in chunks(d):
                        yield event
            except RequestFailedError as err:
                yield _error_event(err)
            if usage is not None:
                yield usage(n_out)
            yield "data: [DONE]\n\n"
            sent_all = True  # resumed only once [DONE] was written

        def on_close() -> None:
            self.aengine.abort(stream.request_id)
            if not sent_all:
                log_client_gone(stream.request_id, f"hung up during the stream, after {stream.num_output_tokens} "
                                                   "tokens; aborted")

        return EngineStreamingResponse(events(), on_close)

    async def collect(self, stream: RequestStream, request: Request) -> tuple[str, int, str]:
        """All the text of a request, its completion tokens and finish reason. If the client
        disconnects first, the request is aborted and :class:`ClientGone` raised."""
        parts: list[str] = []
        result: dict[str, Any] = {"n": 0, "reason": "stop"}

        async def consume() -> None:
            async for d in stream:
                parts.append(d.text)
                result["n"] = d.num_output_tokens
                if d.finished:
                    result["reason"] = d.finish_reason or "stop"

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():  # the client left first (or this handler was cancelled)
                consumer.cancel()
                self.aengine.abort(stream.request_id)
            # let both finish before reading them (a task cancelled a moment ago is not done yet)
            await asyncio.gather(watcher, consumer, return_exceptions=True)
        if consumer.cancelled():
            log_client_gone(stream.request_id, f"hung up before the answer, after {result['n']} tokens; aborted")
            raise ClientGone()
        try:
            consumer.result()
        except RequestFailedError as err:
            raise APIError(err.status, str(err)) from None
        return "".join(parts), result["n"], result["reason"]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(num_prompt: int, num_output: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output)


def _error_event(err: RequestFailedError) -> str:
    return f"data: {json.dumps(error_body(err.status, str(err)))}\n\n"


def create_app(aengine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app; the engine loop starts and stops with it."""
    metrics = ServerMetrics(aengine.snapshot, config.served_model_names[0])
    aengine.metrics = metrics
    serving = Serving(aengine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await aengine.stop()

    app = FastAPI(title="kvledger", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aengine = aengine
    app.state.config = config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; logged, nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _query_error(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        name = str(first["loc"][-1]) if first.get("loc") else None
        message = f"invalid value for '{name}': {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(400, message, name), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}"
        return JSONResponse(error_body(err.status_code, message), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), status_code=500)

    # --- plain endpoints ----------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not aengine.is_running:
            return JSONResponse(error_body(503, "the engine loop is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        serving.check_auth(request)
        return ModelList(data=[ModelCard(id=name, created=config.created, root=aengine.engine.model_name,
                                         max_model_len=config.max_model_len)
                               for name in config.served_model_names])

    @app.get("/")
    async def root() -> RedirectResponse:
        """A browser pointed at the server lands on the dashboard."""
        return RedirectResponse("/dashboard", status_code=307)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_static("dashboard.html"))

    @app.get("/dashboard/ledger.json")
    async def ledger_json(since: float = 0.0) -> JSONResponse:
        snap = aengine.snapshot()
        samples = [s for s in aengine.history if s["t"] > since]
        return JSONResponse({"model": config.served_model_names[0], "num_blocks": snap["num_blocks"],
                             "block_size": snap["block_size"], "bytes_per_token": snap["bytes_per_token"],
                             "max_model_len": config.max_model_len, "latest": snap, "samples": samples})

    @app.get("/ledger")
    async def ledger() -> JSONResponse:
        """The engine's ledger after its latest step (:class:`~kvledger.engine.outputs.KVLedger`'s fields)."""
        return JSONResponse(aengine.snapshot())

    @app.get("/dashboard/vendor/{name}")
    async def vendor(name: str) -> Response:
        if name not in VENDOR_FILES:
            raise APIError(404, f"no such file: {name}")
        return Response(_static("vendor/" + name), media_type=VENDOR_FILES[name])

    # --- generation ---------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.perf_counter()
        serving.check_auth(request)
        req: CompletionRequest = parse_request(CompletionRequest, await serving.read_body(request))
        model = serving.check_model(req.model)
        prompt = req.single_prompt()
        ids = serving.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        serving.check_length(len(ids), max_tokens)
        params = serving.sampling_params(req, max_tokens)
        rid = new_id("cmpl")
        stream = await serving.submit(rid, ids, params, received)
        created = now()

        if req.stream:
            def chunks(d: Any) -> Iterator[str]:
                if d.text or d.finished:
                    yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[
                        CompletionChoice(text=d.text, finish_reason=d.finish_reason)]))

            def usage(n_out: int) -> str:
                return sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(len(ids), n_out)))

            return serving.stream_response(stream, chunks, usage if req.include_usage else None)

        text, n_out, reason = await serving.collect(stream, request)
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=model, choices=[CompletionChoice(text=text, finish_reason=reason)],
            usage=_usage(len(ids), n_out)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        serving.check_auth(request)
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await serving.read_body(request))
        model = serving.check_model(req.model)
        try:
            text = serving.tokenizer.apply_chat_template(req.conversation(), tokenize=False,
                                                         add_generation_prompt=req.add_generation_prompt)
        except Exception as err:  # the template rejected the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        ids = serving.tokenizer.encode(text, add_special_tokens=False)
        # OpenAI's default: as many tokens as the context has room for (at least one)
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, config.max_model_len - len(ids))
        serving.check_length(len(ids), max_tokens, what="messages")
        params = serving.sampling_params(req, max_tokens)
        rid = new_id("chatcmpl")
        stream = await serving.submit(rid, ids, params, received)
        created = now()

        if req.stream:
            def chunk(delta: DeltaMessage, reason: str | None = None) -> str:
                return sse(ChatCompletionChunk(id=rid, created=created, model=model,
                                               choices=[ChatChunkChoice(delta=delta, finish_reason=reason)]))

            def chunks(d: Any) -> Iterator[str]:
                if d.text:
                    yield chunk(DeltaMessage(content=d.text))
                if d.finished:
                    yield chunk(DeltaMessage(), d.finish_reason)

            def usage(n_out: int) -> str:
                return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                               usage=_usage(len(ids), n_out)))

            return serving.stream_response(stream, chunks, usage if req.include_usage else None,
                                           first=chunk(DeltaMessage(role="assistant", content="")))

        text, n_out, reason = await serving.collect(stream, request)
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=model,
            choices=[ChatChoice(message=ChatResponseMessage(content=text), finish_reason=reason)],
            usage=_usage(len(ids), n_out)).model_dump())

    return app


@functools.cache
def _static(name: str) -> bytes:
    return resources.files("kvledger.server").joinpath("static", name).read_bytes()
