"""A small fake Hugging Face Hub on 127.0.0.1 for the Hub manager's tests.

It answers what huggingface_hub 2.4 calls, with the headers the library reads:
- ``GET /api/models`` (search: ``search``, ``filter``, ``sort``, ``limit``, ``config``, and ``expand``
  with ``config`` / ``safetensors``);
- ``GET /api/models/{repo}[/revision/{rev}]`` (``blobs=True`` adds size, blobId and lfs per file);
- ``GET /api/models/{repo}/tree/{rev}`` (what ``snapshot_download`` lists);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ETag, X-Repo-Commit, X-Linked-Etag/-Size,
  Content-Length and ``Range: bytes=N-`` (206 + Content-Range);
- gated repos: 401 without a token, 403 with an ungranted one, both with ``X-Error-Code: GatedRepo``.

Faults are queued per file and consumed by GET requests: answer with an HTTP status, drop the
connection after some bytes, stall after some bytes, or stream slowly; ``add_api_fault`` queues an
HTTP status for an API path (``/api/models``). Every request is logged.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_API = "<api>"  # the fault key of API paths (not a repo id)


@dataclass
class FakeFile:
    path: str
    content: bytes
    is_lfs: bool = False
    served: bytes | None = None  # what GET sends instead (corruption); same length keeps size checks quiet
    served_etag: str | None = None  # what HEAD/GET send as the ETag instead (a hostile mirror)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def blob_id(self) -> str:
        return hashlib.sha1(f"blob {len(self.content)}\0".encode() + self.content).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.is_lfs else self.blob_id


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, FakeFile]
    commit: str
    gated: bool = False
    downloads: int = 0
    likes: int = 0
    trending: float = 0.0
    created_at: str = "2025-01-01T00:00:00.000Z"
    model_type: str | None = None


@dataclass
class Fault:
    """``kind``: "status" (answer ``status``), "drop" (close after ``after_bytes``), "stall" (send
    ``after_bytes`` then hang up to ``seconds``), "slow" (``chunk`` bytes every ``seconds``)."""

    kind: str
    times: int = 1
    status: int = 500
    after_bytes: int = 0
    seconds: float = 0.0
    chunk: int = 16 * 1024


@dataclass
class LoggedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    granted_tokens: dict[str, set[str]] = field(default_factory=dict)  # token -> repo ids
    requests: list[LoggedRequest] = field(default_factory=list)
    _faults: dict[tuple[str, str], list[Fault]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None

    def add_repo(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def add_fault(self, repo_id: str, path: str, fault: Fault) -> None:
        with self._lock:
            self._faults.setdefault((repo_id, path), []).append(fault)

    def add_api_fault(self, path: str, fault: Fault) -> None:
        """Answer the next ``fault.times`` requests of API ``path`` with ``fault.status``."""
        self.add_fault(_API, path, fault)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def take_fault(self, repo_id: str, path: str) -> Fault | None:
        with self._lock:
            faults = self._faults.get((repo_id, path), [])
            if not faults:
                return None
            fault = faults[0]
            fault.times -= 1
            if fault.times <= 0:
                faults.pop(0)
            return fault

    def log(self, request: LoggedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def file_requests(self, repo_id: str, path: str, method: str = "GET") -> list[LoggedRequest]:
        with self._lock:
            return [r for r in self.requests
                    if r.method == method and r.path.startswith(f"/{repo_id}/resolve/") and r.path.endswith(f"/{path}")]

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.02,), name="fakehub", daemon=True).start()
        return self

    def stop(self) -> None:
        self._release.set()  # let stalled responses end
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(body=False)

    def _route(self, *, body: bool) -> None:
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parse_qs(parts.query)
        self.hub.log(LoggedRequest(self.command, path, query, {k.lower(): v for k, v in self.headers.items()}))
        try:
            fault = self.hub.take_fault(_API, path) if path.startswith("/api/") else None
            if fault is not None:
                return self._error(fault.status, None, "injected failure")
            if path == "/api/models":
                return self._json(self._search(query))
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/"):], query)
            if "/resolve/" in path:
                return self._resolve(path, body)
            self._error(404, "RepoNotFound", "not found")
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---- API --------------------------------------------------------------------------------
    def _search(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        text = query.get("search", [""])[0].lower()
        tags = set(query.get("filter", []))
        found = [r for r in self.hub.repos.values()
                 if text in r.repo_id.lower() and tags <= set(self._tags(r))]
        key = {"downloads": "downloads", "likes": "likes", "trendingScore": "trending",
               "createdAt": "created_at"}.get(query.get("sort", ["downloads"])[0], "downloads")
        found.sort(key=lambda r: getattr(r, key), reverse=True)
        limit = int(query.get("limit", [1000])[0])
        expand = query.get("expand", [])
        return [self._summary(r, with_config="config" in query or "config" in expand,
                              with_safetensors="safetensors" in expand) for r in found[:limit]]

    def _tags(self, repo: FakeRepo) -> list[str]:
        return ["safetensors", "text-generation"] + ([repo.model_type] if repo.model_type else [])

    def _summary(self, repo: FakeRepo, *, with_config: bool, with_safetensors: bool = False) -> dict[str, Any]:
        out = {"id": repo.repo_id, "modelId": repo.repo_id, "downloads": repo.downloads, "likes": repo.likes,
               "trendingScore": repo.trending, "createdAt": repo.created_at, "tags": self._tags(repo),
               "private": False, "gated": "manual" if repo.gated else False}
        if with_config and repo.model_type:
            out["config"] = {"model_type": repo.model_type}
        weights = sum(len(f.content) for f in repo.files.values() if f.path.endswith(".safetensors"))
        if with_safetensors and weights:  # the Hub counts parameters per dtype; the fakes hold float32
            out["safetensors"] = {"parameters": {"F32": weights // 4}, "total": weights // 4}
        return out

    def _api(self, rest: str, query: dict[str, list[str]]) -> None:
        org, name, *tail = rest.split("/")
        repo = self.hub.repos.get(f"{org}/{name}")
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if tail and tail[0] == "tree":
            if not self._revision_ok(repo, tail[1]):
                return None
            return self._json([self._tree_entry(f) for f in repo.files.values()])
        if tail and tail[0] == "revision" and not self._revision_ok(repo, tail[1]):
            return None
        info = {**self._summary(repo, with_config=True), "sha": repo.commit,
                "siblings": [self._sibling(f, "blobs" in query) for f in repo.files.values()]}
        return self._json(info)

    def _sibling(self, f: FakeFile, with_blobs: bool) -> dict[str, Any]:
        if not with_blobs:
            return {"rfilename": f.path}
        out: dict[str, Any] = {"rfilename": f.path, "size": len(f.content), "blobId": f.blob_id}
        if f.is_lfs:
            out["lfs"] = {"sha256": f.sha256, "size": len(f.content), "pointerSize": 134}
        return out

    def _tree_entry(self, f: FakeFile) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": len(f.content), "path": f.path}
        if f.is_lfs:
            out["lfs"] = {"oid": f.sha256, "size": len(f.content), "pointerSize": 134}
        return out

    def _revision_ok(self, repo: FakeRepo, revision: str) -> bool:
        if revision in ("main", repo.commit):
            return True
        self._error(404, "RevisionNotFound", "Invalid rev id")
        return False

    # ---- files ------------------------------------------------------------------------------
    def _resolve(self, path: str, body: bool) -> None:
        repo_part, rest = path.lstrip("/").split("/resolve/", 1)
        revision, filename = rest.split("/", 1)
        repo = self.hub.repos.get(repo_part)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if not self._revision_ok(repo, revision) or not self._authorized(repo):
            return None
        f = repo.files.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
        fault = self.hub.take_fault(repo.repo_id, filename) if body else None
        if fault is not None and fault.kind == "status":
            return self._error(fault.status, None, "injected failure")
        data = f.served if f.served is not None else f.content
        etag = f.served_etag or f.etag
        start = self._range_start()
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("Accept-Ranges", "bytes")
        if f.is_lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(f.content)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if body:
            self._send_body(data[start:], fault)

    def _range_start(self) -> int:
        value = self.headers.get("Range")
        if not value or not value.startswith("bytes="):
            return 0
        return int(value[len("bytes="):].split("-")[0] or 0)

    def _send_body(self, data: bytes, fault: Fault | None) -> None:
        if fault is None:
            self.wfile.write(data)
            return
        if fault.kind == "slow":
            for i in range(0, len(data), fault.chunk):
                self.wfile.write(data[i:i + fault.chunk])
                self.wfile.flush()
                time.sleep(fault.seconds)
            return
        self.wfile.write(data[:fault.after_bytes])
        self.wfile.flush()
        if fault.kind == "stall":
            self.hub._release.wait(fault.seconds)
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _authorized(self, repo: FakeRepo) -> bool:
        if not repo.gated:
            return True
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        if token is not None and repo.repo_id in self.hub.granted_tokens.get(token, set()):
            return True
        status = 401 if token is None else 403
        self._error(status, "GatedRepo", f"Access to model {repo.repo_id} is restricted.")
        return False

    def _json(self, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
