"""Automaton state -> the tokens that may come next, fast enough in pure Python for 150K-token
vocabularies.

A token is allowed in a state when the grammar reads all its bytes from there. ``TokenIndex`` (one per
tokenizer and logits width, built once) answers that without reading every token:

- The tokens' byte strings are sorted and each is stored with its common prefix with the one before.
  A walk reads them in order, keeping the state after each prefix byte on a stack, so a shared prefix is
  read once; a prefix the grammar refuses skips every token that starts with it (a bisection). From a
  position between JSON values only tokens starting with ``{ [ " - t f n``, digits or whitespace survive
  their first byte or two.
- Inside a string, a token of plain characters (whole UTF-8 characters, no quote, backslash or control
  byte: most of a vocabulary) is always allowed and only lengthens the string, so those come from a
  mask built once (limited to the tokens short enough under ``maxLength``), and the walk reads only the
  other tokens. Likewise tokens of digits only inside a number (when its bounds no longer matter).
- Inside a string held to a ``pattern`` a plain token is allowed when the pattern's DFA reads its
  characters, and the DFA sees only their classes: spelled as class ids, the vocabulary's plain tokens
  collapse to far fewer sorted keys ("hello" and "world" are one key for ``^\\S+@``), walked like the
  tokens themselves (one index per pattern, built on first use).
- A state is a set of configurations and a token is allowed when one of them takes it, so masks are
  cached per configuration (with its grammar) in a least-recently-used cache bounded in bytes, and a
  state's mask is the union of its configurations'.
"""

from __future__ import annotations

import bisect
import re
from collections import OrderedDict

import torch

from hearth.engine.structured.grammar import Config, Grammar, State
from hearth.engine.structured.patterned import PatternedString
from hearth.engine.structured.regex import Regex
from hearth.engine.structured.vocabulary import Vocabulary

DEFAULT_CACHE_BYTES = 128 << 20
_PATTERNS_KEPT = 16


_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')
_DIGITS_ONLY = re.compile(rb"[0-9]+")


def _plain_chars(data: bytes) -> int:
    """How many characters ``data`` holds when it is whole UTF-8 characters a JSON string may hold as
    they are (no quote, backslash or control character), else -1."""
    if _NOT_PLAIN.search(data):
        return -1
    try:
        return len(data.decode("utf-8"))
    except UnicodeDecodeError:
        return -1


