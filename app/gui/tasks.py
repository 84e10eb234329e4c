"""Short background jobs on the global QThreadPool with success/failure callbacks.

``run_task(fn, on_done, on_error)`` runs ``fn()`` on a pool thread and calls one of the callbacks
back on the GUI thread (through a queued signal of a small QObject, since a QRunnable is not a
QObject). Exceptions are never swallowed: they reach ``on_error`` as the exception object, or are
shown in a message box when no ``on_error`` was given. A job whose owner (``owner``, or the object
of a bound-method ``on_done``) was deleted while it ran calls nothing: a closed tab's widgets are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hearth.app.gui.qt import QMessageBox, QObject, QRunnable, Qt, QThreadPool, Signal, is_alive

logger = logging.getLogger(__name__)
_live: set[_Emitter] = set()  # keeps emitters alive until their callback ran


class _Emitter(QObject):
    done = Signal(object)
    failed = Signal(object)


class _Task(QRunnable):
    def __init__(self, fn: Callable[[], Any], emitter: _Emitter) -> None:
        super().__init__()
        self._fn = fn
        self._emitter = emitter

    def run(self) -> None:
        try:
            result = self._fn()
        except Exception as exc:  # handed to the GUI thread, never dropped
            self._emitter.failed.emit(exc)
            return
        self._emitter.done.emit(result)


def run_task(fn: Callable[[], Any], on_done: Callable[[Any], None] | None = None,
             on_error: Callable[[BaseException], None] | None = None, owner: QObject | None = None) -> None:
    """Run ``fn`` off the GUI thread; then ``on_done(result)`` or ``on_error(exc)`` on the GUI thread,
    unless ``owner`` (default: the QObject whose method ``on_done`` is) has been deleted by then."""
    emitter = _Emitter()
    _live.add(emitter)
    if owner is None and isinstance(getattr(on_done, "__self__", None), QObject):
        owner = on_done.__self__  # type: ignore[union-attr]

    def finish(callback: Callable[[Any], None] | None, value: Any) -> None:
        _live.discard(emitter)
        if owner is not None and not is_alive(owner):
            logger.debug("background task finished after its owner was deleted: result dropped")
            return
        if callback is not None:
            callback(value)

    emitter.done.connect(lambda result: finish(on_done, result))
    emitter.failed.connect(lambda exc: finish(on_error or show_error, exc))
    QThreadPool.globalInstance().start(_Task(fn, emitter))


def show_error(exc: BaseException, parent: Any = None) -> None:
    """A non-modal message box with the exception's one-line message (details go to the log)."""
    logger.error("Background task failed", exc_info=exc)
    box = QMessageBox(QMessageBox.Icon.Warning, "Hearth", str(exc) or type(exc).__name__, parent=parent)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    box.open()


def wait_for_tasks(timeout_ms: int = 10_000) -> bool:
    """Block until the pool is idle (used when quitting and by tests)."""
    return QThreadPool.globalInstance().waitForDone(timeout_ms)
