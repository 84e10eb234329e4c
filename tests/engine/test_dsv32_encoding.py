"""DeepSeek-V3.2 prompt encoding (docs/dsa-models.md section 6) and completion parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hearth.engine.api import HearthError
from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.dsv32_encoding import (
    BOS,
    EOS,
    encode_messages,
    encode_tool_calls,
    parse_completion,
    parse_tool_calls,
)
from hearth.engine.text.tokenizer import Tokenizer

SPEC_MESSAGES = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]
SPEC_PROMPT = (
    "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek."
    "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>"
)
WEATHER_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 2})},
}


def test_spec_example_exactly():
    assert encode_messages(SPEC_MESSAGES, "thinking") == SPEC_PROMPT


def test_spec_example_token_structure(tmp_path: Path):
    write_tiny_tokenizer(tmp_path, "deepseek_v32", 320)
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v32")
    ids = tok.encode_chat(SPEC_MESSAGES, thinking=True)
    assert tok.decode(ids) == SPEC_PROMPT
    user, assistant = tok.token_to_id("<｜User｜>"), tok.token_to_id("<｜Assistant｜>")
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert ids[:2] == [0, user] and ids[-2:] == [assistant, think]
    assert ids.count(1) == 1 and ids.count(end_think) == 1


def test_chat_mode_closes_thinking_everywhere():
    prompt = encode_messages(SPEC_MESSAGES, "chat")
    assert prompt.endswith("1+1=?<｜Assistant｜></think>")
    assert "thinking..." not in prompt and "<think>" not in prompt


def test_reasoning_after_last_user_is_kept():
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    thinking = encode_messages(messages, "thinking")
    assert thinking == f"{BOS}SYS<｜User｜>q<｜Assistant｜><think>r</think>a{EOS}"
    assert encode_messages(messages, "chat") == f"{BOS}SYS<｜User｜>q<｜Assistant｜></think>a{EOS}"


def test_drop_thinking_false_keeps_old_reasoning():
    prompt = encode_messages(SPEC_MESSAGES, "thinking", drop_thinking=False)
    assert prompt == (
        f"{BOS}<｜User｜>hello<｜Assistant｜><think>thinking...</think>Hello! I am DeepSeek.{EOS}"
        "<｜User｜>1+1=?<｜Assistant｜><think>"
    )


def test_no_bos():
    assert encode_messages(SPEC_MESSAGES, "thinking", add_bos=False) == SPEC_PROMPT[len(BOS) :]


def test_tool_call_round_trip_with_results():
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "need tool",
            "tool_calls": [WEATHER_CALL, {"function": {"name": "now", "arguments": {}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "12:00"},
    ]
    calls = encode_tool_calls(messages[1]["tool_calls"])
    expected = (
        f"{BOS}<｜User｜>Weather?<｜Assistant｜><think>need tool</think>Checking.\n\n{calls}{EOS}"
        "\n\n<function_results>\n<result>sunny</result>\n<result>12:00</result>\n</function_results>"
        "\n\n<think>"
    )
    assert encode_messages(messages, "thinking") == expected
    assert encode_messages(messages, "chat").endswith("</function_results>\n\n</think>")
    assert calls == (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    )
    parsed = parse_tool_calls(calls)
    assert [c["function"]["name"] for c in parsed] == ["get_weather", "now"]
    assert json.loads(parsed[0]["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    assert json.loads(parsed[1]["function"]["arguments"]) == {}


def test_tools_go_into_the_system_prompt():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt = encode_messages([{"role": "user", "content": "hi"}], tools=tools)
    system = prompt[len(BOS) : prompt.index("<｜User｜>")]
    assert system.startswith("\n\n## Tools") and '"name": "get_weather"' in system
    with_system = encode_messages(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        tools=tools,
        response_format={"type": "json_object"},
    )
    assert with_system.startswith(f"{BOS}S\n\n## Tools") and "## Response Format:" in with_system


def test_developer_role():
    prompt = encode_messages([{"role": "developer", "content": "find x"}], "thinking")
    assert prompt == f"{BOS}<｜User｜>\n\n# The user's message is: find x<｜Assistant｜><think>"


def test_errors():
    with pytest.raises(HearthError, match="role"):
        encode_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(HearthError, match="thinking_mode"):
        encode_messages([], "deep")  # type: ignore[arg-type]
    broken_call = {"function": {"name": "f", "arguments": "{"}}
    bad = [{"role": "assistant", "content": "", "tool_calls": [broken_call]}]
    with pytest.raises(HearthError, match="not JSON"):
        encode_messages(bad)


def test_parse_completion():
    calls = encode_tool_calls([WEATHER_CALL])
    out = parse_completion(f"let me see</think>On it.\n\n{calls}{EOS}")
    assert out["reasoning_content"] == "let me see" and out["content"] == "On it."
    assert out["tool_calls"][0]["function"]["name"] == "get_weather"
    assert parse_completion(f"plain answer{EOS}junk", thinking=False) == {
        "reasoning_content": "",
        "content": "plain answer",
        "tool_calls": [],
    }
    assert parse_completion("still thinking")["reasoning_content"] == "still thinking"
    assert parse_completion("still thinking")["content"] == ""


def test_template_overrides_builtin_encoder(tmp_path: Path):
    write_tiny_tokenizer(tmp_path, "deepseek_v32", 320)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}T{{ messages[-1]['content'] }}")
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v32")
    assert tok.decode(tok.encode_chat(SPEC_MESSAGES, thinking=True)) == f"{BOS}T1+1=?"
