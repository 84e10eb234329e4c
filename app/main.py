"""The ``hearth`` console command.

    hearth                      open the desktop app
    hearth --screenshot FILE    open the app, save a screenshot of the window to FILE, quit
                                (``--tab NAME`` picks the view)
    hearth --cli ...            the headless command line (``hearth --cli --help``)
    hearth --version            the installed version

The GUI (``hearth.app.gui.main:run``) and the CLI are imported only when used, so each starts
without loading the other (the CLI never needs Qt).
"""

from __future__ import annotations

import sys

USAGE = """usage: hearth [--screenshot FILE [--tab chat|truncated|thinking|models|settings|server] [--timeout S]]
       hearth --cli COMMAND ...

  hearth                     open the desktop app
  hearth --screenshot FILE   open the app, save a screenshot to FILE and quit
    --tab chat|truncated|thinking|models|settings|server   the view the screenshot shows (default: chat)
    --timeout S                                   give up after S seconds (default: 120)
  hearth --cli --help        the command line: chat, run, serve, stats, stop, pull, import, rm, models, search,
                             config
  hearth --version           the installed version
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cli" in argv:
        i = argv.index("--cli")
        from hearth.app.cli.main import main as cli_main

        return cli_main(argv[:i] + argv[i + 1:])
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if argv and argv[0] == "--version":
        from hearth.app.cli.main import version

        print(f"hearth {version()}")
        return 0
    return _run_gui(argv)


def _run_gui(argv: list[str]) -> int:
    try:
        from hearth.app.gui.main import run
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing.startswith("hearth.app.gui"):
            print("hearth: the desktop app is not part of this installation; use `hearth --cli ...` "
                  "(see `hearth --cli --help`)", file=sys.stderr)
            return 2
        if missing.startswith(("PySide6", "shiboken6")):
            print("hearth: the desktop app needs PySide6 (pip install PySide6-Essentials); "
                  "`hearth --cli ...` works without it", file=sys.stderr)
            return 2
        raise
    return int(run(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
