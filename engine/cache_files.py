"""Files of the chat caches on disk (``prefix_store``'s page segments, ``tier_store``'s long chats): a
private folder, files written whole or not at all, mode 0600, and a use time that orders their LRU."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def write_atomically(path: Path, parts: Sequence[bytes | memoryview]) -> None:
    """Write ``parts`` to a temporary file (mode 0600), then rename it to ``path``."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # created 0600
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                out.write(part)
        os.chmod(temp, FILE_MODE)
        touch(Path(temp))
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def private_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) readable by this user only."""
    folder.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if os.name == "posix" and folder.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(folder, DIR_MODE)


def touch(path: Path) -> None:
    """Mark a file used now, so the LRU order survives a restart (an explicit time: the file
    system's own clock may tick only every few milliseconds)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))
