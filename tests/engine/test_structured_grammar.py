"""The JSON Schema automaton (hearth.engine.structured.grammar / schema): texts each keyword allows and
refuses, string escapes and UTF-8 cut anywhere, whitespace bounds, completeness, the keywords refused,
and random texts written by the automaton itself, which must parse and conform and never dead-end."""

from __future__ import annotations

import json
import random

import pytest

from hearth.engine.structured.grammar import MAX_NEWLINES, MAX_SPACES, Grammar
from hearth.engine.structured.nodes import MAX_INT_DIGITS
from hearth.engine.structured.schema import SchemaError
from tests.engine.schema_check import problems


def _state(schema, text: str | bytes):
    grammar = Grammar.from_schema(schema)
    data = text.encode() if isinstance(text, str) else text
    return grammar, grammar.advance_bytes(grammar.initial, data)


def whole(schema, text: str | bytes) -> bool:
    """The text is a complete value of the schema."""
    grammar, state = _state(schema, text)
    return state is not None and grammar.is_complete(state)


def begins(schema, text: str | bytes) -> bool:
    """The text can still become a value of the schema."""
    return _state(schema, text)[1] is not None


PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "nick": {"type": "string"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string"}, ['"x"', '""', '"a b"'], ['x', '"x', "'x'"]),
    ({"type": "integer"}, ["0", "-7", "120"], ["1.5", "1e3", "01", "-", "+1", '"1"']),
    ({"type": "number"}, ["0", "-7.25", "1e3", "2E-4", "0.5e+10"], ["1.", ".5", "1e", "00", "--1", "NaN"]),
    ({"type": "boolean"}, ["true", "false"], ["True", "1", "null"]),
    ({"type": "null"}, ["null"], ["None", "nul"]),
    ({"type": ["string", "null"]}, ['"a"', "null"], ["1", "true"]),
    ({"type": "integer", "nullable": True}, ["3", "null"], ['"3"']),
    ({"type": "array", "items": {"type": "integer"}}, ["[]", "[1, 2,3]", "[ 1 ]"], ["[1,]", "[1 2]", '["a"]', "[,]"]),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}], "items": False},
     ['["a", true]', '["a"]', "[]"], ['["a", true, 1]', "[true]"]),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}},
     ['[1, "a", "b"]'], ['[1, 2]']),
    ({"type": "array", "minItems": 2, "maxItems": 3}, ["[1, 2]", '[1, "a", null]'], ["[1]", "[1, 2, 3, 4]"]),
    ({"enum": ["red", "green", 3, None]}, ['"red"', '"green"', "3", "null"], ['"blue"', '"re"', "4"]),
    ({"enum": [1, 12]}, ["1", "12"], ["2", "123"]),
    ({"const": {"a": [1, 2]}}, ['{"a":[1,2]}'], ['{"a":[1,3]}', '{"a": [1,2]}']),
    ({"type": "string", "enum": ["a", 1]}, ['"a"'], ["1"]),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, ["5", '"ab"'], ['"abc"', "true"]),
    ({"oneOf": [{"type": "boolean"}, {"type": "null"}]}, ["true", "null"], ["0"]),
    ({"allOf": [{"type": "integer", "minimum": 2}]}, ["2"], ["1"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"', '"é😀"'], ['"a"', '"abcd"']),
    ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"not a date"', '"2024-13-01"', "1"]),
    ({"type": "string", "format": "color"}, ['"not a color"'], ["1"]),  # (an annotation)
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ['"abc"', '"a\\u0062"'], ['"abcd"', '""', '"aB"']),
    ({"pattern": "x"}, ['"axb"', '"x"'], ['"ab"', "1"]),  # (a pattern makes the type string)
    ({"enum": ["a1", "b2", "cc"], "pattern": "\\d"}, ['"a1"', '"b2"'], ['"cc"']),
])
def test_keywords_allow_and_refuse(schema, good, bad):
    for text in good:
        assert whole(schema, text), text
        assert problems(json.loads(text), schema) == [], text
    for text in bad:
        assert not whole(schema, text), text


def test_object_properties_come_in_schema_order_required_ones_always():
    assert whole(PERSON, '{"name": "Ada", "age": 36}')
    assert whole(PERSON, '{"name":"Ada","age":36,"nick":"A"}')
    assert not begins(PERSON, '{"age"')  # name first
    assert not begins(PERSON, '{"name": "Ada", "nick"')  # age is required before nick
    assert not whole(PERSON, '{"name": "Ada"}')
    assert not begins(PERSON, '{"name": "Ada", "age": 36, "other"')  # properties given: no others
    assert not begins(PERSON, '{"name": "Ada", "age": 36,}')
    assert not begins(PERSON, '{"name": "Ada", "name"')


