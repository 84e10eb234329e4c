"""One file of a Hub repo into the Hugging Face cache, resumable across pauses and restarts.

huggingface_hub 2.4 downloads each file into a process-unique ``<etag>.<random>.incomplete`` that it
deletes when the download fails, so a pause or a crash loses the partial bytes. Hearth therefore
drives the library's own building blocks itself, with a stable partial file:

1. ``get_hf_file_metadata`` (HEAD /resolve) -> ETag, size, final URL;
2. ``http_get`` streams into ``blobs/<etag>.incomplete``, starting with ``Range: bytes=<size>-`` when
   that file already holds data (http_get also reconnects by itself after short network drops);
3. the complete file is renamed to ``blobs/<etag>`` and linked as ``snapshots/<commit>/<filename>``
   (a relative symlink, as the library makes them; a move where symlinks are not allowed).

Nothing the network sends may name a path: ETags, commit hashes and repo file names become file
names here, so ``RepoCache`` accepts only the shapes the Hub uses (hex ETags and commits, relative
file names without ``..``) and raises ``UnsafeNameError`` for anything else, before any file is
touched. The link is made here rather than by ``hf_hub_download``, which would ask the server for
the ETag a second time and trust that answer.

All HTTP is the library's (same endpoint, proxies, certificates, headers). A worker stops at the next
chunk when its ``stop`` event is set (``TransferStopped``), leaving the partial file for a resume.
Xet-backed files are fetched over the plain HTTP route too (the library's fallback without hf_xet).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import filelock
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from hearth.app.hub.errors import HubError

HASH_BLOCK_BYTES = 8 * 1024 * 1024
# The Hub names blobs by the git object id (40 hex) or the LFS sha256 (64 hex), commits by 40 hex.
_ETAG = re.compile(r"[0-9a-fA-F]{40}|[0-9a-fA-F]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class TransferStopped(Exception):
    """A pause or cancel request reached a worker; partial files are kept."""


class UnsafeNameError(HubError):
    """The Hub (or a mirror) sent an ETag, commit or file name that is not a safe file name."""


class RepoCache:
    """Paths of one model repo inside the HF cache (``models--org--name``). Every name that came
    from the network is checked here (see the module docstring)."""

    def __init__(self, cache_dir: Path, repo_id: str) -> None:
        self.cache_dir = cache_dir
        self.repo_id = repo_id
        self.folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")

    def blob(self, etag: str) -> Path:
        return self.folder / "blobs" / self._etag(etag)

    def partial(self, etag: str) -> Path:
        return self.folder / "blobs" / f"{self._etag(etag)}.incomplete"

    def snapshot(self, commit: str) -> Path:
        if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
            raise self._unsafe("commit hash", commit)
        return self.folder / "snapshots" / commit

    def pointer(self, commit: str, filename: str) -> Path:
        snapshot = self.snapshot(commit)
        parts = filename.split("/") if isinstance(filename, str) else []
        unsafe = (not parts or "\\" in filename or "\0" in filename or filename.startswith("/")
                  or any(part in ("", ".", "..") or ":" in part for part in parts))
        pointer = snapshot.joinpath(*parts)
        if unsafe or os.path.commonpath([os.path.abspath(snapshot), os.path.abspath(pointer)]) != \
                os.path.abspath(snapshot):
            raise self._unsafe("file name", filename)
        return pointer

    def lock(self, etag: str) -> Path:
        return self.cache_dir / ".locks" / self.folder.name / f"{self._etag(etag)}.hearth.lock"

    def _etag(self, etag: str) -> str:
        if not isinstance(etag, str) or not _ETAG.fullmatch(etag):
            raise self._unsafe("ETag", etag)
        return etag.lower()

    def _unsafe(self, what: str, value: object) -> UnsafeNameError:
        shown = ascii(value)[:120]  # one printable line, whatever the server sent
        return UnsafeNameError(f"{self.repo_id}: the Hub sent an unsafe {what} {shown}; refusing to use it "
                               "as a file name (nothing was written). Is the endpoint a trusted Hub or mirror?")


class QuietTqdm(hf_tqdm):
    """The library's progress bars, always disabled: Hearth reports progress through its events."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class _ObservedFile:
    """The partial file as http_get sees it: reports its size after each write, obeys ``stop``."""

    def __init__(self, raw: BinaryIO, stop: threading.Event, on_size: Callable[[int], None]) -> None:
        self._raw = raw
        self._stop = stop
        self._on_size = on_size

    def write(self, data: bytes) -> int:
        if self._stop.is_set():
            raise TransferStopped()
        written = self._raw.write(data)
        self._on_size(self._raw.tell())
        return written

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def truncate(self, size: int | None = None) -> int:
        result = self._raw.truncate(size)
        self._on_size(self._raw.tell() if size is None else size)
        return result

    def flush(self) -> None:
        self._raw.flush()


