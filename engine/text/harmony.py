"""gpt-oss's harmony output format -> reasoning and answer.

After the prompt's ``<|start|>assistant`` the model writes messages such as
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``.
Text of the ``analysis`` channel is reasoning (the API's ``reasoning_content``, the GUI's thinking
block); text of ``final`` (and of a message with no channel) is the answer; ``commentary`` (tool
preambles) is shown as answer text too. Marker tokens never reach either.

:class:`HarmonyParser` works on streamed text cut anywhere, even inside a marker (its
``markers.MarkerScanner`` holds back text that could still become a marker).
"""

from __future__ import annotations

from hearth.engine.text.markers import Marker, MarkerScanner, ReasoningDelta

HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})

_START, _CHANNEL, _MESSAGE, _END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_CONSTRAIN, _RETURN, _CALL = "<|constrain|>", "<|return|>", "<|call|>"
_MARKERS = (_START, _CHANNEL, _MESSAGE, _END, _CONSTRAIN, _RETURN, _CALL)
REASONING_CHANNELS = frozenset({"analysis"})


def uses_harmony(model_type: str) -> bool:
    return model_type in HARMONY_MODEL_TYPES


class HarmonyParser:
    """Incremental parser. State: inside a message header (role, channel, constraint: dropped) or a
    message body (shown as reasoning or content by its channel). The prompt leaves the model in the
    header of an assistant message."""

    def __init__(self) -> None:
        self._scanner = MarkerScanner(_MARKERS)
        self._in_body = False
        self._header = ""  # the current message's header text (what follows <|channel|> names the channel)
        self._channel: str | None = None

    def feed(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        for piece in self._scanner.feed(text):
            if isinstance(piece, Marker):
                self._marker(piece.text)
            else:
                self._text(piece, delta)
        return delta

    def finish(self) -> ReasoningDelta:
        """Flush text held back at the end of the stream (an unfinished marker is plain text)."""
        delta = ReasoningDelta()
        self._text(self._scanner.finish(), delta)
        return delta

    def _marker(self, marker: str) -> None:
        if marker == _MESSAGE:
            self._in_body = True
            self._channel = channel_of(self._header)
        elif marker in (_START, _END, _RETURN, _CALL):
            self._in_body = False
            self._header, self._channel = "", None
        elif not self._in_body:  # <|channel|> / <|constrain|> inside a header
            self._header += marker

    def _text(self, text: str, delta: ReasoningDelta) -> None:
        if not text:
            return
        if not self._in_body:
            self._header += text
        elif self._channel in REASONING_CHANNELS:
            delta.reasoning += text
        else:
            delta.content += text


def channel_of(header: str) -> str | None:
    """The channel a message header names (``<|channel|>final <|constrain|>json`` -> "final"), or None."""
    _, found, rest = header.partition(_CHANNEL)
    if not found:
        return None
    words = rest.split(_CONSTRAIN)[0].split()
    return words[0] if words else None


def parse_harmony(text: str) -> ReasoningDelta:
    """The reasoning and answer of a whole completion."""
    parser = HarmonyParser()
    return parser.feed(text) + parser.finish()
