"""The engine host's HTTP application (FastAPI): OpenAI-compatible ``/v1`` endpoints, Hearth's
``/health`` and ``/hearth/*`` endpoints, the optional API key, and OpenAI-style JSON errors.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status when
the request is at fault, or a 500 without traceback text (logged once, by
``security.UnexpectedErrors``) when the engine is. Requests pass ``security.RequestGuard``
(Host, Origin, JSON body, size limit) before any route runs.
A client that disconnects has its request aborted: streams check ``request.is_disconnected()``
while waiting and abort when the response ends early for any reason; non-streaming handlers abort
when they are cancelled or see the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from hearth.engine.api import ContextLengthError, Event, Finished, HearthError, RequestError, TokenDelta
from hearth.engine.server.host import BusyError, EngineHost, EventRelay, NoModelError, StillLoadingError
from hearth.engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseWriter,
    check_text,
    error_body,
    finish_error,
    sampling_fields,
    sse,
)
from hearth.engine.server.security import (
    AccessPolicy,
    LoadNotAllowedError,
    LoadPaths,
    RequestGuard,
    UnexpectedErrors,
)
from hearth.engine.server.tool_calls import parse_tool_calls
from hearth.engine.text.harmony import uses_harmony
from hearth.engine.text.markers import ReasoningDelta, ReasoningParser
from hearth.engine.text.reasoning import reasoning_parser_for, split_reasoning

_DISCONNECT_POLL_S = 0.5
_RETRY_AFTER_LOADING_S = 5


class LoadRequest(BaseModel):
    model: str
    served_name: str | None = None
    max_model_len: int | None = None


class DropRequest(BaseModel):
    conversation_id: str = Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")


class UnloadRequest(BaseModel):
    """``{}``: unloading takes no options, but a JSON body is still required (see RequestGuard)."""


class ClientGone(Exception):
    """The HTTP client went away before its request finished."""


class RequestStream:
    """Carries one request's engine events from the engine thread onto the asyncio loop (through
    the host's ``EventRelay``: a step's events arrive together)."""

    def __init__(self, relay: EventRelay) -> None:
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.sink = relay.sink(asyncio.get_running_loop(), self._queue.put_nowait)

    async def events(self, request: Request) -> AsyncIterator[Event]:
        """Events until ``Finished``, one at a time (see :meth:`batches`)."""
        async for batch in self.batches(request):
            for event in batch:
                yield event

    async def batches(self, request: Request) -> AsyncIterator[list[Event]]:
        """Events until ``Finished``, in lists of whatever has arrived (one event when the reader
        keeps up, several when it lags: a busy server then writes fewer, larger chunks); raises
        ClientGone if the client disconnects meanwhile (checked every ``_DISCONNECT_POLL_S``,
        whether or not events keep coming)."""
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        queue = self._queue
        while True:
            batch: list[Event] = []
            if queue.empty():
                with contextlib.suppress(TimeoutError):
                    batch.append(await asyncio.wait_for(queue.get(), max(next_check - time.monotonic(), 0.0)))
            while not queue.empty():
                batch.append(queue.get_nowait())
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    raise ClientGone()
                next_check = time.monotonic() + _DISCONNECT_POLL_S
            if not batch:
                continue
            done = next((i for i, e in enumerate(batch) if isinstance(e, Finished)), None)
            yield batch if done is None else batch[:done + 1]
            if done is not None:
                return


class StreamWithCleanup(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (done, disconnect, cancel)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ApiKeyMiddleware:
    """Answers 401 unless the request carries ``Authorization: Bearer <key>`` (the scheme in any case,
    as RFC 7235 has it; the key compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(key.lstrip(b" "), self._expected) and scheme.lower() == b"bearer"):
                body = error_body("missing or wrong API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(host: EngineHost, api_key: str | None = None, policy: AccessPolicy | None = None,
               load_paths: LoadPaths | None = None) -> FastAPI:
    """The ASGI app serving ``host``; ``api_key`` (if given) is required on every request.
    ``policy`` (default: loopback only) says which requests reach the routes at all; ``load_paths``
    (default: only the model loaded now) which folders ``/hearth/load`` may open."""
    if load_paths is None:
        load_paths = LoadPaths.of((), [host.model.path] if host.model else ())
    app = FastAPI(title="Hearth engine host", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    # The last added middleware runs first: the guard, then the key, then the error net.
    app.add_middleware(UnexpectedErrors)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestGuard, policy=policy or AccessPolicy())
    _add_hearth_routes(app, host, load_paths)
    _add_openai_routes(app, host)
    return app


