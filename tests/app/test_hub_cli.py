"""The CLI's pull / models / rm / search, run in-process through argparse and each ``func``."""

from __future__ import annotations

import argparse
import io
import json
import threading
from pathlib import Path

import pytest

from hearth.app.cli import hub_commands
from hearth.app.hub import events as ev
from hearth.app.hub.manager import DownloadManager
from hearth.app.hub.transfer import RepoCache
from hearth.app.store.settings import save_settings
from tests.app.conftest import FAST, GATED_REPO, TINY_REPO
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