def open_partial(path: Path) -> BinaryIO:
    """Open (or create) a partial file positioned at its end. Tests replace this to inject faults."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 - closed by the caller
    raw.seek(0, os.SEEK_END)
    return raw


def fetch_file(*, cache: RepoCache, filename: str, commit: str, endpoint: str, stop: threading.Event,
               on_size: Callable[[int], None]) -> Path:
    """Make ``snapshots/<commit>/<filename>`` present; returns that path. See the module docstring."""
    pointer = cache.pointer(commit, filename)
    if pointer.exists():
        return pointer
    if stop.is_set():
        raise TransferStopped()
    url = hf_hub_url(cache.repo_id, filename, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint, library_name="hearth")
    if meta.etag is None:
        raise HubError(f"{cache.repo_id}/{filename}: the server sent no ETag; is the endpoint a Hub?")
    if not cache.blob(meta.etag).exists():
        # The library's non-Xet route: follow the redirect it resolved, or the /resolve URL for Xet files.
        source = meta.location if meta.xet_file_data is None else url
        _download_blob(cache, meta.etag, source, meta.size, endpoint, stop, on_size)
    _link(cache.blob(meta.etag), pointer)
    return pointer


def _link(blob: Path, pointer: Path) -> None:
    """``pointer`` -> ``blob`` as a relative symlink (the cache stays movable); a move where the
    file system or OS refuses symlinks."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except FileExistsError:
        pass  # another worker linked the same file
    except OSError:
        os.replace(blob, pointer)


def _download_blob(cache: RepoCache, etag: str, url: str, size: int | None, endpoint: str,
                   stop: threading.Event, on_size: Callable[[int], None]) -> None:
    partial = cache.partial(etag)
    cache.lock(etag).parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(cache.lock(etag)), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise HubError(f"{cache.repo_id}: another Hearth process is downloading the same file") from exc
    try:
        with open_partial(partial) as raw:
            resume = raw.tell()
            if size is not None and resume > size:  # longer than the file: not ours to trust
                raw.seek(0)
                raw.truncate()
                resume = 0
            on_size(resume)
            # The token goes to the Hub host only, never to a CDN the Hub redirected to.
            same_host = urlsplit(url).netloc == urlsplit(endpoint).netloc
            headers = build_hf_headers(token=None if same_host else False, library_name="hearth")
            http_get(url, _ObservedFile(raw, stop, on_size), resume_size=resume, headers=headers,
                     expected_size=size, displayed_filename=Path(partial).name, tqdm_class=QuietTqdm)
        os.replace(partial, cache.blob(etag))
    finally:
        lock.release()


def sha256_of(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    _hash_into(digest, path, on_bytes)
    return digest.hexdigest()


def git_blob_sha1_of(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The git object id of a file (how the Hub identifies small, non-LFS files)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    _hash_into(digest, path, on_bytes)
    return digest.hexdigest()


def _hash_into(digest: Any, path: Path, on_bytes: Callable[[int], None] | None) -> None:
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            digest.update(block)
            if on_bytes is not None:
                on_bytes(len(block))


def discard(pointer: Path) -> None:
    """Delete a snapshot entry and the blob it points to (a file that failed its checksum)."""
    blob = pointer.resolve()
    pointer.unlink(missing_ok=True)
    if blob != pointer:
        blob.unlink(missing_ok=True)