# ---- errors --------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def hearth_error(_: Request, exc: HearthError) -> JSONResponse:
        headers = {"Retry-After": str(_RETRY_AFTER_LOADING_S)} if isinstance(exc, StillLoadingError) else None
        status = _status_of(exc)
        type_ = "invalid_request_error" if status < 500 else "server_error"  # no model: the server's state
        param = exc.param if isinstance(exc, RequestError) else None
        return JSONResponse(error_body(str(exc), type_, param), status_code=status, headers=headers)

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc), status_code=400)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HearthError, hearth_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _status_of(exc: HearthError) -> int:
    if isinstance(exc, NoModelError):
        return 503
    return 409 if isinstance(exc, BusyError) else 400


def _validation_body(exc: RequestValidationError) -> dict[str, Any]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_body(f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
                          code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if param is None:
        return error_body("the request body must be a JSON object (sent as Content-Type: application/json)",
                          code="invalid_json")
    message = first.get("msg", "invalid request")
    return error_body(f"{param}: {message}" if param else message, param=param, code="invalid_value")


# ---- Hearth endpoints ----------------------------------------------------------------------


def _add_hearth_routes(app: FastAPI, host: EngineHost, load_paths: LoadPaths) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        model = host.model
        return {"status": host.state, "model": model.name if model else None}

    @app.get("/hearth/stats")
    async def stats() -> dict[str, Any]:
        return await run_in_threadpool(host.stats)

    @app.post("/hearth/load")
    async def load(body: LoadRequest) -> dict[str, Any]:
        check_text(body.model_dump())
        try:
            folder = load_paths.resolve(body.model)
        except LoadNotAllowedError as err:
            raise APIError(403, str(err), param="model", code="model_not_allowed") from None
        model = await run_in_threadpool(host.load, folder, body.served_name, body.max_model_len)
        return {"model": model.name, "path": str(model.path), "max_model_len": model.max_model_len}

    @app.post("/hearth/tokenize")
    async def tokenize(body: ChatCompletionRequest) -> dict[str, Any]:
        """The exact prompt length of a chat-completions body (same template path as the answer)."""
        _check_model(host, body.model)
        count = await run_in_threadpool(host.count_prompt_tokens, body.message_dicts(), None, body.chat_options())
        model = host.model
        return {"model": body.model, "prompt_tokens": count, "max_model_len": model.max_model_len if model else None}

    @app.post("/hearth/cache/drop")
    async def drop(body: DropRequest) -> dict[str, Any]:
        """Delete a conversation's cached pages (GPU, RAM and disk)."""
        dropped = await run_in_threadpool(host.drop_conversation, body.conversation_id)
        return {"conversation_id": body.conversation_id, "dropped_pages": dropped}

    @app.post("/hearth/unload")
    async def unload(_: UnloadRequest) -> dict[str, Any]:
        return {"unloaded": await run_in_threadpool(host.unload)}


# ---- OpenAI endpoints ----------------------------------------------------------------------


def _add_openai_routes(app: FastAPI, host: EngineHost) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(host)] if host.model else []}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        _check_model(host, name)
        return _model_card(host)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_text(body.model_dump())
        _check_model(host, body.model)
        prompt = {"messages": body.message_dicts(), "chat_options": body.chat_options()}
        return await _serve(host, request, body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_text(body.model_dump())
        _check_model(host, body.model)
        prompt = body.prompt_kwargs()
        return await _serve(host, request, body, prompt, chat=False)


def _model_card(host: EngineHost) -> dict[str, Any]:
    model = host.model
    assert model is not None
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "hearth",
            "max_model_len": model.max_model_len}


def _check_model(host: EngineHost, name: str) -> None:
    model = host.require_model()
    if name not in (model.name, str(model.path), model.path.name):
        raise APIError(404, f"the model {name!r} does not exist here; this server serves {model.name!r}",
                       param="model", code="model_not_found")


