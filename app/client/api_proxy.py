"""ApiProxy: the desktop app's API server switch. An OpenAI-compatible endpoint on a port the user
picks that forwards every request to the engine the app already uses (its local engine host, whose
port and token change when it restarts, or a remote backend), so switching it on loads no model a
second time.

    proxy = ApiProxy(backend.upstream, host="127.0.0.1", port=8000, api_key=None)
    proxy.start()               # raises OSError when the port is taken
    proxy.url                   # "http://127.0.0.1:8000/v1"
    proxy.stop()

Only the OpenAI routes (``GET /v1/models``, ``GET /v1/models/NAME``, ``POST /v1/chat/completions``,
``POST /v1/completions``) and ``GET /health`` are forwarded: Hearth's control routes (load, unload)
cannot be reached through it. The engine's own token is added on the way in; clients need
``api_key`` when one is set. On a loopback address the Host header must name a loopback host, so a
web page cannot reach the server through DNS rebinding.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Upstream = Callable[[], "tuple[str, str | None] | None"]  # (base URL, token) of the engine, None: no model
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_START_TIMEOUT_S = 10.0
_UPSTREAM_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


class ApiProxy:
    """One listening server; ``start`` / ``stop`` may be called once each."""

    def __init__(self, upstream: Upstream, *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None) -> None:
        self._upstream = upstream
        self.host = host
        self.port = port
        self._api_key = api_key or None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        shown = f"[{shown}]" if ":" in shown else shown
        return f"http://{shown}:{self.port}/v1"

    @property
    def loopback_only(self) -> bool:
        return _is_loopback(self.host)

    def start(self) -> None:
        """Bind (OSError if the port is taken) and serve on a background thread."""
        if not self.loopback_only and not self._api_key:
            raise ValueError("set an API key before serving beyond this machine")
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="hearth-api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise OSError(f"the API server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests ------------------------------------------------------------------------------
    def _app(self) -> Starlette:
        get, post = ["GET"], ["POST"]
        return Starlette(routes=[
            Route("/health", self._forward, methods=get), Route("/v1/models", self._forward, methods=get),
            Route("/v1/models/{name:path}", self._forward, methods=get),
            Route("/v1/chat/completions", self._forward, methods=post),
            Route("/v1/completions", self._forward, methods=post),
        ])

    async def _forward(self, request: Request) -> Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        upstream = self._upstream()
        if upstream is None:
            return _error(503, "no model is loaded in Hearth; pick one in the app", "model_not_loaded")
        base_url, token = upstream
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if token:
            headers["authorization"] = f"Bearer {token}"
        client = httpx.AsyncClient(timeout=_UPSTREAM_TIMEOUT)
        outgoing = client.build_request(request.method, f"{base_url}{request.url.path}", headers=headers,
                                        params=request.query_params, content=await request.body())
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.HTTPError as err:
            await client.aclose()
            return _error(502, f"Hearth's engine did not answer ({type(err).__name__})", "engine_unreachable")

        async def close() -> None:
            await answer.aclose()
            await client.aclose()

        media_type = answer.headers.get("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            # Closing the upstream stream when the client leaves makes the engine abort the request.
            return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, media_type=media_type,
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(close))
        content = await answer.aread()
        await close()
        return Response(content, status_code=answer.status_code, media_type=media_type)

    def _refusal(self, request: Request) -> Response | None:
        if self.loopback_only and _host_name(request.headers.get("host", "")) not in LOOPBACK_NAMES:
            return _error(403, "this server answers requests to localhost / 127.0.0.1 only", "host_not_allowed")
        if self._api_key:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self._api_key}".encode()):
                return _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "invalid_api_key")
        return None


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def _host_name(header: str) -> str:
    """The host of a Host header: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if os.name != "nt":  # POSIX: rebind right after a stop; on Windows the flag would share a busy port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
