"""gpt-oss's harmony output format -> reasoning and answer.

After the prompt's ``<|start|>assistant`` the model writes messages such as
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``.
Text of the ``analysis`` channel is reasoning (the API's ``reasoning_content``, the GUI's thinking
block); text of ``final`` (and of a message with no channel) is the answer; ``commentary`` (tool
preambles) is shown as answer text too. Marker tokens never reach either.

:class:`HarmonyParser` works on streamed text cut anywhere, even inside a marker: text that could
still become a marker is held back until the next piece decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})

_START, _CHANNEL, _MESSAGE, _END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_CONSTRAIN, _RETURN, _CALL = "<|constrain|>", "<|return|>", "<|call|>"
_MARKERS = (_START, _CHANNEL, _MESSAGE, _END, _CONSTRAIN, _RETURN, _CALL)
REASONING_CHANNELS = frozenset({"analysis"})


def uses_harmony(model_type: str) -> bool:
    return model_type in HARMONY_MODEL_TYPES


@dataclass
class HarmonyDelta:
    """What one piece of streamed text added: reasoning and answer text."""

    reasoning: str = ""
    content: str = ""


class HarmonyParser:
    """Incremental parser. State: inside a message header (role, channel, constraint: dropped) or a
    message body (shown as reasoning or content by its channel). The prompt leaves the model in the
    header of an assistant message."""

    def __init__(self) -> None:
        self._pending = ""  # text that may be the start of a marker
        self._in_body = False
        self._header = ""  # the current message's header text (what follows <|channel|> names the channel)
        self._channel: str | None = None

    def feed(self, text: str) -> HarmonyDelta:
        delta = HarmonyDelta()
        data = self._pending + text
        self._pending = ""
        while data:
            cut = data.find("<|")
            if cut < 0:
                keep = 1 if data.endswith("<") else 0  # a lone "<" at the end may open a marker
                self._text(data[:len(data) - keep], delta)
                self._pending = data[len(data) - keep:]
                break
            if cut:
                self._text(data[:cut], delta)
                data = data[cut:]
            marker = next((m for m in _MARKERS if data.startswith(m)), None)
            if marker is not None:
                self._marker(marker)
                data = data[len(marker):]
            elif any(m.startswith(data) for m in _MARKERS):
                self._pending = data  # a marker cut by the stream: wait for the rest
                break
            else:
                self._text(data[:2], delta)  # "<|" that starts no marker is plain text
                data = data[2:]
        return delta

    def finish(self) -> HarmonyDelta:
        """Flush text held back at the end of the stream (an unfinished marker is plain text)."""
        delta = HarmonyDelta()
        self._text(self._pending, delta)
        self._pending = ""
        return delta

    def _marker(self, marker: str) -> None:
        if marker == _MESSAGE:
            self._in_body = True
            self._channel = self._channel_of(self._header)
        elif marker in (_START, _END, _RETURN, _CALL):
            self._in_body = False
            self._header, self._channel = "", None
        elif not self._in_body:  # <|channel|> / <|constrain|> inside a header
            self._header += marker

    @staticmethod
    def _channel_of(header: str) -> str | None:
        _, found, rest = header.partition(_CHANNEL)
        if not found:
            return None
        words = rest.split(_CONSTRAIN)[0].split()
        return words[0] if words else None

    def _text(self, text: str, delta: HarmonyDelta) -> None:
        if not text:
            return
        if not self._in_body:
            self._header += text
        elif self._channel in REASONING_CHANNELS:
            delta.reasoning += text
        else:
            delta.content += text


def parse_harmony(text: str) -> HarmonyDelta:
    """The reasoning and answer of a whole completion."""
    parser = HarmonyParser()
    whole = parser.feed(text)
    tail = parser.finish()
    return HarmonyDelta(whole.reasoning + tail.reasoning, whole.content + tail.content)
