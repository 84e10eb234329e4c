"""The body of a JSON string held to a ``pattern`` (``hearth.engine.structured.regex``) and its length
bounds, read byte by byte as the grammar reads it.

The pattern applies to the decoded value, so a character counts once it is whole, however the model
writes it: a plain byte, a UTF-8 sequence, ``\\n``, ``\\u00e9`` or a surrogate pair ``\\ud83d\\ude00``.
No byte may start what cannot end well: every prefix of a character narrows the code points it can
still become to an interval (UTF-8 keeps code point order; so do hex digits), and the byte is taken only
when that interval meets the characters allowed next (those after which the DFA can still reach a match
within the length bounds). So, as everywhere in the grammar, no reachable state is a dead end.

A body's state is (count, DFA state, mode, aux); the modes are the grammar's (``PLAIN``, ``ESCAPE``,
``HEX``, ``UTF8``, ``LOW_BACKSLASH``, ``LOW_U``) with aux: UTF8 (bytes still needed, lowest and
highest next byte, the value's bits so far); HEX (digits, value so far, the high surrogate or 0);
LOW_BACKSLASH / LOW_U (the high surrogate).
"""

from __future__ import annotations

import bisect
from typing import Any

from hearth.engine.structured.regex import Regex

PLAIN, ESCAPE, HEX, UTF8, LOW_BACKSLASH, LOW_U = range(6)
CLOSE = "close"
_SIMPLE_ESCAPES = {0x22: 0x22, 0x5C: 0x5C, 0x2F: 0x2F, 0x62: 0x08, 0x66: 0x0C, 0x6E: 0x0A, 0x72: 0x0D, 0x74: 0x09}
_HEX = {b: int(chr(b), 16) for b in b"0123456789abcdefABCDEF"}
_LEADS = {**{b: (1, 0x1F) for b in range(0xC2, 0xE0)}, **{b: (2, 0x0F) for b in range(0xE0, 0xF0)},
          **{b: (3, 0x07) for b in range(0xF0, 0xF5)}}

Body = tuple[int, int, int, Any]  # (count, DFA state, mode, aux)


