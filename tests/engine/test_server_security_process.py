"""The issue S2 probes against a real ``python -m hearth.engine.server`` process without an API key:
the DNS-rebinding unload, a 10 MB body (refused with 413 from its Content-Length, or while it
streams, with /health answering meanwhile), start-up refusals (a non-loopback bind without a key)
and a broken config.json reported in one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.test_server_support import STARTUP_TIMEOUT_S, ServerProcess, start_server, wait_until

TEN_MB = 10 * 1024 * 1024
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe") / "tiny-v32", "deepseek_v32", seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    running = start_server(model_dir, model_dir.parent / "run", max_model_len=256)
    yield running
    running.stop()


def _open(server: ServerProcess, head: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head.encode())
    return sock


def _status(sock: socket.socket) -> int:
    """The status code of the response arriving on ``sock``."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"the server closed the connection without answering: {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])


def _head(server: ServerProcess, length_header: str) -> str:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\n{length_header}\r\n\r\n")


def test_a_foreign_host_and_origin_cannot_unload(server):
    response = httpx.post(f"{server.base_url}/hearth/unload", timeout=10,
                          headers={"Host": "attacker.example", "Origin": "https://evil.example"})
    assert response.status_code == 403
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ready", "model": "tiny-v32"}


def test_a_declared_10_mb_body_is_refused_without_sending_it(server):
    sock = _open(server, _head(server, f"Content-Length: {TEN_MB}"))
    try:
        assert _status(sock) == 413  # answered from the headers alone: not one body byte was sent
    finally:
        sock.close()


def test_a_streamed_10_mb_body_is_refused_and_health_answers_meanwhile(server):
    sock = _open(server, _head(server, "Transfer-Encoding: chunked"))
    chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
    try:
        for _ in range(32):  # 2 MiB: under the 4 MiB limit, so the server is still reading the body
            sock.sendall(chunk)
        health = httpx.get(f"{server.base_url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ready"
        statuses: list[int] = []
        reader = threading.Thread(target=lambda: statuses.append(_status(sock)), daemon=True)
        reader.start()
        sent = 32
        # NOTE: the body never ends (no closing chunk): a server that waited for all of it never answers.
        while reader.is_alive() and sent < TEN_MB // CHUNK:
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed the connection
                break
            sent += 1
        reader.join(30)
        assert statuses == [413]
    finally:
        sock.close()
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ready"


def _server(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "HEARTH_API_KEY"}
    return subprocess.Popen([sys.executable, "-m", "hearth.engine.server", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _exit_status(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The exit code and stderr of a server expected to stop by itself (killed if it does not)."""
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_non_loopback_bind_without_a_key_refuses_to_start(bind):
    returncode, err = _exit_status(_server("--host", bind, "--port", "0"))
    assert returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--insecure-no-key" in lines[0], err


def test_insecure_no_key_lets_it_start(tmp_path):
    port_file = tmp_path / "port"
    proc = _server("--host", "0.0.0.0", "--port", "0", "--port-file", str(port_file), "--insecure-no-key")
    try:
        def listening() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            return port_file.exists() and bool(port_file.read_text().strip())

        wait_until(listening, STARTUP_TIMEOUT_S, 0.05, "the server's port file")
        response = httpx.get(f"http://127.0.0.1:{port_file.read_text().strip()}/health", timeout=30)
        assert response.json() == {"status": "no_model", "model": None}
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("key", "value", "named"), [("hidden_size", -8, "hidden_size"),
                                                     ("num_hidden_layers", "three", "wrong type")])
def test_a_bad_config_is_one_line(model_dir, tmp_path, key, value, named):
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config[key] = value
    (broken / "config.json").write_text(json.dumps(config))
    returncode, err = _exit_status(_server("--model", str(broken), "--port", "0", "--device", "cpu"))
    assert returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], err
