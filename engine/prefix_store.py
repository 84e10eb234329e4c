"""The prefix cache's second and third tiers: cached pages the GPU gives up live on in host RAM,
then on disk, and come back when a later prompt starts with them (a conversation's next turn, a
chat the user switched back to, the same chat after the engine host restarted).

A page is named by its chained prefix hash (``hash_block``: the hash of every token up to the end of
the page), so a hit is exact: same tokens, same position, same model, same content.

``PrefixStore`` holds page bytes keyed by that hash: an LRU of host entries bounded by
``host_bytes``; entries pushed out of RAM are written to ``folder`` (when there is one), an LRU of
files bounded by ``disk_bytes``. ``PageTier`` connects it to the device cache for the
``BlockManager``: pages are copied out when the manager evicts them (never inside a forward step) and
copied into free pages when a new request's prefix is found here (at admission).

Files. One file per page, named ``<model key>-<page hash>.page`` (the model key: a hash of the model
folder's path), written atomically (a temporary file, then rename), mode 0600 in a 0700 folder::

    b"HRTHPG01" | sha256 of the rest (32 bytes) | header length (u32 LE) | header JSON | page bytes

The header names the model fingerprint (``fingerprint()``: config, weight file sizes and times,
dtype, page size, cache formats), the page hash and the conversations that used the page. A file
whose checksum, fingerprint, hash or size does not match is deleted and its page recomputed. The
files of other model folders in the same folder count towards the disk budget and are evicted by
the same LRU (least recently used first, by file time across restarts).

Conversations. A request may name its conversation; its pages carry that tag, and
``drop(conversation)`` forgets the conversation's pages in RAM and on disk (a page that other
conversations also used keeps their tags and stays).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.engine.kv_cache import PagedCache

__all__ = ["FORMAT_VERSION", "PageTier", "PrefixStore", "fingerprint", "model_key"]

logger = logging.getLogger("hearth.engine.prefix_store")

FORMAT_VERSION = 1
_MAGIC = b"HRTHPG01"
_DIGEST = 32
_PREFIX = len(_MAGIC) + _DIGEST + 4
_MAX_HEADER = 1 << 20
_SUFFIX = ".page"
_STALE_TEMP_S = 600.0  # a temporary file this old belongs to no writer still running
DIR_MODE = 0o700
FILE_MODE = 0o600


def model_key(checkpoint: str | Path) -> str:
    """A short name of a model folder (its resolved path) for the store's file names."""
    return hashlib.blake2b(str(Path(checkpoint).resolve()).encode(), digest_size=8).hexdigest()


def fingerprint(checkpoint: str | Path, layout: Mapping[str, Any]) -> str:
    """What a page's bytes depend on: the model folder (path, config.json, the weight files' names,
    sizes and modification times: hashing hundreds of GB of weights is not an option) and
    ``layout`` (dtype, page size, cache formats and options that change the math)."""
    folder = Path(checkpoint).resolve()
    digest = hashlib.sha256(f"hearth prefix pages v{FORMAT_VERSION}\n{folder}\n".encode())
    digest.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors*")):
        stat = path.stat()
        digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    digest.update(json.dumps(dict(layout), sort_keys=True, default=str).encode())
    return digest.hexdigest()


