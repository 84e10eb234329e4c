"""The headless CLI: the one-shot form and ``run`` (in-process and with ``--backend``), one-line
errors for broken models, ``stats``, the ``hearth`` entry point, and the chat REPL driven through
a pseudo-terminal (streaming, /stats, /reset, Ctrl-C during an answer, /exit)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hearth.app import main as hearth_main
from hearth.app.cli.chat import ChatSession, Repl
from hearth.app.cli.common import sampling_options
from hearth.app.cli.main import build_parser
from hearth.app.cli.main import main as cli
from hearth.app.client import ChatClient
from hearth.app.client.local_engine import STATE_FILE
from hearth.app.store.settings import Settings, save_settings
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import FakeSession, Terminal, broken_copies, feed_input, hearth_cmd, run_hearth
from tests.engine.test_server_support import start_server

KEY = "cli-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny-v32", "deepseek_v32", seed=7)


@pytest.fixture(scope="module")
def broken(model_dir, tmp_path_factory):
    return broken_copies(model_dir, tmp_path_factory.mktemp("broken"))


@pytest.fixture(scope="module")
def backend(model_dir, tmp_path_factory):
    """A second engine host, reached only through --backend URL."""
    running = start_server(model_dir, tmp_path_factory.mktemp("cli-backend"), api_key=KEY)
    yield running
    running.stop()


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_one_shot_form_streams_the_answer_and_the_speed(model_dir):
    result = run_hearth("--model", str(model_dir), "--prompt", "Hello", "--max-tokens", "12",
                        "--temperature", "0.8", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr and "first token after" in result.stderr


def test_run_reads_stdin_and_prints_json(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", _Piped("Hello from a pipe"))
    assert cli(["run", "--model", str(model_dir), "--max-tokens", "4", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-v32" and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 4 and out["text"]


@pytest.mark.parametrize(("defect", "words"), [
    ("truncated", "not a valid safetensors file"), ("missing_shard", "is missing"),
    ("wrong_shape", "has shape"), ("unknown_type", "unsupported model_type 'llama'"),
])
def test_broken_models_fail_with_one_clear_line(broken, defect, words, capsys):
    assert cli(["--model", str(broken[defect]), "--prompt", "hi"]) == 1
    assert words in _one_error_line(capsys.readouterr().err)


@pytest.mark.slow
def test_broken_model_in_a_real_process_has_no_traceback(broken):
    result = run_hearth("--model", str(broken["truncated"]), "--prompt", "hi")
    assert result.returncode == 1
    assert "not a valid safetensors file" in _one_error_line(result.stderr)


def test_missing_model_prompt_too_long_and_no_model(model_dir, tmp_path, capsys):
    assert cli(["run", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 1
    assert "no such model folder" in _one_error_line(capsys.readouterr().err)
    assert cli(["run", "--model", str(model_dir), "--max-model-len", "64", "--prompt", "word " * 100]) == 1
    assert "the context holds 64" in _one_error_line(capsys.readouterr().err)
    # Nothing installed and no default: the bundled demo model answers, with a one-line note.
    assert cli(["run", "--prompt", "The", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "bundled tiny demo model" in captured.err
    assert cli(["run", "--model", "demo", "--prompt", "The", "--max-tokens", "4"]) == 0


def test_backend_url_gives_the_same_greedy_answer(model_dir, backend, capsys):
    args = ["--max-tokens", "8", "--temperature", "0", "--prompt", "Hello", "--json"]
    assert cli(["run", "--model", str(model_dir), *args]) == 0
    local = json.loads(capsys.readouterr().out)
    assert cli(["run", "--backend", backend.base_url + "/v1", "--api-key", KEY, *args]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote["model"] == "tiny-v32" and remote["text"] == local["text"]
    assert remote["usage"] == local["usage"]


def test_settings_backend_url_and_stats(backend, monkeypatch, capsys):
    save_settings(Settings(backend_url=backend.base_url))
    monkeypatch.setenv("HEARTH_API_KEY", KEY)
    assert cli(["run", "--prompt", "Hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-v32"
    assert cli(["stats"]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "chat cache " in out and " chats, " in out


def test_the_key_stored_with_the_backend_url_goes_to_that_backend_only(backend, monkeypatch, capsys):
    """The app's Settings keep the backend's API key beside the settings file: run, chat and stats send it to
    the settings' backend_url without --api-key, and never to a --backend naming another server."""
    monkeypatch.delenv("HEARTH_API_KEY", raising=False)
    save_settings(Settings(backend_url=backend.base_url, backend_api_key=KEY))
    assert cli(["run", "--prompt", "Hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-v32"
    # the same server under another spelling of its address is "another server": the stored key stays home
    other = backend.base_url.replace("127.0.0.1", "localhost")
    assert cli(["run", "--backend", other, "--prompt", "Hi", "--max-tokens", "3"]) == 1
    assert "API key" in _one_error_line(capsys.readouterr().err)


def test_stats_show_the_warm_up_when_the_engine_ran_one():
    from hearth.app.cli.serve import format_stats

    assert "warm-up    1.23 s at start" in format_stats({"model": "m", "state": "ready", "warm_up_s": 1.234})
    assert "warm-up" not in format_stats({"model": "m", "state": "ready"})


def test_unreachable_backend_is_one_line(capsys):
    assert cli(["run", "--backend", "http://127.0.0.1:9", "--model", "x", "--prompt", "hi"]) == 1
    assert "cannot connect to http://127.0.0.1:9" in _one_error_line(capsys.readouterr().err)


def test_stats_without_an_engine_says_so_and_succeeds(capsys):
    assert cli(["stats"]) == 0  # nothing running is an answer, not an error
    assert capsys.readouterr().out.startswith("No local engine is running (`hearth --cli serve`")
    assert cli(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


@pytest.mark.slow
def test_serve_runs_the_engine_host_until_interrupted(model_dir):
    proc = subprocess.Popen(hearth_cmd("serve", "--model", str(model_dir), "--port", "0", "--max-model-len", "256"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stderr.readline()  # blocks until the server listens (or exits)
        match = re.search(r"tiny-v32 on (http://127.0.0.1:\d+/v1)", banner)
        assert match, banner + proc.stderr.read()
        with ChatClient(match.group(1)) as client:
            assert client.models() == ["tiny-v32"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_hearth_entry_point_forwards_cli_and_reports_a_missing_gui(monkeypatch, capsys, tmp_path):
    assert hearth_main.main(["--cli", "run", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 1
    monkeypatch.setitem(sys.modules, "hearth.app.gui.main", None)  # as if the GUI were not installed
    assert hearth_main.main(["--screenshot", str(tmp_path / "shot.png")]) == 2
    err = capsys.readouterr().err
    assert "desktop app is not part of this installation" in err and len(err.strip().splitlines()) == 2


@pytest.mark.slow
def test_chat_repl_in_a_terminal(model_dir, isolated_home):
    argv = hearth_cmd("chat", "--model", str(model_dir), "--max-tokens", "400", "--temperature", "0",
                      "--max-model-len", "512")
    term = Terminal(argv, {**os.environ, "TERM": "dumb"})
    try:
        term.expect(r"Chatting with tiny-v32", timeout=90)
        _say(term, "Hello there")
        answer = term.expect(r"\[\d+ tokens", timeout=60)
        assert len(answer.split("Hello there", 1)[-1].strip()) > 5  # streamed text before the speed line
        state = json.loads((isolated_home / "run" / STATE_FILE).read_text())

        _say(term, "/stats")
        term.expect(r"requests\s+\d+ running")
        _say(term, "/reset")
        term.expect(r"Conversation cleared")
        _say(term, "/system Be brief.")
        term.expect(r"System prompt set")

        _say(term, "Tell me more")
        term.expect(r"Tell me more\r?\n")
        term.expect(r"\S")  # the answer has started
        term.send("\x03")
        term.expect(r"\[stopped\]", timeout=30)
        _wait_engine_idle(term)  # still alive, and the stopped request leaves the engine
        term.expect(r"> ")
        # NOTE: input() prints the prompt before it starts waiting; a SIGINT in between is only
        # noticed with the next key (CPython), and nothing observable marks that moment, so settle.
        time.sleep(0.3)
        term.send("\x03")  # one Ctrl-C at the prompt only warns
        term.expect(r"press Ctrl-C again")
        _say(term, "/exit")
        assert term.wait(30) == 0
    finally:
        term.close()
        _stop_recorded_engine(isolated_home)
    assert not (isolated_home / "run" / STATE_FILE).exists()  # the chat stopped the engine it started
    assert not _pid_alive(state["pid"])


def _say(term: Terminal, line: str) -> None:
    """Wait for the prompt, then type a line (typing ahead would race with the echo)."""
    term.expect(r"> ")
    term.send(line + "\r")


def _wait_engine_idle(term: Terminal, timeout: float = 10.0) -> None:
    """Ask /stats until the engine reports nothing running (the server aborts asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        _say(term, "/stats")
        if re.search(r"0 running, 0 waiting", term.expect(r"requests\s+\d+ running, \d+ waiting")):
            return
        assert time.monotonic() < deadline, "the stopped request is still in the engine"


def test_repl_keeps_history_and_applies_system_and_reset(monkeypatch, capsys):
    session = FakeSession()
    feed_input(monkeypatch, "first", "/system Be brief.", "second", "/reset", "third", "/nope", "/exit")
    assert Repl(session, None, {}).run() == 0
    first, second, third = session.sent
    assert first == [{"role": "user", "content": "first"}]
    assert second == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                      {"role": "assistant", "content": "ok 1"}, {"role": "user", "content": "second"}]
    assert third == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "third"}]
    captured = capsys.readouterr()
    assert "ok 3" in captured.out and "unknown command /nope" in captured.err


def test_repl_quits_on_two_ctrl_c_at_the_prompt_or_ctrl_d(monkeypatch):
    feed_input(monkeypatch, KeyboardInterrupt, "hello", KeyboardInterrupt, KeyboardInterrupt)
    session = FakeSession()
    assert Repl(session, None, {}).run() == 0
    assert len(session.sent) == 1  # a Ctrl-C followed by a line does not quit
    feed_input(monkeypatch, EOFError)
    assert Repl(FakeSession(), None, {}).run() == 0


def test_chat_with_a_backend_url(backend, monkeypatch, capsys):
    args = build_parser().parse_args(["chat", "--backend", backend.base_url, "--api-key", KEY,
                                      "--max-tokens", "5", "--temperature", "0"])
    session = ChatSession.open(args, Settings(), sys.stderr)
    assert session.model == "tiny-v32" and session.proc is None
    feed_input(monkeypatch, "Hello", "/stats", "/exit")
    try:
        assert Repl(session, None, sampling_options(args)).run() == 0
    finally:
        session.close()
    captured = capsys.readouterr()
    assert "[5 tokens" in captured.err and "requests" in captured.err  # stdout holds only the answers
    assert "requests" not in captured.out


def _stop_recorded_engine(home) -> None:
    """After a failed chat test, do not leave its engine host running."""
    state_file = home / "run" / STATE_FILE
    if state_file.exists():
        pid = json.loads(state_file.read_text())["pid"]
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        state_file.unlink()


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _Piped:
    """Stands in for a piped stdin."""

    def __init__(self, text: str) -> None:
        self._text = text

    def isatty(self) -> bool:
        return False

    def read(self) -> str:
        return self._text


def test_stats_show_parked_long_chats_when_the_engine_parks_tiers():
    from hearth.app.cli.serve import format_stats

    out = format_stats({"model": "m", "state": "ready", "tier_cache_chats": 2.0, "tier_cache_bytes": 3 * 2**30,
                        "tier_cache_hits_tokens": 4096.0})
    assert "long chats 2 parked, 3.00 GiB in RAM, 4096 prompt tokens reused" in out
    assert "long chats" not in format_stats({"model": "m", "state": "ready"})
    on_disk = format_stats({"model": "m", "state": "ready", "tier_cache_chats": 1.0, "tier_cache_bytes": 2**30,
                            "tier_cache_disk_chats": 3.0, "tier_cache_disk_bytes": 5 * 2**29,
                            "tier_cache_hits_tokens": 0.0})
    assert "long chats 1 parked, 1.00 GiB in RAM, 3 on disk 2.50 GiB, 0 prompt tokens reused" in on_disk
