"""The grammar's nodes: what a JSON Schema compiles to (``hearth.engine.structured.schema``) and the
automaton reads (``hearth.engine.structured.grammar``). Immutable; they refer to each other by index
in one table, so a recursive ``$ref`` is a cycle of indices. ``satisfiable`` / ``pruned`` drop what no
value can satisfy, so the automaton never starts what it cannot finish.

Bounds that are the grammar's own, not the schema's: numbers have at most ``MAX_INT_DIGITS`` integer
and ``MAX_FRACTION_DIGITS`` fraction digits (``hearth.engine.structured.numbers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from hearth.engine.structured.patterned import PatternedString
from hearth.engine.structured.regex import Regex

MAX_INT_DIGITS = 20
MAX_FRACTION_DIGITS = 20


@dataclass(frozen=True)
class Prop:
    name: str
    key: bytes  # the key as written: json.dumps(name) in UTF-8, quotes included
    node: int
    required: bool


@dataclass(frozen=True)
class ObjectNode:
    props: tuple[Prop, ...]
    additional: int | None  # the node of additional properties' values; None: none allowed


@dataclass(frozen=True)
class ArrayNode:
    prefix: tuple[int, ...]
    items: int | None  # the node of items past the prefix; None: none
    min_items: int
    max_items: int | None


@dataclass(frozen=True)
class StringNode:
    """pattern: the DFA the decoded value must match (``pattern`` and enforced ``format``s), or None."""

    min_length: int
    max_length: int | None
    pattern: Regex | None = None


@dataclass(frozen=True)
class NumberNode:
    """integer: digits only. lo / hi: inclusive bounds (exclusive ones are moved onto the grid of
    values the grammar can write: integers, or multiples of 10**-MAX_FRACTION_DIGITS)."""

    integer: bool
    lo: Fraction | None = None
    hi: Fraction | None = None

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None


@dataclass(frozen=True)
class LiteralNode:
    texts: tuple[bytes, ...]  # each alternative exactly as written


@dataclass(frozen=True)
class AnyOfNode:
    alternatives: tuple[int, ...]


@dataclass(frozen=True)
class NeverNode:
    """No value (the ``false`` schema, an empty enum...)."""


Node = ObjectNode | ArrayNode | StringNode | NumberNode | LiteralNode | AnyOfNode | NeverNode


def satisfiable(nodes: list[Node]) -> list[bool]:
    """Which nodes some JSON value (within the grammar's digit bounds) satisfies: the least fixpoint, so
    a ``$ref`` that must recurse forever (a required property of its own type) is unsatisfiable."""
    sat = [False] * len(nodes)
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(nodes):
            if not sat[i] and _holds(node, sat):
                sat[i] = changed = True
    return sat


def _holds(node: Node, sat: list[bool]) -> bool:
    if isinstance(node, StringNode):
        if node.pattern is not None:
            return _matches_some_length(node)
        return node.max_length is None or node.min_length <= node.max_length
    if isinstance(node, NumberNode):
        step = Fraction(1) if node.integer else Fraction(1, 10 ** MAX_FRACTION_DIGITS)
        top = 10 ** MAX_INT_DIGITS - step  # the largest magnitude the grammar writes
        lo = -top if node.lo is None else max(node.lo, -top)
        hi = top if node.hi is None else min(node.hi, top)
        return lo <= hi
    if isinstance(node, LiteralNode):
        return bool(node.texts)
    if isinstance(node, AnyOfNode):
        return any(sat[a] for a in node.alternatives)
    if isinstance(node, ObjectNode):
        return all(sat[p.node] for p in node.props if p.required)
    if isinstance(node, ArrayNode):
        needed = node.prefix[:node.min_items]
        beyond = node.min_items > len(node.prefix)
        fits = node.max_items is None or node.min_items <= node.max_items
        return fits and all(sat[i] for i in needed) and (not beyond or (node.items is not None and sat[node.items]))
    return False


def _matches_some_length(node: StringNode) -> bool:
    assert node.pattern is not None
    return PatternedString(node.pattern, node.min_length, node.max_length).fits(0, 0)


def pruned(node: Node, sat: list[bool]) -> Node:
    """``node`` without the parts no value can take (alternatives, optional properties, items), so the
    grammar never starts what it cannot finish."""
    if isinstance(node, AnyOfNode):
        return AnyOfNode(tuple(a for a in node.alternatives if sat[a]))
    if isinstance(node, ObjectNode):
        additional = node.additional if node.additional is not None and sat[node.additional] else None
        return ObjectNode(tuple(p for p in node.props if sat[p.node]), additional)
    if isinstance(node, ArrayNode):
        prefix = node.prefix
        cut = next((i for i, p in enumerate(prefix) if not sat[p]), None)
        items = node.items if node.items is not None and sat[node.items] else None
        if cut is not None:
            prefix, items = prefix[:cut], None
        max_items = node.max_items
        if items is None:
            max_items = len(prefix) if max_items is None else min(max_items, len(prefix))
        return ArrayNode(prefix, items, node.min_items, max_items)
    return node
