"""JSON Schema -> the grammar's nodes: what ``response_format`` json_schema / json_object compiles to.

A schema becomes a table of immutable nodes (``Grammar.nodes``) that refer to each other by index, so a
local ``$ref`` (recursive ones included) is just an index. Every keyword is either enforced, accepted as
an annotation, or refused with a ``SchemaError`` that names it (the server answers 400 with param
``response_format``): an answer that only looks as if it followed the schema is worse than a refusal.

Enforced: ``type`` (a name or a list; OpenAPI's ``nullable``), ``properties`` (written in schema order;
``required`` ones always, the others optionally), ``additionalProperties`` (false, true or a schema; when
absent it is false if ``properties`` are given, as in OpenAI's strict mode and vLLM's engines, else any),
``items`` / ``prefixItems`` (and the older array form of ``items``), ``minItems`` / ``maxItems``, ``enum``,
``const``, ``anyOf``, ``oneOf`` (as ``anyOf``: alternatives that overlap may match together), ``allOf`` with
one member, local ``$ref`` (``#``, ``#/$defs/...``, ``#/definitions/...`` or any JSON pointer into the
document), ``minLength`` / ``maxLength``, ``pattern`` (ECMA-262, unanchored as JSON Schema says, on the
decoded value; the subset and what is refused: ``hearth.engine.structured.regex``), ``format`` for
``date``, ``time``, ``date-time``, ``uuid``, ``ipv4`` and ``email`` (as the patterns ``FORMAT_PATTERNS``:
RFC 3339 without the days-per-month rule, a practical email), ``minimum`` / ``maximum`` /
``exclusiveMinimum`` / ``exclusiveMaximum``, ``uniqueItems: false``.
Accepted as annotations (JSON Schema 2020-12 makes ``format`` one): other ``format``s, ``title``,
``description``, ``default``, ``examples``, ``$comment``, ``$schema``, ``$id``, ``$anchor``, ``deprecated``,
``readOnly``, ``writeOnly``, ``contentEncoding``, ``contentMediaType``; keywords of no JSON Schema
vocabulary are ignored, as the specification says.
Refused: ``patternProperties``, ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, ``propertyNames``, ``minProperties``, ``maxProperties``,
``uniqueItems: true``, ``contains`` / ``minContains`` / ``maxContains``, ``unevaluatedProperties``,
``unevaluatedItems``, ``multipleOf``, ``$dynamicRef``, ``$recursiveRef``, ``contentSchema``, ``allOf``
with several members, remote ``$ref``, and a schema no value can satisfy.

Bounds that are the grammar's own, not the schema's: numbers have at most ``nodes.MAX_INT_DIGITS``
integer and ``nodes.MAX_FRACTION_DIGITS`` fraction digits and a 3-digit exponent (none when bounded), so
a model cannot write digits forever; ``enum`` / ``const`` values are written as compact JSON
(``json.dumps`` with ``separators=(",", ":")``).
"""

from __future__ import annotations

import functools
import json
from fractions import Fraction
from typing import Any

from hearth.engine.structured.nodes import (
    MAX_FRACTION_DIGITS,
    AnyOfNode,
    ArrayNode,
    LiteralNode,
    NeverNode,
    Node,
    NumberNode,
    ObjectNode,
    Prop,
    StringNode,
    pruned,
    satisfiable,
)
from hearth.engine.structured.regex import PatternError, Regex, compile_pattern, intersection

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "deprecated",
    "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "format", "$defs", "definitions",
})
_REFUSED = ("patternProperties", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "propertyNames", "minProperties", "maxProperties", "contains", "minContains",
            "maxContains", "unevaluatedProperties", "unevaluatedItems", "multipleOf", "$dynamicRef",
            "$recursiveRef", "contentSchema")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_OBJECT_KEYS = ("properties", "required", "additionalProperties")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern")
_DATE = r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?(?:[Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# The formats enforced, as patterns: RFC 3339's full-date (days up to 31 in any month), full-time and
# date-time, RFC 4122's uuid (any version), dotted-quad IPv4, and a practical email (local part of
# letters, digits and ._%+-, a dotted domain ending in two letters or more; no quoted local parts).
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$",
    "ipv4": f"^(?:{_OCTET}\\.){{3}}{_OCTET}$",
    "email": r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}$",
}
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class SchemaError(ValueError):
    """The schema cannot be enforced; the message names the keyword (and where it is)."""


