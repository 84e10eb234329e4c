"""ChatClient against a real engine host and a non-Hearth OpenAI server, EngineProcess's
lifecycle: start, reuse, a crash mid-answer (EngineDiedError), restart, stop; and ``probe_models``
(Settings' Test of a remote backend) against a real HTTP server giving each answer a backend can."""

from __future__ import annotations

import os
import signal
import stat
import time

import httpx
import pytest

from hearth.app.client import ChatClient, ClientError, EngineDiedError, EngineProcess, EngineStartError
from hearth.app.client.local_engine import STATE_FILE
from hearth.app.client.openai_client import probe_models
from hearth.app.paths import runtime_dir
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import broken_copies, fake_openai_server
from tests.app.fake_backend import UNKNOWN_HOST, FakeBackend, closed_port_url, unknown_host_fails_at_once
from tests.engine.test_server_support import start_server, wait_until

KEY = "client-key"
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("client") / "tiny-v32", "deepseek_v32", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    running = start_server(model_dir, tmp_path_factory.mktemp("client-server"), api_key=KEY)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with ChatClient(server.base_url + "/v1", api_key=KEY, timeout=60) as c:
        yield c


def test_models_health_and_stats(client):
    assert client.models() == ["tiny-v32"]
    assert client.health() is True
    stats = client.stats()
    assert stats["model"] == "tiny-v32" and "memory" in stats


def test_stream_and_complete_agree(client):
    chunks = list(client.stream_chat("tiny-v32", HI, max_tokens=10, temperature=0))
    *body, last = chunks
    assert all(c.text and c.finish_reason is None for c in body)
    assert last.finish_reason == "length" and last.usage["completion_tokens"] == 10
    whole = client.complete_chat("tiny-v32", HI, max_tokens=10, temperature=0)
    assert whole.text == "".join(c.text for c in body)
    assert whole.finish_reason == "length" and whole.usage == last.usage


def test_closing_the_stream_early_aborts_the_request(client):
    before = client.stats()["requests_aborted"]
    stream = client.stream_chat("tiny-v32", HI, max_tokens=480, temperature=0, ignore_eos=True)
    assert next(stream).text
    stream.close()
    wait_until(lambda: (s := client.stats())["requests_aborted"] > before and s["running"] == 0,
               timeout=10, what="the server to abort the request")


def test_server_errors_carry_the_server_message(client, server):
    with pytest.raises(ClientError, match="does not exist here") as err:
        client.complete_chat("no-such-model", HI)
    assert err.value.status == 404
    with pytest.raises(ClientError, match="the context holds"):
        list(client.stream_chat("tiny-v32", [{"role": "user", "content": "word " * 600}]))
    with ChatClient(server.base_url, api_key="wrong") as bad, pytest.raises(ClientError, match="API key") as err:
        bad.models()
    assert err.value.status == 401


def test_connection_refused_is_a_clear_error():
    with ChatClient("http://127.0.0.1:9", timeout=5) as nobody:
        assert nobody.health() is False
        with pytest.raises(ClientError, match="cannot connect to http://127.0.0.1:9"):
            nobody.models()


def test_other_openai_servers_degrade_gracefully():
    with fake_openai_server() as url, ChatClient(url) as other:
        assert other.models() == ["other-model"]
        assert other.health() is True  # no /health there: /v1/models answers instead
        assert other.stats() == {}
        assert other.complete_chat("other-model", HI).text == "echo other-model"
        with pytest.raises(ClientError, match="not a Hearth engine host"):
            other.load_model("/some/model")


@pytest.mark.slow
def test_engine_process_lifecycle(model_dir):
    proc = EngineProcess.ensure_running(model_dir, max_model_len=512, startup_timeout=120)
    try:
        assert proc.is_alive() and proc.started_here
        state_file = runtime_dir() / STATE_FILE
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # it holds the token
        again = EngineProcess.ensure_running(model_dir, startup_timeout=120)
        assert again.pid == proc.pid and not again.started_here  # reused, not restarted
        with proc.client() as client:
            assert httpx.get(f"{proc.base_url}/health", timeout=5).status_code == 401  # the token is required
            stream = client.stream_chat(client.models()[0], HI, max_tokens=480, temperature=0, ignore_eos=True)
            assert next(stream).text
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDiedError, match="dropped mid-answer"):
                list(stream)
        assert not proc.is_alive()
        with pytest.raises(EngineDiedError, match="exited with code"):
            proc.check()
        old_pid = proc.restart(startup_timeout=120).pid
        assert proc.is_alive()
        with proc.client() as client:
            answer = client.complete_chat(client.models()[0], HI, max_tokens=3, ignore_eos=True)
            assert answer.usage["completion_tokens"] == 3
        assert EngineProcess.find_running().pid == old_pid
    finally:
        proc.stop()
    assert not proc.is_alive()
    assert not (runtime_dir() / STATE_FILE).exists()


