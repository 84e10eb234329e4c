"""JSON Schema ``pattern``s: the ECMA-262 regular expressions they are written in, compiled to a DFA over
a string's characters (code points, after JSON's escapes are decoded).

    regex = compile_pattern("^[A-Z]{3}-\\d{4}$")
    regex.matches("ABC-1234")          # True
    regex.step(0, ord("A"))            # the state after one character, -1 once nothing can match

The subset: literals and escapes (``\\t \\n \\v \\f \\r \\0 \\cX \\xHH \\uHHHH \\u{H...}``, escaped
punctuation), ``.`` (any character but a line terminator), classes ``[a-z_]`` / ``[^...]``,
``\\d \\w \\s \\D \\W \\S`` (ASCII digits and word characters, ECMA's whitespace), groups ``( )``,
``(?: )`` and ``(?<name> )``, ``|``, quantifiers ``* + ? {n} {n,} {n,m}`` (lazy ones match the same
strings), ``^`` / ``$`` (the string's ends: no multiline flag). Backreferences, lookaround, word
boundaries, ``\\p{...}`` and inline flags raise ``PatternError`` naming the construct. A ``{`` that
starts no quantifier is a literal, as in JavaScript.

A pattern is unanchored (JSON Schema's "search" semantics): the automaton is that of
``[^]* pattern [^]*`` with ``^`` / ``$`` as assertions about the whole string, so ``a`` matches
"banana" and ``^a`` does not. States that can no longer reach a match are dropped (``step`` gives -1),
the DFA is minimised, and state 0 is the start. Surrogate code points (U+D800-DFFF) never match: a JSON
string cannot hold one alone.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 4_000

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges

_ANY: Ranges = ((0, MAX_CODE_POINT),)
_DIGIT: Ranges = ((0x30, 0x39),)
_WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                  (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_LINE_TERMINATORS: Ranges = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_SURROGATES = (0xD800, 0xDFFF)
_CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D}
_SYNTAX = set("^$\\.*+?()[]{}|/-")


class PatternError(ValueError):
    """The pattern is not valid ECMA-262, or uses a construct outside the subset (the message names it)."""


def normalized(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


_CLASS_ESCAPES = {"d": _DIGIT, "D": complement(_DIGIT), "w": _WORD, "W": complement(_WORD), "s": _SPACE,
                  "S": complement(_SPACE)}
_DOT = complement(_LINE_TERMINATORS)

# The syntax tree: ("set", Ranges) | ("cat", [tree]) | ("alt", [tree]) | ("rep", tree, lo, hi or None) |
# ("begin",) | ("end",)
Tree = tuple


class _Parser:
    def __init__(self, source: str) -> None:
        self.text = source
        self.pos = 0

    def fail(self, what: str) -> PatternError:
        return PatternError(f"pattern {self.text!r}: {what} (at {self.pos}) is not supported")

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.text[i] if i < len(self.text) else ""

    def parse(self) -> Tree:
        tree = self.alternation()
        if self.pos < len(self.text):  # only a stray ")" stops an alternation early
            raise PatternError(f"pattern {self.text!r}: unbalanced ')' at {self.pos}")
        return tree

    def alternation(self) -> Tree:
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self) -> Tree:
        items: list[Tree] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            items.append(self.quantified(atom))
        return ("cat", items)

    def quantified(self, atom: Tree) -> Tree:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (bounds := self.braces()) is not None:
                lo, hi = bounds
            else:
                return atom
            if atom[0] in ("begin", "end"):
                raise PatternError(f"pattern {self.text!r}: nothing to repeat at {self.pos - 1}")
            if self.peek() == "?":  # lazy: the same strings match
                self.pos += 1
            atom = ("rep", atom, lo, hi)
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._braces_ahead()):
                raise PatternError(f"pattern {self.text!r}: nothing to repeat at {self.pos}")

    def _braces_ahead(self) -> bool:
        start = self.pos
        found = self.braces() is not None
        self.pos = start
        return found

    def braces(self) -> tuple[int, int | None] | None:
        """``{n}``, ``{n,}``, ``{n,m}`` from the position (then past it), else None (a literal ``{``)."""
        end = self.text.find("}", self.pos)
        if end < 0:
            return None
        body = self.text[self.pos + 1:end]
        lo_text, comma, hi_text = body.partition(",")
        if not _is_number(lo_text) or (hi_text and not _is_number(hi_text)):
            return None
        lo, hi = int(lo_text), (int(hi_text) if hi_text else None) if comma else int(lo_text)
        if hi is not None and hi < lo:
            raise PatternError(f"pattern {self.text!r}: quantifier {{{body}}} has its numbers out of order")
        self.pos = end + 1
        return lo, hi

    def atom(self) -> Tree:
        c = self.peek()
        self.pos += 1
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", _DOT)
        if c == "^":
            return ("begin",)
        if c == "$":
            return ("end",)
        if c == "\\":
            return self.escape()
        if c in ("*", "+", "?"):
            raise PatternError(f"pattern {self.text!r}: nothing to repeat at {self.pos - 1}")
        if c == "{" and self._braces_ahead_at(self.pos - 1):
            raise PatternError(f"pattern {self.text!r}: nothing to repeat at {self.pos - 1}")
        return ("set", ((ord(c), ord(c)),))

    def _braces_ahead_at(self, pos: int) -> bool:
        saved, self.pos = self.pos, pos
        found = self._braces_ahead()
        self.pos = saved
        return found

    def group(self) -> Tree:
        if self.peek() == "?":
            kind = self.text[self.pos:self.pos + 3]
            if kind.startswith("?:"):
                self.pos += 2
            elif kind[:2] in ("?=", "?!"):
                raise self.fail(f"the lookahead '({kind[:2]}'")
            elif kind in ("?<=", "?<!"):
                raise self.fail(f"the lookbehind '({kind}'")
            elif kind.startswith("?<"):
                end = self.text.find(">", self.pos)
                if end < 0:
                    raise PatternError(f"pattern {self.text!r}: unterminated group name at {self.pos}")
                self.pos = end + 1
            else:
                raise self.fail(f"the group syntax {'(' + kind!r}")
        tree = self.alternation()
        if self.peek() != ")":
            raise PatternError(f"pattern {self.text!r}: missing ')'")
        self.pos += 1
        return tree

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while True:
            c = self.peek()
            if c == "":
                raise PatternError(f"pattern {self.text!r}: missing ']'")
            if c == "]":
                self.pos += 1
                break
            first = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                last = self.class_atom()
                if isinstance(first, int) and isinstance(last, int):
                    if last < first:
                        raise PatternError(f"pattern {self.text!r}: class range out of order at {self.pos}")
                    ranges.append((first, last))
                    continue
                ranges.append((0x2D, 0x2D))  # [\d-z]: the "-" is a literal (Annex B)
                ranges.extend(_as_ranges(last))
            ranges.extend(_as_ranges(first))
        result = normalized(ranges)
        return complement(result) if negated else result

    def class_atom(self) -> int | Ranges:
        c = self.peek()
        self.pos += 1
        if c != "\\":
            return ord(c)
        if self.peek() == "b":
            self.pos += 1
            return 0x08
        if self.peek() == "-":
            self.pos += 1
            return 0x2D
        if self.peek() in _CLASS_ESCAPES:
            self.pos += 1
            return _CLASS_ESCAPES[self.text[self.pos - 1]]
        (lo, _), = self.escape()[1]
        return lo

    def escape(self) -> Tree:
        c = self.peek()
        if c == "":
            raise PatternError(f"pattern {self.text!r}: a '\\' ends it")
        self.pos += 1
        if c in _CLASS_ESCAPES:
            return ("set", _CLASS_ESCAPES[c])
        if c in _CONTROL_ESCAPES:
            return _char(_CONTROL_ESCAPES[c])
        if c == "0" and not self.peek().isdigit():
            return _char(0)
        if c.isdigit():
            raise self.fail(f"the backreference '\\{c}'")
        if c == "k":
            raise self.fail("the named backreference '\\k'")
        if c in ("b", "B"):
            raise self.fail(f"the word boundary '\\{c}'")
        if c in ("p", "P"):
            raise self.fail(f"the Unicode property class '\\{c}{{...}}'")
        if c == "c" and self.peek().isascii() and self.peek().isalpha():
            self.pos += 1
            return _char(ord(self.text[self.pos - 1]) % 32)
        if c == "x":
            return _char(self.hex_digits(2))
        if c == "u":
            return _char(self.unicode_escape())
        if c in _SYNTAX or not (c.isascii() and c.isalnum()):
            return _char(ord(c))
        raise self.fail(f"the escape '\\{c}'")

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.pos:self.pos + count]
        if len(digits) != count or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise PatternError(f"pattern {self.text!r}: a bad hex escape at {self.pos}")
        self.pos += count
        return int(digits, 16)

    def unicode_escape(self) -> int:
        if self.peek() == "{":
            end = self.text.find("}", self.pos)
            digits = self.text[self.pos + 1:end] if end > 0 else ""
            if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > MAX_CODE_POINT:
                raise PatternError(f"pattern {self.text!r}: a bad \\u{{...}} escape at {self.pos}")
            self.pos = end + 1
            return int(digits, 16)
        unit = self.hex_digits(4)
        if 0xD800 <= unit <= 0xDBFF and self.text[self.pos:self.pos + 2] == "\\u":
            saved = self.pos
            self.pos += 2
            low = self.hex_digits(4)
            if 0xDC00 <= low <= 0xDFFF:
                return 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
            self.pos = saved
        return unit


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _char(code: int) -> Tree:
    return ("set", ((code, code),))


def _as_ranges(atom: int | Ranges) -> Ranges:
    return ((atom, atom),) if isinstance(atom, int) else atom


class _Nfa:
    """Thompson's construction: ``moves[s]`` (ranges, target), ``eps[s]`` free moves, ``begin[s]`` /
    ``end[s]`` moves only at the string's start / end."""

    def __init__(self) -> None:
        self.moves: list[list[tuple[Ranges, int]]] = []
        self.eps: list[list[int]] = []
        self.begin: list[list[int]] = []
        self.end: list[list[int]] = []

    def state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise PatternError("pattern is too large (repeat counts multiply its size)")
        for table in (self.moves, self.eps, self.begin, self.end):
            table.append([])
        return len(self.moves) - 1

    def build(self, tree: Tree, start: int) -> int:
        """Adds ``tree`` from ``start``; returns its end state."""
        kind = tree[0]
        if kind == "set":
            end = self.state()
            self.moves[start].append((tree[1], end))
            return end
        if kind in ("begin", "end"):
            end = self.state()
            (self.begin if kind == "begin" else self.end)[start].append(end)
            return end
        if kind == "cat":
            for item in tree[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.state()
            for branch in tree[1]:
                entry = self.state()
                self.eps[start].append(entry)
                self.eps[self.build(branch, entry)].append(end)
            return end
        _, body, lo, hi = tree
        for _ in range(lo):
            start = self.build(body, start)
        if hi is None:  # a loop: start -> body -> start
            entry = self.state()
            self.eps[start].append(entry)
            self.eps[self.build(body, entry)].append(start)
            return start
        end = self.state()
        for _ in range(hi - lo):
            self.eps[start].append(end)
            start = self.build(body, start)
        self.eps[start].append(end)
        return end

    def closure(self, states: set[int], at_start: bool, at_end: bool) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            s = todo.pop()
            for table, ok in ((self.eps, True), (self.begin, at_start), (self.end, at_end)):
                if ok:
                    for t in table[s]:
                        if t not in seen:
                            seen.add(t)
                            todo.append(t)
        return frozenset(seen)


@dataclass(frozen=True, eq=False)
class Regex:
    """A DFA over code points: class ``i`` is the code points from ``starts[i]`` up to the next start;
    ``table[state][class]``: the next state, -1 for none. State 0 is the start."""

    source: str
    starts: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]
    accepting: tuple[bool, ...]

    def char_class(self, code: int) -> int:
        return bisect.bisect_right(self.starts, code) - 1

    def step(self, state: int, code: int) -> int:
        return self.table[state][self.char_class(code)]

    def matches(self, text: str) -> bool:
        state = 0
        for ch in text:
            state = self.step(state, ord(ch))
            if state < 0:
                return False
        return self.accepting[state]

    def class_ranges(self, cls: int) -> tuple[int, int]:
        end = self.starts[cls + 1] - 1 if cls + 1 < len(self.starts) else MAX_CODE_POINT
        return self.starts[cls], end

    def lengths(self, bound: int) -> tuple[int, ...]:
        """Per state, a bit set of the lengths of the strings that lead from it to a match: bit L for
        length L < bound, bit ``bound`` for any length >= bound."""
        full = (1 << (bound + 1)) - 1
        successors = [sorted({t for t in row if t >= 0}) for row in self.table]
        reach = [1 if a else 0 for a in self.accepting]
        changed = True
        while changed:
            changed = False
            for q, nexts in enumerate(successors):
                bits = reach[q]
                for t in nexts:
                    shifted = reach[t] << 1
                    if shifted > full:
                        shifted = (shifted & full) | (1 << bound)
                    bits |= shifted
                if bits != reach[q]:
                    reach[q] = bits
                    changed = True
        return tuple(reach)


def compile_pattern(source: str) -> Regex:
    """The DFA of an unanchored ECMA-262 ``pattern``. Raises PatternError."""
    tree = _Parser(source).parse()
    nfa = _Nfa()
    head = nfa.state()
    nfa.moves[head].append((_ANY, head))  # [^]* before the match
    entry = nfa.state()
    nfa.eps[head].append(entry)
    tail = nfa.build(tree, entry)
    final = nfa.state()
    nfa.eps[tail].append(final)
    nfa.moves[final].append((_ANY, final))  # [^]* after it
    return _determinized(source, nfa, head, final)


def intersection(a: Regex, b: Regex) -> Regex:
    """The DFA of the strings both match (a pattern and a ``format``'s)."""
    starts = tuple(sorted(set(a.starts) | set(b.starts)))
    index: dict[tuple[int, int], int] = {(0, 0): 0}
    pairs: list[tuple[int, int]] = [(0, 0)]
    rows: list[tuple[int, ...]] = []
    while len(rows) < len(pairs):
        qa, qb = pairs[len(rows)]
        row = []
        for start in starts:
            ta, tb = a.step(qa, start), b.step(qb, start)
            if ta < 0 or tb < 0:
                row.append(-1)
                continue
            if (ta, tb) not in index:
                if len(pairs) >= MAX_DFA_STATES:
                    raise PatternError(f"pattern {a.source!r} with {b.source!r} is too complex")
                index[(ta, tb)] = len(pairs)
                pairs.append((ta, tb))
            row.append(index[(ta, tb)])
        rows.append(tuple(row))
    accepting = tuple(a.accepting[qa] and b.accepting[qb] for qa, qb in pairs)
    return _minimized(f"({a.source}) and ({b.source})", starts, rows, accepting)


def _determinized(source: str, nfa: _Nfa, head: int, final: int) -> Regex:
    points = {0, _SURROGATES[0], _SURROGATES[1] + 1}
    for edges in nfa.moves:
        for ranges, _ in edges:
            for lo, hi in ranges:
                points.add(lo)
                if hi < MAX_CODE_POINT:
                    points.add(hi + 1)
    starts = tuple(sorted(points))
    surrogate_classes = set(range(bisect.bisect_left(starts, _SURROGATES[0]), bisect.bisect_left(starts, 0xE000)))
    edge_classes = [[(_covered(starts, ranges) - surrogate_classes, t) for ranges, t in edges] for edges in nfa.moves]
    first = (nfa.closure({head}, True, False), True)
    index: dict[tuple[frozenset[int], bool], int] = {first: 0}
    keys = [first]
    rows: list[tuple[int, ...]] = []
    while len(rows) < len(keys):
        subset, _ = keys[len(rows)]
        targets: dict[int, set[int]] = {}
        for s in subset:
            for classes, t in edge_classes[s]:
                for c in classes:
                    targets.setdefault(c, set()).add(t)
        row = [-1] * len(starts)
        for c, moved in targets.items():
            key = (nfa.closure(moved, False, False), False)
            if key not in index:
                if len(keys) >= MAX_DFA_STATES:
                    raise PatternError(f"pattern {source!r} is too complex (over {MAX_DFA_STATES} automaton states)")
                index[key] = len(keys)
                keys.append(key)
            row[c] = index[key]
        rows.append(tuple(row))
    accepting = tuple(final in nfa.closure(set(subset), at_start, True) for subset, at_start in keys)
    return _minimized(source, starts, rows, accepting)


def _covered(starts: tuple[int, ...], ranges: Ranges) -> set[int]:
    classes: set[int] = set()
    for lo, hi in ranges:
        classes.update(range(bisect.bisect_right(starts, lo) - 1, bisect.bisect_right(starts, hi)))
    return classes


def _minimized(source: str, starts: tuple[int, ...], rows: list[tuple[int, ...]], accepting: tuple[bool, ...]) -> Regex:
    """Without the states that cannot reach a match, equivalent states merged (Moore), and classes that
    act alike merged; state 0 stays the start (it may be dead: the pattern matches nothing)."""
    live = set(q for q, a in enumerate(accepting) if a)
    changed = True
    while changed:
        changed = False
        for q, row in enumerate(rows):
            if q not in live and any(t in live for t in row):
                live.add(q)
                changed = True
    rows = [tuple(t if t in live else -1 for t in row) for row in rows]
    block = [int(a) for a in accepting]
    while True:
        signatures: dict[tuple, int] = {}
        new = [signatures.setdefault((block[q], *(block[t] if t >= 0 else -1 for t in row)), len(signatures))
               for q, row in enumerate(rows)]
        if len(signatures) == len(set(block)):
            break
        block = new
    order: dict[int, int] = {}
    for q in [0, *range(len(rows))]:
        order.setdefault(block[q], len(order))
    table = [()] * len(order)
    accept = [False] * len(order)
    for q, row in enumerate(rows):
        table[order[block[q]]] = tuple(order[block[t]] if t >= 0 else -1 for t in row)
        accept[order[block[q]]] = accepting[q]
    # merge neighbouring classes every state treats alike
    keep = [0] + [c for c in range(1, len(starts)) if any(r[c] != r[c - 1] for r in table)]
    return Regex(source, tuple(starts[c] for c in keep), tuple(tuple(r[c] for c in keep) for r in table),
                 tuple(accept))
