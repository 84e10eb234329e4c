"""``hearth --cli pull | import | rm | models | search``: the Hub manager from a terminal.

Each subcommand sets ``func(args) -> int`` (the exit code). Errors print as one line on stderr,
never a traceback. ``pull`` draws a live one-line bar on a terminal and plain lines every few
seconds otherwise; Ctrl-C pauses it, keeping the partial files, and running the same ``pull``
again resumes where it stopped. It refuses, before fetching weights, a repo Hearth could not load
(no safetensors weights; an architecture it does not run, unless ``--force``). ``rm`` finds a model
as ``--model`` does (installed name, repo id or its short name) and also forgets an unfinished pull.
``import`` registers a local model folder, used where it is (``rm`` then only forgets it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

from hearth.app.cli.common import add_debug_option, is_demo_name
from hearth.app.demo_model import bundled_demo_path
from hearth.app.hub import events as ev
from hearth.app.hub.catalog import SORTS, SUPPORTED_MODEL_TYPES, search_models
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError
from hearth.app.hub.installed import (
    InstalledModel,
    delete_model,
    find_installed,
    import_local_model,
    list_installed,
)
from hearth.app.hub.manager import DownloadItem, DownloadManager, DownloadOptions, ItemState
from hearth.app.hub.state import QueueFile, Registry
from hearth.app.hub.units import format_bytes, format_duration, format_speed
from hearth.app.store.settings import Settings, load_settings
from hearth.engine.api import HearthError

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130
PULL_OPTIONS = DownloadOptions()  # module-level so tests can use shorter timeouts


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register pull, import, rm, models and search on the CLI's subparsers."""
    pull = subparsers.add_parser("pull", help="download a model from the Hugging Face Hub (resumable)")
    pull.add_argument("repo", help="repo id, e.g. deepseek-ai/DeepSeek-V3.2")
    pull.add_argument("--include", action="append", metavar="GLOB",
                      help="only files matching GLOB (repeatable; default: safetensors, json, tokenizer)")
    pull.add_argument("--exclude", action="append", metavar="GLOB", help="skip files matching GLOB")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.add_argument("--force", action="store_true",
                      help="download even an architecture Hearth cannot run (it then cannot load it)")
    add_debug_option(pull)
    pull.set_defaults(func=cmd_pull)

    imp = subparsers.add_parser("import", help="add a local model folder to the installed models (used in place)",
                                description="Add a local Hugging Face-layout model folder (config.json, .safetensors "
                                "weights [+ model.safetensors.index.json], tokenizer.json) to the installed models, "
                                "so run, chat, serve and the app's Models tab offer it. The folder is checked first "
                                "(a supported architecture; safetensors headers readable; pickle files are never "
                                "opened), then used where it is: nothing is copied, so keep it there; `hearth --cli "
                                "rm NAME` only forgets it and never deletes the folder.")
    imp.add_argument("folder", metavar="DIR", help="the model folder")
    imp.add_argument("--name", help="the name to run it by (default: the folder's name)")
    add_debug_option(imp)
    imp.set_defaults(func=cmd_import)

    rm = subparsers.add_parser("rm", help="delete a downloaded model (or forget an imported one)",
                               description="Delete a downloaded model (or an unfinished download) from the Hugging "
                               "Face cache. An imported model is only forgotten: its folder is never deleted.")
    rm.add_argument("repo", metavar="NAME", help="installed name, repo id or its short name (as --model takes)")
    rm.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add_debug_option(rm)
    rm.set_defaults(func=cmd_rm)

    models = subparsers.add_parser("models", help="list installed models (and the bundled demo model)")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    add_debug_option(models)
    models.set_defaults(func=cmd_models)

    search = subparsers.add_parser("search", help="search the Hub for models Hearth can run")
    search.add_argument("query")
    search.add_argument("--sort", choices=list(SORTS), default="downloads")
    search.add_argument("--all", action="store_true", help="include architectures Hearth cannot run")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true", help="machine-readable output")
    add_debug_option(search)
    search.set_defaults(func=cmd_search)


def _one_line_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(command)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except BrokenPipeError:  # the reader went away (`| head`): the CLI's main ends quietly
            raise
        except (HearthError, OSError) as exc:  # OSError: permissions, a vanished folder...
            if getattr(args, "debug", False):
                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR

    return wrapper


@_one_line_errors
def cmd_pull(args: argparse.Namespace) -> int:
    try:
        item = pull_model(args.repo, revision=args.revision, include=tuple(args.include) if args.include else None,
                          exclude=tuple(args.exclude) if args.exclude else None, force=args.force, progress=sys.stderr)
    except KeyboardInterrupt:  # paused, and the way to resume printed
        return EXIT_INTERRUPTED
    print(f"Ready: {item.repo_id} ({format_bytes(item.bytes_total)}, checksums verified) in {item.path}")
    return EXIT_OK


