"""A hostile Hub cannot name a path (ETags, commits and file names stay inside the cache), and
`hearth --cli pull` failures are one line on stderr with exit 1 (`--debug` adds the traceback):
gated, missing and malformed repos in a real subprocess, full disks in-process."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.app.hub import fit, transfer
from hearth.app.hub.state import Registry
from hearth.app.hub.transfer import RepoCache, UnsafeNameError
from tests.app.conftest import FAST, GATED_REPO, tiny_model_files
from tests.app.fakehub import FakeFile, FakeHub, FakeRepo
from tests.app.test_hub_cli import run

COMMIT = "c" * 40


@pytest.fixture(autouse=True)
def fast_pull(monkeypatch):
    from hearth.app.cli import hub_commands

    monkeypatch.setattr(hub_commands, "PULL_OPTIONS", FAST)


def _files_outside(root: Path, *inside: Path) -> set[Path]:
    """Every file under ``root`` that is not under one of ``inside``."""
    return {p for p in root.rglob("*") if p.is_file() and not any(p.is_relative_to(i) for i in inside)}


def _climb_to(target: Path) -> str:
    """A relative path that climbs to ``/`` from any folder and then names ``target``."""
    return "../" * 40 + str(target).lstrip("/")


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines and lines[-1].startswith("error: "), err
    assert all(not line.startswith(("error", "WARNING", "ERROR")) for line in lines[:-1]), err
    return lines[-1]


def test_a_hostile_etag_writes_nothing_outside_the_cache(settings, fake_hub: FakeHub, tmp_path: Path, capsys):
    target = tmp_path / "outside" / "x"
    target.parent.mkdir()
    files = tiny_model_files(seed=3)
    files["model.safetensors"].served_etag = _climb_to(target)
    fake_hub.add_repo(FakeRepo("evil/etag", files, commit=COMMIT))
    before = _files_outside(tmp_path, Path(settings.hf_cache_dir), tmp_path / "hearth-home")

    assert run(["pull", "evil/etag"]) == 1
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert "unsafe ETag" in line and "checksums verified" not in out
    assert not target.exists() and not list(target.parent.iterdir())
    assert _files_outside(tmp_path, Path(settings.hf_cache_dir), tmp_path / "hearth-home") == before
    assert "evil/etag" not in Registry(tmp_path / "hearth-home" / "data" / "models.json").ready()


@pytest.mark.parametrize("name", ["{climb}", "sub\\config.json", "/{abs}"])
def test_a_hostile_file_name_is_refused(settings, fake_hub: FakeHub, tmp_path: Path, capsys, name: str):
    target = tmp_path / "outside" / "evil.json"
    target.parent.mkdir()
    name = name.format(climb=_climb_to(target), abs=str(target).lstrip("/"))
    files = tiny_model_files(seed=4)
    files[name] = FakeFile(name, b'{"evil": true}')
    fake_hub.add_repo(FakeRepo("evil/name", files, commit=COMMIT))

    assert run(["pull", "evil/name"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "evil/name" in line and ("unsafe file name" in line or "Invalid filename" in line)
    assert not target.exists()
    assert not fake_hub.file_requests("evil/name", "model.safetensors")  # refused before any download
    snapshot = RepoCache(Path(settings.hf_cache_dir), "evil/name").snapshot(COMMIT)
    assert not snapshot.exists() or not any(snapshot.iterdir())


@pytest.mark.parametrize("etag", ["../x", "", "abc", "g" * 40, "a" * 63, "a" * 64 + "\n", "/" + "a" * 63])
def test_repo_cache_accepts_only_hex_etags(tmp_path: Path, etag: str):
    cache = RepoCache(tmp_path, "org/name")
    with pytest.raises(UnsafeNameError, match="unsafe ETag"):
        cache.blob(etag)
    with pytest.raises(UnsafeNameError):
        cache.partial(etag)
    with pytest.raises(UnsafeNameError):
        cache.lock(etag)
    assert cache.blob("A" * 64) == cache.folder / "blobs" / ("a" * 64)


@pytest.mark.parametrize("commit", ["../" * 8 + "tmp", "main", "A" * 40, "a" * 39, "a" * 40 + "/.."])
def test_repo_cache_accepts_only_commit_hashes(tmp_path: Path, commit: str):
    with pytest.raises(UnsafeNameError, match="unsafe commit hash"):
        RepoCache(tmp_path, "org/name").snapshot(commit)


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "a\\..\\x", "C:x", "a//b", "./a", "a/", "",
                                  "a\0b"])
def test_repo_cache_accepts_only_relative_file_names(tmp_path: Path, name: str):
    cache = RepoCache(tmp_path, "org/name")
    with pytest.raises(UnsafeNameError, match="unsafe file name"):
        cache.pointer(COMMIT, name)
    assert cache.pointer(COMMIT, "sub/model.safetensors") == cache.snapshot(COMMIT) / "sub" / "model.safetensors"


# ---- one line per failure, in a real `hearth --cli pull` ------------------------------------

def _pull(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home")}  # no login token of this machine
    return subprocess.run([sys.executable, "-m", "hearth.app.main", "--cli", *args], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("repo", "expected"), [
    (GATED_REPO, "is gated"),
    ("nobody/nothing", "was not found"),
    ("bad id!!", "is not a Hub repo id"),
    ("a/b/c", "is not a Hub repo id"),
])
def test_pull_failures_are_one_line_and_exit_1(settings, tmp_path: Path, repo: str, expected: str):
    result = _pull("pull", repo, tmp_path=tmp_path)
    assert result.returncode == 1
    assert expected in _one_error_line(result.stderr)


def test_debug_shows_the_traceback(settings, tmp_path: Path):
    result = _pull("--debug", "pull", "nobody/nothing", tmp_path=tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "RepositoryNotFoundError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: nobody/nothing was not found")


def _no_logged_tracebacks(caplog: pytest.LogCaptureFixture) -> bool:
    """Records that would print a traceback on stderr (WARNING and up with exc_info)."""
    return not [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]


def test_full_disk_before_downloading_is_one_line(settings, fake_hub: FakeHub, capsys, caplog, monkeypatch):
    monkeypatch.setattr(fit, "free_disk_bytes", lambda path: 1000)
    assert run(["pull", "hearth-test/tiny-deepseek"]) == 1
    assert "free some space" in _one_error_line(capsys.readouterr().err)
    assert _no_logged_tracebacks(caplog)


def test_disk_filling_up_mid_download_is_one_line(settings, fake_hub: FakeHub, capsys, caplog, monkeypatch):
    real_open = transfer.open_partial

    class FullDisk:
        def __init__(self, raw):
            self.raw = raw

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.raw.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transfer, "open_partial", lambda path: FullDisk(real_open(path)))
    assert run(["pull", "hearth-test/tiny-deepseek"]) == 1
    assert "disk filled up" in _one_error_line(capsys.readouterr().err)
    assert _no_logged_tracebacks(caplog)


def test_pulls_send_no_telemetry(settings, fake_hub: FakeHub, monkeypatch, capsys):
    """No torch version in the user agent, and no lookup of huggingface_hub's "agent harnesses" list,
    which it fetches from its own default endpoint (huggingface.co), not the mirror the settings name."""
    from huggingface_hub.utils import _headers

    looked_up = []
    monkeypatch.setattr(_headers, "detect_agent", lambda: looked_up.append(1))
    files = tiny_model_files(seed=4)
    fake_hub.add_repo(FakeRepo("quiet/model", files, commit=COMMIT))
    assert run(["pull", "quiet/model"]) == 0, capsys.readouterr().err
    agents = [r.headers.get("user-agent", r.headers.get("User-Agent", "")) for r in fake_hub.requests]
    assert agents and all(a.startswith("hearth/") for a in agents), agents
    assert not any("torch/" in a for a in agents) and not looked_up
