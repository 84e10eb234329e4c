"""Token ids of a conversation's chat prompt, tokenising only what changed since its last turn.

A follow-up turn of a long chat renders a prompt that starts with (nearly) the whole previous one: a
64K-token chat re-tokenises ~300 KB of text for a 64-token message, tens of milliseconds of the
turn's time to first token. ``PromptTokens`` keeps, per conversation, the last prompt's text and ids
and the positions of its *anchors*: special tokens that split the text for the tokenizer. The
``tokenizers`` library cuts the text at added tokens (leftmost-longest matching) before it
normalises and pre-tokenises the pieces between them, so the ids of a text are the ids of its
pieces, each computed alone. A new prompt that shares its text with the cached one up to the end of
an anchor therefore has the cached ids up to that anchor, and only ``text[anchor start:]`` is
tokenised (from the anchor itself, so the next piece sees the same left neighbour and is not the
text's first piece).

That holds for an anchor that matches alone: a special added token, not normalised (matched on the
raw text), without ``lstrip`` / ``rstrip`` / ``single_word`` (which look across its edges), whose
text lies inside no other added token's (a longer token covering it could match in the new text
where it did not in the old). Tokenizers that truncate or pad are never cached. Anything else is
tokenised whole. The result is always what ``Tokenizer.encode(text)`` gives.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer

__all__ = ["PromptTokens", "anchor_ids"]

_CONVERSATIONS = 32  # prompts kept (LRU); a 64K-token prompt costs ~1 MB here


def anchor_ids(backend: RustTokenizer) -> frozenset[int]:
    """The special tokens a text may be cut after without changing its tokens (see the module doc)."""
    if backend.truncation is not None or backend.padding is not None:
        return frozenset()
    added = backend.get_added_tokens_decoder()
    texts = [token.content for token in added.values()]

    def alone(content: str) -> bool:
        return sum(content in other for other in texts) == 1  # (itself)

    return frozenset(i for i, token in added.items()
                     if token.special and not token.normalized and not token.lstrip and not token.rstrip
                     and not token.single_word and token.content and alone(token.content))


@dataclass
class _Prompt:
    text: str
    ids: array  # int64 token ids of ``text``
    starts: list[int]  # character span of each anchor, ascending
    ends: list[int]
    indices: list[int]  # token index of each anchor


class PromptTokens:
    """Cached chat prompt ids per conversation (thread-safe; tokenising runs outside the lock).
    ``fewest(text)`` is a lower bound on the tokens of ``text`` (``Tokenizer.fewest_tokens``)."""

    def __init__(self, backend: RustTokenizer, fewest: Callable[[str], int], capacity: int = _CONVERSATIONS) -> None:
        self._backend = backend
        self._fewest = fewest
        self._anchors = anchor_ids(backend)
        self._capacity = capacity
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_tokens = 0  # ids taken from a cached prompt instead of tokenised

    def encode(self, text: str, conversation: str, refuse: Callable[[int], None] | None = None) -> list[int]:
        """The ids of ``text`` (no special tokens added), reusing the conversation's last prompt.
        ``refuse(fewest)`` is called first with a lower bound on the count (the cached ids plus
        ``fewest`` of the rest) and may raise to refuse a prompt too long for the context."""
        with self._lock:
            cached = self._prompts.get(conversation)
        start, kept = _shared(cached, text) if cached is not None else (0, 0)
        head = cached.ids[:cached.indices[kept - 1]] if cached is not None and kept else array("q")
        if refuse is not None:
            refuse(len(head) + self._fewest(text[start:]))
        encoding = self._backend.encode(text[start:], add_special_tokens=False)
        tail = encoding.ids
        if kept and (not tail or tail[0] != cached.ids[len(head)]):  # type: ignore[union-attr]
            # The anchor did not open the rest (never expected): tokenise the whole text instead.
            start, kept, head = 0, 0, array("q")
            encoding = self._backend.encode(text, add_special_tokens=False)
            tail = encoding.ids
        ids = array("q", head)
        ids.extend(tail)
        spans = self._anchor_spans(encoding, tail)
        prompt = _Prompt(text, ids, [], [], [])
        if cached is not None and kept:
            # The anchors before the reused one, then every anchor of the rest (the reused one first).
            prompt.starts, prompt.ends, prompt.indices = (cached.starts[:kept - 1], cached.ends[:kept - 1],
                                                          cached.indices[:kept - 1])
        for first, last, index in spans:
            prompt.starts.append(start + first)
            prompt.ends.append(start + last)
            prompt.indices.append(len(head) + index)
        with self._lock:
            self._prompts[conversation] = prompt
            self._prompts.move_to_end(conversation)
            while len(self._prompts) > self._capacity:
                self._prompts.popitem(last=False)
            self.reused_tokens += len(head)
        return ids.tolist()

    def forget(self, conversation: str) -> None:
        with self._lock:
            self._prompts.pop(conversation, None)

    def _anchor_spans(self, encoding: Encoding, ids: list[int]) -> list[tuple[int, int, int]]:
        """(start, end, token index) of each anchor in ``encoding``, in order (a scan in C per anchor id)."""
        found: list[int] = []
        for anchor in self._anchors:
            at = -1
            while True:
                try:
                    at = ids.index(anchor, at + 1)
                except ValueError:
                    break
                found.append(at)
        spans = []
        for index in sorted(found):
            chars = encoding.token_to_chars(index)
            if chars is not None:
                spans.append((chars[0], chars[1], index))
        return spans


def _shared(cached: _Prompt, text: str) -> tuple[int, int]:
    """Where tokenising ``text`` may start: the start of the last cached anchor up to whose end the
    new text equals the cached one, and how many anchors that keeps; ``(0, 0)`` when none."""
    lo, hi = 0, len(cached.starts)
    while lo < hi:  # binary search: a prefix shared up to one anchor's end is shared up to the earlier ones'
        mid = (lo + hi + 1) // 2
        if text.startswith(cached.text[:cached.ends[mid - 1]]):
            lo = mid
        else:
            hi = mid - 1
    return (cached.starts[lo - 1], lo) if lo else (0, 0)
