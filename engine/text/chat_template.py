"""Render Hugging Face-style Jinja chat templates safely.

Checkpoints ship their prompt format as a Jinja template (``chat_template`` in
``tokenizer_config.json`` or a ``chat_template.jinja`` file). Templates are untrusted input, so they
run in jinja2's immutable sandbox with the settings and helpers those templates are written
against: ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and
a ``tojson`` filter that keeps non-ASCII text as is. Any template failure becomes a ``HearthError``
carrying the template's own message.

Templates get every message's ``content`` as a string: OpenAI clients may send it as a list of parts
(``[{"type": "text", "text": ...}]``), and most templates do string operations on it (Qwen3's
``content.startswith(...)``), so the text parts are joined with newlines first, as vLLM does for such
templates. (Non-text parts are refused before a prompt is rendered: Hearth's models read text only.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hearth.engine.api import HearthError


class TemplateRaisedError(HearthError):
    """The template itself rejected the conversation (it called ``raise_exception``)."""


class _GenerationBlock(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (used by some templates to mark assistant
    text for training masks) and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)  # the "generation" name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: no HTML escaping (unlike jinja's built-in tojson): prompts are not HTML.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Parse a template once; a syntax error becomes a ``HearthError``."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise HearthError(f"chat template has a syntax error (line {err.lineno}): {err.message}") from err


def text_parts(content: Sequence[Any]) -> list[str]:
    """The texts of OpenAI content parts (``[{"type": "text", "text": ...}, ...]``), in order."""
    return [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]


def _string_content(message: Mapping[str, Any]) -> Mapping[str, Any]:
    content = message.get("content")
    return {**message, "content": "\n".join(text_parts(content))} if isinstance(content, list) else message


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render ``source`` for ``messages`` and return the prompt text.

    ``special_tokens`` maps names such as ``bos_token``/``eos_token`` to their text; ``extra`` holds
    template-specific switches (``thinking``, ``enable_thinking``, ``documents``...).
    """
    template = compile_template(source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(extra)
    variables.update(messages=[_string_content(m) for m in messages], add_generation_prompt=add_generation_prompt,
                     tools=tools)
    try:
        return template.render(**variables)
    except TemplateRaisedError:
        raise
    except jinja2.TemplateError as err:
        raise HearthError(f"chat template failed: {err.message or type(err).__name__}") from err
    except Exception as err:  # any failure inside an untrusted template is the template's fault
        raise HearthError(f"chat template failed: {type(err).__name__}: {err}") from err
