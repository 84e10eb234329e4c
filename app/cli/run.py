"""``hearth --cli run [TEXT...]``: answer one prompt and exit (also the bare short form
``hearth --cli --model DIR --prompt "..."``).

The prompt is the words after ``run`` (or ``--prompt``), else stdin when it is piped; with both, the
words come first, then a blank line and stdin (``git diff | hearth --cli run review this``).

The answer streams to stdout and a speed line (tokens, tok/s, time to first token) goes to stderr,
so ``hearth --cli run ... > answer.txt`` keeps only the answer. ``--json`` prints one JSON object
instead. By default the model runs in this process (no server start-up cost); with ``--backend
URL`` (or ``backend_url`` in the settings) the prompt goes to that OpenAI-compatible server. A Hub
repo id that is not installed is pulled first (see ``autopull``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TextIO

from hearth.app.cli.common import (
    Answer,
    add_common_options,
    backend_key_of,
    backend_of,
    chat_options,
    consume,
    context_of,
    download_missing,
    local_chunks,
    messages_for,
    note_context_cap,
    print_json,
    read_prompt,
    resolve_model,
    sampling_options,
    thoughts_stream,
)
from hearth.app.client.openai_client import ChatChunk, ChatClient, ClientError
from hearth.app.store.settings import Settings, load_settings
from hearth.engine.api import HearthError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="answer one prompt and exit",
                                   description="Answer one prompt and exit: the answer streams to stdout, "
                                   "the speed goes to stderr. A Hub repo id given to --model that is not installed "
                                   "is pulled first when stdin is a terminal (--no-pull: fail instead).")
    parser.add_argument("words", nargs="*", metavar="TEXT", help="the prompt (or use --prompt)")
    add_common_options(parser, sub=True)
    add_run_options(parser, sub=True)
    parser.set_defaults(func=cmd_run)


def add_run_options(parser: argparse.ArgumentParser, *, sub: bool) -> None:
    d = {"default": argparse.SUPPRESS} if sub else {}
    parser.add_argument("--prompt", "-p", help="the prompt ('-' reads stdin; piped stdin is read when omitted)", **d)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming", **d)


def cmd_run(args: argparse.Namespace) -> int:
    settings = load_settings()
    words = getattr(args, "words", None)
    if words and args.prompt is not None:
        raise HearthError("give the prompt as words after `run` or with --prompt, not both")
    prompt = read_prompt(" ".join(words) if words else args.prompt, sys.stdin)
    messages = messages_for(prompt, args.system)
    out = None if args.json else sys.stdout
    thoughts = None if args.json else thoughts_stream(args, sys.stderr)
    backend = backend_of(args, settings)
    if backend:
        model, answer = _run_remote(backend, backend_key_of(args, settings, backend), args, messages, out, thoughts)
    else:
        model, answer = _run_local(args, settings, messages, out, thoughts)
    if args.json:
        print_json({"model": model, **answer.to_json()})
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(answer.speed_line(), file=sys.stderr)
    return 0


def _run_local(args: argparse.Namespace, settings: Settings, messages: list[dict[str, str]],
               out: TextIO | None, thoughts: TextIO | None) -> tuple[str, Answer]:
    from hearth.engine import Engine, EngineConfig

    model = resolve_model(args.model, settings, on_missing=download_missing(args, settings))
    note_context_cap(model.path, args, sys.stderr)
    # One request at a time here, so the cache only needs room for one sequence.
    config = EngineConfig(max_model_len=context_of(args, settings), max_num_seqs=1)
    engine = Engine.load(str(model.path), config)
    chunks = local_chunks(engine, messages, sampling_options(args), chat_options(args))
    return model.name, _consume_closing(chunks, out, thoughts)


def _run_remote(url: str, key: str | None, args: argparse.Namespace, messages: list[dict[str, str]],
                out: TextIO | None, thoughts: TextIO | None) -> tuple[str, Answer]:
    with ChatClient(url, key) as client:
        model = args.model or _first_model(client)
        chunks = client.stream_chat(model, messages, **sampling_options(args),
                                    chat_template_kwargs=chat_options(args) or None)
        return model, _consume_closing(chunks, out, thoughts)


def _consume_closing(chunks: Iterator[ChatChunk], out: TextIO | None, thoughts: TextIO | None) -> Answer:
    try:
        return consume(chunks, out, thoughts=thoughts)
    finally:
        chunks.close()  # type: ignore[attr-defined]


def _first_model(client: ChatClient) -> str:
    models = client.models()
    if not models:
        raise ClientError(f"{client.base_url} serves no model; pass --model NAME")
    return models[0]
