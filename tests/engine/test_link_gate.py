"""Auto's runahead gate (hearth.engine.link_gate): sync first at each concurrency, runahead tried only
where sync rounds leave both the link and the compute idle a fair share of the time (what overlapping
them could save), kept only while it beats sync's round time, re-checked."""

from __future__ import annotations

import pytest

from hearth.engine.link_gate import RunaheadGate


class Link:
    """A link whose busy time the test sets: ``busy`` seconds are added by each round it carries."""

    def __init__(self) -> None:
        self.total = 0.0

    def __call__(self) -> float:
        return self.total


def _sync_rounds(gate: RunaheadGate, link: Link, n: int, rounds: int, seconds: float, busy: float) -> None:
    for _ in range(rounds):
        gate.begin()
        link.total += busy
        gate.sync_round(n, seconds)


def test_a_busy_link_never_tries_runahead():
    link = Link()
    gate = RunaheadGate(link, min_gain=0.15, window=3)
    _sync_rounds(gate, link, 32, 200, seconds=0.30, busy=0.27)  # 10% idle, as sync at 32 requests on the H200
    assert not gate.allows(32)
    assert gate.trials == 0
    assert gate.state(32).idle == pytest.approx(0.1)


def test_a_link_with_nothing_to_carry_never_tries_runahead():
    """Every expert resident: the link is idle all round, and there is no copy to overlap."""
    link = Link()
    gate = RunaheadGate(link, window=3)
    _sync_rounds(gate, link, 32, 50, seconds=0.007, busy=0.0)
    assert not gate.allows(32) and gate.trials == 0 and gate.state(32).idle == 1.0


def test_one_slow_round_does_not_decide():
    """A round that compiled or captured (seconds long, the link idle) is outvoted by the window's median."""
    link = Link()
    gate = RunaheadGate(link, window=3)
    _sync_rounds(gate, link, 8, 1, seconds=5.0, busy=0.05)
    _sync_rounds(gate, link, 8, 2, seconds=0.10, busy=0.095)
    assert not gate.allows(8) and gate.state(8).round_s == pytest.approx(0.10)


def test_an_idle_link_tries_runahead_after_a_window_of_sync_rounds():
    link = Link()
    gate = RunaheadGate(link, min_gain=0.15, window=3)
    _sync_rounds(gate, link, 8, 2, seconds=0.10, busy=0.05)
    assert not gate.allows(8)  # not measured enough yet
    _sync_rounds(gate, link, 8, 1, seconds=0.10, busy=0.05)
    assert gate.allows(8) and gate.trials == 1
    assert not gate.allows(4) and not gate.allows(16)  # measured per number of requests


def test_a_winning_trial_keeps_runahead_and_a_losing_one_backs_off():
    link = Link()
    gate = RunaheadGate(link, min_gain=0.15, window=2, max_backoff=4)
    _sync_rounds(gate, link, 4, 2, seconds=0.10, busy=0.05)
    assert gate.allows(4)
    gate.ahead(4, tokens=8, seconds=2.0)  # the warm-in window (switch, compiles, captures): not judged
    assert gate.allows(4) and gate.lost == 0
    gate.ahead(4, tokens=8, seconds=0.15)  # 2 rounds' worth in 0.15 s: 0.075 s per round, faster
    assert gate.allows(4) and gate.lost == 0
    gate.ahead(4, tokens=5, seconds=0.20)  # a window is 8 tokens: not judged yet
    assert gate.allows(4)
    gate.ahead(4, tokens=3, seconds=0.10)  # 8 tokens in 0.30 s: 0.15 s per round, slower than sync
    assert not gate.allows(4) and gate.lost == 1
    # held for backoff x window sync rounds, then tried again; each lost trial doubles the hold
    holds = []
    for _ in range(4):
        rounds = 0
        while not gate.allows(4):
            _sync_rounds(gate, link, 4, 1, seconds=0.10, busy=0.05)
            rounds += 1
            assert rounds < 100
        holds.append(rounds)
        gate.ahead(4, tokens=8, seconds=0.5)  # warm-in
        assert gate.allows(4)
        gate.ahead(4, tokens=8, seconds=0.5)  # loses again
    assert holds == [2 * 1 + 1, 2 * 2 + 1, 2 * 4 + 1, 2 * 4 + 1]  # window x backoff (capped at 4), then 1 round
    assert gate.trials == 5 and gate.lost == 5


def test_runahead_is_rechecked_against_fresh_sync_rounds():
    link = Link()
    gate = RunaheadGate(link, min_gain=0.15, window=1, recheck=3)
    _sync_rounds(gate, link, 2, 1, seconds=0.10, busy=0.05)
    for _ in range(3):  # the warm-in window, then two winning ones
        gate.ahead(2, tokens=2, seconds=0.05)
        assert gate.allows(2)
    gate.ahead(2, tokens=2, seconds=0.05)  # the third window won: sync is measured again
    assert not gate.allows(2) and gate.lost == 0
    _sync_rounds(gate, link, 2, 1, seconds=0.10, busy=0.095)  # the link got busy meanwhile
    assert not gate.allows(2)


def test_ahead_time_is_ignored_outside_a_trial_and_bad_settings_are_refused():
    link = Link()
    gate = RunaheadGate(link)
    gate.ahead(4, tokens=100, seconds=1.0)
    assert gate.state(4).tokens == 0
    gate.begin()
    gate.sync_round(4, 0.0)  # an empty interval measures nothing
    assert not gate.state(4).rounds
    for bad in ({"min_gain": 0.6}, {"min_gain": -0.1}, {"window": 0}, {"recheck": 0}, {"max_backoff": 0}):
        with pytest.raises(ValueError):
            RunaheadGate(link, **bad)


def test_reset_forgets_every_measure_and_trial():
    """What the engine calls after its warm-up, whose rounds copied no expert (their link looked idle)."""
    link = Link()
    gate = RunaheadGate(link, min_gain=0.15, window=3)
    _sync_rounds(gate, link, 8, 3, seconds=0.10, busy=0.0)  # a dry warm-up: nothing on the link
    _sync_rounds(gate, link, 4, 3, seconds=0.10, busy=0.05)
    assert gate.allows(4) and gate.trials == 1
    gate.reset()
    assert not gate.allows(4) and gate.trials == gate.lost == 0
    assert gate.state(8).idle is None and gate.state(4).idle is None
    _sync_rounds(gate, link, 4, 2, seconds=0.10, busy=0.05)
    assert not gate.allows(4)  # a whole window of the users' rounds again before a trial
