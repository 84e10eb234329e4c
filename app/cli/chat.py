"""``hearth --cli chat``: a terminal chat with streaming answers.

Answers come from the local engine host (started on demand as a background process, reused if
one already serves the model, and stopped on exit if this chat started it; ``--keep-engine``
leaves it running) or, with ``--backend URL`` / ``backend_url`` in the settings, from any
OpenAI-compatible server.

Commands: ``/system TEXT`` sets the system prompt (``/system`` alone clears it), ``/clear`` (or
``/reset``) forgets the conversation, ``/stats`` shows the engine's statistics, ``/help``, ``/bye``
or ``/exit`` (or Ctrl-D). A message of several lines goes between lines of ``\"\"\"`` (as in Ollama).
Ctrl-C stops the answer being written (what was written stays in the conversation); Ctrl-C twice
in a row at the prompt quits. If the local engine dies, the next message restarts it.

With stdin not a terminal (``hearth --cli chat < questions.txt``) no prompt is printed: each line
(or block) is a message, and the answers go to stdout, everything else to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from hearth.app.cli.common import (
    Answer,
    add_common_options,
    backend_key_of,
    backend_of,
    chat_options,
    consume,
    context_of,
    download_missing,
    note_context_cap,
    resolve_model,
    sampling_options,
    thoughts_stream,
)
from hearth.app.cli.serve import format_stats
from hearth.app.client.local_engine import EngineProcess
from hearth.app.client.openai_client import ChatChunk, ChatClient, ClientError, EngineDiedError
from hearth.app.store.settings import Settings, load_settings

BLOCK = '"""'  # a message of several lines starts and ends with it (Ollama's convention)
HELP = ("/system TEXT  set the system prompt (/system alone clears it)\n"
        "/clear        start a new conversation (also /reset)\n"
        "/stats        engine statistics\n"
        "/bye          quit (also /exit, Ctrl-D, or Ctrl-C twice at the prompt)\n"
        f"{BLOCK}         begin and end a message of several lines\n"
        "Ctrl-C while an answer is written stops it.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal",
                                   description="Chat in the terminal with streaming answers (/help lists the "
                                   "chat commands). A Hub repo id given to --model that is not installed is pulled "
                                   "first when stdin is a terminal (--no-pull: fail instead).")
    add_common_options(parser, sub=True)
    parser.add_argument("--keep-engine", action="store_true",
                        help="leave the local engine host running after the chat ends (`hearth --cli stop` "
                        "stops it)")
    parser.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    session = ChatSession.open(args, load_settings(), sys.stderr)
    try:
        options = {**sampling_options(args), "chat_template_kwargs": chat_options(args) or None}
        return Repl(session, args.system, options, thoughts=thoughts_stream(args, sys.stderr)).run()
    finally:
        session.close(keep_engine=getattr(args, "keep_engine", False))


