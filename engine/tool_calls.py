"""Tool calls in generated text -> OpenAI ``tool_calls``.

Two formats, by model family:
- DeepSeek-V3.2 writes DSML blocks (``<｜DSML｜function_calls>`` with ``invoke`` / ``parameter``
  elements), parsed by ``dsv32_encoding``;
- Qwen3 (and other Hermes-style templates) write ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Text outside the calls stays the message content. Unparseable blocks are left in the content rather
than dropped, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from hearth.engine.dsv32_encoding import parse_completion

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def parse_tool_calls(text: str, model_type: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls with ids) from a finished answer."""
    if model_type == "deepseek_v32":
        parsed = parse_completion(text, thinking=False)
        calls = [{"function": call["function"]} for call in parsed["tool_calls"]]
        return parsed["content"].strip(), _with_ids(calls)
    content, calls = _hermes(text)
    return content, _with_ids(calls)
