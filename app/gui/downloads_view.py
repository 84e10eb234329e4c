"""The download queue as a table: progress, speed, ETA, and pause / resume / cancel per row.

``HubBridge`` turns the Qt-free ``DownloadManager``'s callbacks (from its worker threads) into a
queued Qt signal, so the table only ever changes on the GUI thread.
"""

from __future__ import annotations

from hearth.app.gui.qt import (
    QHBoxLayout,
    QHeaderView,
    QObject,
    QProgressBar,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.hub import events as ev
from hearth.app.hub.units import format_bytes, format_duration, format_speed

COLUMNS = ("Model", "State", "Progress", "Speed", "ETA", "")


class HubBridge(QObject):
    """Re-emits download events on the GUI thread (Qt queues cross-thread emissions)."""

    event = Signal(object)

    def __call__(self, event: ev.DownloadEvent) -> None:
        self.event.emit(event)


class DownloadsTable(QTableWidget):
    pause_requested = Signal(str)
    resume_requested = Signal(str)
    cancel_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(0, len(COLUMNS), parent)
        self.setHorizontalHeaderLabels(COLUMNS)
        self.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.verticalHeader().hide()
        self.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.rows: dict[str, int] = {}

    def row_for(self, item_id: str, repo_id: str) -> int:
        if item_id in self.rows:
            return self.rows[item_id]
        row = self.rowCount()
        self.insertRow(row)
        self.setItem(row, 0, QTableWidgetItem(repo_id))
        for column in (1, 3, 4):
            self.setItem(row, column, QTableWidgetItem(""))
        bar = QProgressBar(self)
        bar.setRange(0, 1000)
        bar.setValue(0)
        self.setCellWidget(row, 2, bar)
        self.setCellWidget(row, 5, self._actions(item_id))
        self.rows[item_id] = row
        return row

    def _actions(self, item_id: str) -> QWidget:
        box = QWidget(self)
        layout = QHBoxLayout(box)
        layout.setContentsMargins(0, 0, 0, 0)
        for name, tip, signal in (("pause", "Pause", self.pause_requested), ("resume", "Resume", self.resume_requested),
                                  ("cancel", "Cancel and delete partial files", self.cancel_requested)):
            button = QToolButton(box)
            button.setIcon(icon(name))
            button.setToolTip(tip)
            button.setObjectName(f"{name}Button")
            button.clicked.connect(lambda _=False, s=signal: s.emit(item_id))
            layout.addWidget(button)
        return box

    def progress_bar(self, item_id: str) -> QProgressBar | None:
        row = self.rows.get(item_id)
        return None if row is None else self.cellWidget(row, 2)

    def state_text(self, item_id: str) -> str:
        row = self.rows.get(item_id)
        return "" if row is None else self.item(row, 1).text()

    def apply(self, event: ev.DownloadEvent) -> None:
        """Show one manager event in its row."""
        if isinstance(event, ev.DownloadCancelled):
            self._remove(event.item_id)
            return
        row = self.row_for(event.item_id, event.repo_id)
        state, done, total = _describe(event)
        if state is not None:
            self.item(row, 1).setText(state)
        if done is not None and total:
            bar: QProgressBar = self.cellWidget(row, 2)
            bar.setValue(int(1000 * done / total))
            bar.setFormat(f"{format_bytes(done)} / {format_bytes(total)}")
        if isinstance(event, ev.DownloadProgress):
            self.item(row, 3).setText(format_speed(event.speed_bps))
            self.item(row, 4).setText(format_duration(event.eta_s))
        elif isinstance(event, ev.DownloadReady | ev.DownloadPaused | ev.DownloadFailed):
            self.item(row, 3).setText("")
            self.item(row, 4).setText("")

    def _remove(self, item_id: str) -> None:
        row = self.rows.pop(item_id, None)
        if row is None:
            return
        self.removeRow(row)
        self.rows = {k: (r - 1 if r > row else r) for k, r in self.rows.items()}


def _describe(event: ev.DownloadEvent) -> tuple[str | None, int | None, int | None]:
    """(state text, bytes done, bytes total) for an event; None where it says nothing new."""
    match event:
        case ev.DownloadQueued():
            return "queued", None, None
        case ev.DownloadStarted(bytes_total=total, bytes_to_download=todo):
            return "downloading", total - todo, total
        case ev.DownloadProgress(bytes_done=done, bytes_total=total):
            return "downloading", done, total
        case ev.DownloadStalled(idle_s=idle):
            return f"stalled {idle:.0f}s, reconnecting", None, None
        case ev.DownloadRetrying(attempt=attempt, reason=reason):
            return f"retry {attempt}: {reason}", None, None
        case ev.DownloadVerifying(bytes_done=done, bytes_total=total):
            return "verifying", done, total
        case ev.DownloadPaused(bytes_done=done, bytes_total=total):
            return "paused", done, total
        case ev.DownloadReady(bytes_total=total):
            return "ready", total, total
        case ev.DownloadFailed(message=message, is_resumable=resumable):
            return f"failed: {message}" + (" (resumable)" if resumable else ""), None, None
    return None, None, None