class ChatSession:
    """A client, the model it talks to, and the local engine process behind it (if any)."""

    def __init__(self, client: ChatClient, model: str, proc: EngineProcess | None = None,
                 label: str | None = None) -> None:
        """``model``: the id requests name; ``label``: what the user calls it (default: ``model``)."""
        self.client = client
        self.model = model
        self.proc = proc
        self.label = label or model

    @classmethod
    def open(cls, args: argparse.Namespace, settings: Settings, err: TextIO) -> ChatSession:
        url = backend_of(args, settings)
        if url:
            client = ChatClient(url, backend_key_of(args, settings, url))
            return cls(client, args.model or _first_model(client))
        model = resolve_model(args.model, settings, on_missing=download_missing(args, settings))
        note_context_cap(model.path, args, err)
        print(f"Starting the engine for {model.name}...", file=err, flush=True)
        options: dict[str, Any] = {"max_model_len": context_of(args, settings)}
        running = EngineProcess.find_running()
        if running is None or not running.serves(str(model.path.resolve()), options):
            # A new host serves the model under the user's name; one already serving this folder
            # (the app's, say) is reused as it is rather than restarted for a name.
            options["served_name"] = model.name
        proc = EngineProcess.ensure_running(model.path, **options)
        client = proc.client()
        return cls(client, _first_model(client), proc, label=model.name)

    @property
    def where(self) -> str:
        return "the local engine" if self.proc else self.client.base_url

    def stream(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Iterator[ChatChunk]:
        return self.client.stream_chat(self.model, messages, **sampling)

    def recover(self, error: EngineDiedError) -> str:
        """After the connection dropped: restart a dead local engine; returns what happened."""
        if self.proc is None or self.proc.is_alive():
            return str(error)
        self.proc.restart()
        self.client.close()
        self.client = self.proc.client()
        return "the engine stopped unexpectedly; it has been restarted, so send your message again"

    def close(self, keep_engine: bool = False) -> None:
        self.client.close()
        if self.proc is None or not self.proc.started_here:
            return
        if keep_engine:
            print(f"The engine host keeps running (pid {self.proc.pid}); `hearth --cli stop` stops it.",
                  file=sys.stderr)
        else:
            self.proc.stop()


class Repl:
    """The read-answer loop. ``input()`` reads lines, so readline editing works on terminals."""

    def __init__(self, session: ChatSession, system: str | None, sampling: dict[str, Any],
                 out: TextIO | None = None, err: TextIO | None = None, thoughts: TextIO | None = None) -> None:
        """``thoughts``: where a thinking model's reasoning is printed (None: not shown)."""
        self.session = session
        self.thoughts = thoughts
        self.system = system
        self.sampling = sampling
        self.history: list[dict[str, str]] = []
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def run(self) -> int:
        print(f"Chatting with {self.session.label} ({self.session.where}). /help for commands.", file=self.err)
        while True:
            try:
                read = self._read()
                if read is None:
                    return 0
                text, is_block = read
                if text.startswith("/") and not is_block:
                    if not self._command(text):
                        return 0
                elif text:
                    self._answer(text)
            except KeyboardInterrupt:  # Ctrl-C between prompts (e.g. while /stats prints) is harmless
                self.out.write("\n")

    def _read(self) -> tuple[str, bool] | None:
        """The next message and whether it was a \"\"\" block (never a command); None to quit
        (Ctrl-D, or a second Ctrl-C in a row)."""
        interactive = sys.stdin.isatty()
        line = self._input("> " if interactive else "")
        if line is None or not line.lstrip().startswith(BLOCK):
            return None if line is None else (line.strip(), False)
        lines, rest = [], line.lstrip()[len(BLOCK):]
        while not rest.rstrip().endswith(BLOCK):
            lines.append(rest)
            rest = self._input("... " if interactive else "")
            if rest is None:  # the input ended inside the block: send what came
                return "\n".join(lines).strip(), True
        lines.append(rest.rstrip()[:-len(BLOCK)])
        return "\n".join(lines).strip(), True

    def _input(self, prompt: str) -> str | None:
        """One line; None at the end of the input or after a second Ctrl-C in a row."""
        warned = False
        while True:
            try:
                return input(prompt)
            except EOFError:
                if prompt:  # on a terminal: end the prompt's line
                    self.out.write("\n")
                return None
            except KeyboardInterrupt:
                if warned:
                    self.out.write("\n")
                    return None
                self.out.write("\n(press Ctrl-C again or type /bye to quit)\n")
                warned = True

    def _command(self, line: str) -> bool:
        name, _, rest = line.partition(" ")
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name == "/system":
            self.system = rest.strip() or None
            print("System prompt set." if self.system else "System prompt cleared.", file=self.err)
        elif name in ("/clear", "/reset"):
            self.history.clear()
            print("Conversation cleared.", file=self.err)
        elif name == "/stats":
            self._stats()
        elif name == "/help":
            print(HELP, file=self.err)
        else:
            print(f"unknown command {name}; /help lists them", file=self.err)
        return True

    def _stats(self) -> None:
        try:
            stats = self.session.client.stats()
        except ClientError as err:
            print(f"error: {err}", file=self.err)
            return
        print(format_stats(stats) if stats else "This backend does not report statistics.", file=self.err)

    def _answer(self, text: str) -> None:
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = [*system, *self.history, {"role": "user", "content": text}]
        answer = Answer()
        chunks = self.session.stream(messages, self.sampling)
        try:
            consume(chunks, self.out, answer, self.thoughts)
        except KeyboardInterrupt:
            chunks.close()  # closes the HTTP stream, so the server aborts the request
            self.out.write("\n[stopped]\n")
            self._remember(text, answer)
            return
        except EngineDiedError as err:
            self.out.write("\n")
            print(f"error: {self.session.recover(err)}", file=self.err)
            return
        except ClientError as err:
            self.out.write("\n")
            print(f"error: {err}", file=self.err)
            return
        self.out.write("\n")
        print(answer.speed_line(), file=self.err, flush=True)
        self._remember(text, answer)

    def _remember(self, text: str, answer: Answer) -> None:
        # Only the answer: the releases' templates drop earlier reasoning anyway.
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]


def _first_model(client: ChatClient) -> str:
    models = client.models()
    if not models:
        raise ClientError(f"{client.base_url} serves no model; pass --model NAME")
    return models[0]