class PatternedString:
    """The characters a patterned string body may take next; shared by every state of one node."""

    def __init__(self, regex: Regex, min_length: int, max_length: int | None) -> None:
        self.regex = regex
        self.min_length = min_length
        self.max_length = max_length
        self.bound = max_length + 1 if max_length is not None else min_length
        self.reach = regex.lengths(self.bound)
        self._allowed: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._by_class: dict[tuple[tuple[int, int], int], tuple[int, int] | None] = {}

    def fits(self, state: int, count: int) -> bool:
        """Whether, after ``count`` characters, the DFA ``state`` can reach a match in the bounds."""
        if state < 0:
            return False
        lo = max(0, self.min_length - count)
        hi = self.bound if self.max_length is None else self.max_length - count
        return hi >= lo and (self.reach[state] >> lo) & ((1 << (hi - lo + 1)) - 1) != 0

    def counted(self, count: int) -> int:
        # (without maxLength the count matters only up to minLength)
        return count + 1 if self.max_length is not None or count < self.min_length else count

    def allowed(self, state: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The code points that may come next: (range starts, range ends), sorted and disjoint."""
        key = (state, count)
        found = self._allowed.get(key)
        if found is None:
            regex, after = self.regex, self.counted(count)
            los: list[int] = []
            his: list[int] = []
            for cls, target in enumerate(regex.table[state]):
                if target >= 0 and self.fits(target, after):
                    lo, hi = regex.class_ranges(cls)
                    if his and his[-1] + 1 == lo:
                        his[-1] = hi
                    else:
                        los.append(lo)
                        his.append(hi)
            found = self._allowed[key] = (tuple(los), tuple(his))
        return found

    def hits(self, state: int, count: int, lo: int, hi: int) -> bool:
        los, his = self.allowed(state, count)
        i = bisect.bisect_right(los, hi) - 1
        return i >= 0 and his[i] >= lo

    def advance(self, position: tuple[int, int], cls: int) -> tuple[int, int] | None:
        """(DFA state, count) after a character of the DFA's class ``cls``, between characters; None
        when no such character may come (``masks``' walk over tokens spelled as classes)."""
        key = (position, cls)
        found = self._by_class.get(key, False)
        if found is False:
            state, count = position
            target = self.regex.table[state][cls]
            after = self.counted(count)
            found = self._by_class[key] = (target, after) if self.fits(target, after) else None
        return found  # type: ignore[return-value]

    def start(self) -> Body:
        return 0, 0, PLAIN, 0

    def step(self, body: Body, byte: int) -> Body | str | None:
        """The body after ``byte``; CLOSE when the byte is the closing quote; None when refused."""
        count, state, mode, aux = body
        if mode == PLAIN:
            if byte == 0x22:
                return CLOSE if self.regex.accepting[state] and count >= self.min_length else None
            if byte == 0x5C:
                return (count, state, ESCAPE, 0) if self.allowed(state, count)[0] else None
            if 0x20 <= byte < 0x80:
                return self._char(count, state, byte)
            lead = _LEADS.get(byte)
            if lead is None:
                return None
            need, bits = lead
            return self._partial_utf8(count, state, need, byte & bits,
                                      0xA0 if byte == 0xE0 else 0x90 if byte == 0xF0 else 0x80,
                                      0x9F if byte == 0xED else 0x8F if byte == 0xF4 else 0xBF)
        if mode == UTF8:
            need, lo, hi, value = aux
            if not lo <= byte <= hi:
                return None
            value = (value << 6) | (byte & 0x3F)
            if need == 1:
                return self._char(count, state, value)
            return self._partial_utf8(count, state, need - 1, value, 0x80, 0xBF)
        if mode == ESCAPE:
            if byte in _SIMPLE_ESCAPES:
                return self._char(count, state, _SIMPLE_ESCAPES[byte])
            return (count, state, HEX, (0, 0, 0)) if byte == 0x75 else None
        if mode == HEX:
            digit = _HEX.get(byte)
            if digit is None:
                return None
            digits, value, high = aux
            digits, value = digits + 1, (value << 4) | digit
            if not any(self.hits(state, count, lo, hi) for lo, hi in _unit_code_points(digits, value, high)):
                return None
            if digits < 4:
                return count, state, HEX, (digits, value, high)
            if high:
                return self._char(count, state, 0x10000 + ((high - 0xD800) << 10) + (value - 0xDC00))
            if 0xD800 <= value <= 0xDBFF:
                return count, state, LOW_BACKSLASH, value
            return self._char(count, state, value)
        if mode == LOW_BACKSLASH:
            return (count, state, LOW_U, aux) if byte == 0x5C else None
        return (count, state, HEX, (0, 0, aux)) if byte == 0x75 else None  # LOW_U

    def _char(self, count: int, state: int, code: int) -> Body | None:
        if not self.hits(state, count, code, code):
            return None
        return self.counted(count), self.regex.step(state, code), PLAIN, 0

    def _partial_utf8(self, count: int, state: int, need: int, value: int, lo: int, hi: int) -> Body | None:
        first = value << (6 * need) | ((lo & 0x3F) << (6 * need - 6))
        last = value << (6 * need) | ((hi & 0x3F) << (6 * need - 6)) | ((1 << (6 * need - 6)) - 1)
        if not self.hits(state, count, first, last):
            return None
        return count, state, UTF8, (need, lo, hi, value)


def _unit_code_points(digits: int, value: int, high: int) -> list[tuple[int, int]]:
    """The code points a \\uXXXX escape can still write after ``digits`` hex digits of ``value`` (of
    the low surrogate after ``high``, when ``high``): intervals, as surrogates map elsewhere."""
    shift = 4 * (4 - digits)
    lo, hi = value << shift, ((value + 1) << shift) - 1
    if high:
        base = 0x10000 + ((high - 0xD800) << 10)
        lo, hi = max(lo, 0xDC00), min(hi, 0xDFFF)
        return [(base + lo - 0xDC00, base + hi - 0xDC00)] if lo <= hi else []
    out = []
    if lo <= 0xD7FF:
        out.append((lo, min(hi, 0xD7FF)))
    if hi >= 0xE000:
        out.append((max(lo, 0xE000), hi))
    a, b = max(lo, 0xD800), min(hi, 0xDBFF)
    if a <= b:  # high surrogates: the astral code points their pairs write
        out.append((0x10000 + ((a - 0xD800) << 10), 0x10000 + ((b - 0xD800) << 10) + 0x3FF))
    return out
