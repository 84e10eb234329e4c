"""A byte-level pushdown automaton over the JSON text a schema allows (``hearth.engine.structured.schema``).

    grammar = Grammar.from_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    state = grammar.advance_bytes(grammar.initial, b'{"n": 4')   # None once the text cannot continue
    grammar.is_complete(state)                                 # False: the object is not closed

It reads bytes, not characters: a token may end in the middle of a UTF-8 character, and the state then
holds the bytes the character still needs. Strings are checked to be valid UTF-8 and valid JSON (escapes
``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``, UTF-16 surrogates only in pairs, no raw control characters).

A state is a frozenset of configurations (the automaton is nondeterministic: ``anyOf``, optional
properties, a number that may end or go on). A configuration is a tuple of frames, the innermost last;
a frame is a small tuple whose first item is its kind. States are immutable and hashable: the token masks
are cached by them, and ``advance`` remembers its answers.

Whitespace is allowed where JSON allows it, in runs of at most ``MAX_NEWLINES`` line breaks and
``MAX_SPACES`` spaces or tabs (a model's pretty-printing fits; looping on whitespace does not), before
the value too but not after it: once the top-level value is written the state is terminal. No reachable
state is a dead end: every configuration that is not complete can be completed (the schema compiler
prunes what cannot be satisfied and number bounds are checked digit by digit).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hearth.engine.structured import numbers
from hearth.engine.structured.nodes import AnyOfNode, ArrayNode, LiteralNode, Node, NumberNode, ObjectNode, StringNode
from hearth.engine.structured.patterned import CLOSE, PatternedString
from hearth.engine.structured.schema import compile_nodes

MAX_NEWLINES = 2
MAX_SPACES = 20
_MEMO_LIMIT = 1 << 19  # remembered transitions before the memo starts over

# Frame kinds: (WS, newlines, spaces) / (VAL, node) / (OBJ, node, next property, phase) /
# (KEY, node, candidate properties, position) / (XKEY, node, name prefix or None, utf8) /
# (ARR, node, items so far, phase) / (STR, node, characters so far, mode, aux) / (LIT, texts, position) /
# (NUM, node, *numbers.Number) / (PSTR, node, count, DFA state, mode, aux): a string with a pattern
# (``hearth.engine.structured.patterned``).
WS, VAL, OBJ, KEY, XKEY, ARR, STR, LIT, NUM, PSTR = range(10)
OPEN, NEXT, AFTER = range(3)  # object / array phases: after the bracket, after a comma, after a value
# String modes: plain, after a backslash, in \uXXXX (aux: (digits, surrogate flag)), inside a UTF-8
# character (aux: (bytes still needed, lowest, highest next byte)), expecting the "\" or the "u" of the
# low surrogate that must follow a high one.
PLAIN, ESCAPE, HEX, UTF8, LOW_BACKSLASH, LOW_U = range(6)
_HEX_ANY, _HEX_D, _HEX_HIGH, _HEX_LOW, _HEX_LOW_D = range(5)

_WS0 = (WS, 0, 0)
_COLON = (LIT, (b":",), 0)
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = {b: int(chr(b), 16) for b in b"0123456789abcdefABCDEF"}

Config = tuple[tuple[Any, ...], ...]
State = frozenset[Config]


def utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """For the first byte of a multi-byte UTF-8 character: (bytes still needed, lowest and highest
    allowed next byte), which rules out overlong forms, surrogates and code points past U+10FFFF."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
    if 0xF0 <= byte <= 0xF4:
        return 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
    return None


