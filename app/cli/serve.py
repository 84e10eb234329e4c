"""``hearth --cli serve``: run the engine host (OpenAI-compatible API) in the foreground until
Ctrl-C; ``hearth --cli stats``: show the statistics of the running engines (local or --backend);
``hearth --cli stop``: stop the engine host left running in the background.

``serve`` registers itself in the runtime folder while it runs (see ``register_serve``), so
``stats`` and ``stop --all`` find it as they find the background host of ``chat`` and the app.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from hearth.app.cli.common import (
    add_debug_option,
    add_no_pull_option,
    api_key_of,
    backend_key_of,
    download_missing,
    note_context_cap,
    print_json,
    resolve_model,
)
from hearth.app.client.local_engine import serve_record_path
from hearth.app.paths import prefix_cache_dir
from hearth.app.store.settings import Settings, load_settings
from hearth.engine.api import HearthError, engine_options
from hearth.engine.flags import add_engine_arguments, engine_flags
from hearth.engine.server.security import add_security_arguments

_PORT_POLL_S = 0.05


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible engine host in the foreground",
                                  description="Serve a model over an OpenAI-compatible API in the foreground "
                                  "until Ctrl-C (`hearth --cli stats` sees it). A Hub repo id given to --model that "
                                  "is not installed is pulled first when stdin is a terminal (--no-pull: fail "
                                  "instead).")
    serve.add_argument("--model", "-m", default=argparse.SUPPRESS,
                       help="model folder, installed name or Hub repo id (one not installed is downloaded first "
                       "when stdin is a terminal; default: the default model in the settings)")
    serve.add_argument("--served-name", help="the model name clients use (default: the installed name or "
                       "repo id given to --model, demo for the demo model, else the folder name)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=port_number, default=8000, help="port (default: 8000; 0 = any free port)")
    serve.add_argument("--api-key", default=argparse.SUPPRESS, help="require this bearer token "
                       "(default: $HEARTH_API_KEY; needed to bind anything but this machine's loopback)")
    add_no_pull_option(serve)
    add_debug_option(serve)
    add_security_arguments(serve)
    add_engine_arguments(serve, defaults_from="the settings")
    serve.set_defaults(func=cmd_serve)

    stats = subparsers.add_parser("stats", help="show the running engines' statistics",
                                  description="Show the statistics of the local engines (the background "
                                  "host and any `serve`), or of --backend URL.")
    stats.add_argument("--backend", metavar="URL", default=argparse.SUPPRESS,
                       help="ask this server (default: the local engine host)")
    stats.add_argument("--api-key", default=argparse.SUPPRESS, help="API key for --backend")
    stats.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    add_debug_option(stats)
    stats.set_defaults(func=cmd_stats)

    stop = subparsers.add_parser("stop", help="stop the engine host running in the background",
                                 description="Stop the background engine host (started by `chat "
                                 "--keep-engine` or the desktop app); --all also stops `serve` processes.")
    stop.add_argument("--all", action="store_true", help="also stop running `hearth --cli serve` processes")
    add_debug_option(stop)
    stop.set_defaults(func=cmd_stop)


def port_number(text: str) -> int:
    """--port: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535, not {port}")
    return port


def cmd_serve(args: argparse.Namespace) -> int:
    from hearth.engine.server.main import main as server_main

    settings = load_settings()
    check_port_free(args.host, args.port)  # before the model downloads or loads, which can take minutes
    model = resolve_model(args.model, settings, on_missing=download_missing(args, settings))
    path = model.path
    note_context_cap(path, args, sys.stderr)
    # (None from a non-flag option is the top-level parser's "not given" for --max-model-len.)
    given = {o.name: getattr(args, o.name) for o in engine_options()
             if hasattr(args, o.name) and (getattr(args, o.name) is not None or o.kind == "bool")}
    engine = dataclasses.replace(settings.engine, **given)  # the settings, with this command's flags on top
    if engine.prefix_cache_dir is None:
        engine = dataclasses.replace(engine, prefix_cache_dir=str(prefix_cache_dir()))
    argv = ["--model", str(path), "--host", args.host, "--port", str(args.port), "--log-level", "warning",
            "--max-body-mib", str(args.max_body_mib), *engine_flags(engine)]
    # Clients ask for the name the user knows ("demo", org/repo), not the snapshot's commit-hash folder;
    # the host also answers to the folder's name.
    served_name = args.served_name or model.name
    argv += ["--served-name", served_name]
    key = api_key_of(args)
    if key:
        argv += ["--api-key", key]
    for flag, values in (("--allow-load-path", [*_model_folders(settings), *args.allow_load_path]),
                         ("--allowed-host", args.allowed_host), ("--cors-origin", args.cors_origin)):
        for value in values:
            argv += [flag, value]
    if args.insecure_no_key:
        argv.append("--insecure-no-key")
    if args.debug:
        argv.append("--debug")
    port_file = serve_record_path(os.getpid()).with_suffix(".port")
    argv += ["--port-file", str(port_file)]
    with _registered(port_file, args.host, key, served_name):
        return server_main(argv)