def pull_model(repo_id: str, *, revision: str | None = None, include: tuple[str, ...] | None = None,
               exclude: tuple[str, ...] | None = None, force: bool = False, progress: TextIO,
               settings: Settings | None = None) -> DownloadItem:
    """Download ``repo_id`` and verify it, with the progress on ``progress``; returns the ready item.
    ``HubError`` when it fails; after Ctrl-C the download is paused (its files kept), the way to resume
    is printed and KeyboardInterrupt raised again."""
    printer = ProgressPrinter(progress)
    manager = DownloadManager(settings or load_settings(), on_event=printer.on_event, options=PULL_OPTIONS)
    item_id = manager.enqueue(repo_id, revision=revision, include=include, exclude=exclude, force=force)
    manager.start()
    try:
        state = manager.wait(item_id)
    except KeyboardInterrupt:
        _interrupted(manager, item_id, printer)
        raise
    finally:
        manager.close(timeout=10)
    printer.end_line()
    item = manager.item(item_id)
    if state == ItemState.READY:
        return item
    if state == ItemState.FAILED and not item.is_resumable:
        manager.cancel(item_id)  # nothing to continue: no queue entry left behind (partial files are kept)
    raise HubError(item.message or f"download {state}")


def _interrupted(manager: DownloadManager, item_id: str, printer: ProgressPrinter) -> None:
    manager.pause(item_id)
    with contextlib.suppress(TimeoutError, KeyboardInterrupt):
        manager.wait(item_id, timeout=manager.options.stall_timeout_s + 5)
    printer.end_line()
    item = manager.item(item_id)
    if item.bytes_done == 0:  # interrupted while planning (or before any byte arrived)
        print(f"Stopped: nothing downloaded yet; run `hearth --cli pull {item.repo_id}` again to start.",
              file=printer.stream)
    else:
        print(f"Paused: {format_bytes(item.bytes_done)} of {format_bytes(item.bytes_total)} kept; run "
              f"`hearth --cli pull {item.repo_id}` again to resume.", file=printer.stream)


@_one_line_errors
def cmd_import(args: argparse.Namespace) -> int:
    model = import_local_model(args.folder, args.name, HubContext.from_settings(load_settings()))
    print(f"Imported {model.name} ({format_bytes(model.size_bytes)}, {model.model_type}) from {model.path}.")
    print(f"Hearth uses the folder where it is, so keep it there; `hearth --cli rm {model.name}` forgets it and "
          f"leaves the folder alone. Run it with `hearth --cli run -m {model.name}`.")
    return EXIT_OK


@_one_line_errors
def cmd_rm(args: argparse.Namespace) -> int:
    ctx = HubContext.from_settings(load_settings())
    name, model = _to_remove(args.repo, ctx)
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"error: not a terminal; pass --yes to delete {name}", file=sys.stderr)
            return EXIT_ERROR
        size = format_bytes(model.size_bytes) if model else "unfinished download"
        question = (f"Forget {name}? Its folder {model.path} stays as it is." if model and model.source == "imported"
                    else f"Delete {name} ({size})?")
        if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing deleted.")
            return EXIT_ERROR
    freed = delete_model(name, ctx)
    if model is None:
        print(f"Removed the unfinished download of {name} ({format_bytes(freed)} freed).")
    elif model.source == "imported":
        print(f"Forgot {name}; its folder {model.path} was left alone.")
    else:
        print(f"Deleted {name} ({format_bytes(freed)} freed).")
    return EXIT_OK


def _to_remove(name: str, ctx: HubContext) -> tuple[str, InstalledModel | None]:
    """What ``rm NAME`` deletes, found as ``--model`` finds models (exact name, repo id, or its short
    name in any case): the installed name and the model (None for a download that never started
    its first file but is queued); HubError when nothing matches or several do."""
    if is_demo_name(name):
        raise HubError("the bundled demo model is part of Hearth and cannot be removed")
    matches = find_installed(name, ctx)
    if len(matches) > 1:
        raise HubError(f"{name} could be {', '.join(m.name for m in matches)}; pass the full name")
    if matches:
        return matches[0].name, matches[0]
    if any(item.get("repo_id") == name for item in QueueFile(ctx.queue_path).load().values()):
        return name, None
    raise HubError(f"{name} is not installed (see `hearth --cli models`)")


