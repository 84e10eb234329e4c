"""String ``pattern``s and enforced ``format``s (hearth.engine.structured.regex / patterned): the DFA
agrees with Python's ``re.search`` on many generated strings, and so does the grammar reading them as
JSON written every way (raw UTF-8, short escapes, \\uXXXX, surrogate pairs); ECMA's own classes; the
constructs refused by name; masks inside patterned strings equal a brute-force reading; and the tiny
model's answers match their patterns."""

from __future__ import annotations

import json
import random
import re

import pytest

from hearth.engine.structured.grammar import Grammar
from hearth.engine.structured.masks import TokenIndex
from hearth.engine.structured.regex import PatternError, Regex, compile_pattern
from hearth.engine.structured.schema import FORMAT_PATTERNS, SchemaError
from hearth.engine.structured.vocabulary import Vocabulary
from tests.engine.schema_check import problems, python_pattern

# (pattern, characters the generated strings are drawn from besides é, 😀, newline, quote and backslash,
# and Python's spelling where it differs: its "$" also matches before a final newline, its "." matches
# "\r", its named groups are (?P<...>), and "{,2}" is a quantifier to it)
PATTERNS = [
    (r"^[A-Z]{3}-\d{4}$", "ABZa-0193"),
    (r"^\S+@\S+\.\S+$", "ab@. \t"),
    (r"ab|cd", "abcdx"),
    (r"^(?:ab)+$", "abx"),
    (r"^a*?b+c?$", "abc"),
    (r"x{2,3}y{2,}$", "xy"),
    (r"^[^a-c\s]{1,3}$", "abcdz \n"),
    (r"^\w+\W\d*$", "a_9-. "),
    (r"é|😀", "ea"),
    (r'^[\u00e9\-"\\]+$', "e-a"),
    (r"^\x41\u0042\n?$", "AB"),
    (r"(^a|b$)", "abc", r"(^a|b\Z)"),
    (r"^.\..$", "a.b\r\u2028", r"^[^\n\r\u2028]\.[^\n\r\u2028]\Z"),
    (r"^(?<year>\d{2})[./](\d)$", "12./3", r"^(?P<year>\d{2})[./](\d)\Z"),
    (r"a{,2}", "a{,2}", r"a\{,2\}"),  # (not a quantifier to ECMA: literal braces)
    (r"^$", "a"),
    (r"", "ab"),
    (FORMAT_PATTERNS["date"], "2024-0131"),
    (FORMAT_PATTERNS["ipv4"], "1250.9"),
    (FORMAT_PATTERNS["email"], "ab.@c-"),
]
_ALWAYS = 'é😀\n"\\'


def _strings(regex: Regex, alphabet: str, rng: random.Random, count: int) -> list[str]:
    """Random strings of the alphabet, half of them walks of the DFA (most of which match), and those
    walks with one character changed."""
    letters = list(alphabet + _ALWAYS)
    distance = {q: 0 for q, a in enumerate(regex.accepting) if a}  # characters of the alphabet to a match
    for _ in range(len(regex.table)):
        for q in range(len(regex.table)):
            steps = [distance[t] + 1 for ch in letters if (t := regex.step(q, ord(ch))) in distance]
            if steps and min(steps) < distance.get(q, 1 << 30):
                distance[q] = min(steps)
    out = ["", *letters]
    for _ in range(count):
        out.append("".join(rng.choice(letters) for _ in range(rng.randint(1, 14))))
        walk, state = [], 0
        while len(walk) < 20 and not (regex.accepting[state] and rng.random() < 0.3):
            going = [ch for ch in letters if regex.step(state, ord(ch)) in distance]
            closer = [ch for ch in going if distance[regex.step(state, ord(ch))] < distance[state]]
            if closer and rng.random() < 0.7:
                going = closer
            if not going:
                break
            walk.append(rng.choice(going))
            state = regex.step(state, ord(walk[-1]))
        out.append("".join(walk))
        if walk:
            walk[rng.randrange(len(walk))] = rng.choice(letters)
            out.append("".join(walk))
    return out


