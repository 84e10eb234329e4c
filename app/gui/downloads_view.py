"""The download queue as a table: progress, speed, ETA, and the actions that apply to each row's
state (pause while running; resume when paused, or failed with something to continue; cancel until
it is ready, which also removes a failed row; none once ready). A failure's reason wraps in its row
(and is the State cell's tooltip); a gated repo's says where the app takes a token.

A retry back-off counts down ("retrying in 8 s (attempt 3)") with the reason in the tooltip. Items
from an earlier session come back as they were left: paused, or failed with their reason.
``HubBridge`` turns the Qt-free ``DownloadManager``'s callbacks (from its worker threads) into a
queued Qt signal, so the table only ever changes on the GUI thread.
"""

from __future__ import annotations

import math
import time

from hearth.app.gui.qt import (
    QHBoxLayout,
    QHeaderView,
    QObject,
    QProgressBar,
    QTableWidget,
    QTableWidgetItem,
    QTimer,
    QToolButton,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.hub import events as ev
from hearth.app.hub.manager import DownloadItem, ItemState
from hearth.app.hub.units import format_bytes, format_duration, format_speed

COLUMNS = ("Model", "State", "Progress", "Speed", "ETA", "")
ACTIONS = (("pause", "Pause"), ("resume", "Resume"), ("cancel", "Cancel and delete partial files"))
# Which actions each state offers ("running" covers queued, downloading, retrying and verifying; a
# failure is "resumable" when the manager kept something to continue from).
OFFERED = {"running": {"pause", "cancel"}, "paused": {"resume", "cancel"}, "resumable": {"resume", "cancel"},
           "failed": {"cancel"}, "ready": set()}
TOKEN_HINT = "In Hearth, paste a token of an account with access under Settings > Hugging Face > Access token."


def with_token_hint(message: str) -> str:
    """A gated repo's message, plus where this app takes a token (the Hub's message names the CLI's ways)."""
    if " is gated" not in message or TOKEN_HINT in message:
        return message
    return f"{message.rstrip('.')}. {TOKEN_HINT}"


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
        self.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)  # a failure's reason
        self.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.verticalHeader().hide()
        self.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)  # wrapped reasons
        self.setWordWrap(True)
        self.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.setAccessibleName("Downloads")
        self.rows: dict[str, int] = {}
        self.bytes: dict[str, tuple[int, int]] = {}  # item id -> (bytes done, bytes total), as last shown
        self.buttons: dict[str, dict[str, QToolButton]] = {}
        self._retries: dict[str, tuple[float, int]] = {}  # item id -> (back-off ends at, attempt)
        self._countdown = QTimer(self)
        self._countdown.setInterval(1000)
        self._countdown.timeout.connect(self._show_retries)

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
        signals = {"pause": self.pause_requested, "resume": self.resume_requested, "cancel": self.cancel_requested}
        self.buttons[item_id] = {}
        for name, tip in ACTIONS:
            button = QToolButton(box)
            button.setIcon(icon(name))
            button.setToolTip(tip)
            button.setAccessibleName(tip)
            button.setObjectName(f"{name}Button")
            button.clicked.connect(lambda _=False, s=signals[name]: s.emit(item_id))
            layout.addWidget(button)
            self.buttons[item_id][name] = button
        layout.addStretch(1)
        self._offer(item_id, "running")
        return box

    def _offer(self, item_id: str, state: str) -> None:
        for name, button in self.buttons.get(item_id, {}).items():
            button.setVisible(name in OFFERED[state])
        cancel = self.buttons.get(item_id, {}).get("cancel")
        if cancel is not None:  # a failure with nothing to continue: the x only clears the row
            tip = "Remove from the list" if state == "failed" else dict(ACTIONS)["cancel"]
            cancel.setToolTip(tip)
            cancel.setAccessibleName(tip)

    def restore(self, item: DownloadItem) -> None:
        """Show an item from an earlier session as it was left (paused, or failed with its reason)."""
        if item.state == ItemState.FAILED:
            self.apply(ev.DownloadFailed(item.item_id, item.repo_id, item.message or "unknown error",
                                         item.is_resumable))
        else:
            self.apply(ev.DownloadPaused(item.item_id, item.repo_id, item.bytes_done, item.bytes_total))
        if item.bytes_total:
            self._show_bytes(self.rows[item.item_id], item.bytes_done, item.bytes_total)
            self.bytes[item.item_id] = (item.bytes_done, item.bytes_total)

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
        retry = self._retries.get(event.item_id)
        if isinstance(event, ev.DownloadProgress) and retry is not None and time.monotonic() < retry[0]:
            state = None  # progress ticks go on during a back-off; its countdown stays until it ends
        if isinstance(event, ev.DownloadRetrying):
            self._retries[event.item_id] = (time.monotonic() + event.delay_s, event.attempt)
            self.item(row, 1).setToolTip(event.reason)
            self._countdown.start()
            self._show_retries()
        elif state is not None:
            self._retries.pop(event.item_id, None)
            self.item(row, 1).setText(state)
            self.item(row, 1).setToolTip(state)
        self._offer(event.item_id, _offered_state(event))
        if done is not None and total:
            self._show_bytes(row, done, total)
            self.bytes[event.item_id] = (done, total)
        if isinstance(event, ev.DownloadProgress):
            self.item(row, 3).setText(format_speed(event.speed_bps))
            self.item(row, 4).setText(format_duration(event.eta_s))
        elif isinstance(event, ev.DownloadReady | ev.DownloadPaused | ev.DownloadFailed):
            self.item(row, 3).setText("")
            self.item(row, 4).setText("")

    def _show_bytes(self, row: int, done: int, total: int) -> None:
        bar: QProgressBar = self.cellWidget(row, 2)
        bar.setValue(int(1000 * done / total))
        bar.setFormat(f"{format_bytes(done)} / {format_bytes(total)}")

    def _show_retries(self) -> None:
        now = time.monotonic()
        for item_id, (until, attempt) in self._retries.items():
            row = self.rows.get(item_id)
            if row is not None:
                wait = max(math.ceil(until - now), 0)
                self.item(row, 1).setText(f"retrying in {wait} s (attempt {attempt})" if wait else
                                          f"retrying (attempt {attempt})")
        if not self._retries:
            self._countdown.stop()

    def _remove(self, item_id: str) -> None:
        self._retries.pop(item_id, None)
        self.bytes.pop(item_id, None)
        self.buttons.pop(item_id, None)
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
            return f"no data for {idle:.0f} s; reconnecting", None, None
        case ev.DownloadRetrying():
            return None, None, None  # a countdown (see DownloadsTable._show_retries)
        case ev.DownloadVerifying(bytes_done=done, bytes_total=total):
            return "verifying", done, total
        case ev.DownloadPaused(bytes_done=done, bytes_total=total):
            return "paused", done, total
        case ev.DownloadReady(bytes_total=total):
            return "ready", total, total
        case ev.DownloadFailed(message=message, is_resumable=resumable):
            return f"failed: {with_token_hint(message)}" + (" (resumable)" if resumable else ""), None, None
    return None, None, None


def _offered_state(event: ev.DownloadEvent) -> str:
    if isinstance(event, ev.DownloadPaused):
        return "paused"
    if isinstance(event, ev.DownloadFailed):
        return "resumable" if event.is_resumable else "failed"
    return "ready" if isinstance(event, ev.DownloadReady) else "running"
