"""Helpers shared by the GUI tests (no tests here): window factories that close what they open
and fail on leaked top-level widgets, and a demo-model engine backend shared per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hearth.app.gui.backend import DEMO_LABEL, Backend, ModelChoice, demo_model_dir, ensure_demo_model
from hearth.app.gui.qt import QApplication, QEvent, QWidget
from hearth.app.hub.manager import DownloadOptions
from hearth.app.paths import HOME_ENV
from hearth.app.store.settings import Settings

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
