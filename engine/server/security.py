"""What the engine host accepts, checked before any route runs (docs/security.md says why).

``RequestGuard`` is the outermost layer of the HTTP app. In this order, it refuses:

- a ``Host`` header naming anything but this machine's loopback names, the bound address (any IP
  address when bound to all interfaces) or a name added with ``--allowed-host``: a web page whose
  domain was re-pointed at 127.0.0.1 (DNS rebinding) still sends its own domain;
- a browser request from another origin (its ``Origin`` header) unless ``--cors-origin`` allows
  that origin; allowed origins get their CORS preflights answered and CORS headers on responses,
  the refusals below included (without them a browser shows the page an opaque network error);
- a POST whose body is not ``application/json``: browsers send form and text bodies across sites
  without asking, but a JSON body needs a preflight, which the origin check refuses;
- a body over the size limit (413), from ``Content-Length`` before reading any of it, otherwise as
  soon as the bytes received pass the limit, so a huge body costs neither time nor memory.

``LoadPaths`` decides which folders ``POST /hearth/load`` may open, and ``UnexpectedErrors`` turns
an exception no handler took into one logged traceback and a 500 without details.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hearth.engine.api import HearthError

logger = logging.getLogger("hearth.engine.server")

DEFAULT_MAX_BODY_MIB = 4.0  # a 160k-token prompt of English text is under 1 MiB of JSON
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})
_PREFLIGHT_MAX_AGE_S = 600


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine host's access flags (shared by ``python -m hearth.engine.server`` and ``hearth --cli serve``)."""
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host header names NAME (repeatable; "
                             "localhost and the bound address always work)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages from ORIGIN (e.g. https://chat.example) call the API "
                             "(repeatable; '*' allows every origin)")
    parser.add_argument("--allow-load-path", action="append", default=[], metavar="DIR",
                        help="let POST /hearth/load open model folders under DIR (repeatable)")
    parser.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY_MIB, metavar="MIB",
                        help=f"largest request body accepted (default: {DEFAULT_MAX_BODY_MIB:g} MiB)")
    parser.add_argument("--insecure-no-key", action="store_true",
                        help="allow binding a non-loopback address without an API key")


def is_loopback(host: str) -> bool:
    """True for names and addresses that only this machine can reach."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it may resolve to anything, so it is not trusted as local


# ---- the policy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AccessPolicy:
    """Which Host names, origins and body sizes the engine host accepts."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MIB * 2**20)

    def host_allowed(self, host_header: str) -> bool:
        name = _host_name(host_header)
        if name is None:
            return False
        if is_loopback(name) or name in {h.lower().rstrip(".") for h in self.allowed_hosts}:
            return True
        if self.bind_host in WILDCARD_ADDRESSES:
            # Bound to every interface: any address of this machine is a fair Host, and a
            # literal address cannot be rebound the way a domain name can.
            return _is_ip(name)
        return name == self.bind_host.lower().strip("[]")

    def cors_allowed(self, origin: str) -> bool:
        """Whether a page from ``origin`` (another origin than this server's) may call the API."""
        return "*" in self.cors_origins or _origin_key(origin) in {_origin_key(o) for o in self.cors_origins}


