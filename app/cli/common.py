"""Pieces the CLI commands share: the common options, model and backend resolution, turning an
answer stream into terminal output with a speed line, and the in-process engine as a chunk stream.

Options are declared twice, on the top-level parser (so the short form ``hearth --cli --model DIR
--prompt ...`` works) and on each subcommand with ``default=SUPPRESS`` (so ``hearth --cli run
--model DIR`` works too, without the subcommand's defaults overwriting values given before it).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from hearth.app.client.openai_client import ChatChunk
from hearth.app.demo_model import DEMO_NAMES, bundled_demo_path
from hearth.app.store.settings import Settings
from hearth.engine.api import HearthError, decode_rate, engine_options, usage

if TYPE_CHECKING:
    from hearth.app.hub.errors import NotInstalledError

API_KEY_ENV = "HEARTH_API_KEY"


def add_common_options(parser: argparse.ArgumentParser, *, sub: bool) -> None:
    """--model, --backend, --api-key, --max-model-len, --no-pull, --debug and the sampling options."""
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {}
    parser.add_argument("--model", "-m", help="model folder, installed name or Hub repo id (one not installed "
                        "is downloaded first when stdin is a terminal; default: the default model in the settings)",
                        **d)
    parser.add_argument("--backend", metavar="URL", help="use this OpenAI-compatible server instead of the "
                        "local engine (default: backend_url in the settings)", **d)
    parser.add_argument("--api-key", help=f"API key for --backend (default: ${API_KEY_ENV})", **d)
    parser.add_argument("--max-model-len", type=context_length, metavar="N",
                        help="context length for the local engine (default: max_model_len in the settings)", **d)
    parser.add_argument("--max-tokens", type=int, metavar="N", help="answer length limit (default: the context)", **d)
    parser.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: the model's)", **d)
    parser.add_argument("--top-p", type=float, metavar="P", **d)
    parser.add_argument("--top-k", type=int, metavar="K", **d)
    parser.add_argument("--seed", type=int, metavar="S", help="make sampling reproducible", **d)
    parser.add_argument("--system", metavar="TEXT", help="system prompt", **d)
    parser.add_argument("--think", action="store_true", help="ask the model to reason before it answers "
                        "(the chat template's thinking switch; gpt-oss always reasons)", **d)
    parser.add_argument("--hide-thinking", action="store_true", help="do not print the model's reasoning "
                        "(by default it goes to stderr, dimmed, after \"Thinking:\")", **d)
    add_no_pull_option(parser, sub=sub)
    add_debug_option(parser, sub=sub)


def add_no_pull_option(parser: argparse.ArgumentParser, *, sub: bool = True) -> None:
    """--no-pull: a Hub repo id given to --model that is not installed is an error, not a download."""
    parser.add_argument("--no-pull", action="store_true", help="fail instead of downloading a Hub repo id given to "
                        "--model that is not installed (without it, the download happens only when stdin is a "
                        "terminal)", **({"default": argparse.SUPPRESS} if sub else {}))


def add_debug_option(parser: argparse.ArgumentParser, *, sub: bool = True) -> None:
    """--debug, also after a subcommand (``hearth --cli pull REPO --debug``)."""
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs",
                        **({"default": argparse.SUPPRESS} if sub else {}))


def context_length(text: str) -> int:
    """--max-model-len: a whole number of tokens the engine accepts (checked before any model loads)."""
    minimum = next(o.text.minimum for o in engine_options() if o.name == "max_model_len") or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"the context must hold at least {minimum} tokens, not {value}")
    return value


def context_of(args: argparse.Namespace, settings: Settings) -> int:
    """The context length asked for: --max-model-len, else the settings' (0 is refused by the parser)."""
    given = getattr(args, "max_model_len", None)
    return given if given is not None else settings.context_length


