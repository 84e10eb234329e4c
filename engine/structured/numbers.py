"""Numbers, digit by digit: JSON's number syntax, the grammar's digit bounds, and a schema's minimum /
maximum checked at every digit, so no number is begun that cannot end within them.

A number's state is ``(phase, negative, a, b)``. A number under bounds keeps its digits (a, b: the
integer and fraction digit strings) while they matter, and takes no exponent; once every value that can
follow is within the bounds, or when there are none, the digits are only counted (a: integer digits, b:
fraction or exponent digits), so the states repeat and their masks are cached.
"""

from __future__ import annotations

from typing import Any

from hearth.engine.structured.nodes import MAX_FRACTION_DIGITS, MAX_INT_DIGITS, NumberNode

MAX_EXPONENT_DIGITS = 3
SIGN, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(8)
_COMPLETE = frozenset({ZERO, INT, FRAC, EXP_DIGITS})
_DIGITS = frozenset(b"0123456789")

Number = tuple[int, bool, Any, Any]


def start(node: NumberNode, byte: int) -> Number | None:
    """The state after a number's first byte, or None."""
    tracked = node.bounded
    if byte == 0x2D:
        number: Number = (SIGN, True, "" if tracked else 0, "" if tracked else 0)
    elif byte in _DIGITS:
        number = (ZERO if byte == 0x30 else INT, False, chr(byte) if tracked else 1, "" if tracked else 0)
    else:
        return None
    return _settled(node, number)


def step(node: NumberNode, number: Number, byte: int) -> Number | None:
    """The state after one more byte of the number, or None."""
    phase, negative, a, b = number
    digit = byte in _DIGITS
    following: tuple[int, Any, Any] | None = None
    if phase == SIGN and digit:
        following = (ZERO if byte == 0x30 else INT, _more(a, byte), b)
    elif phase == INT and digit and _length(a) < MAX_INT_DIGITS:
        following = (INT, _more(a, byte), b)
    elif phase in (ZERO, INT) and byte == 0x2E and not node.integer:
        following = (DOT, a, b)
    elif phase in (DOT, FRAC) and digit and _length(b) < MAX_FRACTION_DIGITS:
        following = (FRAC, a, _more(b, byte))
    elif node.bounded or node.integer:
        return None
    elif phase in (ZERO, INT, FRAC) and byte in (0x65, 0x45):  # e / E
        following = (EXP, a, 0)
    elif phase == EXP and byte in (0x2B, 0x2D):
        following = (EXP_SIGN, a, 0)
    elif phase in (EXP, EXP_SIGN, EXP_DIGITS) and digit and b < MAX_EXPONENT_DIGITS:
        following = (EXP_DIGITS, a, b + 1)
    if following is None:
        return None
    return _settled(node, (following[0], negative, following[1], following[2]))


def is_complete(node: NumberNode, number: Number) -> bool:
    """Whether the number may end here."""
    return number[0] in _COMPLETE and (not _tracked(number) or _in_range(node, *number))


def digit_room(number: Number) -> int | None:
    """How many more digits a token of digits only may add, where it just lengthens the number (bounds
    no longer mattering), or None."""
    if _tracked(number):
        return None
    phase, _, a, b = number
    if phase == INT:
        return MAX_INT_DIGITS - a
    if phase in (DOT, FRAC):
        return MAX_FRACTION_DIGITS - b
    if phase in (EXP, EXP_SIGN, EXP_DIGITS):
        return MAX_EXPONENT_DIGITS - b
    return None


def _settled(node: NumberNode, number: Number) -> Number | None:
    """The state as kept: None when no value within the bounds can follow; once every value that can
    follow is within them, the bounds no longer matter and the digits are only counted."""
    if not _tracked(number):
        return number
    if not _feasible(node, *number):
        return None
    if _inside(node, *number):
        return number[0], False, len(number[2]), len(number[3])
    return number


def _tracked(number: Number) -> bool:
    """Whether the state keeps its digits (its bounds still matter)."""
    return isinstance(number[2], str)


def _more(digits: Any, byte: int) -> Any:
    return digits + chr(byte) if isinstance(digits, str) else digits + 1


def _length(digits: Any) -> int:
    return len(digits) if isinstance(digits, str) else digits


def _scale(node: NumberNode) -> int:
    return 1 if node.integer else 10 ** MAX_FRACTION_DIGITS


def _magnitudes(node: NumberNode, phase: int, a: str, b: str) -> list[tuple[int, int]]:
    """The magnitudes (in units of 1 / _scale) that numbers beginning with these digits can reach,
    as increasing, disjoint closed intervals."""
    scale = _scale(node)
    fraction_span = scale - 1  # what fraction digits can add
    if phase == SIGN:
        return [(0, 10 ** MAX_INT_DIGITS * scale - 1)]
    whole = int(a) * scale
    if phase in (ZERO, DOT):
        return [(whole, whole + fraction_span)]
    if phase == FRAC:
        unit = 10 ** (MAX_FRACTION_DIGITS - len(b))
        low = whole + int(b) * unit
        return [(low, low + unit - 1)]
    value = int(a)
    spans = []
    for extra in range(MAX_INT_DIGITS - len(a) + 1):  # integer digits still to come
        low = value * 10 ** extra
        spans.append((low * scale, ((value + 1) * 10 ** extra - 1) * scale + fraction_span))
    return spans


def _bounds(node: NumberNode, negative: bool) -> tuple[int | None, int | None]:
    """The node's bounds on the magnitude, in units of 1 / _scale (a negative number's are mirrored)."""
    scale = _scale(node)
    lo = None if node.lo is None else int(node.lo * scale)
    hi = None if node.hi is None else int(node.hi * scale)
    return (None if hi is None else -hi, None if lo is None else -lo) if negative else (lo, hi)


def _feasible(node: NumberNode, phase: int, negative: bool, a: str, b: str) -> bool:
    lo, hi = _bounds(node, negative)
    return any((hi is None or low <= hi) and (lo is None or high >= lo)
               for low, high in _magnitudes(node, phase, a, b))


def _inside(node: NumberNode, phase: int, negative: bool, a: str, b: str) -> bool:
    lo, hi = _bounds(node, negative)
    return all((lo is None or low >= lo) and (hi is None or high <= hi) for low, high in _magnitudes(node, phase, a, b))


def _in_range(node: NumberNode, phase: int, negative: bool, a: str, b: str) -> bool:
    lo, hi = _bounds(node, negative)
    scale = _scale(node)
    value = int(a or "0") * scale + (int(b) * 10 ** (MAX_FRACTION_DIGITS - len(b)) if b else 0)
    return (lo is None or value >= lo) and (hi is None or value <= hi)
