"""A thinking model on the command line: a tiny DeepSeek-V3.2 rewired to write fixed reasoning and an
answer. ``run --think`` streams the answer to stdout and the reasoning to stderr after "Thinking:"
(``--hide-thinking`` drops it, ``--json`` carries it); the chat REPL prints it the same way and
does not send it back in later turns."""

from __future__ import annotations

import io
import json

import pytest

from hearth.app.cli.chat import Repl
from hearth.app.cli.main import main as cli
from hearth.app.client import ChatChunk
from hearth.engine.testing.tiny import write_tiny_model
from hearth.engine.text.tokenizer import Tokenizer
from tests.app.cli_support import FakeSession
from tests.engine.scripted_model import rewire

THOUGHT, ANSWER = " the kettle sang", " Mira smiled."
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-thinking")
    tiny = write_tiny_model(root / "tiny", "deepseek_v32", seed=7)
    tokenizer = Tokenizer.from_pretrained(tiny, "deepseek_v32")
    script = [tokenizer.token_to_id("<think>"), *tokenizer.encode(THOUGHT), tokenizer.token_to_id("</think>"),
              *tokenizer.encode(ANSWER), tokenizer.eos_token_ids[0]]
    return rewire(tiny, root / "tiny-thinking", script)


def _run(model_dir, capsys, *extra: str) -> tuple[str, str]:
    assert cli(["run", "--model", str(model_dir), "--prompt", "Hello", "--temperature", "0", "--max-tokens", "30",
                *extra]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_run_prints_the_reasoning_on_stderr_and_the_answer_on_stdout(model_dir, capsys):
    out, err = _run(model_dir, capsys, "--think")
    assert out.strip() == ANSWER.strip()
    assert f"Thinking: {THOUGHT.strip()}\n" in err and "\x1b[" not in err  # not a terminal: no colour codes
    out, err = _run(model_dir, capsys, "--think", "--hide-thinking")
    assert out.strip() == ANSWER.strip() and "Thinking" not in err and THOUGHT.strip() not in err
    out, _ = _run(model_dir, capsys, "--think", "--json")
    data = json.loads(out)
    assert (data["reasoning"], data["text"]) == (THOUGHT.strip(), ANSWER.strip())


def test_without_think_the_model_answers_directly(model_dir, capsys):
    out, err = _run(model_dir, capsys)
    assert out.strip() == ANSWER.strip() and "Thinking" not in err


class _ThinkingSession(FakeSession):
    """Answers every message with reasoning, then the answer; records what the REPL sends."""

    def stream(self, messages, sampling):
        self.sent.append(messages)
        yield ChatChunk("", reasoning="hmm, ")
        yield ChatChunk("", reasoning="a greeting")
        yield ChatChunk(f"ok {len(self.sent)}")
        yield ChatChunk("", "stop", {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})


def test_chat_prints_the_reasoning_and_does_not_send_it_back(monkeypatch):
    lines = ["first", "second", "/exit"]
    monkeypatch.setattr("builtins.input", lambda _prompt="": lines.pop(0))
    session, out, err = _ThinkingSession(), io.StringIO(), io.StringIO()
    assert Repl(session, None, {}, out=out, err=err, thoughts=err).run() == 0
    assert err.getvalue().count("Thinking: hmm, a greeting\n") == 2
    assert "ok 1" in out.getvalue() and "hmm" not in out.getvalue()
    assert session.sent[1][1] == {"role": "assistant", "content": "ok 1"}


def test_chat_hides_the_reasoning_without_a_thoughts_stream(monkeypatch):
    lines = ["first", "/exit"]
    monkeypatch.setattr("builtins.input", lambda _prompt="": lines.pop(0))
    out, err = io.StringIO(), io.StringIO()
    assert Repl(_ThinkingSession(), None, {}, out=out, err=err).run() == 0
    assert "hmm" not in out.getvalue() + err.getvalue()


def test_the_chat_command_takes_the_flags():
    from hearth.app.cli.main import build_parser

    args = build_parser().parse_args(["chat", "--think", "--hide-thinking"])
    assert args.think and args.hide_thinking
