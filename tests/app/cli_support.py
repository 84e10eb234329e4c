"""Helpers for the client and CLI tests: broken copies of a tiny model, running the
``hearth`` command in a subprocess or a pseudo-terminal, and a minimal non-Hearth OpenAI server."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from safetensors.torch import load_file, save_file

from hearth.app.client import ChatChunk
from hearth.app.hub.state import Registry
from hearth.app.paths import data_dir
from hearth.app.store.settings import Settings, save_settings

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def broken_copies(model: Path, root: Path) -> dict[str, Path]:
    """Copies of ``model`` with one defect each: truncated, missing_shard, wrong_shape, unknown_type."""
    copies = {name: Path(shutil.copytree(model, root / name)) for name in
              ("truncated", "missing_shard", "wrong_shape", "unknown_type")}
    shard = copies["truncated"] / SHARD_2
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (copies["missing_shard"] / SHARD_1).unlink()
    tensors = load_file(str(copies["wrong_shape"] / SHARD_1))
    name = next(n for n, t in sorted(tensors.items()) if t.dim() == 2)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(copies["wrong_shape"] / SHARD_1), metadata={"format": "pt"})
    config_path = copies["unknown_type"] / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"] = "llama"
    config_path.write_text(json.dumps(config))
    return copies


def hearth_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hearth.app.main", "--cli", *args]


def run_hearth(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hearth_cmd(*args), input=stdin, capture_output=True, text=True, timeout=timeout,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


class Terminal:
    """A child process on a pseudo-terminal (its controlling tty, so ``\\x03`` sends SIGINT)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the program
            # A program started from a terminal has Ctrl-C live. A test run started in the background
            # by a non-interactive shell inherits SIGINT ignored, an exec keeps it ignored and Python
            # then installs no KeyboardInterrupt handler: the child would never see Ctrl-C.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.output = ""
        self._pos = 0
        self.returncode: int | None = None

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 30.0) -> str:
        """Read until ``pattern`` (a regex) appears after the previous match; returns the text
        read in between (up to and including the match)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.output, self._pos)
            if match:
                seen, self._pos = self.output[self._pos:match.end()], match.end()
                return seen
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(remaining):
                raise AssertionError(f"no {pattern!r} within {timeout}s; output so far:\n{self.output[-3000:]}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.output += data.decode(errors="replace")
        return bool(data)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the program did not exit; output:\n{self.output[-3000:]}")
            self._read(0.05)
        return self.returncode

    def close(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10)
        os.close(self.fd)


class _FakeOpenAI(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible server that is not Hearth (no /health, no /hearth/*). Streamed
    chats answer "echo: " and the last message; every chat request body is kept in ``received``."""

    received: list[dict]

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "other-model", "object": "model"}]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        self.received.append(body)
        if body.get("stream"):
            self._stream(f"echo: {body['messages'][-1]['content']}")
            return
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"echo {body['model']}"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
        self._json(200, answer)

    def _stream(self, text: str) -> None:
        events = [{"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}]
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload.encode())))
        self.end_headers()
        self.wfile.write(payload.encode())

    def _json(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def fake_openai_server(received: list[dict] | None = None) -> Iterator[str]:
    """The base URL of a running minimal non-Hearth OpenAI server; the chat requests it gets are
    appended to ``received``."""
    handler = type("Handler", (_FakeOpenAI,), {"received": received if received is not None else []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


class FakeSession:
    """Stands in for the chat's ChatSession: records what the REPL sends and answers "ok N"."""

    model = label = "fake-model"
    where = "a fake server"

    def __init__(self) -> None:
        self.sent: list[list[dict[str, str]]] = []

    def stream(self, messages, sampling):
        self.sent.append(messages)
        yield ChatChunk(f"ok {len(self.sent)}")
        yield ChatChunk("", "stop", {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})


class TerminalStdin(io.StringIO):
    """Stands in for stdin on a terminal (``isatty()``), for what only runs when someone is there."""

    def isatty(self) -> bool:
        return True


def feed_input(monkeypatch, *lines: str | type[BaseException]) -> None:
    """``input()`` returns ``lines`` in turn (an exception class is raised instead)."""
    queue = list(lines)

    def fake_input(_prompt: str = "") -> str:
        item = queue.pop(0)
        if isinstance(item, type):
            raise item()
        return item

    monkeypatch.setattr("builtins.input", fake_input)


def install_download(model_dir: Path, cache: Path, repo: str, commit: str) -> Path:
    """``model_dir`` as a verified download of ``repo`` at ``commit`` in the Hugging Face cache ``cache`` (the
    layout the Hub client writes: models--org--name/snapshots/<commit>/), the settings pointing there; returns
    the snapshot folder."""
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    save_settings(Settings(hf_cache_dir=str(cache)))
    Registry(data_dir() / "models.json").mark_ready(repo, commit=commit, revision="main", num_files=7, size_bytes=1)
    return snapshot