def test_engine_process_reports_a_broken_model(model_dir, tmp_path):
    broken = broken_copies(model_dir, tmp_path)["truncated"]
    with pytest.raises(EngineStartError, match="not a valid safetensors file"):
        EngineProcess.ensure_running(broken, startup_timeout=120)
    assert EngineProcess.find_running() is None


def test_load_and_unload_through_the_client(client, model_dir):
    assert client.unload() == {"unloaded": "tiny-v32"}
    assert client.models() == []
    assert client.load_model(str(model_dir))["model"] == "tiny-v32"
    assert client.models() == ["tiny-v32"]


# ---- probing a remote backend (Settings' Test): a real HTTP server on 127.0.0.1 ----------------

@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "", "/"])
def test_probe_lists_the_models_with_or_without_v1_and_sends_the_key(suffix):
    with FakeBackend(api_key="sekret") as backend:
        assert probe_models(backend.root + suffix, "sekret") == ["alpha", "beta"]
        assert backend.requests == [("GET", "/v1/models", "Bearer sekret")]  # never /v1/v1/models


@pytest.mark.parametrize(("answer", "key", "kind", "status", "words"), [
    ("models", None, "auth", 401, "the server needs an API key: Missing API key (HTTP 401)"),
    ("models", "wrong", "auth", 401, "the server refused the API key: Invalid API key (HTTP 401)"),
    ("forbidden", "sekret", "auth", 403, "does not allow this API key here: this key may not list models (HTTP 403)"),
    ("missing", "sekret", "not_found", 404, "/v1/models does not exist (HTTP 404): the address is not an "
     "OpenAI-compatible API"),
    ("html", "sekret", "not_json", None, "/v1/models answered with something that is not JSON (text/html)"),
    ("not_openai", "sekret", "not_openai", None, "answered JSON without a model list"),
])
def test_probe_says_why_a_backend_cannot_be_used(answer, key, kind, status, words):
    with FakeBackend(api_key="sekret", answer=answer) as backend, pytest.raises(ClientError) as err:
        probe_models(backend.url, key)
    assert (err.value.kind, err.value.status) == (kind, status)
    assert words in str(err.value)


def test_probe_of_a_closed_port_an_unknown_host_and_a_silent_server(monkeypatch):
    url = closed_port_url()
    with pytest.raises(ClientError, match="nothing is listening there \\(connection refused\\)") as err:
        probe_models(url)
    assert err.value.kind == "refused" and str(err.value).startswith(f"cannot connect to {url[:-3]}:")
    unknown_host_fails_at_once(monkeypatch)
    with pytest.raises(ClientError, match=f"the host name {UNKNOWN_HOST} was not found") as err:
        probe_models(f"http://{UNKNOWN_HOST}:8000/v1")
    assert err.value.kind == "dns"
    with FakeBackend(answer="slow", delay_s=30) as backend:
        started = time.monotonic()
        with pytest.raises(ClientError, match="did not answer in time \\(ReadTimeout\\)") as err:
            probe_models(backend.url, timeout=0.3)
        assert err.value.kind == "timeout" and time.monotonic() - started < 5


def test_probe_tls_failures_say_what_to_do():
    with FakeBackend() as plain, pytest.raises(ClientError, match="if the server speaks plain http, use an "
                                                             "http:// address") as err:
        probe_models(plain.url.replace("http://", "https://"))
    assert err.value.kind == "tls"
    with FakeBackend(tls=True) as tls, pytest.raises(ClientError, match="certificate is not trusted") as err:
        probe_models(tls.url)
    assert err.value.kind == "tls" and "self-signed" in str(err.value)
