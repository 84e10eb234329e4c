"""The prefix cache's second and third tiers: cached pages the GPU gives up live on in host RAM,
then on disk, and come back when a later prompt starts with them (a conversation's next turn, a
chat the user switched back to, the same chat after the engine host restarted).

A page is named by its chained prefix hash (``hash_block``: the hash of every token up to the end of
the page), so a hit is exact: same tokens, same position, same model, same content.

``PrefixStore`` holds page bytes keyed by that hash: an LRU of host entries bounded by
``host_bytes``; entries pushed out of RAM are written to ``folder`` (when there is one), an LRU of
segment files bounded by ``disk_bytes``. ``PageTier`` connects it to the device cache for the
``BlockManager``: pages are copied out when the manager evicts them (never inside a forward step) and
copied into free pages when a new request's prefix is found here (at admission).

Speed. A 64K-token chat is about a thousand pages, so nothing is done per page that costs more than
a few microseconds of Python: pages leave the device gathered into one contiguous buffer per chunk
(one device-to-host copy), come back through one device staging buffer per chunk (a host-to-device
copy per run of adjacent host pages, then one ``index_copy_`` per layer), and are read from disk as
large sequential reads straight into (pinned) host memory by a small thread pool that also checks
their CRC-32s (both release the GIL).

Files. Pages written together (those that leave RAM at once, or are saved when the engine stops)
share a segment file, one per set of conversations, at most ``_SEGMENT_BYTES`` each, named
``<model key>-<random>.pages`` (the model key: a hash of the model folder's path), written atomically
(a temporary file, then rename), mode 0600 in a 0700 folder::

    b"HRTHSG02" | header length (u32 LE) | CRC-32 of the header (u32 LE) | header JSON | pages

The header names the model fingerprint (``fingerprint()``: config, weight file sizes and times,
dtype, page size, cache formats), the page size, and per page its hash, its conversations and the
CRC-32 of its bytes. A segment whose header, size, fingerprint or any page's checksum does not match
is deleted and its pages recomputed. Segments of other model folders in the same folder count towards
the disk budget and are evicted by the same LRU (least recently used first, by file time across
restarts). A page written again (with new conversations) leaves a dead copy in its old segment until
that segment is evicted; the newest copy is the one read.

Conversations. A request may name its conversation; its pages carry that tag, and
``drop(conversation)`` forgets the conversation's pages in RAM and on disk (a page that other
conversations also used keeps their tags and stays: its segment is rewritten without the tag).

Prompts. Beside a conversation's pages the store keeps one opaque record of it (the engine's
tokenised prompt, ``PromptTokens.to_bytes``: a restarted engine then tokenises only a follow-up's
new text), in ``<model key>-<hash of the conversation>.prompt``, written atomically, mode 0600::

    b"HRTHPT01" | header length (u32 LE) | CRC-32 of header and record (u32 LE) | header JSON | record

The header names the model fingerprint and the conversation; a file whose checksum, fingerprint or
conversation does not match is deleted, never read. ``drop`` deletes it with the pages; a record
whose conversation has no page of this model on disk any more is deleted when the store opens and
when records are saved. Records are small (~13 bytes per token against ~4 KB per token of pages)
and do not count towards ``disk_bytes``.

Warm start. A store may take a ``Preload``: when an engine starts with a folder that holds
conversations, it reads this model's newest segments back into RAM in the background (newest first,
up to ``host_bytes``, evicting nothing for them), so the next turn of a recent chat after a restart
restores from RAM instead of waiting for the disk. Its class doc says how it and the store share the
work without sharing state. Pages a warm start read count as used (their file's time and place in the
disk LRU) only when a request uses them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hearth.engine.cache_files import header_frame, private_folder, read_header_frame, touch, write_atomically
from hearth.engine.kv_cache import PagedCache
from hearth.engine.warm_start import BackgroundReads

__all__ = ["FORMAT_VERSION", "PageTier", "Preload", "PrefixStore", "fingerprint", "model_key"]

logger = logging.getLogger("hearth.engine.prefix_store")

FORMAT_VERSION = 2
_MAGIC = b"HRTHSG02"
_PREFIX = len(_MAGIC) + 8  # magic, header length, header CRC-32
_MAX_HEADER = 64 << 20
_SUFFIX = ".pages"
_PROMPT_SUFFIX = ".prompt"
_PROMPT_MAGIC = b"HRTHPT01"
_OLD_SUFFIX = ".page"  # format 1 (a file per page): deleted when seen
_SEGMENT_BYTES = 256 << 20  # a segment's page bytes at most: LRU eviction and drop work on whole files
_HEADER_BYTES_PER_PAGE = 256  # a page's share of a segment header (hash, conversations, checksum), roughly
_READ_BYTES = 8 << 20  # one read task of the thread pool
_IO_THREADS = 8
_STAGE_PAGES = 64  # pages per device-side chunk of a spill or restore (bounds the GPU staging memory)
_STALE_TEMP_S = 600.0  # a temporary file this old belongs to no writer still running


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
    on_disk: bool = False  # a segment holds these bytes and these conversations
    preloaded_from: str | None = None  # the segment a warm start read it from, until a request uses it

    def data(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.page


@dataclass(frozen=True)
class _SegmentPage:
    index: int  # position in the segment's pages
    crc: int  # CRC-32 of its bytes
    conversations: frozenset[str]


@dataclass
class _Segment:
    """A segment file's header (and its size on disk)."""

    fingerprint: str
    model_key: str
    page_bytes: int
    pages: dict[int, _SegmentPage]  # block hash -> page
    size: int = 0

    @property
    def data_offset(self) -> int:
        return self.size - len(self.pages) * self.page_bytes

    def conversations(self) -> set[str]:
        return {c for page in self.pages.values() for c in page.conversations}

    def to_json(self) -> bytes:
        pages = sorted(self.pages.items(), key=lambda item: item[1].index)
        return json.dumps({"fingerprint": self.fingerprint, "model_key": self.model_key, "page_bytes": self.page_bytes,
                           "pages": [{"hash": f"{block_hash:032x}", "crc32": page.crc,
                                      "conversations": sorted(page.conversations)} for block_hash, page in pages]
                           }).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> _Segment:
        data = json.loads(raw)
        pages: dict[int, _SegmentPage] = {}
        for index, page in enumerate(data["pages"]):
            conversations = page["conversations"]
            if not isinstance(conversations, list) or not all(isinstance(c, str) for c in conversations):
                raise ValueError("conversations must be a list of strings")
            pages[int(page["hash"], 16)] = _SegmentPage(index, int(page["crc32"]), frozenset(conversations))
        page_bytes = int(data["page_bytes"])
        if page_bytes < 1 or len(pages) != len(data["pages"]):
            raise ValueError("bad page size or repeated pages")
        return cls(str(data["fingerprint"]), str(data["model_key"]), page_bytes, pages)


