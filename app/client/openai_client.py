"""ChatClient: a small, Qt-free client for OpenAI-compatible servers (httpx).

Talks to Hearth's engine host and to any other OpenAI-compatible server (vLLM, SGLang, LM Studio,
llama.cpp). Hearth-only endpoints degrade gracefully elsewhere: ``stats()`` returns ``{}``,
``count_tokens()`` returns None and ``health()`` falls back to ``GET /v1/models``.

    client = ChatClient("http://127.0.0.1:8000", api_key="...")
    for chunk in client.stream_chat(client.models()[0], [{"role": "user", "content": "Hi"}]):
        print(chunk.text, end="")

Closing a ``stream_chat`` iterator early (``close()``, ``break`` in a ``with contextlib.closing``,
or garbage collection) closes the HTTP stream, and the server aborts the request. Errors raise
``ClientError`` carrying the server's message and a ``kind`` (``ErrorKind``: refused, DNS, TLS, timeout,
API key, a path that is not an OpenAI API, an answer that is not JSON...); a connection that drops
mid-answer raises ``EngineDiedError``.

``probe_models(url, api_key)`` is the "test connection" of a remote backend: ``GET {root}/v1/models``
with a short timeout, where the root is ``url`` without a trailing ``/v1`` (so ``http://host:8000``
and ``http://host:8000/v1`` both ask ``http://host:8000/v1/models``), as every request here does.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from hearth.engine.api import HearthError

DEFAULT_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 5.0  # a "test connection": a LAN or cloud server answers /v1/models well within it
_CONNECT_TIMEOUT_S = 5.0

# Why a request failed, for callers that say more than the message (the Settings tab's probe):
# refused: nothing listens at the address; dns: the host name does not resolve; tls: the https
# handshake failed (certificate, or a plain-http server); timeout: no answer in time; connect: another
# connection failure; auth: 401/403 (the API key is missing or refused); not_found: 404; http: another
# error status; not_json: a 2xx answer that is not JSON; not_openai: JSON without what the API returns.
ErrorKind = Literal["refused", "dns", "tls", "timeout", "connect", "auth", "not_found", "http", "not_json",
                    "not_openai"]


class ClientError(HearthError):
    """A request failed: the server said no (``status`` set) or could not be reached (``kind`` says why)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind


class EngineDiedError(ClientError):
    """The server went away in the middle of a request (crashed, killed or stopped)."""


