"""Start the desktop app: ``run(argv)`` opens the main window (``hearth``), or with
``--screenshot FILE.png`` loads the demo model, plays a short exchange, saves the window as a PNG
and exits (works with ``QT_QPA_PLATFORM=offscreen``).

    run([])                                   # the app
    run(["--screenshot", "shot.png"])         # chat view; --tab picks another view (TABS)

A screenshot run never touches the user's data: it reads the user's settings (theme, Hub mirror)
once, then runs with its own throwaway Hearth folders (chats, settings, downloads, engine host),
deleted when it exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hearth.app.gui.backend import DEMO_LABEL
from hearth.app.gui.qt import QApplication, QEventLoop, QGuiApplication, Qt, QTimer
from hearth.app.gui.resources import apply_theme, icon
from hearth.app.paths import HOME_ENV
from hearth.app.store.settings import Settings, load_settings

logger = logging.getLogger(__name__)
SCREENSHOT_PROMPT = "Hello! Who are you, and what does a hearth do?"
# "truncated": a chat longer than a small context, with the marker where the model's context starts.
# "thinking": an example chat with a thinking model's reasoning (the demo model does not reason, so
# the exchange is written into the throwaway chat store, not generated).
TABS = ("chat", "truncated", "thinking", "models", "settings", "server")
THINKING_EXAMPLE = (
    ("Is 1001 a prime number?",
     "The user asks whether 1001 is prime. It is odd, its digits sum to 2 so 3 does not divide it, and it "
     "does not end in 0 or 5. Try 7: 7 × 143 = 1001. And 143 = 11 × 13. So 1001 = 7 × 11 × 13.",
     "No. **1001 = 7 × 11 × 13**, so it has divisors other than 1 and itself.", 2.4),
    ("Which is the smallest prime above it?",
     "Check 1002 upwards. 1002 is even. 1003 = 17 × 59. 1004 is even. 1005 ends in 5. 1006 is even. 1007 = "
     "19 × 53. 1008 is even. 1009: not divisible by 2, 3, 5, 7, 11, 13, 17, 19, 23, 29 or 31, and 31² = 961 "
     "< 1009 < 32², so 1009 is prime.",
     "**1009**: 1003 = 17 × 59 and 1007 = 19 × 53 are composite, and 1009 has no prime factor up to 31 "
     "(31² = 961 < 1009 < 32² = 1024).", 5.1),
)
TRUNCATED_CONTEXT = 256
TRUNCATED_PROMPTS = ("What is a hearth?", "Why do people gather around one?", "How do I light a fire safely?",
                     "What wood burns best?", "How do I clean the ashes?", "Tell me about chimneys.",
                     "What is a fire screen for?", "Any last tips?")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hearth", description="Hearth desktop app")
    parser.add_argument("--screenshot", metavar="FILE.png", help="render the main window to a PNG and exit")
    parser.add_argument("--tab", choices=TABS, default="chat",
                        help="what the screenshot shows (truncated: a chat longer than a small context)")
    parser.add_argument("--timeout", type=float, default=120.0, help="screenshot: give up after this many seconds")
    return parser.parse_args(argv)


def make_app(argv: list[str]) -> QApplication:
    """The QApplication (created once), high-DPI aware, themed from the settings."""
    app = QApplication.instance()
    if app is None:
        QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
        app = QApplication(["hearth", *argv])
        app.setApplicationName("Hearth")
        app.setOrganizationName("Hearth")
        app.setWindowIcon(icon("hearth"))
    apply_theme(app, load_settings().theme)
    return app


def _no_display(offscreen_ok: bool) -> str | None:
    """Why no window can open here (Linux without X11/Wayland), or None. Qt would abort instead."""
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM"):
        return None
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    if offscreen_ok:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # --screenshot renders without a screen
        return None
    return ("no display to open the window on (DISPLAY/WAYLAND_DISPLAY unset); use `hearth --cli ...`, "
            "or QT_QPA_PLATFORM=offscreen with --screenshot")


def run(argv: list[str]) -> int:
    """The ``hearth`` GUI entry point; returns the process exit code."""
    args = _parse(argv)
    problem = _no_display(bool(args.screenshot))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    app = make_app(argv)
    from hearth.app.gui.main_window import MainWindow

    if args.screenshot:
        return _screenshot(app, Path(args.screenshot), args.tab, args.timeout)
    window = MainWindow()
    window.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    window.show()
    return app.exec()


def _screenshot(app: QApplication, path: Path, tab: str, timeout_s: float) -> int:
    settings = load_settings().replace(default_model=DEMO_LABEL)
    if tab == "truncated":
        settings = settings.replace(max_model_len=TRUNCATED_CONTEXT)
    with _throwaway_home():
        return _render(app, settings, path, tab, timeout_s)


@contextmanager
def _throwaway_home() -> Iterator[Path]:
    """Point Hearth's folders (``HEARTH_HOME``) at a temporary one for the block, then restore."""
    old = os.environ.get(HOME_ENV)
    with tempfile.TemporaryDirectory(prefix="hearth-screenshot-") as home:
        os.environ[HOME_ENV] = home
        try:
            yield Path(home)
        finally:
            if old is None:
                os.environ.pop(HOME_ENV, None)
            else:
                os.environ[HOME_ENV] = old


