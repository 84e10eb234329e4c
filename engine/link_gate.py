"""Auto's measured choice between sync and runahead for several requests (the runahead gate).

Runahead can only win time the layer-synchronous (sync) step leaves the host-to-device link idle: it
overlaps one request's expert copies with other requests' compute. It also costs: requests that split
across layers no longer share one copy of an expert both need, so where a layer's experts stream
through the pool in rounds a split round fetches more bytes. On the H200 through the user's attention
path (Triton DSA kernels, CUDA graphs) sync kept the link busy 91-96% of the time and runahead, always
on, ran at 0.93x sync at 32 requests with 7% more bytes copied (docs/benchmarks.md, O2).

So auto runs sync first at each number of decoding requests and measures, over its last ``window``
sync rounds, the share of a round the link was busy (the expert cache's copy-stream busy time against
the round's wall time; medians, so a round that compiled or captured does not decide). A sync round
serialises the link's copies with the compute between them; runahead at best overlaps them, so it can
save at most the smaller of the busy and the idle share. Runahead is tried only where that share is at
least ``min_gain`` (a link busy 90% of a round, or idle 100% because every expert is resident, leaves
nothing worth a split). A trial's first ``window`` rounds' worth of tokens warm it in and are not
judged (they carry the switch itself: every request's token put in flight, and the first calls at
group sizes sync never ran; the decoder's expert micro-steps are captured at every size by the engine's
warm-up since 2026-12-04, after the trials measured in docs/benchmarks.md); each later window must beat sync's median
round time. A trial that loses goes back to sync, and the next trial waits twice as long
(``max_backoff`` windows at most). A runahead that keeps winning is re-checked against fresh sync
rounds every ``recheck`` windows, since what the link carries changes as contexts grow and caches warm.

Measurements are keyed by the number of decoding requests: a round's time and its link traffic scale
with it. Intervals that mix in other work (a prompt chunk, requests joining or leaving) are dropped.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

SYNC, AHEAD = "sync", "runahead"


@dataclass
class _AtConcurrency:
    """What the gate knows about one number of decoding requests."""

    mode: str = SYNC
    rounds: deque = field(default_factory=deque)  # sync: (seconds, link busy seconds) of the last rounds
    round_s: float | None = None  # sync: median seconds per round of the last decision's window
    busy: float | None = None  # sync: median share of a round the link carried copies, same window
    hold: int = 0  # sync rounds left before runahead may be tried again
    backoff: int = 1  # windows the next hold lasts after a lost trial
    tokens: int = 0  # runahead: tokens finished in the current window
    seconds: float = 0.0  # runahead: wall time of the current window
    windows: int = 0  # runahead windows judged since the trial began (the first one warms in, unjudged)

    @property
    def idle(self) -> float | None:
        return None if self.busy is None else 1.0 - self.busy


class RunaheadGate:
    """See the module docstring. ``link_seconds``: the link's busy time so far (seconds, only grows:
    ``ExpertCache.copy_seconds``)."""

    def __init__(self, link_seconds: Callable[[], float], min_gain: float = 0.15, window: int = 3,
                 recheck: int = 32, max_backoff: int = 32) -> None:
        if not 0 <= min_gain <= 0.5 or window < 1 or recheck < 1 or max_backoff < 1:
            raise ValueError("min_gain must be in [0, 0.5]; window, recheck and max_backoff >= 1")
        self.link_seconds = link_seconds
        self.min_gain = min_gain
        self.window = window
        self.recheck = recheck
        self.max_backoff = max_backoff
        self.trials = self.lost = 0  # runahead trials started / lost to sync (the benchmark prints them)
        self._at: dict[int, _AtConcurrency] = {}
        self._link_mark = 0.0

    def reset(self) -> None:
        """Forget every measure and trial (the engine's warm-up rounds are not the users')."""
        self.trials = self.lost = 0
        self._at.clear()

    def allows(self, num_requests: int) -> bool:
        """May runahead decode ``num_requests`` requests now?"""
        state = self._at.get(num_requests)
        return state is not None and state.mode == AHEAD

    def state(self, num_requests: int) -> _AtConcurrency:
        return self._at.setdefault(num_requests, _AtConcurrency(rounds=deque(maxlen=self.window)))

    def begin(self) -> None:
        """Mark the link's busy time at the start of an interval (the next :meth:`sync_round`)."""
        self._link_mark = self.link_seconds()

    def sync_round(self, num_requests: int, seconds: float) -> None:
        """A decode round of ``num_requests`` requests ran as one sync step in ``seconds`` (since
        :meth:`begin`)."""
        busy = self.link_seconds() - self._link_mark
        if seconds <= 0:
            return
        s = self.state(num_requests)
        s.rounds.append((seconds, min(busy, seconds)))
        if s.mode != SYNC:
            return
        if s.hold:
            s.hold -= 1
            return
        if len(s.rounds) < self.window:
            return
        s.round_s = statistics.median(t for t, _ in s.rounds)
        s.busy = statistics.median(b / t for t, b in s.rounds)
        if min(s.busy, 1.0 - s.busy) >= self.min_gain:
            s.mode, s.tokens, s.seconds, s.windows = AHEAD, 0, 0.0, -1
            self.trials += 1

    def ahead(self, num_requests: int, tokens: int, seconds: float) -> None:
        """Runahead ran for ``seconds`` with ``num_requests`` requests in flight and finished ``tokens``
        of their tokens. Each ``window`` rounds' worth of tokens after the trial's first is judged against
        sync's round time."""
        s = self.state(num_requests)
        if s.mode != AHEAD:
            return
        s.tokens += tokens
        s.seconds += seconds
        if s.tokens < self.window * num_requests:
            return
        round_s = s.seconds * num_requests / s.tokens
        s.tokens, s.seconds = 0, 0.0
        if s.windows < 0:  # the warm-in window
            s.windows = 0
            return
        if s.round_s is not None and round_s > s.round_s:  # lost: back to sync, longer before the next try
            self.lost += 1
            self._to_sync(s, hold=s.backoff * self.window)
            s.backoff = min(2 * s.backoff, self.max_backoff)
            return
        s.backoff = 1
        s.windows += 1
        if s.windows >= self.recheck:  # re-measure sync: what the link carries drifts
            self._to_sync(s, hold=0)

    @staticmethod
    def _to_sync(s: _AtConcurrency, hold: int) -> None:
        s.mode, s.hold = SYNC, hold
        s.rounds.clear()  # a fresh window decides
