"""Helpers shared by the GUI tests: window factories that close what they open and fail on leaked
top-level widgets, a demo-model engine backend shared per test module, and ``ScriptedBackend``,
a backend without an engine host whose answers the test writes."""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hearth.app.client.context_window import ContextFit, estimate_tokens
from hearth.app.client.openai_client import ChatChunk
from hearth.app.gui.backend import DEMO_LABEL, Backend, Connected, ModelChoice, demo_model_dir, ensure_demo_model
from hearth.app.gui.qt import QApplication, QEvent, QMessageBox, Qt, QTimer, QWidget
from hearth.app.hub.manager import DownloadOptions
from hearth.app.paths import HOME_ENV
from hearth.app.store.settings import Settings

SCRIPTED_TIMEOUT_MS = 20_000  # the longest wait for a window over a ScriptedBackend
FAST_DOWNLOADS = DownloadOptions(stall_timeout_s=0.5, max_retries=4, backoff_base_s=0.05, backoff_max_s=0.2,
                                 progress_interval_s=0.05, chunk_bytes=16 * 1024)


def flush_deletes() -> None:
    """Run pending deleteLater()s so closed windows really go away."""
    app = QApplication.instance()
    for _ in range(3):
        app.processEvents()
        QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def assert_no_leaks() -> None:
    flush_deletes()
    leaked = QApplication.topLevelWidgets()
    assert not leaked, f"top-level widgets left after the test: {leaked}"


class Windows:
    """Opens widgets for a test and closes + deletes them afterwards."""

    def __init__(self) -> None:
        self.opened: list[QWidget] = []

    def track(self, widget: QWidget) -> QWidget:
        self.opened.append(widget)
        widget.show()
        return widget

    def close(self, widget: QWidget) -> None:
        widget.close()
        widget.deleteLater()
        flush_deletes()
        if widget in self.opened:
            self.opened.remove(widget)

    def close_all(self) -> None:
        for widget in list(self.opened):
            self.close(widget)


@contextmanager
def windows_checked() -> Iterator[Windows]:
    windows = Windows()
    try:
        yield windows
    finally:
        windows.close_all()
    assert_no_leaks()


_shared_chat_cache: str | None = None  # the chat-cache folder of the shared host while one runs


@contextmanager
def shared_demo_backend(home: Path) -> Iterator[Backend]:
    """One engine host serving the demo model for a whole test module, started under ``home``."""
    old = os.environ.get(HOME_ENV)
    os.environ[HOME_ENV] = str(home)
    os.environ["HEARTH_NO_BUNDLED_DEMO"] = "1"  # the random tiny demo: fast, and its answers run long
    global _shared_chat_cache
    _shared_chat_cache = str(home / "chat-cache")
    backend = Backend(Settings().replace(prefix_cache_dir=_shared_chat_cache))
    try:
        ensure_demo_model()
        backend.connect(ModelChoice(DEMO_LABEL, str(demo_model_dir()), True, 2048))
        yield backend
    finally:
        backend.close()
        _shared_chat_cache = None
        os.environ.pop("HEARTH_NO_BUNDLED_DEMO", None)
        if old is None:
            os.environ.pop(HOME_ENV, None)
        else:
            os.environ[HOME_ENV] = old


