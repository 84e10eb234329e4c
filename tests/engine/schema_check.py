"""A small JSON Schema checker for the structured-output tests, written from the specification for the
keywords Hearth enforces (jsonschema is not a test dependency). ``problems(value, schema)`` lists
where ``value`` breaks ``schema``; empty when it conforms. ``oneOf`` is checked as Hearth enforces it
(as ``anyOf``); an object schema with ``properties`` and no ``additionalProperties`` allows none.
``pattern`` is checked with Python's ``re.search`` (ASCII classes, ``$`` only at the very end, as ECMA's),
the enforced ``format``s with the standard library's parsers where they agree with the formats' rules."""

from __future__ import annotations

import ipaddress
import re
import uuid
from typing import Any


def problems(value: Any, schema: Any, root: Any = None, where: str = "$") -> list[str]:
    root = schema if root is None else root
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{where}: no value is allowed"]
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/") if schema["$ref"] != "#" else []:
            target = target[part]
        return problems(value, target, root, where)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            if any(not problems(value, s, root, where) for s in schema[key]):
                return []
            if schema.get("nullable") and value is None:
                return []
            return [f"{where}: matches none of {key}"]
    if "allOf" in schema:
        return [p for s in schema["allOf"] for p in problems(value, s, root, where)]
    if schema.get("nullable") and value is None:
        return []
    if "const" in schema and not _equal(value, schema["const"]):
        return [f"{where}: {value!r} is not the const"]
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        return [f"{where}: {value!r} is not in the enum"]
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            return [f"{where}: {value!r} is not of type {types}"]
    found: list[str] = []
    if isinstance(value, dict):
        found += _object(value, schema, root, where)
    elif isinstance(value, list):
        found += _array(value, schema, root, where)
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            found.append(f"{where}: length {len(value)} is outside the bounds")
        if "pattern" in schema and not re.search(python_pattern(schema["pattern"]), value, re.ASCII):
            found.append(f"{where}: {value!r} does not match {schema['pattern']!r}")
        if not _has_format(value, schema.get("format")):
            found.append(f"{where}: {value!r} is no {schema['format']}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        for key, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                        ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            if key in schema and not ok(schema[key]):
                found.append(f"{where}: {value} breaks {key} {schema[key]}")
    return found


def python_pattern(pattern: str) -> str:
    """An ECMA-262 pattern of the tests' kind for Python's ``re``: a final ``$`` is the very end (Python's
    also matches before a final newline)."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern


_DATE = r"(\d{4})-(\d\d)-(\d\d)"
_TIME = r"(\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|[+-](\d\d):(\d\d))"


def _has_format(value: str, form: Any) -> bool:
    if form == "date":
        return _date(re.fullmatch(_DATE, value, re.ASCII))
    if form == "time":
        return _time(re.fullmatch(_TIME, value, re.ASCII))
    if form == "date-time":
        date, sep, time = value[:10], value[10:11], value[11:]
        return sep in ("T", "t") and _date(re.fullmatch(_DATE, date, re.ASCII)) and \
            _time(re.fullmatch(_TIME, time, re.ASCII))
    if form == "uuid":
        return len(value) == 36 and value.count("-") == 4 and _parses(uuid.UUID, value)
    if form == "ipv4":
        return _parses(ipaddress.IPv4Address, value)
    if form == "email":
        local, at, domain = value.rpartition("@")
        return bool(at and local and "." in domain and domain.rsplit(".", 1)[1].isalpha() and value.isascii()
                    and " " not in value and len(domain.rsplit(".", 1)[1]) >= 2 and "@" not in local)
    return True  # (an annotation)


def _date(m: re.Match[str] | None) -> bool:
    return m is not None and 1 <= int(m[2]) <= 12 and 1 <= int(m[3]) <= 31


def _time(m: re.Match[str] | None) -> bool:
    return m is not None and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) <= 60 and \
        (m[6] is None or (int(m[6]) < 24 and int(m[7]) < 60))


def _parses(kind: Any, value: str) -> bool:
    try:
        kind(value)
    except ValueError:
        return False
    return True


def _object(value: dict, schema: dict, root: Any, where: str) -> list[str]:
    found = [f"{where}: lacks {name!r}" for name in schema.get("required", []) if name not in value]
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", not properties)
    for name, item in value.items():
        if name in properties:
            found += problems(item, properties[name], root, f"{where}.{name}")
        elif extra is False:
            found.append(f"{where}: has the additional property {name!r}")
        elif extra is not True:
            found += problems(item, extra, root, f"{where}.{name}")
    return found


def _array(value: list, schema: dict, root: Any, where: str) -> list[str]:
    found = []
    if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
        found.append(f"{where}: {len(value)} items is outside the bounds")
    prefix = schema.get("prefixItems", [])
    items = schema.get("items", True)
    if isinstance(items, list):  # draft 4-7's tuple form
        prefix, items = items, schema.get("additionalItems", True)
    for i, item in enumerate(value):
        found += problems(item, prefix[i] if i < len(prefix) else items, root, f"{where}[{i}]")
    return found


_PYTHON_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "null": type(None),
                                 "number": (int, float)}


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return kind in _PYTHON_TYPES and isinstance(value, _PYTHON_TYPES[kind])


def _equal(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b