def note_context_cap(path: Path, args: argparse.Namespace, err: TextIO) -> None:
    """One line on ``err`` when --max-model-len is more than the model holds (the engine caps it there)."""
    given = getattr(args, "max_model_len", None)
    if given is None:
        return
    from hearth.engine.config import ModelConfig

    try:
        limit = ModelConfig.from_file(path).max_position_embeddings
    except HearthError:  # the load reports what is wrong with the model
        return
    if given > limit:
        print(f"note: --max-model-len {given} is more than this model holds; using its limit, {limit} tokens",
              file=err)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options given on the command line (None = not given)."""
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed}


def chat_options(args: argparse.Namespace) -> dict[str, Any]:
    """Chat-template switches (``chat_template_kwargs``): thinking, under both names templates use."""
    return {"thinking": True, "enable_thinking": True} if getattr(args, "think", False) else {}


def thoughts_stream(args: argparse.Namespace, err: TextIO) -> TextIO | None:
    """Where the reasoning is printed: ``err``, or nowhere with --hide-thinking."""
    return None if getattr(args, "hide_thinking", False) else err


def backend_of(args: argparse.Namespace, settings: Settings) -> str | None:
    return args.backend or settings.backend_url


def api_key_of(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def backend_key_of(args: argparse.Namespace, settings: Settings, url: str) -> str | None:
    """The key for remote backend ``url``: --api-key, else $HEARTH_API_KEY, else the key stored with the
    settings (the app's Settings > backend API key), but only for the settings' own ``backend_url``, so a
    ``--backend`` naming another server never receives it."""
    return api_key_of(args) or (settings.backend_api_key if url == settings.backend_url else None)


@dataclass(frozen=True)
class ResolvedModel:
    """The folder to load, and the name people know it by: the installed name or repo id given (or
    the only installed model's), "demo", or a folder's name. The engine serves it under that name."""

    path: Path
    name: str


MissingModel = Callable[["NotInstalledError"], None]  # raises unless it installed the model


def resolve_model_path(name: str | None, settings: Settings) -> Path:
    """The model folder to load (see ``resolve_model``)."""
    return resolve_model(name, settings).path


def resolve_model(name: str | None, settings: Settings, *, on_missing: MissingModel | None = None) -> ResolvedModel:
    """The model to load: ``name`` (a folder, an installed name, a repo id or its short name), else
    the default model in the settings, else the only installed model, else the bundled demo model.
    Several installed models and no default is an error that lists them. A name that is not
    installed goes to ``on_missing`` (``download_missing``), which may install it."""
    if name:
        return _resolve_named(name, on_missing)
    if settings.default_model:
        return _resolve_named(settings.default_model, on_missing)
    installed = _installed_runnable()
    if len(installed) == 1:
        return ResolvedModel(installed[0].path, installed[0].name)
    if not installed:
        return ResolvedModel(_bundled_demo(explicit=False), "demo")
    names = ", ".join(m.name for m in installed)
    raise HearthError(f"no model given and {len(installed)} are installed ({names}); pass --model NAME or "
                      "set a default with `hearth --cli config set default_model NAME`")


def download_missing(args: argparse.Namespace, settings: Settings) -> MissingModel:
    """``resolve_model``'s ``on_missing`` for run, chat and serve: download a Hub repo id that is not
    installed, as ``pull`` does (see ``autopull``; --no-pull, a stdin that is not a terminal or
    offline mode make it an error instead)."""

    def download(missing: NotInstalledError) -> None:
        from hearth.app.cli.autopull import pull_missing

        pull_missing(missing, settings, no_pull=getattr(args, "no_pull", False), stdin=sys.stdin, err=sys.stderr)

    return download


def _resolve_named(name: str, on_missing: MissingModel | None = None) -> ResolvedModel:
    if is_demo_name(name):
        return ResolvedModel(_bundled_demo(explicit=True), "demo")
    path = Path(name).expanduser()
    if path.is_dir():
        return ResolvedModel(path.resolve(), path.resolve().name)
    if _looks_like_path(name):
        raise HearthError(f"{name}: no such model folder")
    try:
        from hearth.app.hub import NotInstalledError
        from hearth.app.hub import resolve_model as resolve_installed
    except ImportError:  # the Hub manager is optional at run time
        raise HearthError(f"{name}: no such model folder") from None
    try:
        return ResolvedModel(Path(resolve_installed(name)), name.strip())
    except NotInstalledError as missing:
        if on_missing is None or missing.repo_id is None:
            raise
        on_missing(missing)
        return ResolvedModel(Path(resolve_installed(missing.repo_id)), name.strip())


def is_demo_name(name: str) -> bool:
    """``name`` picks the bundled demo model (``--model demo``)."""
    return name.strip().lower() in DEMO_NAMES


def _looks_like_path(name: str) -> bool:
    """A folder the user meant (not an installed name or a repo id like ``org/model``)."""
    return name.startswith((".", "~", os.sep)) or (os.altsep is not None and os.altsep in name) or \
        Path(name).is_absolute() or name.count("/") > 1


def _bundled_demo(explicit: bool) -> Path:
    """The bundled demo model (a tiny DeepSeek-V3.2 trained on Python's docs)."""
    path = bundled_demo_path()
    if path is None:
        raise HearthError("no model given and none installed (and this build has no demo model); pass "
                          "--model DIR or download one with `hearth --cli pull REPO`")
    if not explicit:
        print("note: no model installed; using the bundled tiny demo model (it only imitates English). "
              "Download a real one with `hearth --cli search deepseek` and `hearth --cli pull REPO`.",
              file=sys.stderr)
    return path


def _installed_runnable() -> list[Any]:
    """Installed, verified models of a supported architecture (what the GUI's picker offers)."""
    try:
        from hearth.app.hub import list_installed
    except ImportError:  # the Hub manager is optional at run time
        return []
    return [m for m in list_installed() if m.is_ready and m.is_supported]


def read_prompt(prompt: str | None, stdin: TextIO) -> str:
    """The prompt: TEXT (``--prompt`` or the words after ``run``), stdin for ``--prompt -`` or when
    stdin is not a terminal and no prompt is given, and TEXT, a blank line and stdin when both come
    (``git diff | hearth --cli run "review this"``)."""
    if prompt == "-" or (prompt is None and not stdin.isatty()):
        prompt = stdin.read()
    elif prompt is not None and is_piped(stdin):
        piped = stdin.read()
        if piped.strip():
            prompt = f"{prompt}\n\n{piped}"
    if not prompt or not prompt.strip():
        raise HearthError("no prompt: pass the prompt (`run TEXT` or --prompt TEXT), or pipe it on stdin")
    return prompt


def is_piped(stream: TextIO) -> bool:
    """``stream`` is a pipe or a file (``cmd | hearth``, ``< file``), not a terminal or /dev/null."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stand-in, a closed stream)
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def messages_for(prompt: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


# ---- answers -------------------------------------------------------------------------------


@dataclass
class Answer:
    """What came back, and how fast."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    time_to_first_token_s: float | None = None
    total_time_s: float = 0.0
    chunks: int = 0

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens", self.chunks))

    @property
    def tokens_per_s(self) -> float | None:
        return decode_rate(self.completion_tokens, self.time_to_first_token_s, self.total_time_s)

    def speed_line(self) -> str:
        parts = [f"{self.completion_tokens} tokens"]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.time_to_first_token_s is not None:
            parts.append(f"first token after {self.time_to_first_token_s:.2f} s")
        if self.finish_reason == "length":
            parts.append("stopped at the length limit")
        return "[" + ", ".join(parts) + "]"

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "reasoning": self.reasoning, "finish_reason": self.finish_reason,
                "usage": self.usage, "time_to_first_token_s": self.time_to_first_token_s,
                "tokens_per_s": self.tokens_per_s, "total_time_s": self.total_time_s}


class ThoughtPrinter:
    """Prints reasoning as it streams: "Thinking: " then the text, dimmed on a terminal, and a line
    break once the answer starts (reasoning goes to stderr, so stdout holds only the answer)."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.dim = out.isatty()
        self.open = False

    def write(self, text: str) -> None:
        if not self.open:
            self.out.write((self.DIM if self.dim else "") + "Thinking: ")
            self.open = True
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        if self.open:
            self.out.write((self.RESET if self.dim else "") + "\n")
            self.out.flush()
            self.open = False


def consume(chunks: Iterator[ChatChunk], out: TextIO | None, answer: Answer | None = None,
            thoughts: TextIO | None = None) -> Answer:
    """Read a chunk stream to its end, echoing text to ``out`` and reasoning to ``thoughts`` (see
    ThoughtPrinter) as they come. Pass ``answer`` to keep the partial text when the stream is
    interrupted (KeyboardInterrupt propagates)."""
    answer = answer or Answer()
    printer = ThoughtPrinter(thoughts) if thoughts is not None else None
    start = time.perf_counter()
    try:
        for chunk in chunks:
            if (chunk.text or chunk.reasoning) and answer.time_to_first_token_s is None:
                answer.time_to_first_token_s = time.perf_counter() - start
            if chunk.text or chunk.reasoning:
                answer.chunks += 1
            if chunk.reasoning:
                answer.reasoning += chunk.reasoning
                if printer is not None:
                    printer.write(chunk.reasoning)
            if chunk.text:
                answer.text += chunk.text
                if printer is not None:
                    printer.close()
                if out is not None:
                    out.write(chunk.text)
                    out.flush()
            if chunk.finish_reason is not None or chunk.usage is not None:
                answer.finish_reason = chunk.finish_reason or answer.finish_reason
                answer.usage = chunk.usage or answer.usage
            answer.total_time_s = time.perf_counter() - start
    finally:
        if printer is not None:
            printer.close()
    return answer


def local_chunks(engine: Any, messages: list[dict[str, Any]], options: dict[str, Any],
                 template_options: dict[str, Any] | None = None) -> Iterator[ChatChunk]:
    """The in-process engine's answer as ChatChunks (same shape as a server stream: reasoning split
    from the answer as the server does). ``options`` are the sampling options as given (None = not
    given): the engine fills in the model's defaults; ``template_options`` go to the chat template."""
    from hearth.engine.api import Finished
    from hearth.engine.text.reasoning import PROMPT_TAIL_TOKENS, reasoning_parser_for

    ids = engine.encode(messages, **(template_options or {}))
    new_parser = reasoning_parser_for(engine.model_config.model_type,
                                      engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
    parser = new_parser() if new_parser else None
    for event in engine.generate(prompt_token_ids=ids, sampling=options):
        if isinstance(event, Finished):
            if event.reason not in ("stop", "length"):
                raise HearthError(event.error or f"the answer ended with {event.reason}")
            if parser is not None:
                tail = parser.finish()
                if tail.content or tail.reasoning:
                    yield ChatChunk(tail.content, reasoning=tail.reasoning)
            yield ChatChunk("", event.reason, usage(event.stats))
        elif event.text:
            split = parser.feed(event.text) if parser is not None else None
            if split is None:
                yield ChatChunk(event.text)
            elif split.content or split.reasoning:
                yield ChatChunk(split.content, reasoning=split.reasoning)


def print_json(data: Any, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(json.dumps(data, indent=2) + "\n")