class ScriptedBackend(Backend):
    """The GUI's Backend with the engine host replaced by a script: a model "loads" at once unless
    its label is in ``broken`` (then loading raises that message, as a host that cannot load it
    does); an answer streams the pieces the test puts into ``answers``, one chunk each, until None
    ends it ("stop") and an exception put there fails it. ``streamed`` lists the chats whose answers
    began, ``aborted`` those closed before their end (a Stop). Everything else (connect, restart,
    what counts as connected) is Backend's own."""

    def __init__(self, settings: Settings | None = None, broken: dict[str, str] | None = None) -> None:
        super().__init__(settings or Settings())
        self.broken = dict(broken or {})
        self.answers: queue.Queue[str | Exception | None] = queue.Queue()
        self.loads: list[str] = []  # the labels asked for, in order
        self.streamed: list[int | None] = []  # conversation ids, in the order their answers began
        self.aborted: list[int | None] = []

    def _load(self, choice: ModelChoice) -> Connected:
        self.loads.append(choice.label)
        if choice.label in self.broken:
            raise RuntimeError(self.broken[choice.label])
        return Connected(choice, choice.label, choice.context_length or 2048)

    def fit_context(self, messages: list[dict[str, Any]], max_tokens: int | None, policy: str) -> ContextFit:
        if self.connected is None:
            raise RuntimeError("No model is loaded")
        return ContextFit(list(messages), 0, estimate_tokens(messages), exact=False)

    def count_tokens(self, messages: list[dict[str, Any]]) -> tuple[int, bool]:
        return estimate_tokens(messages), False

    def stream(self, messages: list[dict[str, Any]], sampling: dict[str, Any],
               conversation_id: int | None = None) -> Iterator[ChatChunk]:
        if self.connected is None:
            raise RuntimeError("No model is loaded")
        self.streamed.append(conversation_id)
        try:
            while True:
                try:
                    piece = self.answers.get(timeout=0.02)
                except queue.Empty:
                    yield ChatChunk("")  # nothing yet: an empty chunk lets the worker see a Stop
                    continue
                if piece is None:
                    yield ChatChunk("", finish_reason="stop")
                    return
                if isinstance(piece, Exception):
                    raise piece
                yield ChatChunk(piece)
        except GeneratorExit:
            self.aborted.append(conversation_id)
            raise

    def is_alive(self) -> bool:
        return self.connected is not None

    def stats(self) -> dict[str, Any]:
        return {}

    def upstream(self) -> tuple[str, str | None] | None:
        return None

    def drop_conversation(self, conversation_id: int) -> int:
        return 0

    def close(self) -> None:
        self.connected = None


def send(qtbot: Any, window: Any, text: str) -> None:
    """Type ``text`` in the window's message box and press Enter: an answer begins."""
    window.chat.composer.setPlainText(text)
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Return)
    assert window.chat.is_busy


def finish(qtbot: Any, window: Any, answer: str = "Fine.") -> None:
    """End the answer of a window over a ``ScriptedBackend`` with ``answer``."""
    window.backend.answers.put(answer)
    window.backend.answers.put(None)
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=SCRIPTED_TIMEOUT_MS)


def answer_next_question(button: QMessageBox.StandardButton, seen: list[tuple[str, bool]]) -> None:
    """Answer the next modal question (a real QMessageBox) with ``button`` once it is up; records its
    text and whether No was its default answer."""

    def click() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            seen.append(("no question was asked", False))
            return
        seen.append((box.text(), box.defaultButton() is box.button(QMessageBox.StandardButton.No)))
        box.button(button).click()

    QTimer.singleShot(0, click)


def link_demo_model(shared_home: Path) -> None:
    """Point this test's demo-model folder at the shared one (same real path: the host is reused)."""
    target = demo_model_dir()
    if not target.exists():
        target.symlink_to(shared_home / "data" / "demo-model", target_is_directory=True)


def isolated_settings(tmp_path: Path, **changes: object) -> Settings:
    """Settings that keep the tests off the user's HF cache and the network. Inside
    ``shared_demo_backend`` the chat-cache folder is the shared host's, so windows reuse that host
    (a different folder is a different engine option, which would start a host per test)."""
    if _shared_chat_cache is not None:
        changes = {"prefix_cache_dir": _shared_chat_cache, **changes}
    return Settings(hf_cache_dir=str(tmp_path / "hf-cache"), offline=True).replace(**changes)




def test_the_chat_cache_text_counts_parked_long_chats_bytes():
    from hearth.app.gui.status_bar import chat_cache_text

    stats = {"prefix_cache_conversations": 2.0, "prefix_cache_host_bytes": 2**30, "prefix_cache_disk_bytes": 0.0,
             "tier_cache_bytes": 2 * 2**30}
    assert chat_cache_text(stats) == "Cached chats 2 · 3.2 GB"  # 1 GiB of pages + 2 GiB of parked tiers
    stats["tier_cache_disk_bytes"] = 2**30  # long chats' files count too
    assert chat_cache_text(stats) == "Cached chats 2 · 4.3 GB"
