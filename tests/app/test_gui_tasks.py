"""Background jobs (hearth.app.gui.tasks): a result reaches its callback on the GUI thread, unless the
callback's owner was deleted while the job ran (a closed tab's widgets): then nothing is called and
nothing raises."""

from __future__ import annotations

import threading

import shiboken6

from hearth.app.gui.qt import QWidget
from hearth.app.gui.tasks import run_task, wait_for_tasks


class _Owner(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.results: list[object] = []

    def got(self, value: object) -> None:
        self.results.append(value)


def _finish(qtbot, gate: threading.Event) -> None:
    gate.set()
    assert wait_for_tasks(5_000)
    qtbot.wait(50)  # the queued signal carrying the result


def test_a_live_owner_gets_the_result(qtbot):
    owner, gate = _Owner(), threading.Event()
    qtbot.addWidget(owner)
    run_task(lambda: gate.wait(5) and 7, owner.got)
    _finish(qtbot, gate)
    assert owner.results == [7]


def test_a_deleted_owner_gets_nothing(qtbot):
    """The bound method's object is the owner by default; a lambda names its owner explicitly."""
    owner, gate = _Owner(), threading.Event()
    seen: list[object] = []
    run_task(lambda: gate.wait(5) and 7, owner.got)
    run_task(lambda: gate.wait(5) and 8, lambda value: seen.append(owner.results), owner=owner)
    run_task(lambda: gate.wait(5) and 9, lambda value: seen.append(value))  # no owner: still called
    results = owner.results  # (the Python side outlives the deleted C++ object)
    shiboken6.delete(owner)
    _finish(qtbot, gate)
    assert results == [] and seen == [9]
