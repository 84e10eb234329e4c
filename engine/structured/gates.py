"""Where the answer begins in a model's output: the grammar holds the answer, never the reasoning.

As vLLM does with its reasoning parsers, a model that thinks first writes its reasoning freely and the
schema applies from the end of it (``hearth.engine.text.reasoning`` splits the same text for the API):

- ``<think>`` models (``THINK_MODEL_TYPES``): when the prompt ends inside the block (DeepSeek-V3.2's
  thinking mode ends it with ``<think>``), the answer begins after the ``</think>`` the model writes.
  When the prompt already closed a block (thinking off), the answer begins at once. Otherwise GLM and
  Qwen3 models may open one (with thinking on they write ``<think>`` first): their first token may be the
  ``<think>`` token (when that is one token) or the answer's first. DeepSeek prompts without a block
  (raw completions) are answered at once.
- gpt-oss (harmony): the answer is the body of the first message on the ``final`` channel (or with no
  channel), after its ``<|message|>``; ``analysis`` and ``commentary`` messages before it are free.
- other models: the answer is the whole output.

Markers are found in the tokens' text (``Vocabulary.text``), so a marker the model spells in several
tokens counts too. The bytes after the marker in the same token are the answer's first bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hearth.engine.text.harmony import REASONING_CHANNELS, channel_of, uses_harmony
from hearth.engine.text.markers import Marker, MarkerScanner
from hearth.engine.text.reasoning import THINK_END, THINK_MODEL_TYPES, prompt_opens_reasoning

# <think> models whose prompts may leave the block to the model (thinking on); DeepSeek's prompts always
# end with the opened or the closed block.
_OPEN_THEIR_OWN_BLOCK = frozenset({"glm4_moe", "glm_moe_dsa", "qwen3_moe"})
_HARMONY_MESSAGE = "<|message|>"
_HARMONY_BOUNDARIES = ("<|start|>", "<|end|>", "<|return|>", "<|call|>")
_HARMONY_HEADER = ("<|channel|>", "<|constrain|>")


class AnswerGate:
    """The answer has begun (``open``): from then on every token is the grammar's. ``opener``: a token
    the model may write first instead of the answer (``<think>``), which closes the gate."""

    def __init__(self, open_: bool = True, opener: int | None = None) -> None:
        self.open = open_
        self.opener = opener

    def take_opener(self) -> None:
        """The model wrote ``opener`` first: reasoning until the gate's end marker."""
        self.open, self.opener = False, None

    def feed(self, text: bytes) -> bytes | None:
        """A token while closed (its text): None while the reasoning goes on, else the bytes of the
        token that belong to the answer (the gate is open then)."""
        return None


class _MarkerGate(AnswerGate):
    """Text is scanned as Latin-1 (one character per byte: markers are ASCII, a UTF-8 character
    split across tokens stays whole)."""

    def __init__(self, markers: Sequence[str], opener: int | None = None, open_: bool = False) -> None:
        super().__init__(open_, opener)
        self._scanner = MarkerScanner(markers)

    def feed(self, text: bytes) -> bytes | None:
        pieces = self._scanner.feed(text.decode("latin-1"))
        for n, piece in enumerate(pieces):
            if self._opens(piece):
                self.open = True
                rest = "".join(p.text if isinstance(p, Marker) else p for p in pieces[n + 1:])
                return (rest + self._scanner.finish()).encode("latin-1")
        return None

    def _opens(self, piece: str | Marker) -> bool:
        raise NotImplementedError


class ThinkGate(_MarkerGate):
    def __init__(self, in_reasoning: bool, opener: int | None) -> None:
        super().__init__((THINK_END,), opener=None if in_reasoning else opener, open_=not in_reasoning)

    def _opens(self, piece: str | Marker) -> bool:
        return isinstance(piece, Marker)


class HarmonyGate(_MarkerGate):
    def __init__(self) -> None:
        super().__init__((_HARMONY_MESSAGE, *_HARMONY_BOUNDARIES, *_HARMONY_HEADER))
        self._header = ""
        self._in_body = False

    def _opens(self, piece: str | Marker) -> bool:
        if not isinstance(piece, Marker):
            if not self._in_body:
                self._header += piece
            return False
        if piece.text == _HARMONY_MESSAGE and not self._in_body:
            self._in_body = True
            return channel_of(self._header) not in REASONING_CHANNELS | {"commentary"}
        if piece.text in _HARMONY_BOUNDARIES:
            self._in_body, self._header = False, ""
        elif not self._in_body:
            self._header += piece.text
        return False


def answer_gate(model_type: str, prompt_tail: str, think_start_id: int | None) -> AnswerGate:
    """The gate of a request to a ``model_type`` model whose prompt ends with ``prompt_tail`` (the text of
    its last ``reasoning.PROMPT_TAIL_TOKENS`` tokens, markers kept); ``think_start_id``: the ``<think>`` token's id
    when it is one token."""
    if uses_harmony(model_type):
        return HarmonyGate()
    if model_type not in THINK_MODEL_TYPES:
        return AnswerGate()
    if prompt_opens_reasoning(prompt_tail):
        return ThinkGate(in_reasoning=True, opener=None)
    if THINK_END in prompt_tail or model_type not in _OPEN_THEIR_OWN_BLOCK:
        return AnswerGate()  # the prompt's block is closed (thinking is off), or there is none
    return ThinkGate(in_reasoning=False, opener=think_start_id)