def _render(app: QApplication, settings: Settings, path: Path, tab: str, timeout_s: float) -> int:
    from hearth.app.gui.main_window import MainWindow

    window = MainWindow(settings)
    window.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    window.show()
    ok = _wait(app, lambda: window.chat.connected is not None, timeout_s)
    if ok and tab in ("chat", "truncated"):
        prompts = TRUNCATED_PROMPTS if tab == "truncated" else (SCREENSHOT_PROMPT,)
        for prompt in prompts:
            ok = _ask(app, window, prompt, timeout_s)
            if not ok or (tab == "truncated" and not window.chat.view.context_marker.isHidden()):
                break
    if ok and tab == "thinking":
        _show_thinking_example(window)
    if ok and tab == "server":
        window.server_tab.start_server()
        ok = _wait(app, lambda: window.server_tab.server is not None or window.server_tab.failed, timeout_s)
    window.show_view(tab)
    _wait(app, lambda: False, 0.3)  # let layouts and the status bar settle
    if tab == "truncated":
        window.chat.view.scroll_to_context_marker()
        _wait(app, lambda: False, 0.1)
    saved = ok and window.grab().save(str(path))
    if not ok:
        print(f"hearth: the demo model did not answer within {timeout_s:.0f}s", file=sys.stderr)
    window.close()
    return 0 if saved else 1


def _show_thinking_example(window) -> None:
    """Write THINKING_EXAMPLE into the (throwaway) chat store and open it: the first answer's
    Thinking block folded, the last one's open."""
    from hearth.app.store.chats import MessageStats

    store = window.store
    conversation = store.create_conversation("Is 1001 prime?", model="example")
    parent = None
    for question, reasoning, answer, seconds in THINKING_EXAMPLE:
        parent = store.add_message(conversation.id, "user", question, parent_id=parent).id
        stats = MessageStats(tokens_per_s=21.7, time_to_first_token_s=0.31, thinking_s=seconds)
        parent = store.add_message(conversation.id, "assistant", answer, parent_id=parent, model="example",
                                   stats=stats, finish_reason="stop", reasoning=reasoning).id
    window.chat.think_button.setChecked(True)
    window.open_conversation(conversation.id)
    window.sidebar.refresh()
    window.sidebar.select_id(conversation.id)
    window.chat.view.widgets[-1].thinking.set_expanded(True)


def _ask(app: QApplication, window, prompt: str, timeout_s: float) -> bool:
    window.chat.composer.setPlainText(prompt)
    window.chat.sampling_panel.max_tokens.setValue(40)
    window.chat.send()
    return _wait(app, lambda: not window.chat.is_busy, timeout_s)


def _wait(app: QApplication, done: Callable[[], bool], timeout_s: float) -> bool:
    """Process events until ``done()`` or the timeout (a local event loop, no sleeping)."""
    loop = QEventLoop()
    check = QTimer()
    check.setInterval(20)
    check.timeout.connect(lambda: done() and loop.quit())
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    check.start()
    if not done():
        loop.exec()
    check.stop()
    return bool(done())
