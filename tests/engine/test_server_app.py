"""The engine host's failure paths, in-process (Starlette's TestClient, a real tiny engine):
an engine step that raises fails only the requests in flight (500 JSON / an SSE error event) and
the host keeps serving; an unexpected handler error is a 500 without traceback text; no model is 503;
``/hearth/tokenize`` counts a prompt exactly as the answer's usage does."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hearth.engine.api import EngineConfig
from hearth.engine.server.app import create_app
from hearth.engine.server.host import EngineHost
from tests.engine.test_server_support import LOCAL_URL, in_process_host, serving_client

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    yield from in_process_host(tmp_path_factory.mktemp("app"), max_model_len=256)


@pytest.fixture
def http(host):
    yield from serving_client(host)


def _break_next_step(host: EngineHost, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = host._engine
    real_step = engine.step
    calls = {"n": 0}

    def step(launched=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_step(launched)

    monkeypatch.setattr(engine, "step", step)


def test_a_failing_step_is_a_500_and_the_host_recovers(host, http, monkeypatch):
    _break_next_step(host, monkeypatch)
    response = http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "simulated" not in error["message"]
    again = http.post("/v1/chat/completions", json=BODY)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    stats = http.get("/hearth/stats").json()
    assert stats["requests_failed"] >= 1 and stats["running"] == 0


def test_a_failing_step_ends_a_stream_with_an_error_event(host, http, monkeypatch):
    _break_next_step(host, monkeypatch)
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "internal error" in json.loads(events[-2])["error"]["message"]


def test_an_unexpected_handler_error_is_a_500_without_traceback(host, http, monkeypatch):
    def explode(*_, **__):
        raise ValueError("boom: secret internals")

    monkeypatch.setattr(host, "submit", explode)
    response = http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 500
    assert "boom" not in response.text and "Traceback" not in response.text
    assert response.json()["error"]["type"] == "server_error"


def test_no_model_is_503():
    empty = EngineHost(EngineConfig(device="cpu"))
    with TestClient(create_app(empty), base_url=LOCAL_URL, raise_server_exceptions=False) as client:
        assert client.get("/health").json() == {"status": "no_model", "model": None}
        response = client.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 503 and "no model is loaded" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "server_error"  # the server's state, not the request's fault
        assert client.get("/v1/models").json()["data"] == []


def test_tokenize_counts_the_prompt_as_the_answer_does(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, engine"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Count me"}]
    counted = http.post("/hearth/tokenize", json={"model": "tiny", "messages": messages})
    assert counted.status_code == 200
    body = counted.json()
    answer = http.post("/v1/chat/completions", json={**BODY, "messages": messages})
    assert body["prompt_tokens"] == answer.json()["usage"]["prompt_tokens"] > 8
    assert body["max_model_len"] == 256
    shorter = http.post("/hearth/tokenize", json={"model": "tiny", "messages": messages[-1:]}).json()
    assert shorter["prompt_tokens"] < body["prompt_tokens"]
    assert http.post("/hearth/tokenize", json={"model": "other", "messages": messages}).status_code == 404
    assert http.post("/hearth/tokenize", json={"model": "tiny", "messages": []}).status_code == 400


def test_a_lagging_stream_reads_its_queued_events_in_one_batch():
    """Events queued while the reader was busy come out together (one SSE chunk for their text), up
    to and including Finished; one event at a time when the reader keeps up."""
    import asyncio

    from hearth.engine.api import Finished, RequestStats, TokenDelta
    from hearth.engine.server.app import RequestStream
    from hearth.engine.server.host import EventRelay

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    async def run() -> list[list[str]]:
        relay = EventRelay()  # the engine thread's hand-over: events reach the loop at each flush
        stream = RequestStream(relay)
        stats = RequestStats(prompt_tokens=1, completion_tokens=3, cached_prompt_tokens=0,
                             time_to_first_token_s=0.0, total_time_s=0.0)
        stream.sink(TokenDelta("r", (1,), "a"))
        relay.flush()
        got = []
        async for batch in stream.batches(Connected()):
            got.append([type(e).__name__ for e in batch])
            if len(got) == 1:  # the reader lags: three more events arrive before it asks again
                for event in (TokenDelta("r", (2,), "b"), TokenDelta("r", (3,), "c"),
                              Finished("r", "length", "abc", stats), TokenDelta("r", (4,), "late")):
                    stream.sink(event)
                relay.flush()
                await asyncio.sleep(0.01)
        return got

    assert asyncio.run(run()) == [["TokenDelta"], ["TokenDelta", "TokenDelta", "Finished"]]
