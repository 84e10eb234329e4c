"""Generated text -> reasoning and answer, for models that think before they answer.

Two output formats carry reasoning: gpt-oss's harmony channels (``harmony.HarmonyParser``) and the
``<think>...</think>`` block of DeepSeek-R1-style models (DeepSeek-V3.1/V3.2, GLM-4.5 and later,
GLM-5, Qwen3), parsed by :class:`ThinkParser`. Both parse streamed text cut anywhere, even inside a
marker (``markers.MarkerScanner``). The reasoning goes out as the API's ``reasoning_content`` (the
GUI's "Thinking" block), the rest as the answer, and no marker reaches either.

A ``<think>`` model's prompt may already end inside the block (DeepSeek-V3.2's thinking mode ends
the prompt with ``<think>``): then the answer starts with reasoning and only the ``</think>`` comes.
Other prompts end after an empty block (thinking off) or before any (GLM-4.5 and Qwen3 with thinking
on: the model writes ``<think>`` itself).
"""

from __future__ import annotations

from collections.abc import Callable

from hearth.engine.text.harmony import HarmonyParser, uses_harmony
from hearth.engine.text.markers import Marker, MarkerScanner, ReasoningDelta, ReasoningParser

THINK_START, THINK_END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 4  # a prompt's last tokens show whether it ends inside <think> (at most "<think>\n")
# Model types whose chat formats put reasoning in a <think> block (see the module docstring).
THINK_MODEL_TYPES = frozenset({"deepseek_v32", "deepseek_v3", "glm_moe_dsa", "glm4_moe", "qwen3_moe"})


class ThinkParser:
    """Splits a ``<think>`` model's answer. ``in_reasoning``: the prompt ended inside the block.

    Only the first block is reasoning: a ``<think>`` after answer text, or markers once the block has
    closed, are answer text (a model quoting the tags). The whitespace that opens the reasoning and
    the answer after the block (the newlines templates put around the tags) is dropped; whitespace
    before a block that never comes stays part of the answer.
    """

    def __init__(self, in_reasoning: bool = False) -> None:
        self._scanner = MarkerScanner((THINK_START, THINK_END))
        self._in_reasoning = in_reasoning
        self._block_done = False  # the block has closed, or the answer began without one
        self._strip = in_reasoning  # drop whitespace at the start of the current part
        self._undecided = ""  # leading whitespace while a <think> may still open the block

    def feed(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        for piece in self._scanner.feed(text):
            if isinstance(piece, Marker):
                self._marker(piece.text, delta)
            else:
                self._text(piece, delta)
        return delta

    def finish(self) -> ReasoningDelta:
        delta = ReasoningDelta()
        self._text(self._scanner.finish(), delta)
        delta.content += self._undecided
        self._undecided = ""
        return delta

    def _marker(self, marker: str, delta: ReasoningDelta) -> None:
        if marker == THINK_START and not self._in_reasoning and not self._block_done:
            self._in_reasoning, self._strip, self._undecided = True, True, ""
        elif marker == THINK_END and self._in_reasoning:
            self._in_reasoning, self._block_done, self._strip = False, True, True
        else:
            self._text(marker, delta)

    def _text(self, text: str, delta: ReasoningDelta) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if not text:
            return
        if self._in_reasoning:
            delta.reasoning += text
        elif not self._block_done and not text.strip():
            self._undecided += text
        else:
            self._block_done = True
            delta.content += self._undecided + text
            self._undecided = ""


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the model inside a ``<think>`` block."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def reasoning_parser_for(model_type: str, prompt_tail: str) -> Callable[[], ReasoningParser] | None:
    """A maker of parsers that split this model's answers to a prompt ending in ``prompt_tail``;
    None for models that write no reasoning (their text is all answer)."""
    if uses_harmony(model_type):
        return HarmonyParser
    if model_type in THINK_MODEL_TYPES:
        opened = prompt_opens_reasoning(prompt_tail)
        return lambda: ThinkParser(in_reasoning=opened)
    return None


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """The reasoning and answer of a whole completion."""
    return parser.feed(text) + parser.finish()
