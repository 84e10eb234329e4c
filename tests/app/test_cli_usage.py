"""The CLI as people type it: ``run`` with the prompt as words (and piped stdin joined after it),
each command's own usage for a wrong argument, ``--version``, context lengths refused or capped with a
note, ``serve``'s port checked before the model loads, models named as the user knows them (a
download's repo id, "demo"), and ``chat`` fed from a pipe (no prompt, \"\"\" blocks, /clear, /bye)."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from hearth.app.cli.chat import ChatSession, Repl
from hearth.app.cli.main import build_parser
from hearth.app.cli.main import main as cli
from hearth.app.store.settings import Settings
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import FakeSession, fake_openai_server, feed_input, install_download, run_hearth

REPO = "hearth-test/tiny-v32"
COMMIT = "c0ffee" + "0" * 34
TINY_LIMIT = 2048  # max_position_embeddings of engine.testing.tiny's models


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("usage") / "tiny-v32", "deepseek_v32", seed=7)


@pytest.fixture
def downloaded(model_dir, tmp_path):
    """The tiny model as the only installed model: a verified download of REPO in the HF cache."""
    return install_download(model_dir, tmp_path / "hf-cache", REPO, COMMIT)


# ---- run: the prompt ---------------------------------------------------------------------------


def test_run_takes_the_prompt_as_words(capsys):
    received: list[dict] = []
    with fake_openai_server(received) as url:
        assert cli(["run", "--backend", url, "-m", "other-model", "hi", "there"]) == 0
        assert cli(["run", "hello", "--backend", url, "-m", "other-model", "--json"]) == 0
    assert [r["messages"][-1]["content"] for r in received] == ["hi there", "hello"]
    out = capsys.readouterr().out
    assert out.startswith("echo: hi there\n") and json.loads(out.split("\n", 1)[1])["text"] == "echo: hello"


def test_run_puts_piped_stdin_after_the_prompt():
    received: list[dict] = []
    with fake_openai_server(received) as url:
        words = run_hearth("run", "--backend", url, "-m", "other-model", "review", "this", stdin="def f(): pass\n")
        flag = run_hearth("run", "--backend", url, "-m", "other-model", "-p", "review", stdin="x = 1\n")
        only = run_hearth("run", "--backend", url, "-m", "other-model", stdin="just stdin\n")
    assert (words.returncode, flag.returncode, only.returncode) == (0, 0, 0), words.stderr + flag.stderr
    assert [r["messages"][-1]["content"] for r in received] == [
        "review this\n\ndef f(): pass\n", "review\n\nx = 1\n", "just stdin\n"]


def test_run_refuses_words_and_a_prompt_flag_together(capsys):
    assert cli(["run", "hi", "--prompt", "there", "--backend", "http://127.0.0.1:9", "-m", "x"]) == 1
    assert capsys.readouterr().err.strip() == "error: give the prompt as words after `run` or with --prompt, not both"


# ---- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "usage", "words"), [
    (["pull", "org/model", "--bogus"], "usage: hearth --cli pull", "unrecognized arguments: --bogus"),
    (["config", "set", "theme", "dark", "extra"], "usage: hearth --cli config set", "unrecognized arguments: extra"),
    (["run", "--max-model-len", "0", "hi"], "usage: hearth --cli run",
     "argument --max-model-len: the context must hold at least 2 tokens, not 0"),
    (["chat", "--max-model-len", "-5"], "usage: hearth --cli chat", "at least 2 tokens, not -5"),
    (["serve", "--port", "70000"], "usage: hearth --cli serve", "argument --port: a port is 0 (any free one) to "
     "65535, not 70000"),
])
def test_a_wrong_argument_shows_its_commands_usage(argv, usage, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(usage) and words in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("hearth 0.")
    from hearth.app.main import main as hearth

    assert hearth(["--version"]) == 0 and capsys.readouterr().out.startswith("hearth 0.")  # (no --cli: no Qt)


def test_a_context_beyond_the_model_is_capped_with_a_note(model_dir, capsys):
    assert cli(["run", "--model", str(model_dir), "--max-model-len", "1000000", "--max-tokens", "1", "hi"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("note: --max-model-len 1000000 is more than this model holds; using its limit, "
                      f"{TINY_LIMIT} tokens")
    assert cli(["run", "--model", str(model_dir), "--max-model-len", "512", "--max-tokens", "1", "hi"]) == 0
    assert "note:" not in capsys.readouterr().err


# ---- names: what run, chat and serve call a model ------------------------------------------------


def test_run_names_a_download_by_its_repo_id(downloaded, capsys):
    assert cli(["run", "--max-tokens", "1", "--json", "hi"]) == 0  # the only installed model
    assert json.loads(capsys.readouterr().out)["model"] == REPO
    assert cli(["run", "-m", "TINY-v32", "--max-tokens", "1", "--json", "hi"]) == 0  # its short name, as given
    assert json.loads(capsys.readouterr().out)["model"] == "TINY-v32"


def test_chat_serves_a_download_under_its_repo_id(downloaded, capsys):
    args = build_parser().parse_args(["chat", "-m", REPO, "--max-model-len", "256"])
    session = ChatSession.open(args, Settings(hf_cache_dir=str(downloaded.parents[2])), sys.stderr)
    try:
        assert (session.model, session.label) == (REPO, REPO)  # the host's id, not the commit hash
        assert session.client.models() == [REPO]
    finally:
        session.close()
    assert capsys.readouterr().err.startswith(f"Starting the engine for {REPO}...")


def test_serve_names_the_model_as_the_user_knows_it(downloaded, monkeypatch):
    import hearth.engine.server.main as server

    seen: list[list[str]] = []
    monkeypatch.setattr(server, "main", lambda argv: seen.append(argv) or 0)
    assert cli(["serve", "-m", "demo", "--port", "0"]) == 0
    assert cli(["serve", "--port", "0"]) == 0  # the only installed model
    assert [argv[argv.index("--served-name") + 1] for argv in seen] == ["demo", REPO]


def test_serve_checks_the_port_before_loading_the_model(model_dir, monkeypatch, capsys):
    import hearth.engine.server.main as server

    loaded: list[list[str]] = []
    monkeypatch.setattr(server, "main", lambda argv: loaded.append(argv) or 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["serve", "--model", str(model_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use") and not loaded


# ---- chat from a pipe, blocks and the Ollama commands -------------------------------------------


def test_chat_fed_from_a_pipe_prints_only_the_answers():
    received: list[dict] = []
    lines = ['hello', '"""', 'line one', 'line two', '"""', '/stats', '/clear', 'again', '/bye', 'never sent']
    with fake_openai_server(received) as url:
        result = run_hearth("chat", "--backend", url, "-m", "other-model", stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["echo: hello", "echo: line one", "line two", "echo: again"]
    assert [[m["content"] for m in r["messages"]] for r in received] == [
        ["hello"], ["hello", "echo: hello", "line one\nline two"], ["again"]]  # /clear forgot the rest
    assert "Conversation cleared." in result.stderr and "does not report statistics" in result.stderr
    assert "unknown command" not in result.stderr and ">" not in result.stdout


def test_repl_blocks_are_messages_never_commands(monkeypatch, capsys):
    session = FakeSession()
    feed_input(monkeypatch, '"""/system is text here', 'and so is this"""', '"""one line"""', '/reset', '"""unclosed',
               EOFError, EOFError)
    assert Repl(session, None, {}).run() == 0
    assert [m[-1]["content"] for m in session.sent] == ["/system is text here\nand so is this", "one line",
                                                        "unclosed"]
    assert len(session.sent[2]) == 1  # /reset still clears
    assert "System prompt" not in capsys.readouterr().err