class Grammar:
    """The automaton of one schema. ``advance`` is memoised per grammar (bounded), so build one per
    schema and share it between requests."""

    def __init__(self, nodes: tuple[Node, ...], root: int) -> None:
        self.nodes = nodes = _flatten_alternatives(nodes)
        self.root = root
        self.initial: State = frozenset({((VAL, root), _WS0)})
        self._memo: dict[tuple[State, int], State | None] = {}
        # per object node: the properties a key may name from each position, whether anything may
        # follow a value there, and the declared names an additional key must not repeat
        self._candidates: dict[int, list[tuple[int, ...]]] = {}
        self._last_required: dict[int, int] = {}
        self._name_prefixes: dict[int, frozenset[bytes]] = {}
        self._names: dict[int, frozenset[bytes]] = {}
        self._patterned: dict[int, PatternedString] = {}
        for i, node in enumerate(nodes):
            if isinstance(node, ObjectNode):
                self._index_object(i, node)
            elif isinstance(node, StringNode) and node.pattern is not None:
                self._patterned[i] = PatternedString(node.pattern, node.min_length, node.max_length)

    @classmethod
    def from_schema(cls, schema: Any) -> Grammar:
        """Raises ``SchemaError`` for what it cannot enforce (see ``hearth.engine.structured.schema``)."""
        return cls(*compile_nodes(schema))

    def _index_object(self, i: int, node: ObjectNode) -> None:
        required = [j for j, p in enumerate(node.props) if p.required]
        self._last_required[i] = required[-1] if required else -1
        candidates = []
        for start in range(len(node.props) + 1):
            first_required = next((j for j in required if j >= start), len(node.props) - 1)
            candidates.append(tuple(range(start, min(first_required, len(node.props) - 1) + 1)))
        self._candidates[i] = candidates
        names = [p.name.encode() for p in node.props]
        self._names[i] = frozenset(names)
        self._name_prefixes[i] = frozenset(n[:k] for n in names for k in range(len(n) + 1))

    # ---- the public surface ------------------------------------------------------------------

    def advance(self, state: State, byte: int) -> State | None:
        """The state after ``byte``, or None when no allowed text continues with it."""
        key = (state, byte)
        memo = self._memo
        if key in memo:
            return memo[key]
        out: set[Config] = set()
        for config in state:
            self._step(config, byte, out)
        result = frozenset(out) if out else None
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[key] = result
        return result

    def advance_bytes(self, state: State | None, data: Iterable[int]) -> State | None:
        for byte in data:
            if state is None:
                return None
            state = self.advance(state, byte)
        return state

    def is_complete(self, state: State) -> bool:
        """Whether the text so far is a whole value of the schema."""
        return any(self._completable(c) for c in state)

    def string_room(self, config: Config) -> tuple[bool, int | None]:
        """Whether the configuration is inside a string between characters (where a token of plain
        characters, no quote, backslash or control character, only lengthens it), and how many more
        characters it may take (None: any number)."""
        frame = config[-1] if config else None
        if frame is None:
            return False, None
        if frame[0] == XKEY:
            return not frame[3], None
        if frame[0] != STR or frame[3] != PLAIN:
            return False, None
        node = self.nodes[frame[1]]
        assert isinstance(node, StringNode)
        return True, None if node.max_length is None else node.max_length - frame[2]

    def pattern_position(self, config: Config) -> tuple[PatternedString, tuple[int, int]] | None:
        """For a configuration inside a patterned string between characters: the string's
        ``PatternedString`` and (DFA state, count) there; else None."""
        frame = config[-1] if config else None
        if frame is None or frame[0] != PSTR or frame[4] != PLAIN:
            return None
        return self._patterned[frame[1]], (frame[3], frame[2])

    def digit_room(self, config: Config) -> int | None:
        """How many more digits the configuration's number takes where a token of digits only just
        lengthens it (``numbers.digit_room``), or None."""
        frame = config[-1] if config else None
        if frame is None or frame[0] != NUM:
            return None
        return numbers.digit_room(frame[2:])  # type: ignore[arg-type]

    def is_terminal(self, state: State) -> bool:
        """Complete, and nothing may follow (the value is closed, or a number has all its digits)."""
        if all(not c for c in state):
            return True
        return self.is_complete(state) and all(self.advance(state, b) is None for b in range(256))

    # ---- transitions -------------------------------------------------------------------------

    def _completable(self, config: Config) -> bool:
        for frame in reversed(config):
            kind = frame[0]
            if kind == WS:
                continue
            if kind == NUM:
                node = self.nodes[frame[1]]
                assert isinstance(node, NumberNode)
                if numbers.is_complete(node, frame[2:]):
                    continue
                return False
            if kind == LIT and any(len(t) == frame[2] for t in frame[1]):
                continue
            return False
        return True

    def _step(self, config: Config, byte: int, out: set[Config]) -> None:
        if not config:
            return
        frame = config[-1]
        rest = config[:-1]
        kind = frame[0]
        if kind == STR:
            self._string(rest, frame, byte, out)
        elif kind == PSTR:
            body = self._patterned[frame[1]].step(frame[2:], byte)  # type: ignore[arg-type]
            if body == CLOSE:
                out.add(rest)
            elif body is not None:
                out.add(rest + ((PSTR, frame[1], *body),))
        elif kind == WS:
            if byte == 0x20 or byte == 0x09:
                if frame[2] < MAX_SPACES:
                    out.add(rest + ((WS, frame[1], frame[2] + 1),))
            elif byte == 0x0A:
                if frame[1] < MAX_NEWLINES:
                    out.add(rest + ((WS, frame[1] + 1, frame[2]),))
            else:  # the run ends; the byte belongs to what follows
                self._step(rest, byte, out)
        elif kind == VAL:
            self._value(rest, frame[1], byte, out)
        elif kind == LIT:
            self._literal(rest, frame[1], frame[2], byte, out)
        elif kind == NUM:
            self._number(rest, frame, byte, out)
        elif kind == KEY:
            self._key(rest, frame, byte, out)
        elif kind == XKEY:
            self._extra_key(rest, frame, byte, out)
        elif kind == OBJ:
            self._object(rest, frame, byte, out)
        elif kind == ARR:
            self._array(rest, frame, byte, out)

    def _value(self, rest: Config, index: int, byte: int, out: set[Config]) -> None:
        node = self.nodes[index]
        if isinstance(node, StringNode):
            if byte == 0x22:
                patterned = self._patterned.get(index)
                out.add(rest + ((STR, index, 0, PLAIN, 0) if patterned is None else (PSTR, index, *patterned.start()),))
        elif isinstance(node, ObjectNode):
            if byte == 0x7B:
                out.add(rest + ((OBJ, index, 0, OPEN), _WS0))
        elif isinstance(node, ArrayNode):
            if byte == 0x5B:
                out.add(rest + ((ARR, index, 0, OPEN), _WS0))
        elif isinstance(node, NumberNode):
            number = numbers.start(node, byte)
            if number is not None:
                out.add(rest + ((NUM, index, *number),))
        elif isinstance(node, LiteralNode):
            self._literal(rest, node.texts, 0, byte, out)
        elif isinstance(node, AnyOfNode):
            for alternative in node.alternatives:
                self._value(rest, alternative, byte, out)

    def _literal(self, rest: Config, texts: tuple[bytes, ...], pos: int, byte: int, out: set[Config]) -> None:
        going = tuple(t for t in texts if len(t) > pos and t[pos] == byte)
        if going:
            if all(len(t) == pos + 1 for t in going):
                out.add(rest)  # written whole and nothing longer: the frame is done
            else:
                out.add(rest + ((LIT, going, pos + 1),))
        if pos and any(len(t) == pos for t in texts):  # a shorter alternative ends here ("1" of "1", "12")
            self._step(rest, byte, out)

    def _object(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        _, index, start, phase = frame
        node = self.nodes[index]
        assert isinstance(node, ObjectNode)
        closable = start > self._last_required[index]
        if phase == AFTER:
            if byte == 0x2C and (self._candidates[index][start] or (node.additional is not None and closable)):
                out.add(rest + ((OBJ, index, start, NEXT), _WS0))
            elif byte == 0x7D and closable:
                out.add(rest)
            return
        if byte == 0x7D and phase == OPEN and closable:
            out.add(rest)
        elif byte == 0x22:
            if self._candidates[index][start]:
                out.add(rest + ((KEY, index, self._candidates[index][start], 1),))
            if node.additional is not None and closable:
                prefix = b"" if self._names[index] else None
                out.add(rest + ((XKEY, index, prefix, 0),))

    def _after_key(self, rest: Config, index: int, start: int, value: int) -> Config:
        return rest + ((OBJ, index, start, AFTER), _WS0, (VAL, value), _WS0, _COLON, _WS0)

    def _key(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        _, index, candidates, pos = frame
        props = self.nodes[index].props  # type: ignore[union-attr]
        going = tuple(j for j in candidates if props[j].key[pos] == byte)
        if not going:
            return
        done = next((j for j in going if len(props[j].key) == pos + 1), None)
        if done is None:
            out.add(rest + ((KEY, index, going, pos + 1),))
        else:  # (a key ends with its quote: no other candidate goes on)
            out.add(self._after_key(rest, index, done + 1, props[done].node))

    def _extra_key(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        """A key of an additional property: any string without escapes that is no declared name."""
        _, index, prefix, utf8 = frame
        if utf8:
            need, lo, hi = utf8
            if lo <= byte <= hi:
                out.add(rest + ((XKEY, index, self._prefix(index, prefix, byte),
                                 (need - 1, 0x80, 0xBF) if need > 1 else 0),))
            return
        if byte == 0x22:
            if prefix not in self._names[index]:
                node = self.nodes[index]
                assert isinstance(node, ObjectNode) and node.additional is not None
                out.add(self._after_key(rest, index, len(node.props), node.additional))
        elif 0x20 <= byte < 0x80 and byte != 0x5C:
            out.add(rest + ((XKEY, index, self._prefix(index, prefix, byte), 0),))
        else:
            lead = utf8_lead(byte)
            if lead is not None:
                out.add(rest + ((XKEY, index, self._prefix(index, prefix, byte), lead),))

    def _prefix(self, index: int, prefix: bytes | None, byte: int) -> bytes | None:
        if prefix is None:
            return None
        longer = prefix + bytes((byte,))
        return longer if longer in self._name_prefixes[index] else None

    def _array(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        _, index, count, phase = frame
        node = self.nodes[index]
        assert isinstance(node, ArrayNode)
        item = node.prefix[count] if count < len(node.prefix) else node.items
        more = item is not None and (node.max_items is None or count < node.max_items)
        if phase == AFTER:
            if byte == 0x2C and more:
                out.add(rest + ((ARR, index, count, NEXT), _WS0))
            elif byte == 0x5D and count >= node.min_items:
                out.add(rest)
            return
        if phase == OPEN and byte == 0x5D and node.min_items == 0:
            out.add(rest)
        elif more:
            # past the prefix and minItems (with no maxItems) the count no longer matters: capped, so
            # the states of long arrays repeat and their masks are cached
            after = count + 1 if node.max_items is not None else min(count + 1, max(node.min_items, len(node.prefix)))
            self._value(rest + ((ARR, index, after, AFTER), _WS0), item, byte, out)  # type: ignore[arg-type]

    def _string(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        _, index, count, mode, aux = frame
        if mode == PLAIN:
            node = self.nodes[index]
            assert isinstance(node, StringNode)
            if byte == 0x22:
                if count >= node.min_length:
                    out.add(rest)
                return
            if node.max_length is not None and count >= node.max_length:
                return
            # (without maxLength the count matters only up to minLength)
            count = count + 1 if node.max_length is not None or count < node.min_length else count
            if byte == 0x5C:
                out.add(rest + ((STR, index, count, ESCAPE, 0),))
            elif 0x20 <= byte < 0x80:
                out.add(rest + ((STR, index, count, PLAIN, 0),))
            else:
                lead = utf8_lead(byte)
                if lead is not None:
                    out.add(rest + ((STR, index, count, UTF8, lead),))
        elif mode == UTF8:
            need, lo, hi = aux
            if lo <= byte <= hi:
                out.add(rest + ((STR, index, count, UTF8, (need - 1, 0x80, 0xBF)) if need > 1
                                else (STR, index, count, PLAIN, 0),))
        elif mode == ESCAPE:
            if byte in _SIMPLE_ESCAPES:
                out.add(rest + ((STR, index, count, PLAIN, 0),))
            elif byte == 0x75:  # u
                out.add(rest + ((STR, index, count, HEX, (0, _HEX_ANY)),))
        elif mode == HEX:
            following = _hex_step(aux, byte)
            if following is not None:
                out.add(rest + ((STR, index, count, *following),))
        elif mode == LOW_BACKSLASH:
            if byte == 0x5C:
                out.add(rest + ((STR, index, count, LOW_U, 0),))
        elif mode == LOW_U and byte == 0x75:
            out.add(rest + ((STR, index, count, HEX, (0, _HEX_LOW)),))

    def _number(self, rest: Config, frame: tuple[Any, ...], byte: int, out: set[Config]) -> None:
        node = self.nodes[frame[1]]
        assert isinstance(node, NumberNode)
        number = frame[2:]
        following = numbers.step(node, number, byte)  # type: ignore[arg-type]
        if following is not None:
            out.add(rest + ((NUM, frame[1], *following),))
        if numbers.is_complete(node, number):  # type: ignore[arg-type]
            self._step(rest, byte, out)  # the number ends; the byte belongs to what follows


def _flatten_alternatives(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """Each ``anyOf`` node with the nodes it may be, through nested ``anyOf``s and ``$ref``s, listed
    directly (and none of them an ``anyOf``), so reading a value never recurses through them (a schema
    may be an alternative of itself: ``{"anyOf": [{"type": "string"}, {"$ref": "#"}]}``)."""
    def leaves(start: int) -> tuple[int, ...]:
        found: dict[int, None] = {}
        seen, todo = set(), [start]
        while todo:
            index = todo.pop()
            if index in seen:
                continue
            seen.add(index)
            node = nodes[index]
            if isinstance(node, AnyOfNode):
                todo.extend(reversed(node.alternatives))
            else:
                found[index] = None
        return tuple(found)

    return tuple(AnyOfNode(leaves(i)) if isinstance(n, AnyOfNode) else n for i, n in enumerate(nodes))


def _hex_step(aux: tuple[int, int], byte: int) -> tuple[int, Any] | None:
    """The string's (mode, aux) after one more hex digit of a \\uXXXX escape. Surrogates come only in
    pairs: a high one (D800-DBFF) must be followed by an escaped low one (DC00-DFFF); a lone low one is
    refused at its second digit, so no state is a dead end."""
    value = _HEX.get(byte)
    if value is None:
        return None
    digits, flag = aux
    if digits == 0:
        if flag == _HEX_LOW:
            return (HEX, (1, _HEX_LOW_D)) if value == 0xD else None
        return HEX, (1, _HEX_D if value == 0xD else _HEX_ANY)
    if digits == 1:
        if flag == _HEX_LOW_D:
            return (HEX, (2, _HEX_LOW)) if value >= 0xC else None
        if flag == _HEX_D:
            if value >= 0xC:
                return None  # a low surrogate with no high one before it
            return HEX, (2, _HEX_HIGH if value >= 0x8 else _HEX_ANY)
        return HEX, (2, flag)
    if digits == 2:
        return HEX, (3, flag)
    return (LOW_BACKSLASH, 0) if flag == _HEX_HIGH else (PLAIN, 0)
