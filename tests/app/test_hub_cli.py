"""The CLI's pull / models / rm / search, run in-process through argparse and each ``func``."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub.utils import httpx

from hearth.app.cli import hub_commands
from hearth.app.cli.main import build_parser
from hearth.app.cli.main import main as cli
from hearth.app.hub import catalog
from hearth.app.hub import events as ev
from hearth.app.hub.context import HubContext
from hearth.app.hub.manager import DownloadManager
from hearth.app.hub.state import QueueFile
from hearth.app.hub.transfer import RepoCache
from hearth.app.store.settings import save_settings
from tests.app.cli_support import TerminalStdin, hearth_cmd
from tests.app.conftest import FAST, GATED_REPO, TINY_REPO, add_unloadable_repos
from tests.app.fakehub import FakeHub, Fault


@pytest.fixture(autouse=True)
def fast_pull(monkeypatch):
    monkeypatch.setattr(hub_commands, "PULL_OPTIONS", FAST)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hearth --cli")
    hub_commands.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_pull_then_models_then_rm(settings, fake_hub: FakeHub, capsys):
    assert run(["pull", TINY_REPO]) == 0
    out, err = capsys.readouterr()
    snapshot = RepoCache(Path(settings.hf_cache_dir), TINY_REPO).snapshot("a" * 40)
    assert out.strip() == f"Ready: {TINY_REPO} (262.6 kB, checksums verified) in {snapshot}"
    assert f"Pulling {TINY_REPO} @ aaaaaaaaaa: 3 files" in err and "Traceback" not in err

    assert run(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "ARCH", "SUPPORTED", "STATUS", "PATH"]
    assert table[1].split()[:6] == [TINY_REPO, "262.6", "kB", "deepseek_v3", "yes", "ready"]
    demo_row = table[2].split()
    assert demo_row[0] == "demo" and demo_row[3:7] == ["deepseek_v32", "yes", "bundled", "demo"]
    assert run(["models", "--json"]) == 0
    model, demo = json.loads(capsys.readouterr().out)
    assert model["name"] == TINY_REPO and model["is_supported"] and model["is_ready"]
    assert demo["name"] == "demo" and demo["source"] == "demo" and Path(demo["path"], "config.json").is_file()

    assert run(["rm", TINY_REPO]) == 1  # stdin is not a terminal: needs --yes
    assert "--yes" in capsys.readouterr().err
    assert run(["rm", TINY_REPO, "--yes"]) == 0
    assert capsys.readouterr().out.startswith(f"Deleted {TINY_REPO} (")
    assert run(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == ["NAME", "demo", "No"] and "No models installed" in table[2]


def test_pull_with_patterns_and_revision(settings, fake_hub: FakeHub, capsys):
    assert run(["pull", TINY_REPO, "--include", "*.json", "--exclude", "tokenizer*", "--revision", "a" * 40]) == 0
    assert not fake_hub.file_requests(TINY_REPO, "model.safetensors")
    assert fake_hub.file_requests(TINY_REPO, "config.json") and not fake_hub.file_requests(TINY_REPO, "tokenizer.json")
    assert "1 files" in capsys.readouterr().err


def test_pull_errors_are_one_line(settings, capsys):
    assert run(["pull", GATED_REPO]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "gated" in err and "HF_TOKEN" in err and "Traceback" not in err
    assert run(["pull", "nobody/nothing", "--revision", "main"]) == 1
    assert "not found" in capsys.readouterr().err
    assert run(["rm", "nobody/nothing", "--yes"]) == 1
    assert capsys.readouterr().err.strip() == "error: nobody/nothing is not installed (see `hearth --cli models`)"


def test_ctrl_c_leaves_a_resumable_partial(settings, fake_hub: FakeHub, capsys, monkeypatch):
    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("slow", chunk=16 * 1024, seconds=0.05))
    mid_file = threading.Event()
    real_on_event, real_wait = hub_commands.ProgressPrinter.on_event, DownloadManager.wait

    def on_event(self, event):
        real_on_event(self, event)
        if isinstance(event, ev.DownloadProgress) and event.bytes_done > 20_000:
            mid_file.set()

    def wait(self, item_id, timeout=None):
        if timeout is None:  # the user's Ctrl-C, once bytes are flowing
            assert mid_file.wait(10)
            raise KeyboardInterrupt
        return real_wait(self, item_id, timeout)

    monkeypatch.setattr(hub_commands.ProgressPrinter, "on_event", on_event)
    monkeypatch.setattr(DownloadManager, "wait", wait)
    assert run(["pull", TINY_REPO]) == 130
    err = capsys.readouterr().err
    assert "Paused:" in err and f"hearth --cli pull {TINY_REPO}` again to resume" in err
    assert "Traceback" not in err

    monkeypatch.setattr(DownloadManager, "wait", real_wait)
    assert run(["pull", TINY_REPO]) == 0
    ranges = [r.headers.get("range") for r in fake_hub.file_requests(TINY_REPO, "model.safetensors")]
    assert ranges[0] is None and ranges[-1] and ranges[-1] != "bytes=0-"


def test_search_table_and_json(settings, capsys):
    assert run(["search", "tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["REPO", "DOWNLOADS", "LIKES", "ARCH", "SUPPORTED", "ACCESS"]
    assert lines[1].split() == [TINY_REPO, "500", "10", "deepseek_v3", "yes", "open"]
    assert run(["search", "", "--sort", "likes", "--json", "--limit", "1"]) == 0
    [first] = json.loads(capsys.readouterr().out)
    assert first["repo_id"] == GATED_REPO and first["gated"]
    assert run(["search", "nothing-matches", "--all"]) == 0
    assert "No models match" in capsys.readouterr().out


def test_offline_pull_and_search_fail_cleanly(settings, fake_hub: FakeHub, capsys):
    save_settings(settings.replace(offline=True))
    assert run(["pull", TINY_REPO]) == 1
    assert run(["search", "x"]) == 1
    assert capsys.readouterr().err.count("Offline mode is on") == 2
    assert run(["models"]) == 0
    assert fake_hub.requests == []


def test_search_on_an_unreachable_hub_fails_at_once(settings, fake_hub: FakeHub, capsys, monkeypatch):
    with socket.socket() as sock:  # a closed port
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    save_settings(settings.replace(hf_endpoint=closed))
    started = time.monotonic()
    assert run(["search", "tiny"]) == 1
    assert time.monotonic() - started < 3  # the library's own retries would take some 23 s
    assert _error(capsys.readouterr().err).startswith(f"error: Search for 'tiny' failed: cannot reach {closed} (")

    class NoAnswer:  # a host that never answers the connection attempt: the probe times out
        def head(self, url: str, timeout: float) -> None:
            raise httpx.ConnectTimeout("timed out")

    save_settings(settings)
    monkeypatch.setattr(catalog, "get_session", NoAnswer)
    assert run(["search", "tiny"]) == 1
    assert "failed: cannot reach" in _error(capsys.readouterr().err)
    assert not [r for r in fake_hub.requests if r.path == "/api/models"]  # no search after it


def test_progress_printer_draws_a_live_line_on_a_tty():
    stream = io.StringIO()
    printer = hub_commands.ProgressPrinter(stream, is_tty=True)
    printer.on_event(ev.DownloadProgress("i", "r", 500, 1000, 2e6, 3.0, ()))
    printer.on_event(ev.DownloadProgress("i", "r", 1000, 1000, 2e6, 0.0, ()))
    printer.end_line()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and " 50.0%" in text and "2.0 MB/s" in text
    plain = io.StringIO()
    periodic = hub_commands.ProgressPrinter(plain, is_tty=False, interval_s=3600)
    for done in (1, 2, 3):
        periodic.on_event(ev.DownloadProgress("i", "r", done, 10, None, None, ()))
    assert len(plain.getvalue().splitlines()) == 1 and "\r" not in plain.getvalue()


# ---- what pull refuses, what a failure leaves, what rm finds ----------------------------------


def test_pull_refuses_what_hearth_cannot_load_and_force_overrides_the_architecture(settings, fake_hub, capsys):
    add_unloadable_repos(fake_hub)
    assert run(["pull", "hearth-test/pickle-only"]) == 1
    captured = capsys.readouterr()
    assert "Ready" not in captured.out and "no .safetensors weights (only .bin files)" in _error(captured.err)
    assert run(["pull", "meta/llama-tiny"]) == 1
    assert "`hearth --cli pull --force meta/llama-tiny`" in _error(capsys.readouterr().err)
    assert run(["models", "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)] == ["demo"]  # nothing installed

    assert run(["pull", "meta/llama-tiny", "--force"]) == 0
    assert capsys.readouterr().out.startswith("Ready: meta/llama-tiny")
    assert run(["models"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "meta/llama-tiny" and row[3:6] == ["llama", "no", "ready"]


def test_models_does_not_offer_a_verified_pull_without_weights(settings, fake_hub, capsys):
    assert run(["pull", TINY_REPO, "--include", "*.json"]) == 0
    capsys.readouterr()
    assert run(["models"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == TINY_REPO and row[3:7] == ["deepseek_v3", "no", "no", "weights"]
    assert run(["models", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)[0]
    assert (model["is_ready"], model["is_supported"], model["has_weights"]) == (False, False, False)


def test_a_failed_pull_leaves_nothing_to_resume(settings, capsys):
    assert run(["pull", "nobody/nothing"]) == 1
    capsys.readouterr()
    assert QueueFile(HubContext.from_settings(settings).queue_path).load() == {}  # no entry left behind
    assert cli(["run", "-m", "nobody/nothing", "-p", "hi"]) == 1
    assert _error(capsys.readouterr().err).startswith(  # not "resume it"
        "error: nobody/nothing is not installed; download it with `hearth --cli pull nobody/nothing` first")
    assert run(["rm", "nobody/nothing", "--yes"]) == 1
    assert _error(capsys.readouterr().err) == "error: nobody/nothing is not installed (see `hearth --cli models`)"


def test_rm_clears_an_unfinished_queue_entry(settings, capsys):
    ctx = HubContext.from_settings(settings)
    old = {"item_id": "nobody/nothing@main", "repo_id": "nobody/nothing", "state": "failed", "commit": None,
           "message": "nobody/nothing was not found"}  # left by an older Hearth
    QueueFile(ctx.queue_path).put(old["item_id"], old)
    manager = DownloadManager(settings, options=FAST)  # not started: the item stays queued, then paused
    manager.pause(manager.enqueue(TINY_REPO))
    assert run(["rm", "nobody/nothing", "--yes"]) == 0
    assert run(["rm", TINY_REPO, "--yes"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "Removed the unfinished download of nobody/nothing (0 B freed).",
        f"Removed the unfinished download of {TINY_REPO} (0 B freed)."]
    assert QueueFile(ctx.queue_path).load() == {}


def test_rm_finds_models_as_run_does(settings, capsys, monkeypatch):
    assert run(["pull", TINY_REPO]) == 0
    capsys.readouterr()
    assert run(["rm", "nothere"]) == 1  # stdin is not a terminal, but there is nothing to confirm
    assert _error(capsys.readouterr().err) == "error: nothere is not installed (see `hearth --cli models`)"
    assert run(["rm", "Demo", "--yes"]) == 1
    assert _error(capsys.readouterr().err) == \
        "error: the bundled demo model is part of Hearth and cannot be removed"
    monkeypatch.setattr("sys.stdin", TerminalStdin())
    answers = iter(["n"])
    monkeypatch.setattr("builtins.input", lambda prompt: print(prompt) or next(answers))
    assert run(["rm", "TINY-deepseek"]) == 1  # the short name, any case; confirmation asked, refused
    assert capsys.readouterr().out.splitlines() == [f"Delete {TINY_REPO} (262.6 kB)? [y/N] ", "Nothing deleted."]
    assert run(["rm", "tiny-deepseek", "--yes"]) == 0
    assert capsys.readouterr().out.startswith(f"Deleted {TINY_REPO} (")
    assert not RepoCache(Path(settings.hf_cache_dir), TINY_REPO).folder.exists()


def test_ctrl_c_before_anything_arrived_says_so(settings, capsys, monkeypatch):
    with socket.socket() as sock:  # a closed port, and retries far apart: Ctrl-C comes during one
        sock.bind(("127.0.0.1", 0))
        save_settings(settings.replace(hf_endpoint=f"http://127.0.0.1:{sock.getsockname()[1]}"))
    slow_retries = dataclasses.replace(FAST, backoff_base_s=60.0, backoff_max_s=60.0)
    monkeypatch.setattr(hub_commands, "PULL_OPTIONS", slow_retries)
    retrying = threading.Event()
    real_on_event, real_wait = hub_commands.ProgressPrinter.on_event, DownloadManager.wait

    def on_event(self, event):
        real_on_event(self, event)
        if isinstance(event, ev.DownloadRetrying):
            retrying.set()

    def wait(self, item_id, timeout=None):
        if timeout is None:  # the user's Ctrl-C, while the plan waits to retry
            assert retrying.wait(10)
            raise KeyboardInterrupt
        return real_wait(self, item_id, timeout)

    monkeypatch.setattr(hub_commands.ProgressPrinter, "on_event", on_event)
    monkeypatch.setattr(DownloadManager, "wait", wait)
    assert run(["pull", TINY_REPO]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("Retry 1 in 60.0s: Cannot reach http://127.0.0.1:")
    assert err[1:] == [f"Stopped: nothing downloaded yet; run `hearth --cli pull {TINY_REPO}` again to start."]


@pytest.mark.parametrize("argv", [["pull", "org/model"], ["rm", "x"], ["models"], ["search", "q"],
                                  ["config", "list"], ["config", "set", "theme", "dark"], ["stats"], ["stop"],
                                  ["serve"], ["run"], ["chat"]])
def test_debug_is_taken_after_the_command_too(argv):
    assert build_parser().parse_args([*argv, "--debug"]).debug
    assert build_parser().parse_args(["--debug", *argv]).debug


def test_debug_shows_the_traceback_without_the_hint(settings, capsys, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(hub_commands, "list_installed", broken)
    assert cli(["models"]) == 1
    assert _error(capsys.readouterr().err) == "error: unexpected RuntimeError: boom (run with --debug for details)"
    assert cli(["models", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "error: unexpected RuntimeError: boom"


def test_debug_output_has_no_file_lock_chatter(settings, isolated_home):
    result = subprocess.run(hearth_cmd("pull", TINY_REPO, "--debug"), capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HEARTH_HOME": str(isolated_home)}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "DEBUG" in result.stderr and "lock" not in result.stderr.lower()


def test_a_closed_output_pipe_ends_quietly(settings, isolated_home):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written (`| head` that exited)
    try:
        result = subprocess.run(hearth_cmd("models"), stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=120, env={**os.environ, "HEARTH_HOME": str(isolated_home)},
                                stdin=subprocess.DEVNULL)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (1, "")


def test_the_hub_library_warnings_show_once(fake_hub: FakeHub, settings, isolated_home):
    fake_hub.add_api_fault("/api/models", Fault("status", status=503))  # the library retries once, and says so
    result = subprocess.run(hearth_cmd("search", "tiny"), capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HEARTH_HOME": str(isolated_home)}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and TINY_REPO in result.stdout, result.stderr
    assert result.stderr.count("HTTP Error 503 thrown while requesting GET") == 1, result.stderr
    assert result.stderr.count("Retrying in") == 1, result.stderr


def _error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]
