"""DeepSeek-V3.2's prompt format, written from docs/dsa-models.md section 6.

DeepSeek-V3.2 ships no Jinja chat template; its prompt is built by code. ``encode_messages`` turns
OpenAI-style messages into that prompt string and ``parse_completion`` splits a generated answer back
into reasoning, visible content and tool calls.

Layout (BOS/EOS are ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>``)::

    BOS system  <｜User｜>question<｜Assistant｜></think>answer EOS  <｜User｜>next<｜Assistant｜><think>

A user turn ends in ``<think>`` only when it is the last one and the mode is "thinking"; otherwise
in ``</think>``. Assistant turns after the last user turn (thinking mode) carry
``reasoning + "</think>"`` before their content; earlier reasoning is dropped (``drop_thinking``).
Tool calls use the DSML markup; tool results are grouped in ``<function_results>``.

NOTE: the wording of the tools and response-format blocks in the system prompt is Hearth's own (the
spec does not give it); turns without tools or response formats follow the spec exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from hearth.engine.api import HearthError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"

ThinkingMode = Literal["chat", "thinking"]
Message = Mapping[str, Any]

_USER_ROLES = ("user", "developer")


# --------------------------------------------------------------------------- system-prompt blocks


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text that lists the callable tools and the DSML call syntax."""
    specs = "\n".join(json.dumps(_function_spec(t), ensure_ascii=False) for t in tools)
    return (
        "## Tools\n\n"
        "You can call the functions described below (one JSON schema per line):\n"
        f"{specs}\n\n"
        "To call functions, end your reply with this block, one invoke per call:\n"
        f"{CALLS_OPEN}\n"
        f'<{DSML}invoke name="FUNCTION">\n'
        f'<{DSML}parameter name="ARGUMENT" string="true">plain text value</{DSML}parameter>\n'
        f'<{DSML}parameter name="ARGUMENT" string="false">JSON value</{DSML}parameter>\n'
        f"</{DSML}invoke>\n"
        f"{CALLS_CLOSE}"
    )


def response_format_block(response_format: Mapping[str, Any]) -> str:
    """The system-prompt text that asks for output following a JSON schema."""
    schema = response_format.get("json_schema", response_format)
    return (
        "## Response Format:\n\n"
        "Answer with JSON only, valid against this schema:\n"
        f"{json.dumps(schema, ensure_ascii=False)}"
    )