def _host_name(host_header: str) -> str | None:
    """The name in a Host header ("example.com:8000" -> "example.com", "[::1]:80" -> "::1")."""
    try:
        parts = urlsplit(f"//{host_header}")
        name = parts.hostname
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        return None
    return name.rstrip(".") if name else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_key(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


# ---- the middleware ------------------------------------------------------------------------


class RequestGuard:
    """Refuses requests the ``AccessPolicy`` does not accept (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            await _refuse(send, 403, f"this server does not answer to the host name {host!r} "
                                     "(add it with --allowed-host)", "host_not_allowed")
            return
        origin = headers.get("origin")
        cross_origin = origin is not None and not _same_origin(origin, host)
        if cross_origin and not self.policy.cors_allowed(origin):
            await _refuse(send, 403, f"requests from web pages at {origin!r} are refused "
                                     "(allow an origin with --cors-origin)", "origin_not_allowed")
            return
        if cross_origin and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _answer_preflight(send, origin, headers)
            return
        if cross_origin:
            send = _with_cors(send, origin)
        if scope["method"] == "POST" and _media_type(headers.get("content-type", "")) != "application/json":
            await _refuse(send, 415, "send the request body as JSON with 'Content-Type: application/json'",
                          "unsupported_media_type")
            return
        body = await self._read_body(headers, receive, send)
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, headers: dict[str, str], receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (before reading past the limit)."""
        limit = self.policy.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse_too_large(send, limit)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse_too_large(send, limit)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _same_origin(origin: str, host_header: str) -> bool:
    # The Host was already checked, so an Origin naming that same host:port is this server's own page.
    return urlsplit(origin).netloc.lower() == host_header.lower() and bool(host_header)


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the already-read body, then the client's later messages
    (the disconnect that streaming responses watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_cors(send: Send, origin: str) -> Send:
    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
        await send(message)

    return send_with_cors


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _answer_preflight(send: Send, origin: str, headers: dict[str, str]) -> None:
    allow = [*_cors_headers(origin), (b"access-control-allow-methods", b"GET, POST"),
             (b"access-control-max-age", str(_PREFLIGHT_MAX_AGE_S).encode())]
    requested = headers.get("access-control-request-headers")
    if requested:
        allow.append((b"access-control-allow-headers", requested.encode("latin-1")))
    await send({"type": "http.response.start", "status": 204, "headers": allow})
    await send({"type": "http.response.body", "body": b""})


async def _refuse_too_large(send: Send, limit: int) -> None:
    await _refuse(send, 413, f"the request body is larger than {limit / 2**20:g} MiB, the limit this "
                             "server accepts (--max-body-mib)", "request_too_large")


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    await _send_json(send, status, _error_body(message, "invalid_request_error", code))


def _error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    # NOTE: protocol.error_body's shape; not imported, as that module pulls pydantic into
    # the command line, which reads this module's flags.
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    # NOTE: a refusal may leave part of the body unread; the server then closes the connection.
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class UnexpectedErrors:
    """Logs an exception no handler took, once, and answers a 500 without details. (Starlette's
    own last-resort handler re-raises after answering, so the server logged every traceback twice.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unexpected error while serving %s %s", scope["method"], scope["path"])
            if not started:  # otherwise the response is cut short, which the client sees
                body = _error_body("internal error in the engine host (details are in its log)", "server_error")
                await _send_json(send, 500, body)


# ---- which folders /hearth/load may open ---------------------------------------------------


class LoadNotAllowedError(HearthError):
    """``/hearth/load`` was asked for a folder outside the ones it may open."""


@dataclass(frozen=True)
class LoadPaths:
    """Folders ``POST /hearth/load`` may open: ``models`` (the one the server started with) and any
    folder under ``roots``. Anything else gets one error, whether or not it exists, so the endpoint
    cannot be used to find out what is on the disk."""

    roots: tuple[Path, ...] = ()
    models: tuple[Path, ...] = ()

    @classmethod
    def of(cls, roots: Iterable[str | Path], models: Iterable[str | Path] = ()) -> LoadPaths:
        return cls(tuple(Path(r).expanduser().resolve() for r in roots),
                   tuple(Path(m).expanduser().resolve() for m in models))

    def resolve(self, requested: str) -> Path:
        """The folder to load for ``requested`` (a path, or a name relative to a root)."""
        given = Path(requested).expanduser()
        candidates = [given] if given.is_absolute() else [root / given for root in self.roots]
        allowed = [folder for folder in map(_resolved, candidates) if folder is not None and self._contains(folder)]
        if allowed:
            return next((folder for folder in allowed if folder.is_dir()), allowed[0])
        raise LoadNotAllowedError(f"cannot load {requested!r}: the server may load only the model it started "
                                  "with and folders under its --allow-load-path folders")

    def _contains(self, folder: Path) -> bool:
        return folder in self.models or any(folder.is_relative_to(root) for root in self.roots)


def _resolved(path: Path) -> Path | None:
    """``path`` with symlinks and ".." resolved (before any containment check), or None if it
    cannot be (a symlink loop, a NUL byte...)."""
    try:
        return path.resolve()
    except (OSError, ValueError):
        return None