def literal(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class _Compiler:
    def __init__(self, document: Any) -> None:
        self.document = document
        self.nodes: list[Node | None] = []
        self.refs: dict[str, int] = {}  # JSON pointer -> node, so recursion closes on itself
        self._any: int | None = None

    def add(self, node: Node | None) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def any_value(self) -> int:
        """The node of any JSON value (``true``, ``{}``, ``json_object``'s values)."""
        if self._any is None:
            self._any = index = self.add(None)
            scalars = [self.add(StringNode(0, None)), self.add(NumberNode(False)),
                       self.add(LiteralNode((b"true", b"false", b"null")))]
            obj = self.add(ObjectNode((), index))
            arr = self.add(ArrayNode((), index, 0, None))
            self.nodes[index] = AnyOfNode((obj, arr, *scalars))
        return self._any

    def compile(self, schema: Any, where: str) -> int:
        if schema is True:
            return self.any_value()
        if schema is False:
            return self.add(NeverNode())
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or a boolean, not {type(schema).__name__}")
        for key in _REFUSED:
            if key in schema:
                raise SchemaError(f"{where}: the keyword {key!r} cannot be enforced by Hearth's structured output")
        if schema.get("uniqueItems", False) is not False:
            raise SchemaError(f"{where}: the keyword 'uniqueItems' (true) cannot be enforced by Hearth's "
                              "structured output")
        if "$ref" in schema:
            return self._ref(schema, where)
        if "allOf" in schema:
            return self._all_of(schema, where)
        if "anyOf" in schema or "oneOf" in schema:
            return self._any_of(schema, where)
        if "enum" in schema or "const" in schema:
            return self._enum(schema, where)
        node = self._typed(schema, where)
        if schema.get("nullable") is True:
            return self.add(AnyOfNode((node, self.add(LiteralNode((b"null",))))))
        return node

    def _ref(self, schema: dict[str, Any], where: str) -> int:
        ref = schema["$ref"]
        others = [k for k in schema if k != "$ref" and k not in _ANNOTATIONS]
        if others:
            raise SchemaError(f"{where}: keywords beside '$ref' ({', '.join(others)}) are not supported; "
                              "put them in the referenced schema")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: only local '$ref's (\"#/$defs/...\") are supported, not {ref!r}")
        if ref not in self.refs:
            self.refs[ref] = index = self.add(None)
            target = self.compile(_resolve(self.document, ref, where), ref)
            self.nodes[index] = AnyOfNode((target,))
        return self.refs[ref]

    def _all_of(self, schema: dict[str, Any], where: str) -> int:
        members = schema["allOf"]
        if not isinstance(members, list) or len(members) != 1:
            raise SchemaError(f"{where}: 'allOf' is supported with exactly one member (merge them into one schema)")
        rest = {k: v for k, v in schema.items() if k != "allOf" and k not in _ANNOTATIONS}
        if rest:
            raise SchemaError(f"{where}: keywords beside 'allOf' ({', '.join(rest)}) are not supported")
        return self.compile(members[0], f"{where}/allOf/0")

    def _any_of(self, schema: dict[str, Any], where: str) -> int:
        key = "anyOf" if "anyOf" in schema else "oneOf"
        members = schema[key]
        if not isinstance(members, list) or not members:
            raise SchemaError(f"{where}: '{key}' must be a non-empty list of schemas")
        rest = {k: v for k, v in schema.items() if k != key and k not in _ANNOTATIONS and k != "nullable"}
        if rest or ("anyOf" in schema and "oneOf" in schema):
            raise SchemaError(f"{where}: keywords beside '{key}' ({', '.join(rest)}) are not supported; "
                              "put them in each alternative")
        alternatives = [self.compile(m, f"{where}/{key}/{i}") for i, m in enumerate(members)]
        if schema.get("nullable") is True:
            alternatives.append(self.add(LiteralNode((b"null",))))
        return self.add(AnyOfNode(tuple(alternatives)))

    def _enum(self, schema: dict[str, Any], where: str) -> int:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            raise SchemaError(f"{where}: 'enum' must be a list")
        if "const" in schema and "enum" in schema:
            enum = schema["enum"] if isinstance(schema["enum"], list) else []
            values = [v for v in values if any(_same_json(v, e) for e in enum)]
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const") and k not in _ANNOTATIONS}
        pattern = _string_pattern(schema, where)
        kept = [v for v in values if _conforms(v, rest, where) and (
            pattern is None or not isinstance(v, str) or pattern.matches(v))]
        if schema.get("nullable") is True and not any(v is None for v in kept):
            kept.append(None)
        try:
            texts = tuple(dict.fromkeys(literal(v) for v in kept))
        except ValueError as err:  # NaN / Infinity
            raise SchemaError(f"{where}: 'enum' holds a value JSON cannot write ({err})") from None
        return self.add(LiteralNode(texts))

    def _typed(self, schema: dict[str, Any], where: str) -> int:
        types = schema.get("type")
        if types is None:
            types = _inferred_types(schema)
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
            raise SchemaError(f"{where}: 'type' must be one of {', '.join(_TYPES)} or a list of them, not {types!r}")
        nodes = [self._one_type(t, schema, where) for t in dict.fromkeys(types)]
        return nodes[0] if len(nodes) == 1 else self.add(AnyOfNode(tuple(nodes)))

    def _one_type(self, kind: str, schema: dict[str, Any], where: str) -> int:
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            return self._array(schema, where)
        if kind == "string":
            lo, hi = _count(schema, "minLength", where), _count(schema, "maxLength", where)
            return self.add(StringNode(lo or 0, hi, _string_pattern(schema, where)))
        if kind in ("number", "integer"):
            return self.add(_number(schema, kind == "integer", where))
        return self.add(LiteralNode((b"true", b"false") if kind == "boolean" else (b"null",)))

    def _object(self, schema: dict[str, Any], where: str) -> int:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict):
            raise SchemaError(f"{where}: 'properties' must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}: 'required' must be a list of property names")
        extra = schema.get("additionalProperties", None if properties else True)
        additional = None if extra is None or extra is False else \
            self.compile(extra, f"{where}/additionalProperties")
        props = [Prop(name, literal(name), self.compile(sub, f"{where}/properties/{name}"), name in required)
                 for name, sub in properties.items()]
        for name in required:
            if name not in properties:
                if additional is None:
                    raise SchemaError(f"{where}: 'required' names {name!r}, which is not in 'properties', and "
                                      "additionalProperties does not allow it")
                props.append(Prop(name, literal(name), additional, True))
        return self.add(ObjectNode(tuple(props), additional))

    def _array(self, schema: dict[str, Any], where: str) -> int:
        items = schema.get("items", True)
        prefix_schemas = schema.get("prefixItems", [])
        if isinstance(items, list):  # draft 4-7's tuple form
            prefix_schemas, items = items, schema.get("additionalItems", True)
        if not isinstance(prefix_schemas, list):
            raise SchemaError(f"{where}: 'prefixItems' must be a list of schemas")
        prefix = tuple(self.compile(s, f"{where}/prefixItems/{i}") for i, s in enumerate(prefix_schemas))
        item = None if items is False else self.compile(items, f"{where}/items")
        lo, hi = _count(schema, "minItems", where) or 0, _count(schema, "maxItems", where)
        return self.add(ArrayNode(prefix, item, lo, hi))


