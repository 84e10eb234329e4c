"""A remote OpenAI-compatible backend on 127.0.0.1 (a real HTTP server on a thread) whose answer to
``GET /v1/models`` the test picks: the models, or each way a backend can be unusable (401 / 403,
404, an HTML page, JSON that is not a model list, no answer in time). With ``api_key`` set it wants
that Bearer token, as vLLM's and LM Studio's ``--api-key`` do. Streamed chats answer "echo <model>".
Optionally it speaks TLS with a self-signed certificate (made with the ``openssl`` command)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

Answer = Literal["models", "forbidden", "missing", "html", "not_openai", "slow"]


class FakeBackend:
    """``url`` ends in /v1 (as users paste it); ``root`` is the same server without it."""

    def __init__(self, models: tuple[str, ...] = ("alpha", "beta"), api_key: str | None = None,
                 answer: Answer = "models", delay_s: float = 0.0, tls: bool = False) -> None:
        self.models = models
        self.api_key = api_key
        self.answer: Answer = answer
        self.delay_s = delay_s  # how long "slow" keeps a request waiting (until stop() at the latest)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self.answered = 0  # requests answered (or given up on) so far
        self._release = threading.Event()
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"backend": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        scheme = "http"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(TLS_CERT, TLS_KEY)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            scheme = "https"
        self.root = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self.url = f"{self.root}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeBackend:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def record(self, method: str, path: str, authorization: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, authorization))

    def done(self) -> None:
        with self._lock:
            self.answered += 1

    def wait_released(self) -> None:
        self._release.wait(self.delay_s)


class _Handler(BaseHTTPRequestHandler):
    backend: FakeBackend

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        backend = self.backend
        backend.record("GET", self.path, self.headers.get("Authorization"))
        try:
            if self.path != "/v1/models" or backend.answer == "missing":  # "missing": an API that lives elsewhere
                self._json(404, {"detail": "Not Found"})
            elif not self._authorized():
                pass
            elif backend.answer == "forbidden":
                self._json(403, {"error": {"message": "this key may not list models", "code": "forbidden"}})
            elif backend.answer == "html":
                self._send(200, "text/html; charset=utf-8", b"<!doctype html><html><body>Router login</body></html>")
            elif backend.answer == "not_openai":
                self._json(200, {"status": "ok", "version": "1.2"})
            else:
                if backend.answer == "slow":
                    backend.wait_released()
                self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in backend.models]})
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
            pass
        finally:
            backend.done()

    def do_POST(self) -> None:  # noqa: N802
        backend = self.backend
        backend.record("POST", self.path, self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
        elif self._authorized():
            events = [{"choices": [{"index": 0, "delta": {"content": f"echo {body['model']}"}, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
            payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, "text/event-stream", payload.encode())
        backend.done()

    def _authorized(self) -> bool:
        """Answers 401 (and returns False) unless the request carries the key the backend wants."""
        want = self.backend.api_key
        got = self.headers.get("Authorization")
        if want is None or got == f"Bearer {want}":
            return True
        message = "Missing API key" if got is None else "Invalid API key"
        self._json(401, {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}})
        return False

    def _json(self, status: int, data: dict) -> None:
        self._send(status, "application/json", json.dumps(data).encode())

    def _send(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        pass


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (a port the OS just gave and took back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


UNKNOWN_HOST = "no-such-host.invalid"  # .invalid never resolves (RFC 2606)


def unknown_host_fails_at_once(monkeypatch) -> None:
    """Make the lookup of ``UNKNOWN_HOST`` fail at once, as a resolver that answers NXDOMAIN does
    (a real lookup may first wait out the resolver's timeout, 5 s and more, on a machine without DNS);
    httpx still meets the ``socket.gaierror`` the OS lookup raises, through its own code."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == UNKNOWN_HOST:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


# A throwaway self-signed certificate for 127.0.0.1 and its key (made once with `openssl req -x509 -newkey rsa:2048
# -nodes -days 36500 -subj /CN=127.0.0.1`): a test fixture that no client trusts, which is the point.
TLS_CERT, TLS_KEY = (str(Path(__file__).parent / "data" / f"test-tls-{part}.pem") for part in ("cert", "key"))