@dataclass(frozen=True)
class ChatChunk:
    """A piece of an answer. The last chunk of a stream has ``finish_reason`` ("stop", "length")
    and, when the server reports it, ``usage`` (prompt_tokens, completion_tokens, total_tokens).
    ``reasoning`` carries the thinking of servers that split it out (``reasoning_content``, as
    Hearth, vLLM and llama.cpp send it, or ``reasoning``, as some newer servers do)."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    reasoning: str = ""


class ChatClient:
    """Blocking client for one OpenAI-compatible base URL (with or without the ``/v1`` suffix)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = _root_url(base_url)
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, _CONNECT_TIMEOUT_S)))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- OpenAI endpoints ------------------------------------------------------------------

    def models(self) -> list[str]:
        """Ids of the models the server offers. Raises ``ClientError`` when ``/v1/models`` is missing
        (kind "not_found") or its answer is not an OpenAI model list ("not_json", "not_openai")."""
        url = f"{self.base_url}/v1/models"
        try:
            data = self._json("GET", "/v1/models")
        except ClientError as err:
            if err.status == 404:
                raise ClientError(f"{url} does not exist (HTTP 404): the address is not an OpenAI-compatible API; "
                                  "give the API's base, such as http://host:8000/v1", 404, err.code,
                                  "not_found") from None
            raise
        entries = data.get("data")
        if not isinstance(entries, list):
            raise ClientError(f"{url} answered JSON without a model list (no \"data\" array): the server is not "
                              "OpenAI-compatible, or the address points at another API", kind="not_openai")
        return [str(m["id"]) for m in entries if isinstance(m, dict) and "id" in m]

    def stream_chat(self, model: str, messages: Sequence[dict[str, Any]], *, conversation_id: str | None = None,
                    **sampling: Any) -> Iterator[ChatChunk]:
        """Stream an answer. ``sampling``: max_tokens, temperature, top_p, top_k, min_p, seed, stop,
        presence_penalty, frequency_penalty, ... (sent as given; None values are left out).
        ``conversation_id`` (Hearth engine hosts only) names the chat, whose cache the host then
        keeps for its next turn (``drop_conversation`` deletes it)."""
        body = _body(model, messages, sampling)
        if conversation_id is not None:
            body["hearth"] = {"conversation_id": conversation_id}
        body.update(stream=True, stream_options={"include_usage": True})
        return self._stream(body)

    def complete_chat(self, model: str, messages: Sequence[dict[str, Any]], **sampling: Any) -> ChatChunk:
        """The whole answer in one response."""
        data = self._json("POST", "/v1/chat/completions", json=_body(model, messages, sampling))
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        return ChatChunk(message.get("content") or "", choice.get("finish_reason"), data.get("usage"),
                         _reasoning_of(message))

    # ---- Hearth endpoints ------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers (Hearth's /health, else /v1/models); never raises."""
        for path in ("/health", "/v1/models"):
            try:
                response = self._http.get(path, timeout=_CONNECT_TIMEOUT_S)
            except httpx.HTTPError:
                return False
            if response.status_code != 404:
                return response.status_code == 200
        return False

    def stats(self) -> dict[str, Any]:
        """Hearth's engine statistics; ``{}`` from servers without /hearth/stats."""
        try:
            return self._json("GET", "/hearth/stats")
        except ClientError as err:
            if err.status in (404, 405):
                return {}
            raise

    def count_tokens(self, model: str, messages: Sequence[dict[str, Any]]) -> int | None:
        """The exact prompt length of ``messages`` (Hearth's ``/hearth/tokenize``: the server's own
        tokenizer and chat template); None from servers that do not offer it."""
        try:
            data = self._json("POST", "/hearth/tokenize", json={"model": model, "messages": list(messages)})
        except ClientError as err:
            if err.status in (404, 405):
                return None
            raise
        count = data.get("prompt_tokens")
        return int(count) if isinstance(count, int) and not isinstance(count, bool) else None

    def drop_conversation(self, conversation_id: str) -> int:
        """Delete a chat's cached pages on the engine host (GPU, RAM, disk); returns how many."""
        data = self._hearth_only("POST", "/hearth/cache/drop", {"conversation_id": conversation_id})
        return int(data.get("dropped_pages") or 0)

    def load_model(self, path: str, served_name: str | None = None, max_model_len: int | None = None) -> dict[str, Any]:
        """Ask a Hearth engine host to load the model folder ``path`` (replacing its current one)."""
        body = {"model": path, "served_name": served_name, "max_model_len": max_model_len}
        return self._hearth_only("POST", "/hearth/load", {k: v for k, v in body.items() if v is not None})

    def unload(self) -> dict[str, Any]:
        """Ask a Hearth engine host to drop its model and free the memory."""
        return self._hearth_only("POST", "/hearth/unload", {})

    # ---- plumbing --------------------------------------------------------------------------

    def _hearth_only(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._json(method, path, json=body)
        except ClientError as err:
            if err.status in (404, 405):
                raise ClientError(f"{self.base_url} is not a Hearth engine host ({path} is missing)",
                                  err.status) from None
            raise

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise self._transport_error(err, started=False) from None
        _raise_for_status(response)
        try:
            data = response.json()
        except ValueError:
            content_type = response.headers.get("content-type", "").split(";")[0].strip() or "no content type"
            raise ClientError(f"{self.base_url}{path} answered with something that is not JSON ({content_type}): is "
                              "the address a web page or another kind of server rather than an OpenAI-compatible "
                              "API?", kind="not_json") from None
        return data if isinstance(data, dict) else {"data": data}

    def _stream(self, body: dict[str, Any]) -> Iterator[ChatChunk]:
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response)
                yield from _parse_stream(response)
        except httpx.HTTPError as err:
            raise self._transport_error(err, started=True) from None

    def _transport_error(self, err: httpx.HTTPError, started: bool) -> ClientError:
        if isinstance(err, httpx.ConnectError):
            return _connect_error(self.base_url, err)
        if isinstance(err, httpx.TimeoutException):
            return ClientError(f"{self.base_url} did not answer in time ({type(err).__name__}): the server may be "
                               "busy, or a firewall drops the connection", kind="timeout")
        if started or isinstance(err, httpx.RemoteProtocolError | httpx.ReadError):
            return EngineDiedError(f"the connection to {self.base_url} dropped mid-answer "
                                   f"({_reason(err)}); the engine may have stopped or crashed")
        return ClientError(f"request to {self.base_url} failed: {_reason(err)}")


