"""Overlapped decode: the device-side pieces ``Engine.step`` uses to launch decode step N+1 before
it reads step N's tokens back (what vLLM calls async scheduling).

A pure decode step (every request one token, no penalties, no runahead) samples on the device and
becomes a ``Flight``: its tokens stay there, to be copied straight into the next step's input ids,
and a non-blocking copy into pinned host memory, followed by a CUDA event, brings them back while
the GPU already runs the next step. The engine then detokenises, checks stop conditions and builds
events for step N while the GPU computes step N+1 (``hearth.engine.engine`` has the whole design).
Off CUDA the tokens are on the host already and nothing here waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PendingTokens:
    """Sampled tokens on their way to the host."""

    host: torch.Tensor  # (n,) long: the copy's destination (pinned), or the tokens themselves off CUDA
    copied: torch.cuda.Event | None  # recorded after the copy; None when nothing is copied

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()  # only this copy and what precedes it, not the step after it
        return self.host.tolist()


class TokenReadback:
    """Non-blocking device-to-host copies of sampled tokens into two pinned buffers used in turn:
    one step's tokens are read while the next step's copy fills the other. The engine lands each
    flight before it starts the one after the next, so a buffer is never refilled while unread."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [self._buffer(capacity) for _ in range(2)] if self._cuda else []
        self._events = [torch.cuda.Event() for _ in range(2)] if self._cuda else []
        self._turn = 0

    @staticmethod
    def _buffer(capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.long, pin_memory=True)

    def start(self, tokens: torch.Tensor) -> PendingTokens:
        if not self._cuda:
            return PendingTokens(tokens, None)
        self._turn ^= 1
        if self._buffers[self._turn].numel() < tokens.numel():
            self._buffers[self._turn] = self._buffer(tokens.numel())
        host = self._buffers[self._turn][:tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event = self._events[self._turn]
        event.record()
        return PendingTokens(host, event)


@dataclass
class Flight:
    """A launched decode step whose tokens the host has not read: row i is ``requests[i]``'s token.
    The requests are the engine's own records (``hearth.engine.engine._Request``)."""

    requests: list[Any]
    tokens: torch.Tensor  # (n,) long on the device
    pending: PendingTokens


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on ``device`` without a host sync (pageable host-to-device copies wait)."""
    index = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index
