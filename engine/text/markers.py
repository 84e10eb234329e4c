"""What the reasoning parsers share: the split they return and the scanner that finds their markers
in streamed text cut anywhere (``harmony`` for gpt-oss's channels, ``reasoning`` for ``<think>``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass
class ReasoningDelta:
    """What one piece of streamed text added: reasoning and answer text."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningParser(Protocol):
    """Splits one streamed answer: ``feed`` each piece, then ``finish`` once it has ended."""

    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


@dataclass(frozen=True)
class Marker:
    text: str


class MarkerScanner:
    """Cuts a stream of text into plain text and markers, however the stream is cut: a tail that
    could still become a marker is held back until the next piece decides it."""

    def __init__(self, markers: Iterable[str]) -> None:
        self._markers = tuple(markers)
        self._longest = max(map(len, self._markers))
        self._pending = ""  # a tail that may be the start of a marker

    def feed(self, text: str) -> list[str | Marker]:
        """The pieces ``text`` completes: plain text (str) and whole markers, in order."""
        data, self._pending = self._pending + text, ""
        pieces: list[str | Marker] = []
        while data:
            found = [(data.find(m), -len(m), m) for m in self._markers if m in data]
            if not found:
                keep = self._partial_marker_len(data)
                self._pending = data[len(data) - keep:]
                if len(data) > keep:
                    pieces.append(data[:len(data) - keep])
                break
            start, _, marker = min(found)  # the earliest; the longest of those starting there
            if start:
                pieces.append(data[:start])
            pieces.append(Marker(marker))
            data = data[start + len(marker):]
        return pieces

    def finish(self) -> str:
        """Text held back at the end of the stream (an unfinished marker is plain text)."""
        tail, self._pending = self._pending, ""
        return tail

    def _partial_marker_len(self, data: str) -> int:
        """Length of the longest tail of ``data`` that is a proper prefix of some marker."""
        for n in range(min(len(data), self._longest - 1), 0, -1):
            if any(m.startswith(data[-n:]) for m in self._markers):
                return n
        return 0