def _json_text(value: str, rng: random.Random) -> bytes:
    """``value`` as a JSON string, each character written one of the ways JSON allows."""
    parts = ['"']
    for ch in value:
        code = ord(ch)
        way = rng.random()
        if ch in '"\\' or code < 0x20:
            short = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch)
            parts.append(short if short and way < 0.6 else f"\\u{code:04x}")
        elif way < 0.25:
            if code > 0xFFFF:
                high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
                parts.append(f"\\u{high:04X}\\u{low:04x}")
            else:
                parts.append(f"\\u{code:04X}" if way < 0.12 else f"\\u{code:04x}")
        elif ch == "/" and way < 0.3:
            parts.append("\\/")
        else:
            parts.append(ch)
    return ("".join(parts) + '"').encode()


@pytest.mark.parametrize("case", PATTERNS, ids=range(len(PATTERNS)))
def test_pattern_matches_as_python_re_search_in_the_dfa_and_the_grammar(case):
    pattern, alphabet = case[:2]
    regex = compile_pattern(pattern)
    expected_re = re.compile(case[2] if len(case) > 2 else python_pattern(pattern), re.ASCII)
    grammar = Grammar.from_schema({"type": "string", "pattern": pattern})
    rng = random.Random(sum(map(ord, pattern)))
    matched = 0
    for value in _strings(regex, alphabet, rng, 300):
        expected = expected_re.search(value) is not None
        matched += expected
        assert regex.matches(value) == expected, value
        if grammar is not None:
            text = _json_text(value, rng)
            assert json.loads(text) == value
            state = grammar.advance_bytes(grammar.initial, text)
            assert (state is not None and grammar.is_complete(state)) == expected, text
    assert matched > 20  # (each pattern is tried on strings it matches)


def test_ecma_classes_differ_from_python_s():
    assert not compile_pattern("^.$").matches("\r") and not compile_pattern("^.$").matches("\u2028")
    assert compile_pattern("^.$").matches("\x85")
    assert compile_pattern(r"^\s$").matches("\u00a0") and compile_pattern(r"^\s$").matches("\ufeff")
    assert not compile_pattern(r"^\s$").matches("\x1c")  # (Python's str.isspace says yes)
    assert not compile_pattern(r"\d").matches("\u0663") and not compile_pattern(r"\w").matches("é")
    assert compile_pattern(r"^[\b]$").matches("\b") and compile_pattern(r"^\cJ$").matches("\n")
    assert compile_pattern(r"^\u{1F600}$").matches("😀") and compile_pattern(r"^\ud83d\ude00$").matches("😀")
    assert compile_pattern("^[^]$").matches("\n") and not compile_pattern("[]").matches("a")


def test_length_bounds_combine_with_the_pattern_and_nothing_dead_ends():
    schema = {"type": "string", "pattern": "^(?:ab)+$", "minLength": 3, "maxLength": 6}
    grammar = Grammar.from_schema(schema)
    for value, ok in (("ab", False), ("abab", True), ("ababab", True), ("abababab", False)):
        state = grammar.advance_bytes(grammar.initial, json.dumps(value).encode())
        assert (state is not None and grammar.is_complete(state)) == ok, value
    # after "ababab" only the quote may follow; after "a" only "b": every byte taken can be finished
    for prefix in (b'"', b'"a', b'"ab', b'"abab', b'"ababab', b'"\\u0061'):
        state = grammar.advance_bytes(grammar.initial, prefix)
        follow = [b for b in range(256) if grammar.advance(state, b) is not None]
        assert follow, prefix
    state = grammar.advance_bytes(grammar.initial, b'"ababab')
    assert [b for b in range(256) if grammar.advance(state, b) is not None] == [0x22]
    # a UTF-8 lead byte or \u digit that cannot become an allowed character is refused at once
    letters = Grammar.from_schema({"type": "string", "pattern": "^[a-z]*$"})
    assert letters.advance_bytes(letters.initial, '"é'.encode()[:2]) is None
    assert letters.advance_bytes(letters.initial, b'"\\u00') is not None
    assert letters.advance_bytes(letters.initial, b'"\\u01') is None and letters.advance_bytes(
        letters.initial, b'"\\ud8') is None
    emoji = Grammar.from_schema({"type": "string", "pattern": "^😀$"})
    assert emoji.advance_bytes(emoji.initial, b'"\\ud83d\\ude0') is not None
    assert emoji.advance_bytes(emoji.initial, b'"\\ud83d\\ude01') is None
    assert emoji.advance_bytes(emoji.initial, b'"\\ud83e') is None
    assert emoji.advance_bytes(emoji.initial, b'"\xf0\x9f\x98\x81') is None


