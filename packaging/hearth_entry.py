"""Entry point of the frozen (PyInstaller) Hearth: the ``hearth`` command, plus ``-m MODULE``.

A frozen app has no Python interpreter to run ``python -m ...``, but the GUI starts its engine host
as ``[sys.executable, "-m", "hearth.engine.server", ...]`` and, frozen, ``sys.executable`` is this
program. So ``hearth -m MODULE ARGS`` runs MODULE as ``__main__`` (like ``python -m``); anything
else goes to ``hearth.app.main``.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys


def main() -> int:
    multiprocessing.freeze_support()
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "-m":
        sys.argv = [sys.argv[0], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    from hearth.app.main import main as hearth_main

    return int(hearth_main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
