"""The warm starts' background reads (hearth.engine.warm_start.BackgroundReads): items are read in
plan order in a thread; while the engine serves requests the thread holds before its next item and
between the parts of one, except for an item the engine waits for."""

from __future__ import annotations

import threading
import time

from hearth.engine.warm_start import BackgroundReads


def test_reads_hold_while_the_engine_is_busy_and_go_on_when_it_is_idle():
    reads: list[str] = []
    background = BackgroundReads("test-reads", lambda item: reads.append(item) or item.upper(), str, ["a", "b"])
    background.set_busy(True)
    background.start()
    time.sleep(0.2)
    assert reads == [] and background.claim() == []
    background.set_busy(False)
    assert background.wait(10) and reads == ["a", "b"]
    assert [(item, result.result()) for item, result in background.claim()] == [("a", "A"), ("b", "B")]


def test_an_item_the_engine_waits_for_is_never_held():
    parts: list[tuple[str, int]] = []
    first, busy = threading.Event(), threading.Event()

    def read(item: str) -> str:
        for part in range(3):
            if item == "a" and part == 1:
                first.set()
                assert busy.wait(10)
            background.pause(item)
            parts.append((item, part))
        return item

    background = BackgroundReads("test-reads", read, str, ["a", "b", "c"])
    background.start()
    assert first.wait(10)
    background.set_busy(True)  # a request runs: a's read holds after its first part
    busy.set()
    time.sleep(0.2)
    assert parts == [("a", 0)]
    background.withdraw(["a", "b"])  # the request needs a (begun: finished for it) and b (not begun: its own)
    assert parts == [("a", 0), ("a", 1), ("a", 2)]
    [(item, result)] = background.claim("a")
    assert item == "a" and result.result() == "a"
    time.sleep(0.2)
    assert len(parts) == 3  # c waits for the engine to be idle
    background.set_busy(False)
    assert background.wait(10) and parts[3:] == [("c", 0), ("c", 1), ("c", 2)]
    assert [item for item, _ in background.claim()] == ["c"]


def test_cancel_ends_a_held_read():
    background = BackgroundReads("test-reads", lambda item: item, str, ["a"])
    background.set_busy(True)
    background.start()
    assert background.cancel(10)
    assert background.claim() == []