def test_additional_properties():
    free = {**PERSON, "additionalProperties": True}
    assert whole(free, '{"name": "A", "age": 1, "x": [1, {"y": null}], "z": "w"}')
    assert not begins(free, '{"name": "A", "age": 1, "name"')  # a declared name is no additional key
    assert not begins(free, '{"name": "A", "age": 1, "ag\\u0065"')  # additional keys take no escapes
    assert whole(free, '{"name": "A", "age": 1, "names": 2, "ag": 3}')
    typed = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert whole(typed, '{"a": 1, "é": 2}')
    assert not begins(typed, '{"a": "x"')
    assert whole({"type": "object"}, '{"a": {"b": [true, 1.5, "c", null]}}')  # json_object: any object
    assert not begins({"type": "object"}, "[")
    assert not begins({"type": "object", "properties": {}, "additionalProperties": False}, '{"')
    assert whole({"type": "object", "properties": {}, "additionalProperties": False}, "{}")


def test_required_property_outside_properties_takes_the_additional_schema():
    schema = {"type": "object", "required": ["id"], "additionalProperties": {"type": "integer"}}
    assert whole(schema, '{"id": 3}')
    assert not whole(schema, "{}")
    with pytest.raises(SchemaError, match="id"):
        Grammar.from_schema({"type": "object", "properties": {"a": {}}, "required": ["id"],
                             "additionalProperties": False})


def test_refs_local_and_recursive():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"}
    assert whole(tree, '{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]}')
    assert not begins(tree, '{"v": 1, "kids": [{"w"')
    old = {"definitions": {"x": {"type": "boolean"}}, "type": "array", "items": {"$ref": "#/definitions/x"}}
    assert whole(old, "[true, false]")
    itself = {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]}
    assert whole(itself, "[1, [2, [[]]]]")
    alias = {"anyOf": [{"type": "string"}, {"$ref": "#"}]}  # an alternative of itself
    assert whole(alias, '"a"')


def test_number_bounds_are_enforced_digit_by_digit():
    age = {"type": "integer", "minimum": 0, "maximum": 150}
    assert all(whole(age, str(n)) for n in (0, 7, 99, 150))
    assert whole(age, "-0") and not begins(age, "-1")  # (-0 is 0)
    assert not begins({"type": "integer", "minimum": 1}, "-")  # no negative value: refused at the sign
    assert not begins(age, "2000") and not begins(age, "151") and begins(age, "15")
    exclusive = {"type": "number", "exclusiveMinimum": -1.5, "exclusiveMaximum": 2}
    assert whole(exclusive, "-1.49") and whole(exclusive, "1.999") and whole(exclusive, "0")
    assert not whole(exclusive, "-1.5") and not begins(exclusive, "2.0") and not begins(exclusive, "-2")
    assert not begins(exclusive, "1e1")  # bounded numbers take no exponent
    low = {"type": "number", "minimum": 10}
    assert whole(low, "10") and whole(low, "123456.5") and not whole(low, "9.99")
    assert begins(low, "9")  # (90 is fine)
    assert not begins({"type": "integer", "maximum": -5}, "0")


def test_numbers_have_bounded_digits():
    assert whole({"type": "integer"}, "9" * MAX_INT_DIGITS)
    assert not begins({"type": "integer"}, "9" * (MAX_INT_DIGITS + 1))
    assert not begins({"type": "number"}, "1e1234")


def test_string_escapes_and_control_characters():
    s = {"type": "string"}
    for text in (r'"\" \\ \/ \b \f \n \r \t"', r'"\u00e9\u0041"', r'"\ud83d\ude00"', r'"\uD83D\uDE00"'):
        assert whole(s, text), text
    assert json.loads(r'"\ud83d\ude00"') == "😀"
    for text in (r'"\x"', r'"\u12g4"', '"a\nb"', '"\t"', '"\x00"'):
        assert not begins(s, text), text
    assert not begins(s, r'"\udc')  # a low surrogate with no high one: refused at its second digit
    assert begins(s, r'"\ud83d') and not begins(s, r'"\ud83da') and not begins(s, r'"\ud83d\u0041')
    assert not whole(s, r'"\ud83d"')
    assert whole({"type": "string", "maxLength": 1}, r'"\ud83d\ude00"')  # one character


def test_utf8_is_checked_byte_by_byte_and_may_be_cut_anywhere():
    s = {"type": "string", "maxLength": 2}
    text = '"é😀"'.encode()
    grammar = Grammar.from_schema(s)
    state = grammar.initial
    for byte in text:  # one byte at a time: every state in between is mid-character
        state = grammar.advance(state, byte)
        assert state is not None
    assert grammar.is_complete(state)
    for bad in (b'"\xc0\x80"', b'"\xed\xa0\x80"', b'"\xf5\x80\x80\x80"', b'"\x80"', b'"\xe2\x82"'):
        assert not whole(s, bad), bad
    assert not begins(s, '"éé😀')  # three characters


def test_whitespace_is_bounded_and_never_after_the_value():
    schema = {"type": "array", "items": {"type": "integer"}}
    assert whole(schema, "[\n  1,\n  2\n]")
    assert whole(schema, "\n\n[1]")
    assert begins(schema, "[" + "\n" * MAX_NEWLINES) and not begins(schema, "[" + "\n" * (MAX_NEWLINES + 1))
    assert begins(schema, "[" + " " * MAX_SPACES) and not begins(schema, "[" + " " * (MAX_SPACES + 1))
    assert begins(schema, "[1" + " " * MAX_SPACES + "," + " " * MAX_SPACES)  # each run has its own bound
    assert not begins(schema, "[1] ") and not begins(schema, "[1]\n")
    assert not begins(schema, "[1,\r2]")