@dataclass
class StoreCounters:
    """What the store did since it started, for /hearth/stats."""

    pages_spilled: int = 0  # pages copied out of the device cache
    pages_restored: int = 0  # pages copied back into it
    files_written: int = 0
    files_rejected: int = 0  # corrupt or stale files deleted instead of used
    # Host time of the two halves of a restore: pages read (and checked) from disk into RAM, and the
    # restore call as a whole (disk reads included; on CUDA its copies to the device are queued, not waited).
    disk_read_s: float = 0.0
    disk_read_bytes: int = 0
    restore_s: float = 0.0
    spill_s: float = 0.0  # host time keeping pages the device is about to reuse (their copies queued on CUDA)
    pages_preloaded: int = 0  # pages a warm start read into RAM and handed over (``Preload``)
    preload_wait_s: float = 0.0  # restores waiting for a segment the warm start was reading


@dataclass
class _ReadTask:
    """Pages ``[first, first + count)`` of a segment into ``out`` rows (the thread pool's unit)."""

    path: Path
    offset: int
    out: torch.Tensor  # uint8 [count, page_bytes], contiguous
    crcs: list[int] = field(default_factory=list)


class PrefixStore:
    """Page bytes by prefix hash: host RAM first, then segment files in ``folder`` (see the module doc).

    ``folder`` None keeps pages in RAM only (and forgets those pushed out). ``fingerprint_`` and
    ``key`` identify the model (``fingerprint()`` / ``model_key()``); ``page_bytes`` is the size
    every page has; ``pin`` reads pages from disk into pinned memory (for CUDA copies). Not
    thread-safe: the engine's stepping thread owns it.
    """

    def __init__(self, page_bytes: int, host_bytes: int, *, folder: str | Path | None = None, disk_bytes: int = 0,
                 fingerprint_: str = "", key: str = "", pin: bool = False) -> None:
        self.page_bytes = page_bytes
        self.host_budget = host_bytes
        self.disk_budget = disk_bytes if folder is not None else 0
        self.fingerprint = fingerprint_
        self.key = key
        self.pin = pin
        self.counters = StoreCounters()
        self._host: OrderedDict[int, _HostEntry] = OrderedDict()  # oldest first
        self._disk: OrderedDict[str, _Segment] = OrderedDict()  # file name -> segment, oldest first
        self._index: dict[int, str] = {}  # block hash -> the newest segment of this model holding it
        self._disk_total = 0
        self.preload: Preload | None = None  # a warm start's reads (``attach_preload``)
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            private_folder(self.folder)
            self._scan()

    # ---- questions -------------------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._host or block_hash in self._index

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.page_bytes

    @property
    def disk_bytes(self) -> int:
        return self._disk_total

    def conversations(self) -> set[str]:
        """Every conversation with a page here (in RAM or on disk, any model's files)."""
        tags = {c for entry in self._host.values() for c in entry.conversations}
        return tags.union(*(segment.conversations() for segment in self._disk.values()))

    # ---- pages -----------------------------------------------------------------------------

    def put(self, block_hash: int, page: torch.Tensor | None, conversations: Iterable[str],
            ready: torch.cuda.Event | None = None) -> None:
        """Keep ``page`` (uint8 ``[page_bytes]``) under ``block_hash``, or, with ``page`` None, add
        ``conversations`` to the page already kept (the caller checked ``block_hash in self``)."""
        self.put_many([(block_hash, page, conversations)], ready)

    def put_many(self, pages: Iterable[tuple[int, torch.Tensor | None, Iterable[str]]],
                 ready: torch.cuda.Event | None = None) -> None:
        """``put`` for many pages, then one trip to disk for those that no longer fit in RAM."""
        for block_hash, page, conversations in pages:
            entry = self._host.get(block_hash)
            if entry is None and page is None:
                self.settle_preload([block_hash])
                entry = self._host.get(block_hash) or self._load([block_hash]).get(block_hash)
                if entry is None:
                    continue
            if entry is None:
                assert page is not None
                if page.numel() != self.page_bytes:
                    raise ValueError(f"a page has {self.page_bytes} bytes, got {page.numel()}")
                entry = self._host[block_hash] = _HostEntry(page, set(), ready)
            new = set(conversations) - entry.conversations
            if new:
                entry.conversations |= new
                entry.on_disk = False  # its segment lacks the new tags: write it again when it leaves RAM
            self._host.move_to_end(block_hash)
        self._fit_host()

    def get(self, block_hash: int) -> tuple[torch.Tensor, frozenset[str]] | None:
        """The page's bytes and conversations, or None when it is unknown here or its file was
        unusable (then deleted). A page read from disk stays in RAM too."""
        found = self._take([block_hash])
        return (found[0].data(), frozenset(found[0].conversations)) if found else None

    def take(self, block_hashes: Sequence[int]) -> list[tuple[torch.Tensor, frozenset[str]]]:
        """The bytes and conversations of the leading pages of ``block_hashes`` this store can give
        (it stops at the first it cannot); those on disk are read together and stay in RAM too.
        Bytes that left the device may still be arriving: only device copies on the same stream
        (ordered after them) may read them without ``get``'s wait."""
        return [(entry.page, frozenset(entry.conversations)) for entry in self._take(block_hashes)]

    def _take(self, block_hashes: Sequence[int]) -> list[_HostEntry]:
        known = []
        for block_hash in block_hashes:
            if block_hash not in self:
                break
            known.append(block_hash)
        self.settle_preload([h for h in known if h not in self._host])
        start = time.perf_counter()
        loaded = self._load([h for h in known if h not in self._host])
        if loaded:
            self.counters.disk_read_s += time.perf_counter() - start
            self.counters.disk_read_bytes += len(loaded) * self.page_bytes
        found = []
        used: set[str] = set()  # segments a warm start read these pages from: in use now
        for block_hash in known:
            entry = self._host.get(block_hash) or loaded.get(block_hash)
            if entry is None:
                break
            if block_hash in self._host:
                self._host.move_to_end(block_hash)
            if entry.preloaded_from is not None:
                used.add(entry.preloaded_from)
                entry.preloaded_from = None
            found.append(entry)
        for name in used & self._disk.keys():
            self._disk.move_to_end(name)
            touch(self._path(name))
        self._fit_host()
        return found

    def drop(self, conversation: str) -> int:
        """Forget ``conversation``'s pages (RAM and disk); returns how many pages were deleted.
        Pages other conversations used too lose this tag only."""
        dropped: set[int] = set()
        for block_hash, entry in list(self._host.items()):
            if conversation in entry.conversations:
                entry.conversations.discard(conversation)
                entry.on_disk = False
                if not entry.conversations:
                    del self._host[block_hash]
                    dropped.add(block_hash)
        for name, segment in list(self._disk.items()):
            if not any(conversation in page.conversations for page in segment.pages.values()):
                continue
            gone = [h for h, page in segment.pages.items() if page.conversations == {conversation}]
            dropped.update(gone)
            if len(gone) == len(segment.pages) or not self._retag(name, segment, conversation):
                self._delete(name)
        if self.folder is not None:
            for path in self.folder.glob(f"*-{_conversation_key(conversation)}{_PROMPT_SUFFIX}"):  # any model's
                self._unlink(path)
        return len(dropped)

    def flush(self) -> int:
        """Write every page held only in RAM to disk (the engine is stopping); returns how many."""
        if self.folder is None:
            return 0
        pending = [(block_hash, entry) for block_hash, entry in self._host.items() if not entry.on_disk]
        self._write(pending)
        return len(pending)

    # ---- prompts ---------------------------------------------------------------------------

    def save_prompts(self, records: Mapping[str, bytes]) -> int:
        """Keep a record per conversation (see the module doc) for those with pages on disk;
        returns how many were written."""
        if self.folder is None:
            return 0
        on_disk = self._disk_conversations()
        written = 0
        for conversation, record in records.items():
            if conversation not in on_disk:
                continue
            header = json.dumps({"fingerprint": self.fingerprint, "model_key": self.key,
                                 "conversation": conversation}).encode()
            try:
                write_atomically(self._prompt_path(conversation), [
                    _PROMPT_MAGIC + struct.pack("<II", len(header), zlib.crc32(record, zlib.crc32(header))),
                    header, record])
            except OSError as err:
                logger.warning("could not write a prompt record to %s: %s", self.folder, err)
                continue
            written += 1
        self._prune_prompts(on_disk)
        return written

    def load_prompt(self, conversation: str) -> bytes | None:
        """The conversation's record, or None when there is none or it is unsound (then deleted).
        Reads only the file, never the store's state: safe from any thread."""
        if self.folder is None:
            return None
        path = self._prompt_path(conversation)
        try:
            data = path.read_bytes()
        except OSError:  # none (the usual case) or unreadable: the prompt is tokenised whole
            return None
        record = _prompt_record(data, self.fingerprint, self.key, conversation)
        if record is None:
            logger.warning("prompt record %s is corrupt or stale; deleting it", path.name)
            self._unlink(path)
        return record

    def _prompt_path(self, conversation: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{self.key}-{_conversation_key(conversation)}{_PROMPT_SUFFIX}"

    def _disk_conversations(self) -> set[str]:
        """The conversations with a page of this model on disk."""
        return set().union(*(segment.conversations() for segment in self._disk.values()
                             if segment.model_key == self.key))

    def _prune_prompts(self, on_disk: set[str]) -> None:
        """Delete this model's prompt records whose conversation has no page on disk."""
        assert self.folder is not None
        keep = {self._prompt_path(conversation).name for conversation in on_disk}
        for path in self.folder.glob(f"{self.key}-*{_PROMPT_SUFFIX}"):
            if path.name not in keep:
                self._unlink(path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            logger.warning("could not delete prefix cache file %s: %s", path.name, err)

    # ---- warm start (``Preload``) --------------------------------------------------------------

    def attach_preload(self, preload: Preload) -> None:
        """Take the pages ``preload`` reads (it may have started before this store existed)."""
        self.preload = preload

    @property
    def preload_running(self) -> bool:
        return self.preload is not None and self.preload.running

    def settle_preload(self, block_hashes: Iterable[int] = ()) -> None:
        """Take over the segments the preload has read so far (never blocking), after waiting for the
        ones holding ``block_hashes`` (a request needs them) whose read has begun; those whose read has
        not begun are taken out of the preload (the caller reads them itself). Engine thread only."""
        preload = self.preload
        if preload is None or not preload.running:
            return
        needed = {name for block_hash in block_hashes if (name := self._index.get(block_hash)) is not None}
        start = time.perf_counter()
        items = preload.claim(needed)
        if needed:
            self.counters.preload_wait_s += time.perf_counter() - start
        for item, result in items:
            if not self._adopt(item, result):
                preload.cancel(wait=False)
                return

    def yield_preload(self, busy: bool) -> None:
        """The engine serves requests (``busy``) or is idle: the warm start holds meanwhile."""
        if self.preload is not None:
            self.preload.set_busy(busy)

    def cancel_preload(self) -> None:
        """Stop the preload and wait for its reads in progress (the engine is stopping)."""
        if self.preload is not None:
            self.preload.cancel()

    def _adopt(self, item: _PreloadItem, result: Future[_PreloadOutcome]) -> bool:
        """Put a preloaded segment's pages in RAM, at the least recently used end (older segments
        before newer ones), unless the segment changed since the preload read its header (deleted,
        rewritten, evicted: its copy is dropped) or they no longer fit: False (the preload stops; no
        page is evicted for it). A segment with a bad page is rejected as ``_load`` rejects it."""
        try:
            buffer, sound = result.result()
        except Exception as err:  # (pinned memory ran out, say): the pages stay on disk
            logger.warning("could not preload prefix cache file %s: %s", item.name, err)
            return True
        segment = item.segment
        if self._disk.get(item.name) != segment or segment.model_key != self.key \
                or segment.fingerprint != self.fingerprint:
            return True
        if not all(sound):
            self._reject(item.name, _problem(sound))
            return True
        rows = [(row, block_hash) for row, block_hash in enumerate(item.hashes)
                if self._index.get(block_hash) == item.name and block_hash not in self._host]
        if self.host_bytes + len(rows) * self.page_bytes > self.host_budget:
            return False
        for row, block_hash in reversed(rows):
            conversations = set(segment.pages[block_hash].conversations)
            self._host[block_hash] = _HostEntry(buffer[row], conversations, on_disk=True, preloaded_from=item.name)
            self._host.move_to_end(block_hash, last=False)
        self.counters.pages_preloaded += len(rows)
        return True

    # ---- RAM -------------------------------------------------------------------------------

    def _fit_host(self) -> None:
        leaving = []
        while self._host and self.host_bytes > self.host_budget:
            block_hash, entry = self._host.popitem(last=False)
            if not entry.on_disk:
                leaving.append((block_hash, entry))
        if leaving and self.folder is not None:
            self._write(leaving)

    # ---- disk: writes ----------------------------------------------------------------------

    def _write(self, entries: list[tuple[int, _HostEntry]]) -> None:
        """Write ``entries`` as segments: one per set of conversations, split to fit the budgets."""
        if self.folder is None or not entries or self.page_bytes + _HEADER_BYTES_PER_PAGE > self.disk_budget:
            return
        groups: dict[frozenset[str], list[tuple[int, _HostEntry]]] = {}
        for block_hash, entry in entries:
            groups.setdefault(frozenset(entry.conversations), []).append((block_hash, entry))
        per_segment = max(1, min(_SEGMENT_BYTES, self.disk_budget) // (self.page_bytes + _HEADER_BYTES_PER_PAGE))
        for group in groups.values():
            for start in range(0, len(group), per_segment):
                self._write_segment(group[start:start + per_segment])
        self._fit_disk()

    def _write_segment(self, entries: list[tuple[int, _HostEntry]]) -> None:
        assert self.folder is not None
        datas = [entry.data() for _, entry in entries]
        crcs = list(_io_pool().map(_crc, datas))
        pages = {block_hash: _SegmentPage(i, crc, frozenset(entry.conversations))
                 for i, ((block_hash, entry), crc) in enumerate(zip(entries, crcs))}
        segment = _Segment(self.fingerprint, self.key, self.page_bytes, pages)
        name = f"{self.key}-{uuid.uuid4().hex}{_SUFFIX}"
        try:
            _write_file(self.folder / name, segment, [memoryview(d.numpy()) for d in datas])
        except OSError as err:  # a full disk loses the pages (they will be recomputed), not the engine
            logger.warning("could not write prefix cache pages to %s: %s", self.folder, err)
            return
        for _, entry in entries:
            entry.on_disk = True
        self._add_segment(name, segment)
        self.counters.files_written += 1

    def _add_segment(self, name: str, segment: _Segment) -> None:
        self._disk[name] = segment
        self._disk_total += segment.size
        if segment.model_key == self.key and segment.fingerprint == self.fingerprint:
            for block_hash in segment.pages:
                self._index[block_hash] = name

    def _fit_disk(self) -> None:
        while self._disk and self._disk_total > self.disk_budget:
            self._delete(next(iter(self._disk)))

    def _retag(self, name: str, segment: _Segment, conversation: str) -> bool:
        """Rewrite a segment without ``conversation`` (and its pages no one else used); False when it
        cannot be read (then the caller deletes it)."""
        keep = {h: page for h, page in segment.pages.items() if page.conversations != {conversation}}
        order = sorted(keep, key=lambda h: keep[h].index)
        try:
            out = torch.empty(len(order), segment.page_bytes, dtype=torch.uint8)
            tasks = [_ReadTask(self._path(name), segment.data_offset + keep[h].index * segment.page_bytes,
                               out[i:i + 1], [keep[h].crc]) for i, h in enumerate(order)]
            if not all(_io_pool().map(_read_task, tasks)):
                return False
            pages = {h: _SegmentPage(i, keep[h].crc, keep[h].conversations - {conversation})
                     for i, h in enumerate(order)}
            rewritten = _Segment(segment.fingerprint, segment.model_key, segment.page_bytes, pages)
            _write_file(self._path(name), rewritten, [memoryview(row.numpy()) for row in out])
        except OSError:
            return False
        self._disk_total -= segment.size
        self._disk[name] = rewritten
        self._disk_total += rewritten.size
        for block_hash in set(segment.pages) - set(pages):
            if self._index.get(block_hash) == name:
                del self._index[block_hash]
        return True

    def _delete(self, name: str) -> None:
        segment = self._disk.pop(name, None)
        if segment is not None:
            self._disk_total -= segment.size
            for block_hash in segment.pages:
                if self._index.get(block_hash) == name:
                    del self._index[block_hash]
        self._unlink(self._path(name))

    # ---- disk: reads -----------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        return self.folder / name

    def _load(self, block_hashes: list[int]) -> dict[int, _HostEntry]:
        """Read pages from their segments into RAM (one buffer, large reads in parallel, checksums
        checked); a segment with any bad page is deleted and none of its pages returned."""
        by_segment: dict[str, list[int]] = {}
        for block_hash in block_hashes:
            name = self._index.get(block_hash)
            if name is not None:
                by_segment.setdefault(name, []).append(block_hash)
        if not by_segment:
            return {}
        total = sum(len(hashes) for hashes in by_segment.values())
        buffer = torch.empty(total, self.page_bytes, dtype=torch.uint8, pin_memory=self.pin)
        row = 0
        plans: list[tuple[str, list[int], list[_ReadTask]]] = []
        for name, hashes in by_segment.items():
            segment = self._disk[name]
            hashes.sort(key=lambda h: segment.pages[h].index)
            tasks = _read_tasks(self._path(name), segment, hashes, buffer[row:row + len(hashes)])
            plans.append((name, hashes, tasks))
            row += len(hashes)
        results = iter(_io_pool().map(_read_task, [task for _, _, tasks in plans for task in tasks]))
        loaded: dict[int, _HostEntry] = {}
        row = 0
        for name, hashes, tasks in plans:
            sound = [next(results) for _ in tasks]
            if not all(sound):
                self._reject(name, _problem(sound))
            else:
                segment = self._disk[name]
                self._disk.move_to_end(name)
                touch(self._path(name))
                for i, block_hash in enumerate(hashes):
                    conversations = set(segment.pages[block_hash].conversations)
                    entry = _HostEntry(buffer[row + i], conversations, on_disk=True)
                    loaded[block_hash] = self._host[block_hash] = entry
            row += len(hashes)
        return loaded

    def _reject(self, name: str, problem: str) -> None:
        logger.warning("prefix cache file %s is %s; deleting it and recomputing its tokens", name, problem)
        self.counters.files_rejected += 1
        self._delete(name)

    def _scan(self) -> None:
        """Index the folder's segments, oldest first; delete unreadable ones, this model's stale ones
        and files of the old one-page format."""
        assert self.folder is not None
        found: list[tuple[float, str, _Segment]] = []
        now = time.time()
        for path in self.folder.iterdir():
            try:
                stat = path.stat()
                if path.name.startswith(".tmp-"):
                    if now - stat.st_mtime > _STALE_TEMP_S:
                        path.unlink(missing_ok=True)
                    continue
                if not path.is_file() or not path.name.endswith((_SUFFIX, _OLD_SUFFIX)):
                    continue
                segment = _read_header(path, stat.st_size) if path.name.endswith(_SUFFIX) else None
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                segment = None
            if segment is None or (segment.model_key == self.key and segment.fingerprint != self.fingerprint):
                self.counters.files_rejected += 1
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, path.name, segment))
        for _, name, segment in sorted(found, key=lambda item: item[:2]):
            self._add_segment(name, segment)
        self._fit_disk()
        self._prune_prompts(self._disk_conversations())


def _read_tasks(path: Path, segment: _Segment, hashes: list[int], out: torch.Tensor) -> list[_ReadTask]:
    """Read tasks for the pages ``hashes`` (in file order) of the segment in ``path`` into ``out``: one
    per run of adjacent pages, split at ``_READ_BYTES``."""
    per_task = max(1, _READ_BYTES // segment.page_bytes)
    tasks: list[_ReadTask] = []
    start = 0
    for i in range(1, len(hashes) + 1):
        run_ends = i == len(hashes) or segment.pages[hashes[i]].index != segment.pages[hashes[i - 1]].index + 1
        if run_ends or i - start == per_task:
            first = segment.pages[hashes[start]].index
            tasks.append(_ReadTask(path, segment.data_offset + first * segment.page_bytes, out[start:i],
                                   [segment.pages[h].crc for h in hashes[start:i]]))
            start = i
    return tasks


def drop_from_folder(folder: str | Path, conversation: str) -> int:
    """``PrefixStore.drop`` for a folder no engine has open (no model loaded): any model's files."""
    store = PrefixStore(0, 0, folder=folder, disk_bytes=1 << 62, fingerprint_="", key="")
    return store.drop(conversation)


# ---- the file format -------------------------------------------------------------------------


def _conversation_key(conversation: str) -> str:
    """A file-name-safe name of a conversation (its id may hold ``:`` and ``.``)."""
    return hashlib.blake2b(conversation.encode(), digest_size=12).hexdigest()


def _prompt_record(data: bytes, fingerprint_: str, key: str, conversation: str) -> bytes | None:
    """The record of a prompt file's bytes, or None when the file is not a sound one of this model
    and conversation."""
    prefix = len(_PROMPT_MAGIC) + 8
    if len(data) < prefix or not data.startswith(_PROMPT_MAGIC):
        return None
    header_len, crc = struct.unpack_from("<II", data, len(_PROMPT_MAGIC))
    if prefix + header_len > len(data) or zlib.crc32(memoryview(data)[prefix:]) != crc:
        return None
    try:
        header = json.loads(data[prefix:prefix + header_len])
    except ValueError:
        return None
    expected = {"fingerprint": fingerprint_, "model_key": key, "conversation": conversation}
    return data[prefix + header_len:] if header == expected else None


def _problem(sound: Sequence[bool | None]) -> str:
    """What ``_read_task`` results say is wrong with a segment."""
    return "corrupt or cut short" if all(s is not None for s in sound) else "unreadable"


def _crc(page: torch.Tensor) -> int:
    return zlib.crc32(memoryview(page.numpy()))


def _write_file(path: Path, segment: _Segment, pages: list[memoryview]) -> None:
    """Write a segment atomically; sets ``segment.size``."""
    header = segment.to_json()
    write_atomically(path, [header_frame(_MAGIC, header), *pages])
    segment.size = _PREFIX + len(header) + len(pages) * segment.page_bytes


def _read_header(path: Path, size: int) -> _Segment:
    """A segment's header (its pages' checksums are checked when they are read); ValueError when the
    file is not a whole, sound segment."""
    with open(path, "rb") as file:
        header = read_header_frame(file, _MAGIC, _MAX_HEADER, "segment")
    segment = _Segment.from_json(header)
    segment.size = _PREFIX + len(header) + len(segment.pages) * segment.page_bytes
    if segment.size != size:
        raise ValueError(f"{size} bytes long, not {segment.size}")
    return segment


def _read_task(task: _ReadTask) -> bool | None:
    """Read and check one task's pages (in a pool thread): True when sound, False when cut short or
    a checksum differs, None when the file could not be read."""
    view = memoryview(task.out.numpy()).cast("B")
    page_bytes = task.out.shape[1]
    try:
        with open(task.path, "rb", buffering=0) as file:
            file.seek(task.offset)
            done = 0
            while done < len(view):
                got = file.readinto(view[done:])
                if not got:
                    return False
                done += got
    except OSError:
        return None
    return all(zlib.crc32(view[i * page_bytes:(i + 1) * page_bytes]) == crc for i, crc in enumerate(task.crcs))


@functools.cache
def _io_pool() -> ThreadPoolExecutor:
    """Threads for page reads and checksums (file reads and zlib release the GIL)."""
    return ThreadPoolExecutor(max_workers=min(_IO_THREADS, os.cpu_count() or 1), thread_name_prefix="hearth-pages")






# ---- warm start ------------------------------------------------------------------------------


@dataclass
class _PreloadItem:
    """A segment the preload reads: its header as read then and the pages it reads (in file order:
    those no newer segment holds)."""

    name: str
    segment: _Segment
    hashes: list[int]


_PreloadOutcome = tuple[torch.Tensor, list[bool | None]]  # the pages' buffer, each read task's result


class Preload:
    """Warm start: read the pages of one model's newest segments in ``folder`` (its key ``key``) into
    host RAM in the background, newest first, up to ``budget`` bytes of pages (it stops at the first
    segment that would exceed it), so that a conversation's next turn after a restart finds its pages
    in RAM instead of waiting for the disk.

    It starts before the store exists (``Engine.load`` starts it before the weights load), so it
    plans from the files alone: it reads the headers itself, newest file first, and reads only the
    pages no newer segment holds (the copy the store will index).

    Threads. The store is not thread-safe, so this never touches it. A thread of its own plans, then
    reads the segments one after another: for each, it allocates the buffer the pages stay in (pinned
    with ``pin``: cudaHostAlloc is slow, and it runs here, not on the engine thread) and runs the
    reads and checksums as ``_read_task``s in the store's I/O pool. Each segment's outcome is a
    ``Future``. The engine thread takes finished segments over with ``PrefixStore.settle_preload``
    (``claim`` here), which the store calls before it reads anything from disk and the engine calls
    when it reports its stats; the store then checks each against its own index (the segment may
    have been deleted, rewritten or evicted meanwhile: that copy is dropped), rejects a corrupt one
    exactly as a read of its own would (deleted, counted, recomputed later) and keeps the rest
    unless RAM has no room for them (then the preload stops; nothing is evicted for it). A request
    that needs a segment still planned takes it back (``Future.cancel``: the request reads it
    itself and this thread skips it) or, when its read has begun, waits for that read: no page is
    read twice and no buffer is shared by two readers.

    ``cancel`` stops it: segments not begun are skipped, read tasks not begun return at once, and
    (``wait``) the thread is joined; ``wait`` is its completion handle. The thread, the futures and
    the taking back are ``warm_start.BackgroundReads``'s (shared with ``tier_store.TierPreload``).
    """

    def __init__(self, folder: str | Path, key: str, budget: int, *, pin: bool) -> None:
        self.folder = Path(folder)
        self.key = key
        self.budget = budget
        self.pin = pin
        self._reads: BackgroundReads[_PreloadItem, _PreloadOutcome] = BackgroundReads(
            "hearth-preload", self._read, lambda item: item.name, self._plan)
        self.stopping = self._reads.stopping
        self._reads.start()

    @property
    def running(self) -> bool:
        """Whether segments are still being read or wait to be claimed."""
        if self.stopping.is_set():
            return False
        return self._reads.thread.is_alive() or self._reads.outstanding

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every planned segment was read (or skipped); False on timeout."""
        return self._reads.wait(timeout)

    def cancel(self, wait: bool = True) -> None:
        self._reads.cancel(None if wait else 0)

    def set_busy(self, busy: bool) -> None:
        """(Engine thread.) Hold between segments while the engine serves requests."""
        self._reads.set_busy(busy)

    def claim(self, needed: set[str]) -> list[tuple[_PreloadItem, Future[_PreloadOutcome]]]:
        """(Engine thread.) The segments read since the last claim, newest first, after waiting for
        those in ``needed`` whose read has begun; those in ``needed`` not begun leave the plan. Their
        futures have ended (a failed read's with its exception)."""
        if self.stopping.is_set() or not self._reads.plan_known(wait=bool(needed)):
            return []
        self._reads.withdraw(needed)
        return self._reads.claim()

    def _plan(self) -> list[_PreloadItem]:
        """(The thread.) ``_plan_items``, or nothing when the folder cannot be listed."""
        try:
            return self._plan_items()
        except OSError as err:
            logger.warning("could not list prefix cache files in %s: %s", self.folder, err)
            return []

    def _plan_items(self) -> list[_PreloadItem]:
        """This model's segments, newest first, with the pages each holds that no newer one does,
        up to the byte budget."""
        found: list[tuple[float, str, _Segment]] = []
        for path in self.folder.glob(f"{self.key}-*{_SUFFIX}"):
            try:
                stat = path.stat()
                segment = _read_header(path, stat.st_size)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # (the store's scan deletes what is unsound)
            if segment.model_key == self.key:
                found.append((stat.st_mtime, path.name, segment))
        items: list[_PreloadItem] = []
        seen: set[int] = set()
        left = self.budget
        for _, name, segment in sorted(found, key=lambda item: item[:2], reverse=True):
            hashes = sorted(segment.pages.keys() - seen, key=lambda h: segment.pages[h].index)
            seen.update(segment.pages)
            cost = len(hashes) * segment.page_bytes
            if cost > left:
                break
            if hashes:
                items.append(_PreloadItem(name, segment, hashes))
                left -= cost
        return items

    def _read(self, item: _PreloadItem) -> _PreloadOutcome:
        buffer = torch.empty(len(item.hashes), item.segment.page_bytes, dtype=torch.uint8, pin_memory=self.pin)
        tasks = _read_tasks(self.folder / item.name, item.segment, item.hashes, buffer)
        return buffer, list(_io_pool().map(self._read_unless_stopping, tasks))

    def _read_unless_stopping(self, task: _ReadTask) -> bool | None:
        return None if self.stopping.is_set() else _read_task(task)


# ---- the tier the BlockManager sees ----------------------------------------------------------


class PageTier:
    """Moves whole pages between the device cache and a ``PrefixStore`` (the ``BlockManager``'s
    spill and restore hooks). On CUDA the copies are non-blocking through pinned memory: a spill
    is ordered before the step that reuses its page by the stream, a restore before the step that
    reads it. Both move ``_STAGE_PAGES`` pages per chunk through a contiguous device buffer."""

    def __init__(self, cache: PagedCache, store: PrefixStore) -> None:
        self.cache = cache
        self.store = store
        self._cuda = cache.latent[0] is not None and cache.latent[0].is_cuda
        store.pin = self._cuda

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.store

    def spill(self, pages: list[tuple[int, int, frozenset[str]]]) -> None:
        """Keep the pages ``(block id, hash, conversations)`` the device is about to reuse."""
        start = time.perf_counter()
        known = [(block_hash, None, conversations) for _, block_hash, conversations in pages
                 if block_hash in self.store]
        fresh = [page for page in pages if page[1] not in self.store]
        self.store.put_many(known)
        for offset in range(0, len(fresh), _STAGE_PAGES):
            chunk = fresh[offset:offset + _STAGE_PAGES]
            data = self.cache.read_pages([block_id for block_id, _, _ in chunk], pin=self._cuda)
            ready = None
            if self._cuda:
                ready = torch.cuda.Event()
                ready.record()
            self.store.put_many(((block_hash, row, tags) for row, (_, block_hash, tags) in zip(data, chunk)), ready)
        self.store.counters.pages_spilled += len(fresh)
        self.store.counters.spill_s += time.perf_counter() - start

    def restore(self, pages: list[tuple[int, int]]) -> list[frozenset[str]]:
        """Copy the pages ``(hash, block id)`` into the device, in order, stopping at the first the
        store cannot give; returns the conversations of each page restored."""
        start = time.perf_counter()
        found = self.store.take([block_hash for block_hash, _ in pages])
        device = self.cache.page_device
        for offset in range(0, len(found), _STAGE_PAGES):
            rows = [row for row, _ in found[offset:offset + _STAGE_PAGES]]
            stage = torch.empty(len(rows), self.store.page_bytes, dtype=torch.uint8, device=device)
            for first, run in _adjacent_runs(rows):
                stage[first:first + run.shape[0]].copy_(run, non_blocking=self._cuda)
            self.cache.write_pages([block_id for _, block_id in pages[offset:offset + len(rows)]], stage)
        self.store.counters.pages_restored += len(found)
        self.store.counters.restore_s += time.perf_counter() - start
        return [tags for _, tags in found]


def _adjacent_runs(rows: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``rows`` (1-D, equal sizes) as ``(first, [n, size] view)`` runs of rows that lie one after
    another in the same storage, so each run is one copy."""
    runs: list[tuple[int, torch.Tensor]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and _follows(rows[i - 1], rows[i]):
            continue
        head = rows[start]
        runs.append((start, head.as_strided((i - start, head.numel()), (head.numel(), 1))))
        start = i
    return runs


def _follows(prev: torch.Tensor, row: torch.Tensor) -> bool:
    return (row.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and row.storage_offset() == prev.storage_offset() + prev.numel())