@_one_line_errors
def cmd_models(args: argparse.Namespace) -> int:
    ctx = HubContext.from_settings(load_settings())
    models = list_installed(ctx)
    verified = Registry(ctx.registry_path).ready()
    demo = _demo_entry()
    if args.json:
        print(json.dumps([m.to_json() for m in models] + ([demo] if demo else []), indent=2))
        return EXIT_OK
    rows = [(m.name, format_bytes(m.size_bytes), m.model_type or "?", "yes" if m.is_supported else "no",
             _status(m, m.name in verified), str(m.path)) for m in models]
    if demo:
        rows.append(("demo", format_bytes(demo["size_bytes"]), demo["model_type"] or "?",
                     "yes" if demo["is_supported"] else "no", "bundled demo", demo["path"]))
    if rows:
        _print_table(("NAME", "SIZE", "ARCH", "SUPPORTED", "STATUS", "PATH"), rows)
    if not models:
        print("No models installed. Find one with `hearth --cli search QUERY`, then `hearth --cli pull REPO`.")
    return EXIT_OK


def _demo_entry() -> dict[str, Any] | None:
    """The bundled demo model in ``models --json``'s shape (``--model demo`` picks it)."""
    path = bundled_demo_path()
    if path is None:
        return None
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    model_type = config.get("model_type")
    return {"name": "demo", "path": str(path), "size_bytes": size, "model_type": model_type,
            "is_supported": model_type in SUPPORTED_MODEL_TYPES, "source": "demo", "is_ready": True, "commit": None}


@_one_line_errors
def cmd_search(args: argparse.Namespace) -> int:
    if args.limit < 1:
        print("error: --limit must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    ctx = HubContext.from_settings(load_settings())
    results = search_models(ctx, args.query, sort=args.sort, all_architectures=args.all, limit=args.limit)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
        return EXIT_OK
    if not results:
        hint = "" if args.all else " that Hearth can run (try --all)"
        print(f"No models match {args.query!r}{hint}.")
        return EXIT_OK
    rows = [(r.repo_id, f"{r.downloads:,}", f"{r.likes:,}", r.model_type or "?",
             "yes" if r.is_supported else "no", "gated" if r.gated else "open") for r in results]
    _print_table(("REPO", "DOWNLOADS", "LIKES", "ARCH", "SUPPORTED", "ACCESS"), rows)
    return EXIT_OK


def _status(model: InstalledModel, verified: bool) -> str:
    """``verified``: the download finished and matched its checksums."""
    if model.source == "imported":
        if not model.path.is_dir():
            return "folder missing"
        return "imported" if model.is_ready else "no weights"
    if model.is_ready:
        return "ready"
    return "no weights" if verified and not model.has_weights else "incomplete"


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


class ProgressPrinter:
    """Turns download events into a live bar (terminal) or a line every ``interval_s`` (logs)."""

    def __init__(self, stream: TextIO, *, is_tty: bool | None = None, interval_s: float = 5.0) -> None:
        self.stream = stream
        self.is_tty = stream.isatty() if is_tty is None else is_tty
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._live = False
        self._last_line_at: float | None = None

    def on_event(self, event: ev.DownloadEvent) -> None:
        with self._lock:
            self._handle(event)

    def end_line(self) -> None:
        with self._lock:
            self._end_live()

    def _handle(self, event: Any) -> None:
        if isinstance(event, ev.DownloadStarted):
            self._say(f"Pulling {event.repo_id} @ {event.commit[:10]}: {event.num_files} files, "
                      f"{format_bytes(event.bytes_total)} ({format_bytes(event.bytes_to_download)} to download)")
        elif isinstance(event, ev.DownloadProgress):
            self._progress(event)
        elif isinstance(event, ev.DownloadStalled):
            self._say(f"No data for {event.idle_s:.0f}s on {event.filename}; reconnecting")
        elif isinstance(event, ev.DownloadRetrying):
            where = f" ({event.filename})" if event.filename else ""
            self._say(f"Retry {event.attempt} in {event.delay_s:.1f}s{where}: {event.reason}")
        elif isinstance(event, ev.DownloadVerifying):
            percent = 100 * event.bytes_done / max(event.bytes_total, 1)
            self._live_or_periodic(f"Verifying checksums {percent:5.1f}%")

    def _progress(self, event: ev.DownloadProgress) -> None:
        fraction = event.bytes_done / max(event.bytes_total, 1)
        bar = "#" * int(24 * fraction) + "-" * (24 - int(24 * fraction))
        self._live_or_periodic(
            f"[{bar}] {100 * fraction:5.1f}% {format_bytes(event.bytes_done)}/{format_bytes(event.bytes_total)} "
            f"{format_speed(event.speed_bps)} ETA {format_duration(event.eta_s)}")

    def _live_or_periodic(self, text: str) -> None:
        if self.is_tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + text[:width].ljust(width))
            self.stream.flush()
            self._live = True
        elif self._last_line_at is None or time.monotonic() - self._last_line_at >= self.interval_s:
            self._last_line_at = time.monotonic()
            self._say(text)

    def _say(self, text: str) -> None:
        self._end_live()
        print(text, file=self.stream, flush=True)

    def _end_live(self) -> None:
        if self._live:
            self.stream.write("\n")
            self._live = False
