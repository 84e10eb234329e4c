"""Hearth's folders are the owner's only (0700) and the files it writes there are 0600: chats are
covered in test_chats_recovery.py; here the folders, the state files and their locks, and a real
engine host's log and runtime files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hearth.app import paths
from hearth.app.client.local_engine import LOG_FILE, STATE_FILE, EngineProcess
from hearth.app.hub.state import QueueFile, Registry
from hearth.app.store.settings import Settings, save_settings

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
FOLDERS = (paths.config_dir, paths.data_dir, paths.cache_dir, paths.runtime_dir, paths.log_dir)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_folder_is_private_even_one_made_before(isolated_home: Path):
    (isolated_home / "data").mkdir(parents=True)
    os.chmod(isolated_home / "data", 0o755)  # as an older Hearth left it
    assert [_mode(folder()) for folder in FOLDERS] == [0o700] * len(FOLDERS)


def test_state_files_and_their_locks_are_private(isolated_home: Path):
    save_settings(Settings())
    Registry(paths.data_dir() / "models.json").add_import("mine", isolated_home)
    QueueFile(paths.data_dir() / "downloads.json").put("a@main", {"repo_id": "a"})
    written = [paths.settings_path(), *(paths.data_dir() / n for n in ("models.json", "models.json.lock",
                                                                        "downloads.json", "downloads.json.lock"))]
    assert {p.name: _mode(p) for p in written} == {p.name: 0o600 for p in written}


def test_private_file_fixes_an_existing_file(tmp_path: Path):
    path = tmp_path / "log"
    path.write_text("kept")
    os.chmod(path, 0o644)
    assert paths.private_file(path) == path and _mode(path) == 0o600 and path.read_text() == "kept"


def test_the_engine_host_log_and_runtime_files_are_private(isolated_home: Path):
    log = paths.log_dir() / LOG_FILE
    log.write_text("an older run\n")
    os.chmod(log, 0o644)
    host = EngineProcess.ensure_running(None, startup_timeout=120)
    try:
        runtime = [p for p in paths.runtime_dir().iterdir()]
        assert {STATE_FILE, f"{STATE_FILE}.lock"} <= {p.name for p in runtime}
        assert {p.name: _mode(p) for p in runtime} == {p.name: 0o600 for p in runtime}
        assert _mode(log) == 0o600 and log.read_text().startswith("an older run\n")
    finally:
        host.stop()