def _resolve(document: Any, ref: str, where: str) -> Any:
    node = document
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"{where}: '$ref' {ref!r} points to nothing in the schema")
    return node


def _inferred_types(schema: dict[str, Any]) -> list[str]:
    """The type a schema without ``type`` is written for: its keywords say which (JSON Schema would let
    any other type through, which is never what such a schema means); none: any type."""
    for kind, keys in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS), ("string", _STRING_KEYS),
                       ("number", _NUMBER_KEYS)):
        if any(k in schema for k in keys):
            return [kind]
    return list(_TYPES[:-2]) + ["boolean", "null"]


def _count(schema: dict[str, Any], key: str, where: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise SchemaError(f"{where}: '{key}' must be a non-negative integer")
    return int(value)


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> Regex:
    return compile_pattern(source)


def _string_pattern(schema: dict[str, Any], where: str) -> Regex | None:
    """The DFA of the string's ``pattern`` and enforced ``format`` together, or None."""
    found: list[Regex] = []
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise SchemaError(f"{where}: 'pattern' must be a string")
        try:
            found.append(_compiled(pattern))
        except PatternError as err:
            raise SchemaError(f"{where}: the keyword 'pattern': {err}") from None
    form = schema.get("format")
    if isinstance(form, str) and form in FORMAT_PATTERNS:
        found.append(_compiled(FORMAT_PATTERNS[form]))
    if len(found) == 2:
        try:
            return intersection(*found)
        except PatternError as err:
            raise SchemaError(f"{where}: the keywords 'pattern' and 'format': {err}") from None
    return found[0] if found else None


def _bound(schema: dict[str, Any], key: str, where: str) -> Fraction | None:
    value = schema.get(key)
    if value is None or (isinstance(value, bool) and key.startswith("exclusive")):
        return None  # (draft 4's boolean exclusiveMinimum is handled by the caller)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(f"{where}: '{key}' must be a number")
    return Fraction(value)


def _number(schema: dict[str, Any], integer: bool, where: str) -> NumberNode:
    step = Fraction(1) if integer else Fraction(1, 10 ** MAX_FRACTION_DIGITS)
    lo, hi = _bound(schema, "minimum", where), _bound(schema, "maximum", where)
    ex_lo, ex_hi = _bound(schema, "exclusiveMinimum", where), _bound(schema, "exclusiveMaximum", where)
    if schema.get("exclusiveMinimum") is True and lo is not None:  # draft 4
        lo, ex_lo = None, lo
    if schema.get("exclusiveMaximum") is True and hi is not None:
        hi, ex_hi = None, hi
    # Onto the grid of writable values: the smallest one >= lo (> ex_lo), the largest <= hi (< ex_hi).
    lows = [_ceil_to(v, step) for v in (lo,) if v is not None] + \
           [_floor_to(v, step) + step for v in (ex_lo,) if v is not None]
    highs = [_floor_to(v, step) for v in (hi,) if v is not None] + \
            [_ceil_to(v, step) - step for v in (ex_hi,) if v is not None]
    return NumberNode(integer, max(lows) if lows else None, min(highs) if highs else None)


def _floor_to(value: Fraction, step: Fraction) -> Fraction:
    return (value // step) * step


def _ceil_to(value: Fraction, step: Fraction) -> Fraction:
    return -((-value) // step) * step


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _conforms(value: Any, schema: dict[str, Any], where: str) -> bool:
    """Whether an ``enum`` / ``const`` value meets the schema's other keywords (those that may sit beside
    them: type, string lengths, numeric bounds; anything else is refused)."""
    unsupported = [k for k in schema if k not in ("type", "nullable", *_STRING_KEYS, *_NUMBER_KEYS)]
    if unsupported:
        raise SchemaError(f"{where}: keywords beside 'enum' / 'const' ({', '.join(unsupported)}) are not supported")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or any(t not in _TYPES for t in types):
            raise SchemaError(f"{where}: 'type' must be one of {', '.join(_TYPES)} or a list of them")
        if not any(_is_type(value, t) for t in types):
            return False
    if isinstance(value, str):  # (the caller checks 'pattern')
        lo, hi = _count(schema, "minLength", where), _count(schema, "maxLength", where)
        return (lo is None or len(value) >= lo) and (hi is None or len(value) <= hi)
    if isinstance(value, int | float) and not isinstance(value, bool):
        node = _number(schema, False, where)
        exact = Fraction(value)
        return (node.lo is None or exact >= node.lo) and (node.hi is None or exact <= node.hi)
    return True


_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {"object": dict, "array": list, "string": str,
                                                     "null": type(None), "number": (int, float)}


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return kind != "boolean" and isinstance(value, _PYTHON_TYPES[kind])


def compile_nodes(schema: Any) -> tuple[tuple[Node, ...], int]:
    """The node table of ``schema`` and its root's index. Raises SchemaError."""
    compiler = _Compiler(schema)
    root = compiler.compile(schema, "#")
    nodes = [n if n is not None else NeverNode() for n in compiler.nodes]  # (every placeholder is filled)
    sat = satisfiable(nodes)
    if not sat[root]:
        raise SchemaError("#: no JSON value satisfies this schema (an empty enum, a required property that can "
                          "never be written, minItems beyond what the items allow...)")
    return tuple(pruned(n, sat) for n in nodes), root
