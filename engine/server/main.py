"""The engine host: an OpenAI-compatible HTTP server around one ``Engine``.

    python -m hearth.engine.server --model PATH [--host 127.0.0.1] [--port 8000] [--api-key K]
                                   [--served-name NAME] [--max-model-len N] [--max-num-seqs N] ...

Every ``EngineConfig`` field is a flag of the same name (``--max-model-len`` for ``max_model_len``);
``--help`` lists them with their one-line help from ``EngineConfig``'s metadata.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
with server-sent events or not), and Hearth's own ``GET /health``, ``GET /hearth/stats``,
``POST /hearth/load`` ``{"model": PATH}``, ``POST /hearth/unload`` and ``POST /hearth/tokenize`` (a
chat-completions body; answers ``{"prompt_tokens"}``, counted as the answer's prompt would be).

It binds 127.0.0.1 unless told otherwise, and refuses to bind anything else without an API key
(unless ``--insecure-no-key``). The API key can also come from the ``HEARTH_API_KEY`` environment
variable, which keeps it out of the process list; when set, every request needs
``Authorization: Bearer <key>``. What else it checks (Host, Origin, body size, load paths):
``security`` and docs/security.md. ``--port 0`` picks a free port; ``--port-file F`` writes the port
to F once the server accepts connections (how the app's local engine process finds it).

The pieces: ``host.EngineHost`` (the engine thread), ``app.create_app`` (routes and
errors), ``protocol`` (the OpenAI wire format).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

from hearth.engine.api import HearthError
from hearth.engine.flags import add_engine_arguments, engine_config
from hearth.engine.server.app import create_app
from hearth.engine.server.host import EngineHost
from hearth.engine.server.security import AccessPolicy, LoadPaths, add_security_arguments, is_loopback
from hearth.engine.stack_samples import ENV as STACK_SAMPLES_ENV
from hearth.engine.stack_samples import StackSampler

API_KEY_ENV = "HEARTH_API_KEY"
DEFAULT_PORT = 8000
logger = logging.getLogger("hearth.engine.server")

__all__ = ["API_KEY_ENV", "DEFAULT_PORT", "EngineHost", "add_engine_arguments", "build_parser", "create_app",
           "engine_config", "main", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hearth.engine.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder to load at start (or load one later via /hearth/load)")
    parser.add_argument("--served-name", help="the model name clients use (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0 = any free port)")
    parser.add_argument("--port-file", help="write the bound port to this file once serving")
    parser.add_argument("--api-key", help=f"require this bearer token (or set {API_KEY_ENV})")
    add_engine_arguments(parser)
    add_security_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of start-up errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not api_key and not is_loopback(args.host) and not args.insecure_no_key:
        print(f"error: refusing to serve on {args.host} without an API key: anyone who can reach it could use "
              f"the model; set --api-key or {API_KEY_ENV} (or pass --insecure-no-key)", file=sys.stderr)
        return 1
    if args.max_body_mib <= 0:
        print("error: --max-body-mib must be > 0", file=sys.stderr)
        return 1
    try:
        config = engine_config(args)
        host = EngineHost(config)
        if args.model:
            host.load(args.model, args.served_name)
    except Exception as err:  # a start-up failure is one line; --debug shows the traceback
        if args.debug:
            raise
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 1
    if not api_key and not is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach this port can use it", args.host)
    policy = AccessPolicy(bind_host=args.host, allowed_hosts=tuple(args.allowed_host),
                          cors_origins=tuple(args.cors_origin), max_body_bytes=int(args.max_body_mib * 2**20))
    load_paths = LoadPaths.of(args.allow_load_path, [args.model] if args.model else ())
    host.start()
    sampler = _stack_sampler(host)
    # uvicorn stops gracefully on SIGTERM, then raises it again: as Ctrl-C, it then ends up in the
    # ``finally`` below, which saves the chat cache, instead of killing the process.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(create_app(host, api_key, policy, load_paths), args.host, args.port, args.port_file,
              label=host.model.name if host.model else "no model")
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: a normal stop
        pass
    except OSError as err:
        print(f"error: cannot listen on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 1
    finally:
        host.close()
        if sampler is not None:
            sampler.stop()
    return 0


def _stack_sampler(host: EngineHost) -> StackSampler | None:
    """The developers' stack samples of the engine thread and this (the HTTP loop's) thread, when the
    environment names their file (``hearth.engine.stack_samples``)."""
    path = os.environ.get(STACK_SAMPLES_ENV)
    if not path:
        return None
    logger.info("sampling the engine's stacks into %s (a diagnostic: it slows the server a little)", path)
    return StackSampler([host.thread, threading.main_thread()], path).start()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _one_line(err: Exception) -> str:
    """A start-up error as one line: Hearth's own errors say what to do; anything else (a config
    value the model code cannot build, say) is named with its type."""
    if isinstance(err, HearthError):
        return str(err)
    text = " ".join(str(err).split()) or "no details"
    return f"cannot start: {type(err).__name__}: {text} (--debug shows the traceback)"


def serve(app: object, host: str, port: int, port_file: str | None = None, label: str = "") -> None:
    """Run ``app`` with uvicorn on host:port until SIGINT/SIGTERM."""
    import uvicorn

    sock = _listening_socket(host, port)
    bound = sock.getsockname()[1]
    if port_file:
        _write_atomic(Path(port_file), str(bound))
    shown = f"[{host}]" if ":" in host else host
    print(f"Hearth engine host: {label} on http://{shown}:{bound}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # NOTE: listen now, so a client that read the port file queues in the backlog until uvicorn accepts.
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)

