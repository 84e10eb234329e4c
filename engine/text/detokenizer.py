"""Streaming text from generated token ids, and stop strings over that stream.

``IncrementalDetokenizer`` turns one token at a time into text without ever emitting half of a
multi-byte character: byte-level BPE splits emoji, CJK and accented letters across tokens, and
decoding such a partial sequence yields U+FFFD, which is held back until the character completes.
Decoding restarts from a short window of recent tokens (not the whole answer) so decoders that
depend on the previous token (e.g. leading-space handling) still see it.

``StopChecker`` cuts the stream at the first stop string, holding back text that may still grow into
one, so a stop string split across deltas never leaks to the user.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# UTF-8 characters are at most 4 bytes and each token carries at least one, so a character can't be
# still incomplete after this many held tokens: a U+FFFD then is a real invalid byte, not a split.
_MAX_HELD_TOKENS = 6
# Prompt tokens kept as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids one by one with ``push``; each call returns only new, complete text.

    ``text`` is everything returned so far. ``flush`` returns what is still held back (only a
    trailing invalid byte sequence can be) once generation has ended.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        # ids[_prefix:_read] is context already emitted; ids[_read:] is pending text, of which
        # _held_chars characters were emitted already.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._held_chars = 0
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        window = self._decode(self._prefix)
        if not window.startswith(self._prefix_text):
            # The new token changed how the context decodes; fall back to no context.
            self._prefix, self._prefix_text = self._read, ""
            window = self._decode(self._prefix)
        pending = window[len(self._prefix_text) :]
        held_tokens = len(self._ids) - self._read
        if pending.endswith(REPLACEMENT) and held_tokens < _MAX_HELD_TOKENS:
            return self._emit(pending[:-1], advance=False)
        return self._emit(pending, advance=True)

    def _emit(self, pending: str, advance: bool) -> str:
        delta = pending[self._held_chars :]
        if advance:
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
            self._held_chars = 0
        else:
            self._held_chars = max(self._held_chars, len(pending))
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Return the held-back tail (an invalid byte sequence shown as U+FFFD), if any."""
        if len(self._ids) == self._read:
            return ""
        pending = self._decode(self._prefix)[len(self._prefix_text) :]
        return self._emit(pending, advance=True)


class StopChecker:
    """Apply stop strings to a stream of text deltas.

    ``feed`` returns the text that is safe to show now and whether a stop string was hit. The output
    is cut where the stop string starts; when several could match, the one that completes first in
    the text wins, so the result does not depend on how the text was split into deltas. After a hit,
    further ``feed`` calls return ``("", True)``.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop if s)
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        self._buffer += delta
        cut = self._first_match()
        if cut is not None:
            out, self._buffer, self.stopped = self._buffer[:cut], "", True
            return out, True
        keep = self._partial_suffix_len()
        split = len(self._buffer) - keep
        out, self._buffer = self._buffer[:split], self._buffer[split:]
        return out, False

    def flush(self) -> str:
        """The held-back text, once the stream has ended without hitting a stop string."""
        out, self._buffer = self._buffer, ""
        return "" if self.stopped else out

    def _first_match(self) -> int | None:
        best: tuple[int, int] | None = None  # (end, start) of the earliest-completing match
        for stop in self._stops:
            start = self._buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
                    self.matched = stop
        return None if best is None else best[1]

    def _partial_suffix_len(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._buffer)), longest, -1):
                if self._buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