@contextlib.contextmanager
def _registered(port_file: Path, host: str, api_key: str | None, model: str):
    """Register this ``serve`` once the server has bound its port; unregister when it ends."""
    from hearth.app.client.local_engine import register_serve

    done = threading.Event()

    def register_when_bound() -> None:
        while not done.wait(_PORT_POLL_S):
            with contextlib.suppress(FileNotFoundError, ValueError):
                register_serve(host, int(port_file.read_text().strip()), api_key, model)
                return

    thread = threading.Thread(target=register_when_bound, name="hearth-serve-register", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        port_file.unlink(missing_ok=True)
        serve_record_path(os.getpid()).unlink(missing_ok=True)


def check_port_free(host: str, port: int) -> None:
    """Raise ``HearthError`` when ``host:port`` cannot be bound now (in use, or not this machine's
    address), as the server would find out only after loading the model. Port 0 always binds."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            sock.bind((host, port))
    except OSError as err:
        raise HearthError(f"cannot listen on {host}:{port}: {err.strerror or err}; pick another --port "
                          "(0 = any free port) or stop what uses it") from None


def _model_folders(settings: Settings) -> list[str]:
    """Where installed models live (the Hub cache and imported folders): /hearth/load may open them."""
    try:
        from hearth.app.hub import HubContext, list_installed
    except ImportError:  # the Hub manager is optional at run time
        return []
    ctx = HubContext.from_settings(settings)
    return [str(ctx.cache_dir), *(str(m.path) for m in list_installed(ctx) if m.source == "imported")]


def cmd_stats(args: argparse.Namespace) -> int:
    from hearth.app.client.local_engine import running_engines
    from hearth.app.client.openai_client import ChatClient

    settings = load_settings()
    url = args.backend or settings.backend_url
    if url:
        with ChatClient(url, backend_key_of(args, settings, url), timeout=10.0) as client:
            stats = client.stats()
        if args.json:
            print_json(stats)
        else:
            print(format_stats(stats) if stats else
                  f"{client.base_url} does not report statistics (not a Hearth engine host)")
        return 0
    engines = running_engines()
    if not engines:
        if args.json:
            print_json([])
        else:
            print("No local engine is running (`hearth --cli serve`, `chat --keep-engine` or the app starts one).")
        return 0
    reports = []
    for engine in engines:
        with engine.client() as client:
            reports.append((engine, client.stats()))
    if args.json:  # one object for one engine (the usual case), a list when several run
        print_json(reports[0][1] if len(reports) == 1 else [stats for _, stats in reports])
        return 0
    print("\n\n".join(f"engine     {engine.describe()}\n{format_stats(stats)}" for engine, stats in reports))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from hearth.app.client.local_engine import EngineProcess, running_engines, stop_serve

    stopped = []
    background = EngineProcess.find_running()
    if background is not None:
        background.stop()
        stopped.append(f"Stopped the background engine host (pid {background.pid}, model "
                       f"{Path(background.model).name if background.model else 'none'}).")
    serves = [e for e in running_engines() if e.kind == "serve"]
    for engine in serves if args.all else ():
        stop_serve(engine)
        stopped.append(f"Stopped {engine.describe()}.")
    print("\n".join(stopped) if stopped else "No engine host is running in the background.")
    if serves and not args.all:
        where = ", ".join(e.describe() for e in serves)
        print(f"Still running: {where}; stop it with Ctrl-C in its terminal or `hearth --cli stop --all`.")
    return 0


def format_stats(stats: dict[str, Any]) -> str:
    """A few readable lines from /hearth/stats."""
    gib = 1024 ** 3
    memory = stats.get("memory") or {}
    lines = [
        f"model      {stats.get('model') or '(none)'}  [{stats.get('state', '?')}]",
        f"requests   {stats.get('running', 0)} running, {stats.get('waiting', 0)} waiting, "
        f"{stats.get('requests_total', 0)} served",
        f"speed      {stats.get('decode_tokens_per_s', 0.0):.1f} tok/s (last 5 s), "
        f"{stats.get('generated_tokens', 0)} tokens generated",
    ]
    if "warm_up_s" in stats:
        lines.append(f"warm-up    {stats['warm_up_s']:.2f} s at start (kernels compiled, decode graphs captured)")
    if "cache_blocks_total" in stats:
        lines.append(f"kv cache   {stats['cache_blocks_free']} of {stats['cache_blocks_total']} pages free, "
                     f"context {stats.get('max_model_len')} tokens")
    if "prefix_cache_conversations" in stats:
        lines.append(f"chat cache {int(stats['prefix_cache_conversations'])} chats, "
                     f"{stats.get('prefix_cache_host_bytes', 0) / gib:.2f} GiB in RAM, "
                     f"{stats.get('prefix_cache_disk_bytes', 0) / gib:.2f} GiB on disk, "
                     f"{int(stats.get('prefix_cache_hits_tokens', 0))} prompt tokens reused")
    if "tier_cache_chats" in stats:
        disk = (f"{int(stats['tier_cache_disk_chats'])} on disk "
                f"{stats.get('tier_cache_disk_bytes', 0) / gib:.2f} GiB, ") if "tier_cache_disk_chats" in stats else ""
        lines.append(f"long chats {int(stats['tier_cache_chats'])} parked, "
                     f"{stats.get('tier_cache_bytes', 0) / gib:.2f} GiB in RAM, {disk}"
                     f"{int(stats.get('tier_cache_hits_tokens', 0))} prompt tokens reused")
    if memory:
        lines.append(f"memory     {memory.get('process_rss_bytes', 0) / gib:.2f} GiB resident, "
                     f"{memory.get('host_available_bytes', 0) / gib:.1f} GiB of host RAM free")
    for gpu in memory.get("gpus", []):
        lines.append(f"gpu {gpu['index']}      {gpu['allocated_bytes'] / gib:.2f} GiB allocated, "
                     f"{gpu['reserved_bytes'] / gib:.2f} GiB reserved of {gpu['total_bytes'] / gib:.1f} GiB")
    return "\n".join(lines)