def test_completeness_and_terminal_states():
    grammar, state = _state(PERSON, '{"name": "A", "age": 3}')
    assert grammar.is_complete(state) and grammar.is_terminal(state)
    grammar, state = _state({"type": "integer"}, "12")
    assert grammar.is_complete(state) and not grammar.is_terminal(state)  # more digits may follow
    grammar, state = _state({"enum": [1, 12]}, "12")
    assert grammar.is_terminal(state)
    grammar, state = _state(PERSON, '{"name": "A", "age": 3')
    assert not grammar.is_complete(state)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^(a)\\1$"}, "backreference"),
    ({"type": "string", "pattern": "^a(?=b)"}, "lookahead"),
    ({"type": "string", "pattern": "^a[b"}, "pattern"),
    ({"type": "string", "pattern": "^a$", "minLength": 2}, "no JSON value"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
    ({"$ref": "https://example.com/s.json"}, "\\$ref"),
    ({"$ref": "#/$defs/missing"}, "\\$ref"),
    ({"type": "strange"}, "type"),
    ({"enum": []}, "no JSON value"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "no JSON value"),
    ({"type": "integer", "minimum": 1, "maximum": 0}, "no JSON value"),
    ({"type": "integer", "minimum": 10 ** 30}, "no JSON value"),
    ({"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
      "$ref": "#/$defs/a"}, "no JSON value"),
])
def test_what_cannot_be_enforced_is_refused_by_name(schema, keyword):
    with pytest.raises(SchemaError, match=keyword):
        Grammar.from_schema(schema)


def test_unsatisfiable_parts_are_pruned_not_started():
    schema = {"type": "object", "properties": {"a": {"enum": []}, "b": {"type": "integer"}}}
    assert not begins(schema, '{"a"') and whole(schema, '{"b": 1}')
    choice = {"anyOf": [{"type": "string", "minLength": 5, "maxLength": 1}, {"type": "integer"}]}
    assert not begins(choice, '"') and whole(choice, "4")


# Schemas the random texts are drawn from: every keyword the grammar enforces.
RANDOM_SCHEMAS = [
    PERSON,
    {"type": "object"},
    {"type": "array", "prefixItems": [{"type": "number"}, {"enum": ["a", "b", None]}],
     "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[a-f]\\d?(?:x|\\\\)*$", "maxLength": 5},
                                          {"type": "string", "pattern": "^[\u00e9n\\\\]?\\w*$", "minLength": 2},
                                          {"type": "string", "format": "date"}]}},
    {"type": "object", "properties": {
        "score": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 10},
        "n": {"type": "integer", "minimum": 5, "maximum": 1234},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "meta": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": {"type": "integer"}}]}},
     "required": ["score", "n", "flags", "meta"], "additionalProperties": {"type": "string"}},
    {"$defs": {"t": {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/t"},
                                                            "maxItems": 2}}}}, "$ref": "#/$defs/t"},
]
# Bytes the random walk tries: structure, digits, letters, escapes, whitespace, controls, UTF-8 pieces.
_CANDIDATES = list(b'{}[],:"\\ \n\t-+.eE0123456789abfnrtuxAD') + [0x01, 0x7F, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80]
_CLOSERS = list(b'"}]0,:tfnu1') + [0xA9, 0x80, 0x98]  # ways out, tried first once a text is long
_WHITESPACE = b" \n\t"


def _random_text(grammar: Grammar, rng: random.Random, budget: int) -> bytes:
    state, out = grammar.initial, bytearray()
    while not grammar.is_terminal(state):
        if len(out) > 4 * budget + 300:
            raise AssertionError(f"no end in sight: {bytes(out)!r}")
        if len(out) > budget and grammar.is_complete(state):
            break
        order = rng.sample(_CANDIDATES, len(_CANDIDATES))
        if rng.random() < 0.8:  # whitespace now and then, else it fills the texts
            order = [b for b in order if b not in _WHITESPACE] + list(_WHITESPACE)
        if len(out) > budget:
            order = _CLOSERS + order
        following = next(((b, s) for b in order if (s := grammar.advance(state, b)) is not None), None)
        if following is None:  # none of the candidates: some byte must go on (no dead ends)
            following = next(((b, s) for b in range(256) if (s := grammar.advance(state, b)) is not None), None)
            assert following is not None, f"dead end after {bytes(out)!r}"
        out.append(following[0])
        state = following[1]
    assert grammar.is_complete(state)
    return bytes(out)


@pytest.mark.parametrize("schema", RANDOM_SCHEMAS, ids=range(len(RANDOM_SCHEMAS)))
def test_random_texts_parse_and_conform(schema):
    grammar = Grammar.from_schema(schema)
    rng = random.Random(7)
    for _ in range(12):
        text = _random_text(grammar, rng, budget=rng.randint(5, 60))
        value = json.loads(text.decode("utf-8"))
        assert problems(value, schema) == [], text