@dataclass
class _HostEntry:
    page: torch.Tensor  # uint8 [page_bytes] on the host (pinned on CUDA)
    conversations: set[str]
    ready: torch.cuda.Event | None = None  # the device-to-host copy; wait for it before reading
    on_disk: bool = False  # a file holds these bytes and these conversations

    def data(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.page


@dataclass
class _DiskEntry:
    size: int
    conversations: frozenset[str]


@dataclass
class _Header:
    fingerprint: str
    model_key: str
    block_hash: int
    conversations: frozenset[str]
    payload_bytes: int

    def to_json(self) -> bytes:
        return json.dumps({"fingerprint": self.fingerprint, "model_key": self.model_key,
                           "block_hash": f"{self.block_hash:032x}", "conversations": sorted(self.conversations),
                           "payload_bytes": self.payload_bytes}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> _Header:
        data = json.loads(raw)
        conversations = data["conversations"]
        if not isinstance(conversations, list) or not all(isinstance(c, str) for c in conversations):
            raise ValueError("conversations must be a list of strings")
        return cls(str(data["fingerprint"]), str(data["model_key"]), int(data["block_hash"], 16),
                   frozenset(conversations), int(data["payload_bytes"]))


@dataclass
class StoreCounters:
    """What the store did since it started, for /hearth/stats."""

    pages_spilled: int = 0  # pages copied out of the device cache
    pages_restored: int = 0  # pages copied back into it
    files_written: int = 0
    files_rejected: int = 0  # corrupt or stale files deleted instead of used


class PrefixStore:
    """Page bytes by prefix hash: host RAM first, then files in ``folder`` (see the module doc).

    ``folder`` None keeps pages in RAM only (and forgets those pushed out). ``fingerprint_`` and
    ``key`` identify the model (``fingerprint()`` / ``model_key()``); ``page_bytes`` is the size
    every page has. Not thread-safe: the engine's stepping thread owns it.
    """

    def __init__(self, page_bytes: int, host_bytes: int, *, folder: str | Path | None = None, disk_bytes: int = 0,
                 fingerprint_: str = "", key: str = "") -> None:
        self.page_bytes = page_bytes
        self.host_budget = host_bytes
        self.disk_budget = disk_bytes if folder is not None else 0
        self.fingerprint = fingerprint_
        self.key = key
        self.counters = StoreCounters()
        self._host: OrderedDict[int, _HostEntry] = OrderedDict()  # oldest first
        self._disk: OrderedDict[str, _DiskEntry] = OrderedDict()  # file name -> entry, oldest first
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            _private_folder(self.folder)
            self._scan()

    # ---- questions -------------------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._host or self._name(block_hash) in self._disk

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.page_bytes

    @property
    def disk_bytes(self) -> int:
        return sum(entry.size for entry in self._disk.values())

    def conversations(self) -> set[str]:
        """Every conversation with a page here (in RAM or on disk, any model's files)."""
        tags = {c for entry in self._host.values() for c in entry.conversations}
        return tags.union(*(entry.conversations for entry in self._disk.values()))

    # ---- pages -----------------------------------------------------------------------------

    def put(self, block_hash: int, page: torch.Tensor | None, conversations: Iterable[str],
            ready: torch.cuda.Event | None = None) -> None:
        """Keep ``page`` (uint8 ``[page_bytes]``) under ``block_hash``, or, with ``page`` None, add
        ``conversations`` to the page already kept (the caller checked ``block_hash in self``)."""
        entry = self._host.get(block_hash)
        if entry is None and page is None:
            page_and_tags = self._read(block_hash)
            if page_and_tags is None:
                return
            page, tags = page_and_tags
            entry = self._host_entry(block_hash, page, set(tags), on_disk=True)
        if entry is None:
            assert page is not None
            if page.numel() != self.page_bytes:
                raise ValueError(f"a page has {self.page_bytes} bytes, got {page.numel()}")
            entry = self._host_entry(block_hash, page, set(), ready=ready)
        new = set(conversations) - entry.conversations
        if new:
            entry.conversations |= new
            entry.on_disk = False  # the file's header lacks the new tags: write it again when it leaves RAM
        self._host.move_to_end(block_hash)
        self._fit_host()

    def get(self, block_hash: int) -> tuple[torch.Tensor, frozenset[str]] | None:
        """The page's bytes and conversations, or None when it is unknown here or its file was
        unusable (then deleted). A page read from disk stays in RAM too."""
        entry = self._host.get(block_hash)
        if entry is None:
            page_and_tags = self._read(block_hash)
            if page_and_tags is None:
                return None
            entry = self._host_entry(block_hash, page_and_tags[0], set(page_and_tags[1]), on_disk=True)
            self._fit_host()
        else:
            self._host.move_to_end(block_hash)
        return entry.data(), frozenset(entry.conversations)

    def drop(self, conversation: str) -> int:
        """Forget ``conversation``'s pages (RAM and disk); returns how many pages or files were
        deleted. Pages other conversations used too lose this tag only."""
        dropped: set[str] = set()  # file names, of the pages in RAM too
        for block_hash, entry in list(self._host.items()):
            if conversation in entry.conversations:
                entry.conversations.discard(conversation)
                entry.on_disk = False
                if not entry.conversations:
                    del self._host[block_hash]
                    dropped.add(self._name(block_hash))
        for name, disk in list(self._disk.items()):
            if conversation not in disk.conversations:
                continue
            remaining = disk.conversations - {conversation}
            if remaining and self._retag(name, remaining):
                continue
            self._delete(name)
            dropped.add(name)
        return len(dropped)

    def flush(self) -> int:
        """Write every page held only in RAM to disk (the engine is stopping); returns how many."""
        if self.folder is None:
            return 0
        written = 0
        for block_hash, entry in list(self._host.items()):
            if not entry.on_disk:
                self._write(block_hash, entry)
                written += 1
        return written

    # ---- RAM -------------------------------------------------------------------------------

    def _host_entry(self, block_hash: int, page: torch.Tensor, conversations: set[str], *,
                    ready: torch.cuda.Event | None = None, on_disk: bool = False) -> _HostEntry:
        entry = _HostEntry(page, conversations, ready, on_disk)
        self._host[block_hash] = entry
        return entry

    def _fit_host(self) -> None:
        while self._host and self.host_bytes > self.host_budget:
            block_hash, entry = self._host.popitem(last=False)
            if self.folder is not None and not entry.on_disk:
                self._write(block_hash, entry)

    # ---- disk ------------------------------------------------------------------------------

    def _name(self, block_hash: int) -> str:
        return f"{self.key}-{block_hash:032x}{_SUFFIX}"

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        return self.folder / name

    def _write(self, block_hash: int, entry: _HostEntry) -> None:
        if self.folder is None or self.page_bytes > self.disk_budget:
            return
        header = _Header(self.fingerprint, self.key, block_hash, frozenset(entry.conversations), self.page_bytes)
        name = self._name(block_hash)
        try:
            size = _write_file(self.folder, name, header, entry.data().numpy().tobytes())
        except OSError as err:  # a full disk loses the page (it will be recomputed), not the engine
            logger.warning("could not write a prefix cache page to %s: %s", self.folder, err)
            return
        entry.on_disk = True
        self._disk.pop(name, None)
        self._disk[name] = _DiskEntry(size, frozenset(entry.conversations))
        self.counters.files_written += 1
        self._fit_disk()

    def _fit_disk(self) -> None:
        total = self.disk_bytes
        while self._disk and total > self.disk_budget:
            name, entry = next(iter(self._disk.items()))
            self._delete(name)
            total -= entry.size

    def _read(self, block_hash: int) -> tuple[torch.Tensor, frozenset[str]] | None:
        name = self._name(block_hash)
        if name not in self._disk:
            return None
        path = self._path(name)
        try:
            raw = path.read_bytes()
            header, payload = _parse(raw)
            problem = self._check(header, block_hash, len(payload))
        except FileNotFoundError:  # another engine on the same folder deleted it
            self._disk.pop(name, None)
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            problem = f"unreadable ({err})"
        if problem is not None:
            logger.warning("prefix cache file %s is %s; deleting it and recomputing its tokens", name, problem)
            self.counters.files_rejected += 1
            self._delete(name)
            return None
        self._disk.move_to_end(name)
        _touch(path)
        page = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return page, header.conversations

    def _check(self, header: _Header, block_hash: int, payload_bytes: int) -> str | None:
        if header.fingerprint != self.fingerprint:
            return "from another model or engine setup"
        if header.block_hash != block_hash or header.model_key != self.key:
            return "not the page its name says"
        if payload_bytes != self.page_bytes or header.payload_bytes != payload_bytes:
            return f"{payload_bytes} bytes long, not {self.page_bytes}"
        return None

    def _retag(self, name: str, conversations: frozenset[str]) -> bool:
        """Rewrite a file with fewer conversation tags; False when it cannot be read (delete it)."""
        try:
            header, payload = _parse(self._path(name).read_bytes())
            header.conversations = conversations
            size = _write_file(self._path(name).parent, name, header, payload)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        self._disk[name] = _DiskEntry(size, conversations)
        return True

    def _delete(self, name: str) -> None:
        self._disk.pop(name, None)
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as err:
            logger.warning("could not delete prefix cache file %s: %s", name, err)

    def _scan(self) -> None:
        """Index the folder's files, oldest first; delete unreadable ones and this model's stale ones."""
        assert self.folder is not None
        found: list[tuple[float, str, _DiskEntry]] = []
        now = time.time()
        for path in self.folder.iterdir():
            try:
                stat = path.stat()
                if path.name.startswith(".tmp-"):
                    if now - stat.st_mtime > _STALE_TEMP_S:
                        path.unlink(missing_ok=True)
                    continue
                if not path.name.endswith(_SUFFIX) or not path.is_file():
                    continue
                header = _read_header(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                header = None
            if header is None or (header.model_key == self.key and header.fingerprint != self.fingerprint):
                self.counters.files_rejected += 1
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, path.name, _DiskEntry(stat.st_size, header.conversations)))
        for _, name, entry in sorted(found, key=lambda item: item[:2]):
            self._disk[name] = entry
        self._fit_disk()


def drop_from_folder(folder: str | Path, conversation: str) -> int:
    """``PrefixStore.drop`` for a folder no engine has open (no model loaded): any model's files."""
    store = PrefixStore(0, 0, folder=folder, disk_bytes=1 << 62, fingerprint_="", key="")
    return store.drop(conversation)


# ---- the file format -------------------------------------------------------------------------


def _write_file(folder: Path, name: str, header: _Header, payload: bytes) -> int:
    header_json = header.to_json()
    rest = struct.pack("<I", len(header_json)) + header_json
    digest = hashlib.sha256(rest)
    digest.update(payload)
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-")  # created 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_MAGIC + digest.digest() + rest)
            out.write(payload)
        os.chmod(temp, FILE_MODE)
        _touch(Path(temp))
        os.replace(temp, folder / name)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return _PREFIX + len(header_json) + len(payload)


def _parse(raw: bytes) -> tuple[_Header, bytes]:
    """Header and payload of a whole file, or ValueError when it is not a sound page file."""
    if len(raw) < _PREFIX or raw[:len(_MAGIC)] != _MAGIC:
        raise ValueError("not a Hearth page file")
    if hashlib.sha256(raw[len(_MAGIC) + _DIGEST:]).digest() != raw[len(_MAGIC):len(_MAGIC) + _DIGEST]:
        raise ValueError("checksum mismatch")
    (header_len,) = struct.unpack_from("<I", raw, _PREFIX - 4)
    header = _Header.from_json(raw[_PREFIX:_PREFIX + header_len])
    return header, raw[_PREFIX + header_len:]


def _read_header(path: Path) -> _Header:
    """The header alone (the folder scan; the checksum is checked when the page is used)."""
    with open(path, "rb") as file:
        prefix = file.read(_PREFIX)
        if len(prefix) < _PREFIX or prefix[:len(_MAGIC)] != _MAGIC:
            raise ValueError("not a Hearth page file")
        (header_len,) = struct.unpack_from("<I", prefix, _PREFIX - 4)
        if header_len > _MAX_HEADER:
            raise ValueError("header too long")
        return _Header.from_json(file.read(header_len))


def _private_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if os.name == "posix" and folder.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(folder, DIR_MODE)


def _touch(path: Path) -> None:
    """Mark a file used now, so the LRU order survives a restart (an explicit time: the file
    system's own clock may tick only every few milliseconds)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


# ---- the tier the BlockManager sees ----------------------------------------------------------


class PageTier:
    """Moves whole pages between the device cache and a ``PrefixStore`` (the ``BlockManager``'s
    spill and restore hooks). On CUDA the copies are non-blocking through pinned memory: a spill
    is ordered before the step that reuses its page by the stream, a restore before the step that
    reads it."""

    def __init__(self, cache: PagedCache, store: PrefixStore) -> None:
        self.cache = cache
        self.store = store
        self._cuda = cache.latent[0] is not None and cache.latent[0].is_cuda

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.store

    def spill(self, pages: list[tuple[int, int, frozenset[str]]]) -> None:
        """Keep the pages ``(block id, hash, conversations)`` the device is about to reuse."""
        fresh = []
        for block_id, block_hash, conversations in pages:
            if block_hash in self.store:
                self.store.put(block_hash, None, conversations)
            else:
                fresh.append((block_id, block_hash, conversations))
        if not fresh:
            return
        data = self.cache.read_pages([block_id for block_id, _, _ in fresh], pin=self._cuda)
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        for row, (_, block_hash, conversations) in zip(data, fresh):
            self.store.put(block_hash, row, conversations, ready)
        self.store.counters.pages_spilled += len(fresh)

    def restore(self, pages: list[tuple[int, int]]) -> list[frozenset[str]]:
        """Copy the pages ``(hash, block id)`` into the device, in order, stopping at the first the
        store cannot give; returns the conversations of each page restored."""
        rows, tags = [], []
        for block_hash, _ in pages:
            found = self.store.get(block_hash)
            if found is None:
                break
            rows.append(found[0])
            tags.append(found[1])
        if rows:
            data = torch.stack(rows)
            if self._cuda:
                data = data.pin_memory()
            self.cache.write_pages([block_id for _, block_id in pages[:len(rows)]], data)
            self.store.counters.pages_restored += len(rows)
        return tags