def _common_prefix(a: bytes, b: bytes, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _after_prefix(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with ``prefix`` (None: none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes((stripped[-1] + 1,))


class SortedTokens:
    """Token byte strings in sorted order, with the ids of each."""

    def __init__(self, keys: list[bytes], ids: list[list[int]]) -> None:
        self.keys = keys
        self.ids = ids

    def walk(self, grammar: Grammar | PatternedString, state: State | tuple[int, int]) -> list[int]:
        """The ids of the tokens ``grammar`` reads whole from ``state`` (a ``PatternedString`` reads keys
        of class ids from a (DFA state, count))."""
        advance = grammar.advance
        keys, n = self.keys, len(self.keys)
        allowed: list[int] = []
        states = [state]  # states[d]: after the first d bytes of the previous key read
        previous = b""
        i = 0
        while i < n:
            key = keys[i]
            # (only the keys read are compared: a walk that skips most of them costs what it reads)
            depth = _common_prefix(previous, key, len(states) - 1)
            previous = key
            del states[depth + 1:]
            current: State | tuple[int, int] | None = states[depth]
            end = len(key)
            while depth < end:
                current = advance(current, key[depth])  # type: ignore[arg-type]
                if current is None:
                    break
                states.append(current)
                depth += 1
            if current is not None:
                allowed.extend(self.ids[i])
                i += 1
            else:  # no token that starts with key[:depth + 1] can be read: skip them all
                bound = _after_prefix(key[:depth + 1])
                i = n if bound is None else bisect.bisect_left(keys, bound, i + 1)
        return allowed


def _per_token(width: int, ids: list[list[int]], values: list[int]) -> torch.Tensor:
    """[width] int32: each key's value at the ids it stands for, -1 elsewhere."""
    out = torch.full((width,), -1, dtype=torch.int32)
    flat_ids = [i for group in ids for i in group]
    flat_values = [v for group, v in zip(ids, values) for _ in group]
    out[torch.tensor(flat_ids, dtype=torch.long)] = torch.tensor(flat_values, dtype=torch.int32)
    return out


class TokenIndex:
    """The allowed-token masks of one vocabulary: bool tensors of ``width`` (the logits' width; ids
    past the vocabulary are never allowed) on the host."""

    def __init__(self, vocabulary: Vocabulary, width: int, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.width = width
        self.vocabulary = vocabulary
        grouped: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(vocabulary.grammar[:width]):
            if data:  # (an empty token would let a model write nothing forever)
                grouped.setdefault(data, []).append(token_id)
        keys = sorted(grouped)
        ids = [grouped[k] for k in keys]
        chars = [_plain_chars(k) for k in keys]
        digits = [len(k) if _DIGITS_ONLY.fullmatch(k) else -1 for k in keys]
        self._plain_chars = _per_token(width, ids, chars)
        self._plain = self._plain_chars >= 0
        self._digits = _per_token(width, ids, digits)
        self._every = SortedTokens(keys, ids)
        self._not_plain = SortedTokens([k for k, c in zip(keys, chars) if c < 0],
                                       [i for i, c in zip(ids, chars) if c < 0])
        self._not_digits = SortedTokens([k for k, d in zip(keys, digits) if d < 0],
                                        [i for i, d in zip(ids, digits) if d < 0])
        self._plain_texts = [(k.decode("utf-8"), i) for k, i, c in zip(keys, ids, chars) if c >= 0]
        self._seen_chars: set[str] | None = None
        self._by_class: OrderedDict[Regex, SortedTokens | None] = OrderedDict()
        self._cache: OrderedDict[tuple[Grammar, Config], torch.Tensor] = OrderedDict()
        self._cache_limit = max(1, cache_bytes // max(1, width))

    def counts(self) -> dict[str, int]:
        """How the vocabulary splits: tokens a mask may allow, plain string pieces, digit runs."""
        return {"tokens": sum(len(i) for i in self._every.ids), "plain": int(self._plain.sum()),
                "digits": int((self._digits > 0).sum()), "walked_in_strings": sum(len(i) for i in self._not_plain.ids)}

    def token_bytes(self, token_id: int) -> bytes | None:
        grammar = self.vocabulary.grammar
        return grammar[token_id] if 0 <= token_id < min(len(grammar), self.width) else None

    def token_text(self, token_id: int) -> bytes:
        text = self.vocabulary.text
        return text[token_id] if 0 <= token_id < len(text) else b""

    def mask(self, grammar: Grammar, state: State) -> torch.Tensor:
        """[width] bool: the tokens ``grammar`` reads whole from ``state``. The tensor may be shared with
        the cache: do not write to it."""
        masks = [self._config_mask(grammar, config) for config in state]
        if len(masks) == 1:
            return masks[0]
        union = masks[0].clone()
        for other in masks[1:]:
            union |= other
        return union

    def _class_keys(self, regex: Regex) -> SortedTokens | None:
        """The plain tokens spelled as the DFA's class ids, one byte each (None past 255 classes)."""
        if regex in self._by_class:
            self._by_class.move_to_end(regex)
            return self._by_class[regex]
        keys = None
        if len(regex.starts) < 256:
            if self._seen_chars is None:
                self._seen_chars = {ch for text, _ in self._plain_texts for ch in text}
            table = {ord(ch): chr(regex.char_class(ord(ch))) for ch in self._seen_chars}
            grouped: dict[bytes, list[int]] = {}
            for text, ids in self._plain_texts:
                grouped.setdefault(text.translate(table).encode("latin-1"), []).extend(ids)
            ordered = sorted(grouped)
            keys = SortedTokens(ordered, [grouped[k] for k in ordered])
        self._by_class[regex] = keys
        if len(self._by_class) > _PATTERNS_KEPT:
            self._by_class.popitem(last=False)
        return keys

    def _config_mask(self, grammar: Grammar, config: Config) -> torch.Tensor:
        key = (grammar, config)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        in_string, room = grammar.string_room(config)
        digit_room = grammar.digit_room(config)
        single = frozenset((config,))
        patterned = grammar.pattern_position(config)
        by_class = self._class_keys(patterned[0].regex) if patterned is not None else None
        if patterned is not None and by_class is not None:
            mask = torch.zeros(self.width, dtype=torch.bool)
            walked = by_class.walk(patterned[0], patterned[1]) + self._not_plain.walk(grammar, single)
        elif in_string:
            mask = self._plain.clone() if room is None else self._plain & (self._plain_chars <= room)
            walked = self._not_plain.walk(grammar, single)
        elif digit_room is not None:
            mask = (self._digits > 0) & (self._digits <= digit_room)
            walked = self._not_digits.walk(grammar, single)
        else:
            mask = torch.zeros(self.width, dtype=torch.bool)
            walked = self._every.walk(grammar, single)
        if walked:
            mask[torch.tensor(walked, dtype=torch.long)] = True
        self._cache[key] = mask
        if len(self._cache) > self._cache_limit:
            self._cache.popitem(last=False)
        return mask