def _function_spec(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    # OpenAI puts the schema under "function"; a bare function schema is accepted too.
    return tool.get("function", tool)


def _with_blocks(text: str, message: Message) -> str:
    if message.get("tools"):
        text += "\n\n" + tools_block(message["tools"])
    if message.get("response_format"):
        text += "\n\n" + response_format_block(message["response_format"])
    return text


# --------------------------------------------------------------------------- tool calls


def _arguments(call: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    function = call.get("function", call)
    args = function.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise HearthError(f"tool call {function.get('name')!r} has arguments that are not JSON") from err
    if not isinstance(args, Mapping):
        raise HearthError(f"tool call {function.get('name')!r} arguments must be a JSON object")
    return str(function["name"]), args


def encode_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """DSML text for OpenAI-style ``tool_calls`` (``arguments`` as a dict or a JSON string)."""
    parts = [CALLS_OPEN]
    for call in tool_calls:
        name, args = _arguments(call)
        parts.append(f'<{DSML}invoke name="{name}">')
        for key, value in args.items():
            is_string = isinstance(value, str)
            text = value if is_string else json.dumps(value, ensure_ascii=False)
            flag = "true" if is_string else "false"
            parts.append(f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>')
        parts.append(f"</{DSML}invoke>")
    parts.append(CALLS_CLOSE)
    return "\n".join(parts)


# --------------------------------------------------------------------------- encoder


def _last_user_index(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in _USER_ROLES:
            return i
    return -1


def _content(message: Message) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: keep the text parts, in order.
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _think_marker(thinking: bool) -> str:
    return THINK_START if thinking else THINK_END


def _encode_user(message: Message, thinking: bool) -> str:
    text = _content(message)
    if message.get("role") == "developer":
        text = _with_blocks("", message).lstrip("\n") + f"\n\n# The user's message is: {text}"
    return f"{USER}{text}{ASSISTANT}{_think_marker(thinking)}"


def _encode_assistant(message: Message, keep_reasoning: bool) -> str:
    text = ""
    if keep_reasoning:
        text += (message.get("reasoning_content") or "") + THINK_END
    text += _content(message)
    if message.get("tool_calls"):
        text += "\n\n" + encode_tool_calls(message["tool_calls"])
    return text + EOS


def _encode_tool(messages: Sequence[Message], i: int, thinking: bool) -> str:
    first = i == 0 or messages[i - 1].get("role") != "tool"
    last = i == len(messages) - 1 or messages[i + 1].get("role") != "tool"
    text = "\n\n<function_results>" if first else ""
    text += f"\n<result>{_content(messages[i])}</result>"
    if last:
        text += "\n</function_results>\n\n" + _think_marker(thinking)
    return text


def encode_messages(
    messages: Sequence[Message],
    thinking_mode: ThinkingMode = "chat",
    *,
    drop_thinking: bool = True,
    add_bos: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> str:
    """Return DeepSeek-V3.2's prompt text for OpenAI-style ``messages``.

    ``tools``/``response_format`` attach to the first system message (one is created if needed); a
    system or developer message may also carry its own ``tools``/``response_format`` keys.
    ``drop_thinking=False`` keeps the reasoning of earlier assistant turns (thinking mode only).
    The prompt already ends with the assistant prefix whenever the last message is a user turn.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise HearthError(f"thinking_mode must be 'chat' or 'thinking', not {thinking_mode!r}")
    messages = _attach_blocks(messages, tools, response_format)
    last_user = _last_user_index(messages)
    is_thinking = thinking_mode == "thinking"
    parts = [BOS] if add_bos else []
    for i in range(len(messages)):
        # Turns after the last user message are the live exchange; earlier reasoning is dropped.
        live = is_thinking and (i >= last_user or not drop_thinking)
        parts.append(_encode_one(messages, i, live))
    return "".join(parts)


def _encode_one(messages: Sequence[Message], i: int, live: bool) -> str:
    message = messages[i]
    role = message.get("role")
    if role == "system":
        return _with_blocks(_content(message), message)
    if role in _USER_ROLES:
        return _encode_user(message, live)
    if role == "assistant":
        return _encode_assistant(message, live)
    if role == "tool":
        return _encode_tool(messages, i, live)
    raise HearthError(f"unknown message role {role!r} (expected system, user, developer, assistant or tool)")


def _attach_blocks(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    response_format: Mapping[str, Any] | None,
) -> list[Message]:
    out = [dict(m) for m in messages]
    if not tools and not response_format:
        return out
    if not out or out[0].get("role") != "system":
        out.insert(0, {"role": "system", "content": ""})
    if tools:
        out[0]["tools"] = tools
    if response_format:
        out[0]["response_format"] = response_format
    return out


# --------------------------------------------------------------------------- parser

_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">\n?(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def _parse_value(text: str, is_string: bool) -> Any:
    if is_string:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_tool_calls(block: str) -> list[dict[str, Any]]:
    """OpenAI-style tool calls (``arguments`` as a JSON string) from a DSML block."""
    calls = []
    for name, body in _INVOKE.findall(block):
        args = {key: _parse_value(value, flag == "true") for key, flag, value in _PARAM.findall(body)}
        arguments = json.dumps(args, ensure_ascii=False)
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def parse_completion(text: str, thinking: bool = True) -> dict[str, Any]:
    """Split generated text into ``reasoning_content``, ``content`` and ``tool_calls``.

    With ``thinking`` the text is expected to start inside ``<think>`` (the prompt opened it): all
    text before ``</think>`` is reasoning. An answer that never closes its reasoning is all reasoning.
    """
    text = text.split(EOS, 1)[0]
    reasoning = ""
    if thinking:
        reasoning, sep, rest = text.partition(THINK_END)
        if not sep:
            return {"reasoning_content": reasoning, "content": "", "tool_calls": []}
        text = rest
    content, sep, calls = text.partition("\n\n" + CALLS_OPEN)
    tool_calls = parse_tool_calls(calls) if sep else []
    return {"reasoning_content": reasoning, "content": content, "tool_calls": tool_calls}
