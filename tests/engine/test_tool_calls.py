"""OpenAI tool calling: tools reach the prompt (DeepSeek-V3.2's encoder renders them), answers that
contain tool calls come back as ``tool_calls`` with finish_reason "tool_calls" (streaming and not),
and the two call formats parse."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hearth.engine.server.host import EngineHost
from hearth.engine.server.tool_calls import parse_tool_calls
from hearth.engine.text.dsv32_encoding import encode_tool_calls
from tests.engine.test_server_support import in_process_host, serving_client

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 4,
        "temperature": 0}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}


def test_parse_dsml_and_hermes_formats():
    text = "Let me look." + "\n\n" + encode_tool_calls([CALL])
    content, calls = parse_tool_calls(text, "deepseek_v32")
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    hermes = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_tool_calls(hermes, "qwen3_moe")
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    broken = "x <tool_call>not json</tool_call>"
    assert parse_tool_calls(broken, "qwen3_moe") == (broken, [])  # kept, not lost


def test_parse_glm_format():
    """GLM-4.5 puts each part on its own line, GLM-4.7 / GLM-5 run them together; string values are
    printed as they are, other values as JSON."""
    glm45 = ("<think>the user wants weather</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    content, calls = parse_tool_calls(glm45, "glm4_moe")
    assert content == "<think>the user wants weather</think>Checking."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    compact = ('<tool_call>search<arg_key>query</arg_key><arg_value>hearth "stones"</arg_value><arg_key>filters'
               '</arg_key><arg_value>{"year": 2024}</arg_value></tool_call><tool_call>now</tool_call>')
    content, calls = parse_tool_calls(compact, "glm_moe_dsa")
    assert content == "" and [c["function"]["name"] for c in calls] == ["search", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": 'hearth "stones"', "filters": {"year": 2024}}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    for broken in ("x <tool_call>two words</tool_call>", "<tool_call>f<arg_key>a</arg_key>stray</tool_call>"):
        assert parse_tool_calls(broken, "glm4_moe") == (broken, [])  # kept, not lost


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    yield from in_process_host(tmp_path_factory.mktemp("tools"), max_model_len=512)


@pytest.fixture
def http(host):
    yield from serving_client(host)


def test_tools_are_rendered_into_the_prompt(http):
    plain = http.post("/v1/chat/completions", json=BODY).json()
    with_tools = http.post("/v1/chat/completions", json={**BODY, "tools": [WEATHER]}).json()
    hidden = http.post("/v1/chat/completions", json={**BODY, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert hidden["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert with_tools["choices"][0]["finish_reason"] == "length"  # the random model calls nothing
    forced = http.post("/v1/chat/completions", json={**BODY, "tools": [WEATHER], "tool_choice": "required"})
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"


def _model_writes(host: EngineHost, monkeypatch, text: str) -> None:
    """Make the next answers end with ``text`` (what a trained model would write) in their Finished."""
    engine = host._engine
    real_finish = engine._finish

    def finish(request, reason, error=None):
        return dataclasses.replace(real_finish(request, reason, error), text=text)

    monkeypatch.setattr(engine, "_finish", finish)


def test_a_tool_call_comes_back_as_tool_calls(host, http, monkeypatch):
    _model_writes(host, monkeypatch, "Checking.\n\n" + encode_tool_calls([CALL]))
    body = http.post("/v1/chat/completions", json={**BODY, "tools": [WEATHER]}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "tools": [WEATHER], "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert any("tool_calls" in d for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
