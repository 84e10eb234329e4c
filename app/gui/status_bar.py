"""The status bar (engine state, GPU and RAM use, expert-cache hit rate, cached chats, tok/s), its stats poller,
the banner that says the engine stopped, with a Restart button, and the one that says a model could
not be loaded and why, with a way back to the model used before.

Messages ("Could not load ...") go to their own stretching label on the left, clipped with the full
text in its tooltip, so they never draw over the engine state on the right. A reload waiting for the
answers being written to end ("… will reload when the answer ends") has its own label beside the
engine state, shown until it happens: later messages do not hide it.

Stats come from ``ChatClient.stats()``, polled on a timer through the thread pool, never on the GUI
thread; a poll is skipped while the previous one is still out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil

from hearth.app.gui.qt import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QObject,
    QPushButton,
    QSizePolicy,
    QStatusBar,
    Qt,
    QTimer,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.gui.tasks import run_task
from hearth.app.hub.units import format_bytes

POLL_MS = 1500


class StatsPoller(QObject):
    """Calls ``fetch()`` off the GUI thread every ``POLL_MS``; emits the dict or the failure."""

    stats = Signal(object)
    failed = Signal(str)

    def __init__(self, fetch: Callable[[], dict[str, Any]], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._fetch = fetch
        self._in_flight = False
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)

    def poll(self) -> None:
        if self._in_flight:
            return
        self._in_flight = True
        run_task(self._fetch, self._done, self._failed)

    def _done(self, stats: dict[str, Any]) -> None:
        self._in_flight = False
        self.stats.emit(stats)

    def _failed(self, exc: BaseException) -> None:
        self._in_flight = False
        self.failed.emit(str(exc) or type(exc).__name__)


class EngineStatusBar(QStatusBar):
    restart_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message_label = QLabel("", self)
        self.message_label.setObjectName("statusMessage")
        self.message_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.addWidget(self.message_label, 1)
        self._message_timer = QTimer(self)
        self._message_timer.setSingleShot(True)
        self._message_timer.timeout.connect(self.clearMessage)
        self.engine_label = QLabel("Engine: not started", self)
        self.pending_label = QLabel("", self)
        self.pending_label.setObjectName("pendingLabel")
        self.pending_label.hide()
        self.memory_label = QLabel("", self)
        self.cache_label = QLabel("", self)
        self.chat_cache_label = QLabel("", self)
        self.speed_label = QLabel("", self)
        self.restart_button = QPushButton(icon("restart"), "Restart engine", self)
        self.restart_button.clicked.connect(self.restart_requested)
        self.restart_button.hide()
        for widget in (self.engine_label, self.pending_label, self.memory_label, self.cache_label,
                       self.chat_cache_label, self.speed_label):
            self.addPermanentWidget(widget)
        self.addPermanentWidget(self.restart_button)

    def showMessage(self, text: str, timeout: int | None = 0) -> None:  # noqa: N802 - replaces QStatusBar's
        """Show ``text`` in the message label (for ``timeout`` ms; 0 or None = until replaced).
        Replaces the built-in temporary message, which Qt draws over the bar's widgets."""
        self.message_label.setText(text)
        self.message_label.setToolTip(text)
        self._message_timer.stop()
        if timeout:
            self._message_timer.start(timeout)

    def clearMessage(self) -> None:  # noqa: N802 - replaces QStatusBar's
        self.message_label.clear()
        self.message_label.setToolTip("")

    def currentMessage(self) -> str:  # noqa: N802 - replaces QStatusBar's
        return self.message_label.text()

    def set_engine_state(self, text: str, *, crashed: bool = False) -> None:
        self.engine_label.setText(f"Engine: {text}")
        self.restart_button.setVisible(crashed)

    def set_pending(self, text: str | None) -> None:
        """Announce a reload that waits for the answers to end (None: there is none)."""
        self.pending_label.setText(text or "")
        self.pending_label.setToolTip(text or "")
        self.pending_label.setVisible(bool(text))

    def show_stats(self, stats: dict[str, Any]) -> None:
        extra = stats.get("extra") if isinstance(stats.get("extra"), dict) else {}
        merged = {**extra, **stats}
        self.memory_label.setText(memory_text(merged))
        experts = merged.get("expert_cache") if isinstance(merged.get("expert_cache"), dict) else {}
        hit = _first({**experts, **merged}, "expert_cache_hit_rate", "hit_rate")
        self.cache_label.setText(f"Expert cache hits {hit:.0%}" if hit is not None else "")
        self.chat_cache_label.setText(chat_cache_text(merged))
        speed = _first(merged, "decode_tokens_per_s", "tokens_per_s")
        self.speed_label.setText(f"{speed:.1f} tok/s" if speed else "idle")