async def _serve(host: EngineHost, request: Request, body: ChatCompletionRequest | CompletionRequest,
                 prompt: dict[str, Any], *, chat: bool) -> Any:
    sampling = sampling_fields(body)
    stream = RequestStream(host.relay)
    try:
        submission = await run_in_threadpool(
            lambda: host.submit(stream.sink, sampling=sampling, conversation_id=body.conversation_id, **prompt))
    except ContextLengthError as err:  # OpenAI's shape, which clients match to trim the history
        raise APIError(400, str(err), param="messages" if chat else "prompt", code="context_length_exceeded") from None
    writer = ResponseWriter(submission.request_id, host.model.name if host.model else body.model, chat)
    model_type = host.model.model_type if host.model else ""
    parsed = isinstance(body, ChatCompletionRequest) and body.reasoning_format == "parsed"
    new_parser = reasoning_parser_for(model_type, submission.prompt_tail) if parsed else None
    # Harmony's tool calls (commentary-channel messages) are not parsed: its templates get no tools.
    tools = isinstance(body, ChatCompletionRequest) and body.uses_tools and not uses_harmony(model_type)
    tools_model_type = model_type if tools else None
    if body.stream:
        chunks = _stream_chunks(stream, request, writer, body.include_usage, tools_model_type, new_parser)
        return StreamWithCleanup(chunks, on_close=lambda: host.abort(submission.request_id))
    try:
        finished = await _wait_finished(stream, request)
    finally:
        host.abort(submission.request_id)  # a no-op when it finished; stops it when we were cancelled
    error = finish_error(finished)
    if error is not None:
        raise error
    if not chat:
        return writer.response(finished)
    split = split_reasoning(new_parser(), finished.text) if new_parser else ReasoningDelta(content=finished.text)
    if tools_model_type is None:
        return writer.response(finished, split.content, split.reasoning)
    content, calls = parse_tool_calls(split.content, tools_model_type)
    return writer.response(finished, content, split.reasoning, calls)


async def _wait_finished(stream: RequestStream, request: Request) -> Finished:
    try:
        async for event in stream.events(request):
            if isinstance(event, Finished):
                return event
    except ClientGone:
        pass
    # The client left; nobody reads this answer.
    raise APIError(499, "the client closed the connection", code="client_closed")


async def _stream_chunks(stream: RequestStream, request: Request, writer: ResponseWriter,
                         include_usage: bool, tools_model_type: str | None = None,
                         new_parser: Callable[[], ReasoningParser] | None = None) -> AsyncIterator[bytes]:
    """SSE chunks. With ``new_parser`` each piece is split into reasoning and content as it comes.
    With tools offered the content is held back until the answer ends (a tool call is only known
    once complete), then sent as content and tool_calls chunks parsed from the whole answer, like a
    non-streamed one; reasoning still streams as it comes."""
    if writer.chat:
        yield sse(writer.chunk("", first=True))
    parser = new_parser() if new_parser else None
    try:
        async for batch in stream.batches(request):
            text = "".join(e.text for e in batch if isinstance(e, TokenDelta))
            event = batch[-1] if isinstance(batch[-1], Finished) else None
            split = parser.feed(text) if parser else ReasoningDelta(content=text)
            if event is not None and parser is not None:
                split += parser.finish()
            if tools_model_type is not None:
                split.content = ""
            if split.reasoning:
                yield sse(writer.chunk(split.content or None, reasoning=split.reasoning))
            elif split.content:
                yield writer.content_event(split.content)
            if event is None:
                continue
            error = finish_error(event)
            if error is not None:
                yield sse(error.body())
                break
            reason = event.reason
            if tools_model_type is not None:
                answer = split_reasoning(new_parser(), event.text).content if new_parser else event.text
                content, calls = parse_tool_calls(answer, tools_model_type)
                if content:
                    yield sse(writer.chunk(content))
                if calls:
                    yield sse(writer.tool_calls_chunk(calls))
                    reason = "tool_calls"
            yield sse(writer.chunk(None, reason))
            if include_usage:
                yield sse(writer.usage_chunk(event.stats))
    except ClientGone:
        return
    yield sse("[DONE]")
