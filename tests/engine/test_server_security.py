"""The engine host refuses what it must (issue S2), in-process through Starlette's TestClient or a
uvicorn server on a thread, with a real tiny engine: foreign Host headers and cross-site origins,
body-less and non-JSON POSTs, oversized bodies (early, from Content-Length or while streaming),
prompts past the context (before tokenising them), bad values as 400s naming the field, load paths
outside the allowed folders (one generic error), 503 "still loading" with Retry-After, and CORS
headers on the refusals an allowed origin gets."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hearth.engine.api import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.server.app import create_app
from hearth.engine.server.host import EngineHost
from hearth.engine.server.security import AccessPolicy, LoadPaths, RequestGuard, is_loopback
from tests.engine.test_server_support import LOCAL_URL, in_process_host, serving_client, wait_until

MAX_MODEL_LEN = 256
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    yield from in_process_host(tmp_path_factory.mktemp("security"), max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def http(host):
    yield from serving_client(host)


@contextmanager
def app_client(app) -> Iterator[TestClient]:
    with TestClient(app, base_url=LOCAL_URL, raise_server_exceptions=False) as client:
        yield client


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


# ---- Host and Origin (DNS rebinding, cross-site requests) ---------------------------------


def test_the_attack_from_the_issue_no_longer_unloads_the_model(host, http):
    response = http.post("/hearth/unload", headers={"Host": "attacker.example", "Origin": "https://evil.example"})
    assert response.status_code == 403 and _error(response)["code"] == "host_not_allowed"
    response = http.post("/hearth/unload", json={}, headers={"Host": "attacker.example:8000"})
    assert response.status_code == 403
    assert host.model is not None and http.get("/health").json()["status"] == "ready"


@pytest.mark.parametrize(("bind", "host_header", "allowed"), [
    ("127.0.0.1", "127.0.0.1:8000", True),
    ("127.0.0.1", "localhost:8000", True),
    ("127.0.0.1", "[::1]:8000", True),
    ("127.0.0.1", "LOCALHOST.", True),
    ("127.0.0.1", "attacker.example:8000", False),
    ("127.0.0.1", "localhost.attacker.example", False),
    ("127.0.0.1", "127.0.0.1:port", False),
    ("127.0.0.1", "", False),
    ("0.0.0.0", "192.168.1.20:8000", True),  # bound to every interface: any address literal
    ("0.0.0.0", "attacker.example", False),
    ("::", "[fe80::1]:8000", True),
    ("192.168.1.20", "192.168.1.20:8000", True),
    ("192.168.1.20", "10.0.0.1:8000", False),
])
def test_host_header_must_name_this_server(bind, host_header, allowed):
    assert AccessPolicy(bind_host=bind).host_allowed(host_header) is allowed


def test_allowed_host_adds_names():
    policy = AccessPolicy(allowed_hosts=("hearth.lan",))
    assert policy.host_allowed("HEARTH.lan:8000") and not policy.host_allowed("other.lan")


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "192.168.1.2", "myhost"]))


def test_cross_origin_requests_are_refused_but_same_origin_is_not(host, http):
    response = http.get("/hearth/stats", headers={"Origin": "https://evil.example"})
    assert response.status_code == 403 and _error(response)["code"] == "origin_not_allowed"
    assert http.post("/v1/chat/completions", json=BODY, headers={"Origin": "null"}).status_code == 403
    assert http.get("/health", headers={"Origin": LOCAL_URL}).status_code == 200


def test_cors_origin_allows_a_web_page_and_answers_its_preflight(host):
    policy = AccessPolicy(cors_origins=("https://chat.example",))
    with app_client(create_app(host, api_key="k", policy=policy)) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 204  # answered before the API key check: browsers send none
        assert preflight.headers["access-control-allow-origin"] == "https://chat.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        answer = client.post("/v1/chat/completions", json=BODY,
                             headers={"Origin": "https://chat.example", "Authorization": "Bearer k"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://chat.example"
        no_key = client.get("/v1/models", headers={"Origin": "https://chat.example"})
        assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == "https://chat.example"
        other = client.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_refusals_after_the_origin_check_carry_cors_headers(host):
    """A page from an allowed origin must be able to read why its request was refused (a response
    without Access-Control-Allow-Origin reaches its script as an opaque network error)."""
    page = "https://chat.example"
    policy = AccessPolicy(cors_origins=(page,), max_body_bytes=1000)
    with app_client(create_app(host, policy=policy)) as client:
        not_json = client.post("/v1/chat/completions", content=b"{}", headers={"Origin": page,
                                                                             "Content-Type": "text/plain"})
        too_large = client.post("/v1/chat/completions", headers={"Origin": page}, json={
            **BODY, "messages": [{"role": "user", "content": "x" * 2000}]})
        bad_value = client.post("/v1/chat/completions", headers={"Origin": page}, json={**BODY, "top_p": 0})
        for response, status in ((not_json, 415), (too_large, 413), (bad_value, 400)):
            assert response.status_code == status
            assert response.headers["access-control-allow-origin"] == page
        same_origin = client.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
        assert same_origin.status_code == 415 and "access-control-allow-origin" not in same_origin.headers


@pytest.mark.parametrize("kwargs", [
    {},  # curl -X POST with no body
    {"content": b"{}", "headers": {"Content-Type": "text/plain"}},  # a cross-site form needs no preflight
    {"data": {"model": "x"}},  # application/x-www-form-urlencoded
])
def test_post_needs_a_json_body(host, http, kwargs):
    response = http.post("/hearth/unload", **kwargs)
    assert response.status_code == 415 and _error(response)["code"] == "unsupported_media_type"
    assert host.model is not None


def test_unload_with_an_empty_json_body_is_400(host, http):
    response = http.post("/hearth/unload", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and host.model is not None


def test_stats_do_not_name_the_model_folder(host, http):
    response = http.get("/hearth/stats")
    assert response.json()["model"] == "tiny" and "model_path" not in response.json()
    assert str(host.model.path) not in response.text and host.model.path.name in response.text  # the name only


# ---- big requests --------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413(host):
    with app_client(create_app(host, policy=AccessPolicy(max_body_bytes=1000))) as client:
        response = client.post("/v1/chat/completions", json={**BODY, "messages": [
            {"role": "user", "content": "x" * 2000}]})
        assert response.status_code == 413 and _error(response)["code"] == "request_too_large"
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200


def _run_guard(headers: list[tuple[bytes, bytes]], chunks: Iterator[bytes], limit: int) -> tuple[int, int, bool]:
    """Drive RequestGuard with a body delivered in ``chunks``: (status, chunks read, app reached)."""
    reached, read, sent = [], [0], []

    async def app(scope, receive, send):
        reached.append(True)

    async def receive():
        read[0] += 1
        chunk = next(chunks, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"), *headers]}
    asyncio.run(RequestGuard(app, AccessPolicy(max_body_bytes=limit))(scope, receive, send))
    return sent[0]["status"], read[0], bool(reached)


def test_a_declared_10_mb_body_is_refused_before_reading_any_of_it():
    chunks = iter([b"x" * 65536] * 160)
    assert _run_guard([(b"content-length", b"10485760")], chunks, limit=2**20) == (413, 0, False)


def test_a_streamed_10_mb_body_is_refused_once_it_passes_the_limit():
    chunks = iter([b"x" * 65536] * 160)  # 10 MiB without Content-Length (chunked)
    status, read, reached = _run_guard([], chunks, limit=2**20)
    assert (status, reached) == (413, False)
    assert read == 17  # 16 chunks fill the 1 MiB limit; the 17th passes it; the other 143 are never read


def test_a_prompt_past_the_context_is_refused_before_it_is_tokenised(host, http, monkeypatch):
    tokenizer = host._engine.tokenizer
    spy = _EncodeSpy(tokenizer._backend)
    monkeypatch.setattr(tokenizer, "_backend", spy)
    huge = "hearth " * 100_000  # 700,000 characters: far more than 256 tokens, whatever the vocabulary
    chat = http.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": huge}]})
    text = http.post("/v1/completions", json={"model": "tiny", "prompt": huge, "max_tokens": 2})
    for response in (chat, text):
        assert response.status_code == 400 and f"the context holds {MAX_MODEL_LEN}" in _error(response)["message"]
    assert spy.lengths == []  # neither prompt reached the tokenizer
    assert http.post("/v1/chat/completions", json=BODY).status_code == 200 and spy.lengths


def test_prompts_are_tokenised_outside_the_host_lock(host, http, monkeypatch):
    # The engine thread and every other request take this lock: a long prompt must not hold it.
    tokenizer = host._engine.tokenizer
    spy = _EncodeSpy(tokenizer._backend, on_encode=lambda: host._lock.locked())
    monkeypatch.setattr(tokenizer, "_backend", spy)
    assert http.post("/v1/chat/completions", json=BODY).status_code == 200
    assert spy.seen == [False]


@pytest.mark.parametrize("text", ["", "a", "hearth " * 50, "<｜begin▁of▁sentence｜>" * 30, "日本語のテキスト" * 40,
                                  "\n\n    " * 60, "".join(chr(c) for c in range(32, 2000))])
def test_fewest_tokens_never_exceeds_the_real_count(host, text):
    tokenizer = host._engine.tokenizer
    assert tokenizer.fewest_tokens(text) <= len(tokenizer.encode(text))


class _EncodeSpy:
    """Stands in for the ``tokenizers`` object and records the length of every text it encodes."""

    def __init__(self, real, on_encode: Callable[[], object] = lambda: None) -> None:
        self.real = real
        self.on_encode = on_encode
        self.lengths: list[int] = []
        self.seen: list[object] = []  # what on_encode returned at each call

    def encode(self, text: str, **kwargs):
        self.lengths.append(len(text))
        self.seen.append(self.on_encode())
        return self.real.encode(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


# ---- bad values are 400s naming the field ---------------------------------------------------


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": 2, "seed": 99999999999999999999999}', "seed"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], '
                             b'"max_tokens": 2}', "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": 2, "chat_template_kwargs": {"messages": "x"}}', "chat_template_kwargs"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": 2, "chat_template_kwargs": {"prompt": "x"}}', "chat_template_kwargs"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": 2, "stop": ["\\udfff"]}', "stop.0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "seed": -9223372036854775809}', "seed"),
    ("/hearth/load", b'{"model": "tiny", "served_name": "\\ud800"}', "served_name"),
])
def test_bad_values_are_400_naming_the_field(host, http, path, raw, param):
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == param and _error(response)["type"] == "invalid_request_error"
    assert host.model is not None and host.model.name == "tiny"


def test_chat_options_the_chat_format_cannot_use_are_400(http):
    response = http.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {"response_format": "x"}})
    assert response.status_code == 400 and "chat format" in _error(response)["message"]


@contextmanager
def uvicorn_thread(app) -> Iterator[str]:
    """A real uvicorn server for ``app`` on a thread (its logs go to the root logger)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30, what="uvicorn to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_an_unexpected_error_is_logged_once(host, monkeypatch, caplog):
    def explode(*_, **__):
        raise ValueError("boom")

    monkeypatch.setattr(host, "submit", explode)
    with caplog.at_level(logging.INFO), uvicorn_thread(create_app(host)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30)
    assert response.status_code == 500 and "boom" not in response.text
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert tracebacks[0].name == "hearth.engine.server" and "POST /v1/chat/completions" in tracebacks[0].getMessage()


