"""``hearth --cli ...``: the headless command line.

    hearth --cli chat [--model M] [--backend URL]       chat in the terminal
    hearth --cli run [--model M] "..." [--json]         answer one prompt (also --prompt "...")
                                                        (a Hub repo id not installed is pulled first)
    hearth --cli --model M --prompt "..."               the same (the one-shot form)
    hearth --cli serve [--model M --host H --port P --api-key K]
    hearth --cli stats [--json]                         the running engine's statistics
    hearth --cli stop                                   stop the engine host left running in the background
    hearth --cli pull | rm | models | search            the model library (Hugging Face Hub)
    hearth --cli import DIR [--name NAME]               add a local model folder (used in place)
    hearth --cli config list | get KEY | set KEY VALUE  the settings file

Errors print one line on stderr and exit with code 1 (``--debug``, before or after the command,
shows the traceback); Ctrl-C exits with 130; a wrong argument shows the command's usage and exits
with 2. Without a command, a prompt (``--prompt`` or piped stdin) runs one-shot and an interactive
terminal opens the chat.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from importlib import metadata

from hearth.app.cli import chat, config, run, serve
from hearth.app.cli.common import add_common_options
from hearth.engine.api import HearthError

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hearth --cli", description="Hearth without the window.",
                                     epilog="Run `hearth --cli COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"hearth {version()}")
    add_common_options(parser, sub=False)
    run.add_run_options(parser, sub=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat.add_parser(subparsers)
    run.add_parser(subparsers)
    serve.add_parser(subparsers)
    _add_hub_commands(subparsers)
    config.add_parser(subparsers)
    return parser


def _add_hub_commands(subparsers: argparse._SubParsersAction) -> None:
    try:
        from hearth.app.cli.hub_commands import add_subcommands
    except ImportError as err:  # the Hub manager is a separate piece; the rest of the CLI works without it
        logging.getLogger(__name__).debug("hub commands unavailable: %s", err)
        return
    add_subcommands(subparsers)


def version() -> str:
    """The installed package's version."""
    try:
        return metadata.version("hearth")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        if args.prompt is None and sys.stdin.isatty():
            args.func = chat.cmd_chat
        else:
            args.func = run.cmd_run
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(message)s")
    _quiet_libraries()
    return _call(args)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, reporting arguments no parser took with the usage of the command they followed
    (argparse would show the top-level usage)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's parser the arguments reached: ``config set``'s for ``config set K V``."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, action.dest, None) if action is not None else None
        if action is None or chosen not in action.choices:
            return parser
        parser = action.choices[chosen]


def _quiet_libraries() -> None:
    """Library logging that is not for people: huggingface_hub's own handler already prints its
    warnings (through the root logger too they showed twice), and filelock's DEBUG lines would bury
    ``--debug``'s."""
    logging.getLogger("huggingface_hub").propagate = False
    logging.getLogger("filelock").setLevel(logging.WARNING)


def _call(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or EXIT_OK)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of our output went away (`| head`)
        # NOTE: what is still buffered for stdout would fail again at exit, with a message.
        with contextlib.suppress(OSError, ValueError):  # (no file descriptor: a test's stand-in)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except HearthError as err:
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:  # noqa: BLE001 - the CLI's promise is one line, not a traceback
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (run with --debug for details)"
        print(f"error: unexpected {type(err).__name__}: {err}{hint}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
