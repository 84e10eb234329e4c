"""Measure Hearth's cold start as a user meets it: process start -> first paint of the main window
-> model picker filled -> demo model connected (engine host up), offscreen.

    QT_QPA_PLATFORM=offscreen HOME=$(mktemp -d) python packaging/measure_startup.py [--shot first.png]

Times count from the creation of this process (psutil), so interpreter start and imports are
included. A fresh HOME gives first-run conditions (no settings, no installed models). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

_CREATED = psutil.Process().create_time()


def since_start() -> float:
    return round(time.time() - _CREATED, 3)


def measure(shot: str | None, timeout_s: float) -> dict[str, object]:
    marks: dict[str, object] = {"python_ready_s": since_start()}
    from hearth.app.gui.main import make_app
    from hearth.app.gui.qt import QEvent, QObject, QTimer

    app = make_app([])
    from hearth.app.gui.main_window import MainWindow

    marks["imports_done_s"] = since_start()

    class FirstPaint(QObject):
        def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt's name)
            if event.type() == QEvent.Type.Paint and "first_paint_s" not in marks:
                marks["first_paint_s"] = since_start()
                if shot:
                    QTimer.singleShot(0, lambda: window.grab().save(shot))
            return False

    window = MainWindow()
    watcher = FirstPaint()
    window.installEventFilter(watcher)
    window.show()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app.processEvents()
        if "models_listed_s" not in marks and window.choices:
            marks["models_listed_s"] = since_start()
            marks["models_offered"] = [c.label for c in window.choices]
        if window.connected is not None:
            marks["model_connected_s"] = since_start()
            marks["model"] = window.connected.choice.label
            if shot:
                window.grab().save(shot.replace(".png", "-connected.png"))
            break
        time.sleep(0.005)
    marks["window_title"] = window.windowTitle()
    window.close()
    return marks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shot", help="save the window at first paint to this PNG")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shot, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
