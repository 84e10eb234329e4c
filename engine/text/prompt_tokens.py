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

Across restarts. ``to_bytes`` / ``adopt`` carry a conversation's cached prompt to the next engine
(the prefix store keeps it beside the chat's pages, checksummed): without it the first turn after a
restart tokenises the whole history (~0.1-0.2 s at 64K tokens). The bytes name the tokenizer
(``identity``: a hash of its tokenizer.json), and ``adopt`` takes them only when that matches and
they hold together (sizes, ascending anchors whose ids are anchors and whose text is the anchor's
own); ``encode`` still checks the new text against the cached one, so a prompt kept for another
text is never used.
"""

from __future__ import annotations

import json
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer

__all__ = ["PromptTokens", "anchor_ids"]

_CONVERSATIONS = 32  # prompts kept (LRU); a 64K-token prompt costs ~1 MB here
_FORMAT = 1  # of ``to_bytes``


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

    def __init__(self, backend: RustTokenizer, fewest: Callable[[str], int], capacity: int = _CONVERSATIONS,
                 identity: str = "") -> None:
        self._backend = backend
        self._fewest = fewest
        self._anchors = anchor_ids(backend)
        self.identity = identity  # of the tokenizer; saved prompts of another one are not adopted
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

    def __contains__(self, conversation: str) -> bool:
        with self._lock:
            return conversation in self._prompts

    def conversations(self) -> list[str]:
        """The conversations with a cached prompt, least recently used first."""
        with self._lock:
            return list(self._prompts)

    def to_bytes(self, conversation: str) -> bytes | None:
        """The conversation's cached prompt as bytes for ``adopt`` (None when none is cached)::

            header length (u32 LE) | header JSON | ids | anchor starts | ends | indices (int64, native order: the
            same machine reads them) | text (UTF-8)
        """
        with self._lock:
            prompt = self._prompts.get(conversation)
        if prompt is None:
            return None
        text = prompt.text.encode("utf-8", "surrogatepass")
        header = json.dumps({"format": _FORMAT, "tokenizer": self.identity, "tokens": len(prompt.ids),
                             "anchors": len(prompt.indices), "text_bytes": len(text)}).encode()
        arrays = [prompt.ids, array("q", prompt.starts), array("q", prompt.ends), array("q", prompt.indices)]
        return b"".join([struct.pack("<I", len(header)), header, *(values.tobytes() for values in arrays), text])

    def adopt(self, conversation: str, data: bytes) -> bool:
        """Cache a prompt saved by ``to_bytes`` (of an engine with the same tokenizer) for
        ``conversation``, unless one is cached already; False when ``data`` is not such a prompt."""
        prompt = self._parse(data)
        if prompt is None:
            return False
        with self._lock:
            if conversation not in self._prompts:
                self._prompts[conversation] = prompt
                while len(self._prompts) > self._capacity:
                    self._prompts.popitem(last=False)
        return True

    def _parse(self, data: bytes) -> _Prompt | None:
        try:
            (size,) = struct.unpack_from("<I", data)
            header = json.loads(data[4:4 + size])
            tokens, anchors, text_bytes = header["tokens"], header["anchors"], header["text_bytes"]
            if (header["format"] != _FORMAT or header["tokenizer"] != self.identity or not self.identity
                    or not all(isinstance(n, int) and n >= 0 for n in (tokens, anchors, text_bytes))
                    or len(data) != 4 + size + 8 * (tokens + 3 * anchors) + text_bytes):
                return None
            at = 4 + size
            arrays = []
            for count in (tokens, anchors, anchors, anchors):
                arrays.append(array("q", data[at:at + 8 * count]))
                at += 8 * count
            text = data[at:].decode("utf-8", "surrogatepass")
        except (struct.error, ValueError, KeyError, TypeError):
            return None
        ids, starts, ends, indices = arrays
        prompt = _Prompt(text, ids, starts.tolist(), ends.tolist(), indices.tolist())
        return prompt if self._sound(prompt) else None

    def _sound(self, prompt: _Prompt) -> bool:
        """Whether a parsed prompt holds together: each anchor is an anchor id at an ascending token
        index whose characters, ascending and inside the text, are that token's own text."""
        added = self._backend.get_added_tokens_decoder()
        last_index, last_end = -1, 0
        for start, end, index in zip(prompt.starts, prompt.ends, prompt.indices):
            if not (last_index < index < len(prompt.ids) and last_end <= start < end <= len(prompt.text)):
                return False
            token = prompt.ids[index]
            if token not in self._anchors or prompt.text[start:end] != added[token].content:
                return False
            last_index, last_end = index, end
        return True

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
