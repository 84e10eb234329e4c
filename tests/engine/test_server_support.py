"""Helpers for the engine host tests (start a real ``python -m hearth.engine.server`` on 127.0.0.1,
bounded polling), and unit tests of the wire-format pieces that need no server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from hearth.engine.api import Finished, RequestStats
from hearth.engine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseWriter,
    finish_error,
    sampling_fields,
    sse,
)

T = TypeVar("T")
LOCAL_URL = "http://127.0.0.1"  # in-process clients: a Host the server answers to ("testserver" is refused)
STARTUP_TIMEOUT_S = 120.0  # generous: CI machines may be busy; the wait ends as soon as it answers


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


@dataclass
class ServerProcess:
    """A running engine host subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    api_key: str | None
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(model_dir: Path, work_dir: Path, *, api_key: str | None = None, max_model_len: int = 512,
                 extra: tuple[str, ...] = ()) -> ServerProcess:
    """Start an engine host on a free port and wait until it answers /health."""
    import httpx

    work_dir.mkdir(parents=True, exist_ok=True)
    port_file, log_path = work_dir / "port", work_dir / "server.log"
    cmd = [sys.executable, "-m", "hearth.engine.server", "--model", str(model_dir), "--port", "0",
           "--port-file", str(port_file), "--max-model-len", str(max_model_len), "--log-level", "warning", *extra]
    env = {k: v for k, v in os.environ.items() if k != "HEARTH_API_KEY"}
    if api_key:
        env["HEARTH_API_KEY"] = api_key
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    server = ServerProcess(proc, 0, api_key, log_path)

    def port_ready() -> bool:
        assert proc.poll() is None, f"server exited: {server.log()}"
        return port_file.exists() and bool(port_file.read_text().strip())

    wait_until(port_ready, STARTUP_TIMEOUT_S, 0.05, "the server's port file")
    server.port = int(port_file.read_text())

    def healthy() -> bool:
        try:
            return httpx.get(f"{server.base_url}/health", headers=server.headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, STARTUP_TIMEOUT_S, 0.05, "/health")
    return server


# ---- unit tests of the wire format ---------------------------------------------------------


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_sampling_fields_are_what_the_client_gave():
    fields = sampling_fields(_chat(temperature=0.0, stop="END", max_completion_tokens=9))
    assert fields["temperature"] == 0.0 and fields["top_p"] is None and fields["max_tokens"] == 9
    assert fields["stop"] == ("END",)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_fields_are_400(fields, param):
    request = _chat(**fields)
    with pytest.raises(APIError) as err:
        request.requested_max_tokens()
        sampling_fields(request)
    assert err.value.status == 400 and err.value.param == param




def test_null_means_not_given():
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi", "name": None}], "n": None, "stream": None,
        "ignore_eos": None, "reasoning_format": None, "stream_options": {"include_usage": None}, "temperature": None,
        "stop": None, "hearth": None, "add_generation_prompt": None, "continue_final_message": None})
    assert (request.n, request.stream, request.ignore_eos, request.reasoning_format) == (1, False, False, "parsed")
    assert not request.include_usage and not request.continue_final_message
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": None, "suffix": None})
    assert completion.prompt_kwargs() == {"prompt": "a"}
    with pytest.raises(ValueError, match="Field required"):
        ChatCompletionRequest.model_validate({"model": None, "messages": [{"role": "user", "content": "hi"}]})


def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context():
    assert sampling_fields(CompletionRequest(model="m", prompt="a"))["max_tokens"] == 16
    assert sampling_fields(CompletionRequest(model="m", prompt="a", max_tokens=300))["max_tokens"] == 300
    assert sampling_fields(_chat())["max_tokens"] is None


def test_top_k_minus_one_is_off_and_logit_bias_keys_become_ids():
    fields = sampling_fields(_chat(top_k=-1, logit_bias={"12": -100, "7": 2.5}))
    assert fields["top_k"] == 0 and fields["logit_bias"] == {12: -100, 7: 2.5}
    with pytest.raises(APIError, match="logit_bias keys must be token ids") as err:
        sampling_fields(_chat(logit_bias={"the": 1}))
    assert err.value.param == "logit_bias"


def test_response_format_becomes_the_json_schema():
    assert sampling_fields(_chat(response_format={"type": "text"}))["json_schema"] is None
    assert sampling_fields(_chat())["json_schema"] is None
    assert json.loads(sampling_fields(_chat(response_format={"type": "json_object"}))["json_schema"]) == {
        "type": "object"}
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    given = sampling_fields(_chat(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert given["json_schema"] == json.dumps(schema)  # properties keep their order: the answer's order
    assert json.loads(sampling_fields(_chat(guided_json={"type": "integer"}))["json_schema"]) == {"type": "integer"}
    vllm = sampling_fields(_chat(structured_outputs={"json": {"type": "null"}}))
    assert json.loads(vllm["json_schema"]) == {"type": "null"}
    for fields, param in (({"response_format": {"type": "yaml"}}, "response_format.type"),
                          ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                          ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
                          ({"structured_outputs": {"regex": "a+"}}, "structured_outputs")):
        with pytest.raises(APIError) as err:
            sampling_fields(_chat(**fields))
        assert err.value.status == 400 and err.value.param == param


def test_generation_prompt_options_reach_the_chat_format():
    assert _chat().chat_options() == {"add_generation_prompt": True, "continue_final_message": False}
    assert _chat(continue_final_message=True).chat_options() == {"add_generation_prompt": False,
                                                                 "continue_final_message": True}
    assert _chat(add_generation_prompt=False).chat_options()["add_generation_prompt"] is False
    with pytest.raises(APIError, match="cannot both be true") as err:
        _chat(continue_final_message=True, add_generation_prompt=True).chat_options()
    assert err.value.param == "continue_final_message"
    with pytest.raises(APIError) as err:
        _chat(chat_template_kwargs={"continue_final_message": True}).chat_options()
    assert err.value.param == "chat_template_kwargs"


def test_completion_prompt_forms():
    assert CompletionRequest(model="m", prompt="abc").prompt_kwargs() == {"prompt": "abc"}
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt_kwargs() == {"prompt_token_ids": [1, 2]}
    assert CompletionRequest(model="m", prompt=[[3, 4]]).prompt_kwargs() == {"prompt_token_ids": [3, 4]}
    with pytest.raises(APIError, match="one prompt per request"):
        CompletionRequest(model="m", prompt=["a", "b"]).prompt_kwargs()


def test_non_text_content_parts_are_rejected():
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}])
    with pytest.raises(APIError, match="text only"):
        request.message_dicts()