# ---- /hearth/load ------------------------------------------------------------------------------


@pytest.fixture
def models_root(host, tmp_path) -> Path:
    """An allowed models folder holding a link to the tiny model, and things outside it."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "tiny-link").symlink_to(host.model.path)  # points outside the root
    (tmp_path / "elsewhere").mkdir()
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    return root


def test_load_refuses_everything_outside_its_folders_with_one_error(host, models_root, tmp_path):
    with app_client(create_app(host, load_paths=LoadPaths.of([models_root]))) as client:
        answers = {}
        for given in (str(tmp_path / "elsewhere"), str(tmp_path / "missing"), "/etc/passwd", "/",
                      str(models_root / ".." / "elsewhere"), "../elsewhere", "escape", "tiny-link", "a\x00b"):
            response = client.post("/hearth/load", json={"model": given})
            assert response.status_code == 403, (given, response.text)
            answers[given] = response.json()["error"]["message"].replace(repr(given), "NAME")
        assert len(set(answers.values())) == 1, answers  # nothing tells which of them exist
        assert host.model is not None and host.model.name == "tiny"


def test_load_opens_folders_under_an_allowed_path(host, models_root, tmp_path):
    (models_root / "empty").mkdir()
    with app_client(create_app(host, load_paths=LoadPaths.of([models_root, host.model.path.parent]))) as client:
        inside = client.post("/hearth/load", json={"model": "empty"})
        assert inside.status_code == 400 and "no config.json" in _error(inside)["message"]  # inside: details are fine
        loaded = client.post("/hearth/load", json={"model": "tiny", "served_name": "tiny"})
        assert loaded.status_code == 200 and loaded.json()["model"] == "tiny"


# ---- a model that is loading ---------------------------------------------------------------


def test_requests_during_a_load_get_503_still_loading_with_retry_after(host, monkeypatch, tmp_path):
    fresh = EngineHost(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN))
    fresh.start()
    entered, release = threading.Event(), threading.Event()
    real_load = Engine.load

    def slow_load(path, config):
        entered.set()
        release.wait(60)
        return real_load(path, config)

    monkeypatch.setattr(Engine, "load", slow_load)
    loader = threading.Thread(target=fresh.load, args=(host.model.path, "tiny"))
    loader.start()
    try:
        assert entered.wait(30)
        with app_client(create_app(fresh)) as client:
            response = client.post("/v1/chat/completions", json=BODY)
            assert response.status_code == 503 and response.headers["retry-after"].isdigit()
            assert "still loading" in _error(response)["message"] and str(tmp_path) not in response.text
            assert _error(response)["type"] == "server_error"
            assert client.get("/health").json()["status"] == "loading"
            release.set()
            loader.join(60)
            assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    finally:
        release.set()
        loader.join(60)
        fresh.close()