@pytest.mark.parametrize("form, good, bad", [
    ("date", ["2024-02-29", "1999-12-31"], ["2024-2-29", "2024-00-10", "2024-01-32", "24-01-01"]),
    ("time", ["23:59:60Z", "08:30:00.123+05:30"], ["24:00:00Z", "08:30:00", "8:30:00Z"]),
    ("date-time", ["2024-02-29T08:30:00Z", "2024-02-29t08:30:00-01:00"], ["2024-02-29 08:30:00Z"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "123e4567-e89b"]),
    ("ipv4", ["0.0.0.0", "192.168.1.255"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    ("email", ["ada.lovelace+x@math.example.org"], ["ada@localhost", "a b@x.io", "@x.io", "ada@x.c"]),
])
def test_formats_are_enforced(form, good, bad):
    schema = {"type": "string", "format": form}
    grammar = Grammar.from_schema(schema)
    for value in good + bad:
        state = grammar.advance_bytes(grammar.initial, json.dumps(value).encode())
        ok = state is not None and grammar.is_complete(state)
        assert ok == (value in good), value
        assert (problems(value, schema) == []) == ok, value  # (the test checker agrees)
    both = Grammar.from_schema({**schema, "pattern": "^2" if form != "email" else "^a"})  # pattern and format
    assert both.advance_bytes(both.initial, json.dumps(good[0]).encode()) is not None or good[0][0] not in "2a"


@pytest.mark.parametrize("pattern, named", [
    (r"^(a)\1$", "backreference"), (r"\k<x>", "backreference"), ("a(?=b)", "lookahead"), ("a(?!b)", "lookahead"),
    ("(?<=a)b", "lookbehind"), ("(?<!a)b", "lookbehind"), (r"\bword", "word boundary"), (r"\p{L}", "Unicode property"),
    ("(?i)abc", "group syntax"), (r"\z", "escape"), ("a**", "nothing to repeat"), ("(ab", "missing"),
    ("a{3,1}", "out of order"), ("[z-a]", "out of order"), ("^a{100}{100}{100}", "repeat"),
])
def test_constructs_outside_the_subset_are_refused_by_name(pattern, named):
    with pytest.raises(PatternError, match=named):
        compile_pattern(pattern)
    with pytest.raises(SchemaError, match=f"'pattern'.*{named}"):
        Grammar.from_schema({"type": "string", "pattern": pattern})


def _brute(grammar: Grammar, state, vocabulary, width: int) -> set[int]:
    return {i for i, data in enumerate(vocabulary[:width]) if data and grammar.advance_bytes(state, data) is not None}


_PIECES = [b'"', b'"}', b'\\', b'\\u', b'\\u00', b'\\u00e9', b'\\ud83d', b'\\ude00', b'\\"', b'\\n', "é".encode(),
           b'\xc3', b'\xa9', "😀".encode(), b'\xf0\x9f', b'\x98\x80"', b"@", b"a@b", b"ab", b"AB", b"ABC",
           b"ABC-", b"-12", b"1234", b"1234\"", b"x.y", b".com", b'.io"', b" ", b"a b", b"\t", b"-"]


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": r"^[A-Z]{3}-\d{4}$"},
    {"type": "string", "pattern": r"^\S+@\S+\.\S+$", "maxLength": 9},
    {"type": "string", "pattern": r'[é😀"\n]', "minLength": 3},
    {"type": "string", "format": "email"},
], ids=range(4))
def test_masks_in_patterned_strings_equal_brute_force(schema):
    singles = [bytes((b,)) for b in range(256)]
    entries: list[bytes | None] = [*singles, *_PIECES, None]
    vocabulary = Vocabulary(entries, [e or b"<s>" for e in entries])
    index = TokenIndex(vocabulary, len(entries) + 3)
    grammar = Grammar.from_schema(schema)
    rng = random.Random(5)
    checked = 0
    for _ in range(6):
        state, steps = grammar.initial, 0
        while state is not None and not grammar.is_terminal(state) and steps < 14:
            got = set(index.mask(grammar, state).nonzero().flatten().tolist())
            assert got == _brute(grammar, state, entries, index.width), state
            checked += 1
            token = rng.choice(sorted(got))
            state = grammar.advance_bytes(state, entries[token])
            steps += 1
    assert checked > 30
    assert any(grammar.pattern_position(c) is not None for c in grammar.advance_bytes(grammar.initial, b'"'))
