"""Tool calls in generated text -> OpenAI ``tool_calls``.

Three formats, by model family:
- DeepSeek-V3.2 writes DSML blocks (``<｜DSML｜function_calls>`` with ``invoke`` / ``parameter``
  elements), parsed by ``dsv32_encoding``;
- GLM-4.5 / 4.6 / 4.7 and GLM-5 write ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
  </tool_call>`` (with or without newlines between the parts); their templates print string values
  as they are and other values as JSON, so a value that reads as JSON is taken as that JSON value;
- Qwen3 (and other Hermes-style templates) write ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Text outside the calls stays the message content. Unparseable blocks are left in the content rather
than dropped, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from hearth.engine.text.dsv32_encoding import parse_completion

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
_GLM_MODEL_TYPES = frozenset({"glm4_moe", "glm_moe_dsa"})


def _with_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", **call} for call in calls]


def _hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls, kept = [], []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            data = json.loads(match.group(1))
            name, arguments = data["name"], data.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue  # not a call we can read: it stays in the content
        kept.append(text[last:match.start()])
        last = match.end()
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append({"function": {"name": str(name), "arguments": args}})
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _glm_argument(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _glm_call(body: str) -> dict[str, Any] | None:
    """The call in one ``<tool_call>`` body, or None when it is not in GLM's shape."""
    name, sep, rest = body.partition("<arg_key>")
    name, pairs = name.strip(), sep + rest
    if not name or any(c.isspace() for c in name) or _GLM_ARGUMENT.sub("", pairs).strip():
        return None
    arguments = {key.strip(): _glm_argument(value) for key, value in _GLM_ARGUMENT.findall(pairs)}
    return {"function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _glm(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls, kept = [], []
    last = 0
    for match in _HERMES.finditer(text):
        call = _glm_call(match.group(1))
        if call is None:
            continue  # not a call we can read: it stays in the content
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def parse_tool_calls(text: str, model_type: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls with ids) from a finished answer."""
    if model_type == "deepseek_v32":
        parsed = parse_completion(text, thinking=False)
        calls = [{"function": call["function"]} for call in parsed["tool_calls"]]
        return parsed["content"].strip(), _with_ids(calls)
    content, calls = _glm(text) if model_type in _GLM_MODEL_TYPES else _hermes(text)
    return content, _with_ids(calls)