def probe_models(base_url: str, api_key: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """The ids of the models the OpenAI-compatible server at ``base_url`` serves, asked within
    ``timeout`` seconds; raises ``ClientError`` saying why not (its ``kind`` for the category)."""
    with ChatClient(base_url, api_key=api_key, timeout=timeout) as client:
        return client.models()


def _connect_error(base_url: str, err: httpx.ConnectError) -> ClientError:
    """What a failed connection means, from the OS or TLS error underneath httpx's."""
    cause = _root_cause(err)
    reason = _reason(err)
    if isinstance(cause, ConnectionRefusedError):
        return ClientError(f"cannot connect to {base_url}: nothing is listening there (connection refused); is the "
                           "server running, and are the host and port right?", kind="refused")
    if isinstance(cause, socket.gaierror):
        host = httpx.URL(base_url).host
        return ClientError(f"cannot connect to {base_url}: the host name {host} was not found ({reason}); check "
                           "the address", kind="dns")
    if isinstance(cause, ssl.SSLCertVerificationError):
        return ClientError(f"cannot connect to {base_url}: its TLS certificate is not trusted ({cause.verify_message}"
                           "); a self-signed certificate must be trusted by this machine first", kind="tls")
    if isinstance(cause, ssl.SSLError):
        return ClientError(f"cannot connect to {base_url}: the TLS (https) handshake failed ({reason}); if the "
                           "server speaks plain http, use an http:// address", kind="tls")
    return ClientError(f"cannot connect to {base_url} ({reason}); is the server running?", kind="connect")


def _root_cause(err: BaseException) -> BaseException:
    """The innermost exception httpx (and httpcore under it) wrapped."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return err


def _parse_stream(response: httpx.Response) -> Iterator[ChatChunk]:
    """ChatChunks from an SSE body; the finish chunk is held back until usage or [DONE] arrives."""
    pending: ChatChunk | None = None
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        try:
            event = json.loads(payload)
        except ValueError:
            raise ClientError(f"the server sent a malformed stream event: {payload[:120]!r}") from None
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            raise ClientError(f"the server stopped the answer: {error.get('message')}", code=error.get("code"))
        if event.get("usage") and not event.get("choices"):
            pending = ChatChunk("", pending.finish_reason if pending else None, event["usage"])
            continue
        chunk = _chunk_of(event)
        if chunk.finish_reason is not None:
            pending = chunk
        elif chunk.text or chunk.reasoning:
            yield chunk
    if pending is None:
        raise EngineDiedError("the answer ended without a finish reason; the server may have stopped")
    yield pending


def _chunk_of(event: dict[str, Any]) -> ChatChunk:
    choice = (event.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    return ChatChunk(delta.get("content") or "", choice.get("finish_reason"), event.get("usage"), _reasoning_of(delta))


def _reasoning_of(message: dict[str, Any]) -> str:
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return reasoning if isinstance(reasoning, str) else ""


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message, code = _error_message(response)
    status = response.status_code
    kind: ErrorKind = "not_found" if status == 404 else "http"
    if status in (401, 403):
        kind = "auth"
        sent_key = "authorization" in response.request.headers
        if status == 401:
            message = (f"the server refused the API key: {message}" if sent_key
                       else f"the server needs an API key: {message}")
        else:
            message = (f"the server does not allow this API key here: {message}" if sent_key
                       else f"the server refused access without an API key: {message}")
    raise ClientError(f"{message} (HTTP {status})", status, code, kind)


def _error_message(response: httpx.Response) -> tuple[str, str | None]:
    try:
        data = response.json()
    except ValueError:
        return (response.text.strip()[:300] or response.reason_phrase), None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error), error.get("code")
    if isinstance(error, str):
        return error, None
    detail = data.get("detail") if isinstance(data, dict) else None
    return str(detail or data), None


def _body(model: str, messages: Sequence[dict[str, Any]], sampling: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": list(messages)}
    body.update({k: v for k, v in sampling.items() if v is not None})
    return body


def _root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _reason(err: httpx.HTTPError) -> str:
    text = str(err).strip()
    return text or type(err).__name__