def chat_cache_text(stats: dict[str, Any]) -> str:
    """"Cached chats 3 · 1.2 GB": chats whose cache the engine keeps (GPU, RAM, disk; long chats'
    parked tiers, in RAM and on disk) and the bytes it holds in RAM and on disk; empty when the
    engine keeps none."""
    chats = _first(stats, "prefix_cache_conversations")
    if not chats:
        return ""
    held = sum(_first(stats, key) or 0 for key in ("prefix_cache_host_bytes", "prefix_cache_disk_bytes",
                                                   "tier_cache_bytes", "tier_cache_disk_bytes"))
    return f"Cached chats {int(chats)} · {format_bytes(int(held))}"


def memory_text(stats: dict[str, Any]) -> str:
    """GPU memory from the engine's stats (``memory.gpus``); the engine host's RAM (its RSS), or
    this machine's RAM in use when the engine does not report it."""
    memory = stats.get("memory") if isinstance(stats.get("memory"), dict) else {}
    gpus = [g for g in memory.get("gpus") or [] if isinstance(g, dict)]
    if gpus:
        used = sum(int(g.get("reserved_bytes") or g.get("allocated_bytes") or 0) for g in gpus)
        total = sum(int(g.get("total_bytes") or 0) for g in gpus)
        gpu = f"GPU {format_bytes(used)} / {format_bytes(total)}" if total else f"GPU {format_bytes(used)}"
    else:
        gpu = "GPU n/a"
    rss = _first(memory, "process_rss_bytes")
    if rss is not None:
        ram = f"RAM {format_bytes(rss)} (engine)"
    else:
        vm = psutil.virtual_memory()
        ram = f"RAM {format_bytes(vm.used)} / {format_bytes(vm.total)}"
    return f"{gpu} · {ram}"


def _first(stats: dict[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = stats.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class CrashBanner(QFrame):
    """"The engine stopped: …  [Restart]" above the chat; hidden while the engine is fine."""

    restart_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("crashBanner")
        row = QHBoxLayout(self)
        self.label = QLabel("", self)
        self.label.setWordWrap(True)
        self.restart_button = QPushButton(icon("restart"), "Restart", self)
        self.restart_button.clicked.connect(self.restart_requested)
        row.addWidget(self.label, 1)
        row.addWidget(self.restart_button)
        self.hide()

    def show_crash(self, reason: str) -> None:
        self.label.setText(f"The engine stopped ({reason}). Your chats are safe; restart it to continue.")
        self.restart_button.setEnabled(True)
        self.show()


class LoadErrorBanner(QFrame):
    """"Could not load X: why" above the chat, with [Use <the model before>] and [Try again]; hidden
    while a model is loaded. A model that cannot load is no engine crash: this says what went wrong."""

    fallback_requested = Signal(object)  # the ModelChoice to load instead
    retry_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("crashBanner")  # (styled as the crash banner: both say something went wrong)
        row = QHBoxLayout(self)
        self.label = QLabel("", self)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.fallback_button = QPushButton("Use the model before", self)  # named for the model when shown
        self.fallback_button.setToolTip("Load the model that worked before instead")
        self.fallback_button.clicked.connect(lambda: self.fallback_requested.emit(self.fallback))
        self.retry_button = QPushButton(icon("restart"), "Try again", self)
        self.retry_button.clicked.connect(self.retry_requested)
        row.addWidget(self.label, 1)
        row.addWidget(self.fallback_button)
        row.addWidget(self.retry_button)
        self.fallback: Any = None
        self.hide()

    def show_failure(self, message: str, fallback: Any = None, *, can_retry: bool = True) -> None:
        """Show ``message``; ``fallback`` (a ModelChoice) gets a button that loads it instead."""
        self.label.setText(message)
        self.label.setToolTip(message)
        self.fallback = fallback
        self.fallback_button.setVisible(fallback is not None)
        if fallback is not None:
            self.fallback_button.setText(f"Use {fallback.label}")
        self.retry_button.setVisible(can_retry)
        self.show()
