"""``hearth --cli run``: answer one prompt and exit (also the bare short form
``hearth --cli --model DIR --prompt "..."``).

The answer streams to stdout and a speed line (tokens, tok/s, time to first token) goes to stderr,
so ``hearth --cli run ... > answer.txt`` keeps only the answer. ``--json`` prints one JSON object
instead. By default the model runs in this process (no server start-up cost); with ``--backend
URL`` (or ``backend_url`` in the settings) the prompt goes to that OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TextIO

from hearth.app.cli.common import (
    Answer,
    add_common_options,
    api_key_of,
    backend_of,
    chat_options,
    consume,
    local_chunks,
    messages_for,
    print_json,
    read_prompt,
    resolve_model_path,
    sampling_options,
    thoughts_stream,
)
from hearth.app.client.openai_client import ChatChunk, ChatClient, ClientError
from hearth.app.store.settings import Settings, load_settings


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="answer one prompt and exit",
                                   description="Answer one prompt and exit: the answer streams to stdout, "
                                   "the speed goes to stderr.")
    add_common_options(parser, sub=True)
    add_run_options(parser, sub=True)
    parser.set_defaults(func=cmd_run)


def add_run_options(parser: argparse.ArgumentParser, *, sub: bool) -> None:
    d = {"default": argparse.SUPPRESS} if sub else {}
    parser.add_argument("--prompt", "-p", help="the prompt ('-' reads stdin; piped stdin is read when omitted)", **d)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming", **d)


def cmd_run(args: argparse.Namespace) -> int:
    settings = load_settings()
    prompt = read_prompt(args.prompt, sys.stdin)
    messages = messages_for(prompt, args.system)
    out = None if args.json else sys.stdout
    thoughts = None if args.json else thoughts_stream(args, sys.stderr)
    backend = backend_of(args, settings)
    if backend:
        model, answer = _run_remote(backend, args, messages, out, thoughts)
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

    path = resolve_model_path(args.model, settings)
    # One request at a time here, so the cache only needs room for one sequence.
    config = EngineConfig(max_model_len=args.max_model_len or settings.context_length, max_num_seqs=1)
    engine = Engine.load(str(path), config)
    chunks = local_chunks(engine, messages, sampling_options(args), chat_options(args))
    return path.name, _consume_closing(chunks, out, thoughts)


def _run_remote(url: str, args: argparse.Namespace, messages: list[dict[str, str]],
                out: TextIO | None, thoughts: TextIO | None) -> tuple[str, Answer]:
    with ChatClient(url, api_key_of(args)) as client:
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
