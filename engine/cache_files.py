"""Files of the chat caches on disk (``prefix_store``'s page segments, ``tier_store``'s long chats): a
private folder, files written whole or not at all, mode 0600, a use time that orders their LRU, and a
checksummed header at the start of each."""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

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


def header_frame(magic: bytes, header: bytes) -> bytes:
    """The start of a cache file: its magic, the header's length and CRC-32, then the header."""
    return magic + struct.pack("<II", len(header), zlib.crc32(header)) + header


def read_header_frame(file: BinaryIO, magic: bytes, max_len: int, what: str) -> bytes:
    """The header of a file written with ``header_frame`` (the file positioned after it); ValueError
    when the magic, the length or the checksum is wrong. ``what`` names the file kind in the error."""
    prefix = file.read(len(magic) + 8)
    if len(prefix) < len(magic) + 8 or prefix[:len(magic)] != magic:
        raise ValueError(f"not a Hearth {what} file")
    header_len, header_crc = struct.unpack_from("<II", prefix, len(magic))
    if header_len > max_len:
        raise ValueError("header too long")
    header = file.read(header_len)
    if len(header) != header_len or zlib.crc32(header) != header_crc:
        raise ValueError("header checksum mismatch")
    return header