def test_writer_and_finish_errors():
    stats = RequestStats(3, 2, 0, 0.1, 0.2)
    body = ResponseWriter("r1", "m", chat=True).response(Finished("r1", "length", "hey", stats))
    assert body["choices"][0]["message"]["content"] == "hey"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert finish_error(Finished("r1", "stop", "", stats)) is None
    assert finish_error(Finished("r1", "error", "", stats, "GPU out of memory")).status == 500


def in_process_host(root: Path, max_model_len: int, seed: int = 4):
    """A started EngineHost serving a tiny DeepSeek-V3.2 named "tiny" (a generator: close after)."""
    from hearth.engine.api import EngineConfig
    from hearth.engine.server.host import EngineHost
    from hearth.engine.testing.tiny import write_tiny_model

    engine_host = EngineHost(EngineConfig(max_model_len=max_model_len, device="cpu"))
    engine_host.load(write_tiny_model(root / "tiny", "deepseek_v32", seed=seed))
    engine_host.start()
    try:
        yield engine_host
    finally:
        engine_host.close()


def serving_client(engine_host):
    """Starlette's TestClient over the host's app, errors answered as HTTP (a generator)."""
    from fastapi.testclient import TestClient

    from hearth.engine.server.app import create_app

    with TestClient(create_app(engine_host), base_url=LOCAL_URL, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", ["hi", ' "quoted" \\ back\nslash', "ünïcödé 🙂", "\x00text\x00", ""])
def test_a_text_chunk_encodes_as_the_whole_chunk_would(chat, text):
    writer = ResponseWriter("r\"1", 'model "x"', chat)
    assert writer.content_event(text) == sse(writer.chunk(text))


def test_the_event_relay_wakes_each_loop_once_per_flush_and_keeps_order():
    import asyncio
    import threading

    from hearth.engine.api import TokenDelta
    from hearth.engine.server.host import EventRelay

    relay = EventRelay()
    loop = asyncio.new_event_loop()
    wakes = {"n": 0}
    real = loop.call_soon_threadsafe

    def counted(*args):
        wakes["n"] += 1
        return real(*args)

    loop.call_soon_threadsafe = counted
    got: dict[str, list[str]] = {"a": [], "b": []}
    sinks = {rid: relay.sink(loop, lambda e, rid=rid: got[rid].append(e.text)) for rid in got}

    def engine_thread() -> None:  # three steps of two requests' tokens, flushed once per step
        for step in range(3):
            for rid in got:
                sinks[rid](TokenDelta(rid, (step,), f"{rid}{step}"))
            relay.flush()
        relay.flush()  # nothing queued: no wake-up
        loop.call_soon_threadsafe(loop.stop)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    loop.run_forever()
    thread.join()
    loop.close()
    assert got == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    assert wakes["n"] == 3 + 1  # one per step with events, and the stop
    relay.sink(loop, got["a"].append)(TokenDelta("a", (9,), "late"))
    relay.flush()  # the loop is closed (a server shutting down): dropped without an error


def test_a_request_s_first_token_is_relayed_before_the_next_step_starts(tmp_path):
    """The relay normally hands a step's events to the loop when the next step is launched (which may
    first capture a CUDA graph); a request's first token is relayed as soon as its step ends."""
    import asyncio
    import threading

    from hearth.engine.api import TokenDelta

    log: list[str] = []
    done = threading.Event()
    loop = asyncio.new_event_loop()
    hosts = in_process_host(tmp_path, max_model_len=64)
    engine_host = next(hosts)
    try:
        engine, relay = engine_host._engine, engine_host.relay
        real_step, real_flush = engine.step, relay.flush

        def step(launched=None):
            log.append("step")
            return real_step(launched=launched)

        def flush():
            log.append("flush")
            real_flush()

        engine.step, relay.flush = step, flush
        queue = relay.sink(loop, lambda event: None)

        def sink(event):
            log.append("token" if isinstance(event, TokenDelta) else "end")
            queue(event)
            if not isinstance(event, TokenDelta):
                done.set()

        engine_host.submit(sink, sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True},
                           prompt_token_ids=list(range(3, 20)))
        assert done.wait(120)
    finally:
        hosts.close()
        loop.close()
    first = log.index("token")
    assert "step" in log[first:] and log[first + 1:].index("flush") < log[first + 1:].index("step")
