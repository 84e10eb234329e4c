"""Hearth's two small JSON state files under the data folder, safe to share between processes.

``models.json`` (the registry): repos whose download finished and passed verification
(``ready``), and local folders imported by name (``imported``).
``downloads.json`` (the queue): every unfinished download, so it survives a restart.

Each change is read-modify-write under a file lock, written atomically, so the GUI and a CLI
``pull`` running at the same time do not lose each other's entries.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import filelock

from hearth.app.paths import PRIVATE_FILE_MODE
from hearth.app.store.settings import write_json_atomic

logger = logging.getLogger(__name__)


class StateFile:
    """A JSON object on disk with locked updates. A corrupt file is set aside and read as empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = filelock.FileLock(str(path.with_name(path.name + ".lock")), mode=PRIVATE_FILE_MODE)

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except ValueError:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            self.path.replace(aside)
            logger.warning("%s was not valid JSON; moved it to %s", self.path, aside)
            return {}
        return data if isinstance(data, dict) else {}

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to the current contents and write the result; returns it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = self.read()
            change(data)
            write_json_atomic(self.path, data)
        return data


class Registry:
    """Ready downloads (by repo id) and imported folders (by name)."""

    def __init__(self, path: Path) -> None:
        self._file = StateFile(path)

    def ready(self) -> dict[str, dict[str, Any]]:
        return dict(self._file.read().get("ready", {}))

    def imported(self) -> dict[str, str]:
        return dict(self._file.read().get("imported", {}))

    def mark_ready(self, repo_id: str, *, commit: str, revision: str, num_files: int,
                   size_bytes: int) -> None:
        entry = {"commit": commit, "revision": revision, "num_files": num_files,
                 "size_bytes": size_bytes, "verified_at": time.time()}
        self._file.update(lambda d: d.setdefault("ready", {}).__setitem__(repo_id, entry))

    def unmark_ready(self, repo_id: str) -> None:
        self._file.update(lambda d: d.setdefault("ready", {}).pop(repo_id, None))

    def add_import(self, name: str, path: Path) -> None:
        self._file.update(lambda d: d.setdefault("imported", {}).__setitem__(name, str(path)))

    def remove_import(self, name: str) -> bool:
        removed: list[bool] = []
        self._file.update(lambda d: removed.append(d.setdefault("imported", {}).pop(name, None) is not None))
        return removed[0]


class QueueFile:
    """The persisted download queue: item dicts by item id (see ``DownloadItem.to_json``)."""

    def __init__(self, path: Path) -> None:
        self._file = StateFile(path)

    def load(self) -> dict[str, dict[str, Any]]:
        return dict(self._file.read().get("items", {}))

    def put(self, item_id: str, item: dict[str, Any]) -> None:
        self._file.update(lambda d: d.setdefault("items", {}).__setitem__(item_id, item))

    def remove(self, item_id: str) -> None:
        self._file.update(lambda d: d.setdefault("items", {}).pop(item_id, None))

    def unfinished(self, repo_id: str) -> list[dict[str, Any]]:
        """The repo's entries that pulling again would continue: a plan was made (so files may be
        here) and no failure ended it for good (``DownloadItem.is_resumable``)."""
        return [item for item in self.load().values() if item.get("repo_id") == repo_id
                and item.get("commit") is not None and item.get("is_resumable", True)]

    def remove_repo(self, repo_id: str) -> int:
        """Forget every entry of ``repo_id``; returns how many there were."""
        removed: list[str] = []

        def change(data: dict[str, Any]) -> None:
            items = data.setdefault("items", {})
            removed.extend(k for k, v in items.items() if v.get("repo_id") == repo_id)
            for key in removed:
                del items[key]

        self._file.update(change)
        return len(removed)
