"""Fitting a conversation into the model's context.

The prompt is counted exactly by the server (``ChatClient.count_tokens``: Hearth's own tokenizer and
chat template) or, from servers that cannot count, estimated at four characters per token. When the
conversation plus the room kept for the answer outgrows the context, the ``"truncate"`` policy drops
the oldest turns (the system prompt stays; what is sent always starts at a user message), as LM
Studio's "truncate middle" and Ollama do; the ``"stop"`` policy refuses with a message that says why.

    fit = fit_messages(messages, counter, context_length=2048, reserve=512, policy="truncate")
    fit.messages, fit.dropped, fit.prompt_tokens
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hearth.engine.api import HearthError

Counter = Callable[[Sequence[dict[str, Any]]], int]
ANSWER_SHARE = 4  # at most a quarter of the context is kept free for the answer
_CHARS_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4  # role markers of a typical chat template


class ContextFullError(HearthError):
    """The conversation does not fit the context (policy "stop", or the last message alone)."""


@dataclass(frozen=True)
class ContextFit:
    """What to send: ``messages`` (``dropped`` of the history's first messages left out) and its
    length in tokens (``exact``: counted by the server, not estimated)."""

    messages: list[dict[str, Any]]
    dropped: int
    prompt_tokens: int
    exact: bool = True


def answer_reserve(context_length: int, max_tokens: int | None) -> int:
    """Tokens kept free for the answer: the requested maximum, at most a quarter of the context."""
    share = max(context_length // ANSWER_SHARE, 1)
    return max(min(max_tokens or share, share), 1)


def estimate_tokens(messages: Sequence[dict[str, Any]]) -> int:
    """A rough count for servers that cannot count (about four characters per token)."""
    chars = sum(len(str(m.get("content") or "")) for m in messages)
    return (chars + _CHARS_PER_TOKEN - 1) // _CHARS_PER_TOKEN + _TOKENS_PER_MESSAGE * len(messages)


def fit_messages(messages: Sequence[dict[str, Any]], count: Counter, *, context_length: int, reserve: int,
                 policy: str) -> ContextFit:
    """``messages`` (leading system messages, then the history ending with the user's message)
    made to fit ``context_length - reserve`` tokens by ``policy`` ("truncate" or "stop"); raises
    ContextFullError."""
    budget = context_length - reserve
    system = _leading_system(messages)
    history = list(messages[len(system):])
    total = count(list(messages))
    if total <= budget:
        return ContextFit(list(messages), 0, total)
    if policy == "stop":
        raise ContextFullError(
            f"This chat has outgrown the model's context: it is {total:,} tokens, and the context holds "
            f"{context_length:,} with {reserve:,} kept for the answer. Start a new chat, or choose "
            "\"Drop the oldest messages\" in Settings to keep going.")
    cuts = [i for i, m in enumerate(history) if m.get("role") == "user" and i > 0]
    best = _smallest_fitting_cut(cuts, lambda i: count(system + history[i:]), budget)
    if best is None:
        last = count(system + history[cuts[-1]:]) if cuts else total
        raise ContextFullError(
            f"Your message is too long for the model's context: with the system prompt it is {last:,} tokens, "
            f"and the context holds {context_length:,} with {reserve:,} kept for the answer. Shorten it, or "
            "raise the context length in Settings.")
    cut, tokens = best
    return ContextFit(system + history[cut:], cut, tokens)


def _leading_system(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("role") != "system":
            break
        out.append(message)
    return out


def _smallest_fitting_cut(cuts: list[int], count: Callable[[int], int], budget: int) -> tuple[int, int] | None:
    """Binary search: dropping more never makes the prompt longer, so the first cut that fits is
    found with log2(len(cuts)) counts. Returns (cut, its token count) or None."""
    low, high, best = 0, len(cuts) - 1, None
    while low <= high:
        mid = (low + high) // 2
        tokens = count(cuts[mid])
        if tokens <= budget:
            best, high = (cuts[mid], tokens), mid - 1
        else:
            low = mid + 1
    return best
