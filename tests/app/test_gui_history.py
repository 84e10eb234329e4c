"""Large chat histories: the sidebar pages conversations in (a real SQLite store with 7,000 of
them), `hearth --screenshot` survives a 20,000-conversation database, the Qt binding cannot free
``None`` (the cause of the old ``none_dealloc`` abort), and an unreadable chat file is reported once."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.sidebar import PAGE_SIZE, Sidebar
from hearth.app.store.chats import ChatStore
from tests.app.test_gui_helpers import isolated_settings

OLDEST_TITLE = "The oldest aardvark"


def fill_history(path: Path, count: int) -> None:
    """``count`` conversations of one message each, written in one transaction (the store's own
    schema: the store creates the file first)."""
    ChatStore(path).close()
    now = time.time()
    db = sqlite3.connect(path)
    with db:
        db.executemany("INSERT INTO conversations(id, title, created_at, updated_at) VALUES (?, ?, ?, ?)",
                       [(i, OLDEST_TITLE if i == 1 else f"Chat {i}", now + i, now + i) for i in range(1, count + 1)])
        db.executemany("INSERT INTO messages(conversation_id, role, content, created_at) VALUES (?, 'user', ?, ?)",
                       [(i, f"question number {i}", now + i) for i in range(1, count + 1)])
        db.execute("UPDATE conversations SET current_leaf_id = id")
    db.close()


def test_the_sidebar_pages_in_a_long_history(qtbot, tmp_path: Path, windows):
    fill_history(tmp_path / "chats.sqlite3", 7000)
    store = ChatStore(tmp_path / "chats.sqlite3")
    try:
        bar = windows.track(Sidebar(store))
        assert bar.list.count() == PAGE_SIZE and bar.has_more()
        assert bar.list.item(0).text() == "Chat 7000"  # the most recent first

        assert bar.load_more() == PAGE_SIZE
        assert bar.list.item(2 * PAGE_SIZE - 1).text() == f"Chat {7001 - 2 * PAGE_SIZE}"
        bar.list.scrollToBottom()  # reaching the end reads the next page
        assert bar.list.count() == 3 * PAGE_SIZE

        qtbot.keyClicks(bar.search_edit, "aardvark")  # a search sees every conversation
        assert [bar.list.item(i).text() for i in range(bar.list.count())] == [OLDEST_TITLE]
        assert not bar.has_more()
        bar.search_edit.clear()
        assert bar.list.count() == 3 * PAGE_SIZE  # what was listed stays listed

        while bar.load_more():
            pass
        assert bar.list.count() == 7000 and not bar.has_more()
        assert bar.list.item(6999).text() == OLDEST_TITLE
    finally:
        store.close()


def test_the_qt_binding_never_frees_none():
    """PySide6 6.12.0 on Python 3.11 drops a reference to None on every void call; 300,000 calls
    used to abort the process (none_dealloc). Importing Hearth's Qt module must make them safe."""
    code = ("from hearth.app.gui.qt import QObject\n"
            "probe = QObject()\n"
            "for _ in range(300_000):\n"
            "    probe.setObjectName('x')\n"
            "print('alive')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert result.returncode == 0 and result.stdout.strip() == "alive", result.stderr[-2000:]


def test_screenshot_with_a_huge_history_exits_0(tmp_path: Path):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    fill_history(home / "data" / "chats.sqlite3", 20_000)
    out = tmp_path / "shot.png"
    env = {**os.environ, "HEARTH_HOME": str(home), "HEARTH_NO_BUNDLED_DEMO": "1", "QT_QPA_PLATFORM": "offscreen"}
    result = subprocess.run([sys.executable, "-m", "hearth.app.main", "--screenshot", str(out)], env=env,
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "none_dealloc" not in result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreadable_chat_file_is_reported_once(qtbot, tmp_path: Path, windows):
    path = tmp_path / "chats.sqlite3"
    path.write_bytes(b"not a database " * 1000)
    store = ChatStore(path)
    settings = isolated_settings(tmp_path, backend_url="http://127.0.0.1:9/v1")  # nothing listens there
    try:
        window = windows.track(MainWindow(settings, store=store))
        notice = window.recovery_notice
        assert notice is not None and notice.isVisible() and not notice.isModal()
        assert str(store.recovery.aside) in notice.text() and "fresh one started" in notice.text()
        assert window.sidebar.list.count() == 0
        # let the model listing (a background task) finish before the window goes
        qtbot.waitUntil(lambda: bool(window.choices) or "models" in window.status.currentMessage(), timeout=30_000)
    finally:
        windows.close_all()
        store.close()
    again = ChatStore(path)
    try:
        assert again.recovery is None
    finally:
        again.close()
