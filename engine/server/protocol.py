"""The OpenAI-compatible wire format of the engine host: request bodies (pydantic), their checks,
and the JSON / server-sent-event payloads sent back. Pure data: no HTTP framework, no engine state.

Unknown request fields are accepted and ignored, as OpenAI clients send many optional ones; a JSON
null in a known field means "not given" (clients send null for unset optional fields), and numbers
must be finite (Python's json reads NaN and Infinity, which no field means). Field checks of the
wire format (``n``, ``max_tokens`` >= 1, logprobs, ``response_format``'s shape, ``logit_bias`` keys) raise
``APIError`` here, so the server turns them into ``{"error": {...}}`` bodies; sampling ranges are
checked once, by the engine (``SamplingParams``), and come back as 400s naming the field too.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hearth.engine.api import Finished, RequestStats, usage

# Names a chat template gets from the server (with the tokenizer's special tokens) and the other
# arguments of Engine.encode: a request's chat_template_kwargs must not replace them.
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "raise_exception",
                                    "strftime_now", "bos_token", "eos_token", "pad_token", "unk_token",
                                    "prompt", "prompt_token_ids", "max_tokens", "conversation_id",
                                    "continue_final_message"})
# What /v1/completions writes when the request gives no max_tokens (OpenAI's and vLLM's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- requests ------------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """Drop the known fields given as null, so they take their defaults (a null required field is
        then reported missing)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema``: OpenAI's ``{name, schema, strict}`` (``strict`` changes nothing:
    what Hearth accepts it enforces)."""

    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Lenient):
    """vLLM's ``structured_outputs``: only its ``json`` (a schema, or its JSON text) is supported."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")


class HearthFields(_Lenient):
    """``"hearth": {...}`` in a completion request: Hearth's own options.

    conversation_id: names the conversation the request continues; its cache pages are kept in
    RAM and on disk under that name and deleted by ``POST /hearth/cache/drop``.
    """

    conversation_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")


class _SamplingFields(_Lenient):
    """Fields shared by chat and text completions (OpenAI names, plus vLLM's common extensions, plus
    ``hearth``: Hearth's own options)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # vLLM's older name for structured_outputs.json
    structured_outputs: StructuredOutputs | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    hearth: HearthFields | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.hearth.conversation_id if self.hearth is not None else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return _check_max_tokens(self.max_tokens, "max_tokens")


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # "parsed": a thinking model's reasoning comes back as reasoning_content, apart from the
    # content; "raw": the text as the model wrote it, reasoning and its markers inside the content.
    reasoning_format: Literal["parsed", "raw"] = "parsed"
    # vLLM's: render without the assistant's generation prompt (None: unless continuing), or end the
    # prompt inside the last (assistant) message so the answer continues its text.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @property
    def uses_tools(self) -> bool:
        """Tools offered to the model (``tool_choice`` "auto" or unset; "none" hides them)."""
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice must be \"auto\" or \"none\" (forcing a tool is not supported)",
                           param="tool_choice")
        return bool(self.tools) and self.tool_choice != "none"

    def chat_options(self) -> dict[str, Any]:
        options = dict(self.chat_template_kwargs or {})
        taken = sorted(set(options) & TEMPLATE_OWN_VARIABLES)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
                                "those itself (send messages and tools as their own fields)",
                           param="chat_template_kwargs", code="invalid_value")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: a prompt "
                                "that continues the last message cannot also open a new one",
                           param="continue_final_message", code="invalid_value")
        if self.uses_tools:
            options["tools"] = self.tools
        options["add_generation_prompt"] = self.add_generation_prompt is not False and not self.continue_final_message
        options["continue_final_message"] = self.continue_final_message
        return options

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return _check_max_tokens(self.max_completion_tokens, "max_completion_tokens")
        return _check_max_tokens(self.max_tokens, "max_tokens")

    def message_dicts(self) -> list[dict[str, Any]]:
        for i, message in enumerate(self.messages):
            for part in message.content if isinstance(message.content, list) else []:
                if part.get("type") != "text":
                    raise APIError(400, f"message {i} has a {part.get('type')!r} part; this model reads text only",
                                   param=f"messages.{i}.content")
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is None:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return _check_max_tokens(self.max_tokens, "max_tokens")

    def prompt_kwargs(self) -> dict[str, Any]:
        """``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` for ``Engine.encode``."""
        if self.echo or self.suffix is not None:
            raise APIError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"got {len(prompt)} prompts; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return {"prompt_token_ids": list(prompt)}


def check_text(value: Any, path: str = "") -> None:
    """Raise a 400 naming the field if a string in ``value`` (a request as plain data) is not valid
    Unicode: JSON lets a lone UTF-16 surrogate such as "\\ud800" through, and nothing downstream
    (tokenizer, file system, UTF-8 output) can handle one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            where = path or "body"
            raise APIError(400, f"{where}: the text holds a lone UTF-16 surrogate at character {err.start}, "
                                "which is not valid Unicode", param=path or None, code="invalid_value") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, path)
            check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_text(item, f"{path}.{i}" if path else str(i))


def _check_max_tokens(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise APIError(400, f"{name} must be at least 1, got {value}", param=name, code="invalid_value")
    return value


def sampling_fields(req: _SamplingFields) -> dict[str, Any]:
    """The sampling options the client gave, as ``SamplingParams`` keywords (None = not given;
    ``Engine.add_request`` fills in the model's defaults and checks the values).

    Raises APIError (400) for what the wire format itself rules out: ``n != 1``, logprobs, a
    ``max_tokens`` below 1, an unknown ``response_format`` and ``logit_bias`` keys that are not token ids.
    A JSON answer's schema (``response_format``, or vLLM's ``guided_json`` / ``structured_outputs.json``)
    goes as ``json_schema`` (JSON text); the engine compiles it and refuses what it cannot enforce."""
    if req.n != 1:
        raise APIError(400, f"n must be 1 (Hearth returns one choice per request), got {req.n}", param="n")
    if getattr(req, "logprobs", None):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    schema = _json_schema(req)
    return {
        "temperature": req.temperature, "top_p": req.top_p,
        "top_k": 0 if req.top_k == -1 else req.top_k,  # vLLM's "off"
        "min_p": req.min_p, "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "max_tokens": req.requested_max_tokens(),
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "logit_bias": _token_ids(req.logit_bias), "json_schema": schema,
    }


def _json_schema(req: _SamplingFields) -> str | None:
    """The schema the answer is held to, as JSON text (``{"type": "object"}`` for json_object), or None."""
    given = {"response_format": _response_format_schema(req.response_format), "guided_json": req.guided_json,
             "structured_outputs": _structured_outputs_schema(req.structured_outputs)}
    named = [name for name, schema in given.items() if schema is not None]
    if len(named) > 1:
        raise APIError(400, f"give one of {' and '.join(named)}: each asks for a JSON answer", param=named[1],
                       code="invalid_value")
    if not named:
        return None
    schema = given[named[0]]
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)


def _response_format_schema(response_format: ResponseFormat | None) -> dict[str, Any] | bool | None:
    """``json_object``: any JSON object; ``json_schema``: its schema; ``text`` (or none): None."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.type == "json_schema":
        given = response_format.json_schema
        if given is None or given.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema (the JSON Schema of the answer)",
                           param="response_format.json_schema", code="invalid_value")
        return given.schema_
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, not "
                        f"{response_format.type!r}", param="response_format.type", code="invalid_value")


def _structured_outputs_schema(options: StructuredOutputs | None) -> dict[str, Any] | bool | str | None:
    if options is None:
        return None
    others = sorted(k for k, v in (options.model_extra or {}).items() if v is not None)
    if others:
        raise APIError(400, f"structured_outputs supports only json, not {', '.join(others)}",
                       param="structured_outputs", code="unsupported_value")
    return options.json_


def _token_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys (token ids, as JSON object keys are strings) as ints."""
    if logit_bias is None:
        return None
    try:
        return {int(token): bias for token, bias in logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids, e.g. {\"1234\": -100}", param="logit_bias",
                       code="invalid_value") from None


# ---- responses -----------------------------------------------------------------------------


def finish_error(finished: Finished) -> APIError | None:
    """The error a request that ended abnormally reports; None for stop / length."""
    if finished.reason in ("stop", "length"):
        return None
    if finished.reason == "abort":
        return APIError(503, finished.error or "the request was cancelled", "server_error", code="aborted")
    return APIError(500, finished.error or "the engine failed on this request", "server_error")


# JSON-encoded with its quotes, the marker cannot occur inside another encoded string (an id, a model name).
_MARKER = "\x00text\x00"


class ResponseWriter:
    """Builds the response objects of one request (ids, timestamps and object names in one place)."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        # A text chunk is the same bytes each time but for its text: encoded once, around a marker.
        marker = json.dumps(_MARKER)
        self._text_event = sse(self.chunk(_MARKER)).decode().split(marker)

    def content_event(self, text: str) -> bytes:
        """``sse(self.chunk(text))``, without building and encoding the whole chunk per token."""
        head, tail = self._text_event
        return (head + json.dumps(text, ensure_ascii=False) + tail).encode()

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def response(self, finished: Finished, content: str | None = None, reasoning: str = "",
                 tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The non-streaming body. For chat, ``content`` (default: the whole text), ``reasoning``
        and ``tool_calls`` are what the chat layer split out of the answer."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": finished.text if content is None else content}
            if reasoning:
                message["reasoning_content"] = reasoning
            reason = finished.reason
            if tool_calls:
                message["content"] = message["content"] or None
                message["tool_calls"] = tool_calls
                reason = "tool_calls"
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": finished.text, "logprobs": None, "finish_reason": finished.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(finished.stats)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
              reasoning: str = "") -> dict[str, Any]:
        """One streamed chunk; ``text=None`` for the closing chunk that carries only the reason.
        ``reasoning`` goes out as the delta's ``reasoning_content`` (chat only)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def tool_calls_chunk(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """One streamed chunk carrying whole tool calls (each with its index)."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": None}])

    def usage_chunk(self, stats: RequestStats) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(stats)
        return body


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
