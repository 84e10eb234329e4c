"""Parked tiers on disk: a long chat's tiered keys and latents (``hearth.engine.tier_cache``) outlive
the engine, so its next turn after a restart adopts them instead of computing the conversation again.

``TierStore`` keeps one file per parked chat in a folder of its own (``tier_folder``: ``tiers`` in the
chat cache folder the prefix store uses). The ``TierCache`` writes a chat when its RAM budget pushes
it out and, for every chat held only in RAM, when the engine stops (``Engine.close``); it reads one
back into RAM when a new prompt matches it. Its conventions are the prefix store's
(``hearth.engine.prefix_store``): files named ``<model key>-<conversation key>-<random>.tiers``,
written atomically (a temporary file, then rename), mode 0600 in a 0700 folder, checksummed,
bounded by ``budget_bytes`` with the least recently used (by file time, across restarts) deleted
first, and deleted with their chat (``drop``; any model's files of the conversation)::

    b"HRTHTC01" | header length (u32 LE) | CRC-32 of the header (u32 LE) | header JSON
                | token ids (i32 LE) | tensors

The header names the model fingerprint (``prefix_store.fingerprint`` of the checkpoint and a layout
holding the tier configs: a file written under another model, dtype or tier config is stale), the
model key, the conversation, the token count and their CRC-32, and per layer its key pages (pool
geometry, page count, the pool's used pages and its summaries) or latent rows; every tensor has its
dtype, shape, offset and CRC-32. Opening the store reads headers and token ids only (the chats'
matching needs the ids); a chat's tensors are read when a prompt matches it. A file whose header,
size, fingerprint, token ids or any tensor's checksum does not match is deleted and its tokens
computed again: nothing unsound is used. Files of other model folders count towards the budget
(and are evicted by the same LRU) but are never matched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hearth.engine.cache_files import header_frame, private_folder, read_header_frame, touch, write_atomically
from hearth.engine.warm_start import BackgroundReads
from hearth.offload.coarse_index import PagePool
from hearth.offload.parked import ParkedPages, ParkedRows, headroom

__all__ = ["FORMAT_VERSION", "HostMemoryError", "ReadTally", "StoredChat", "TierPreload", "TierStore", "read_chat",
           "drop_tiers_from_folder", "tier_folder"]

logger = logging.getLogger("hearth.engine.tier_store")

FORMAT_VERSION = 1
_MAGIC = b"HRTHTC01"
_PREFIX = len(_MAGIC) + 8  # magic, header length, header CRC-32
_MAX_HEADER = 16 << 20
_SUFFIX = ".tiers"
_NO_CONVERSATION = "none"  # the conversation key of a chat no conversation named (hashes are 24 hex digits)
_STALE_TEMP_S = 600.0  # a temporary file this old belongs to no writer still running
_DTYPES = {name: getattr(torch, name) for name in
           ("uint8", "int8", "int32", "int64", "float32", "float16", "bfloat16", "float8_e4m3fn")}

KeyStates = dict[int, ParkedPages]
LatentStates = dict[int, ParkedRows]
Outcome = tuple[tuple[KeyStates, LatentStates] | None, str]  # ``read_chat``'s


def tier_folder(cache_dir: str | Path) -> Path:
    """The store's folder inside the chat cache folder (the prefix store's segments lie beside it)."""
    return Path(cache_dir) / "tiers"


@dataclass(frozen=True)
class StoredChat:
    """A file's header as the store indexes it."""

    name: str
    model_key: str
    fingerprint: str
    conversation: str | None
    token_ids: list[int]
    state_bytes: int  # host bytes of its states once read
    size: int  # bytes on disk
    data_offset: int  # where its tensors start
    header: dict[str, Any]


class TierStore:
    """One file per parked chat in ``folder`` (see the module doc). ``fingerprint_`` and ``key``
    identify the model and tier config (``prefix_store.fingerprint`` / ``model_key``); ``pin`` reads
    host pools into pinned memory (the tiers copy them to a CUDA device). Not thread-safe: the
    engine's stepping thread owns it."""

    def __init__(self, folder: str | Path, budget_bytes: int, *, fingerprint_: str, key: str,
                 pin: bool = False) -> None:
        self.folder = Path(folder)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint_
        self.key = key
        self.pin = pin
        self.files_written = 0
        self.files_rejected = 0  # corrupt or stale files deleted instead of used
        # cumulative host time (ms) and bytes, for ``TierCache.stats``: reading a chat's tensors back
        # (``read_ms``: the whole ``read``, of it ``alloc_ms`` allocating their (pinned) tensors and
        # ``crc_ms`` checksumming them; ``read_bytes`` their bytes), writing chats (``write_ms``: the
        # whole ``write``, of it ``write_crc_ms`` checksumming; ``write_bytes`` the files' sizes) and
        # indexing the folder when the store opens (``scan_ms``)
        self.read_ms = self.alloc_ms = self.crc_ms = 0.0
        self.read_bytes = 0
        self.write_ms = self.write_crc_ms = 0.0
        self.write_bytes = 0
        self.scan_ms = 0.0
        self.chats: OrderedDict[str, StoredChat] = OrderedDict()  # every file, least recently used first
        self.disk_bytes = 0
        private_folder(self.folder)
        self._scan()

    # ---- questions -------------------------------------------------------------------------

    def usable(self) -> Iterator[StoredChat]:
        """The chats this model and tier config may adopt."""
        return (chat for chat in self.chats.values() if chat.model_key == self.key
                and chat.fingerprint == self.fingerprint)

    def conversations(self) -> set[str]:
        return {chat.conversation for chat in self.chats.values() if chat.conversation is not None}

    # ---- writing ---------------------------------------------------------------------------

    def write(self, token_ids: list[int], conversation: str | None, keys: KeyStates,
              latents: LatentStates) -> str | None:
        """Save a parked chat (its states are not changed); returns its file's name, or None when it
        does not fit the budget or could not be written (it is then computed again when needed)."""
        start = time.perf_counter()
        try:
            return self._write(token_ids, conversation, keys, latents)
        finally:
            self.write_ms += (time.perf_counter() - start) * 1e3

    def _write(self, token_ids: list[int], conversation: str | None, keys: KeyStates,
               latents: LatentStates) -> str | None:
        tensors: list[torch.Tensor] = []

        def entry(tensor: torch.Tensor) -> dict[str, Any]:
            flat = _bytes_of(tensor)
            tensors.append(flat)
            start = time.perf_counter()
            crc = zlib.crc32(memoryview(flat.numpy()))
            self.write_crc_ms += (time.perf_counter() - start) * 1e3
            return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "crc32": crc}

        ids = np.asarray(token_ids, dtype="<i4").tobytes()
        header = {
            "format": FORMAT_VERSION, "fingerprint": self.fingerprint, "model_key": self.key,
            "conversation": conversation, "tokens": len(token_ids), "tokens_crc32": zlib.crc32(ids),
            "keys": [{"layer": layer, "pages": state.pages, "page_size": state.host.page_size,
                      "head_dim": state.host.head_dim, "fmt": state.host.fmt,
                      "pool": entry(state.host.buf[:state.pages]),
                      "summaries": [None if t is None else entry(t) for t in state.summaries]}
                     for layer, state in sorted(keys.items())],
            "latents": [{"layer": layer, "rows": state.rows, "host": entry(state.host[:state.rows])}
                        for layer, state in sorted(latents.items())],
        }
        raw = json.dumps(header).encode()
        size = _PREFIX + len(raw) + len(ids) + sum(t.numel() for t in tensors)
        if size > self.budget_bytes:
            return None
        name = f"{self.key}-{_conversation_key(conversation)}-{uuid.uuid4().hex}{_SUFFIX}"
        parts = [header_frame(_MAGIC, raw), ids,
                 *(memoryview(t.numpy()) for t in tensors)]
        try:
            write_atomically(self.folder / name, parts)
        except OSError as err:  # a full disk loses the chat's cache (it is recomputed), not the engine
            logger.warning("could not write a long chat's cache to %s: %s", self.folder, err)
            return None
        self.files_written += 1
        self.write_bytes += size
        self._add(StoredChat(name, self.key, self.fingerprint, conversation, list(token_ids),
                             _state_bytes(header), size, size - _state_bytes(header), header))
        self._fit()
        return name if name in self.chats else None

    # ---- reading ---------------------------------------------------------------------------

    def read(self, name: str) -> tuple[KeyStates, LatentStates] | None:
        """A usable chat's states in host RAM, or None when its file is unsound (then deleted) or
        host memory for them is short (then kept). The file counts as used now."""
        chat = self.chats[name]
        start = time.perf_counter()
        tally = ReadTally()
        try:
            states, problem = read_chat(self.folder / name, chat, self.pin, tally)
        except HostMemoryError as err:
            logger.warning("long chat cache: no host memory to read %s (kept on disk): %s", name, err)
            return None
        finally:
            self.read_ms += (time.perf_counter() - start) * 1e3
            self.alloc_ms += tally.alloc_ms
            self.crc_ms += tally.crc_ms
            self.read_bytes += tally.bytes
        return self.settle_read(name, states, problem)

    def settle_read(self, name: str, states: tuple[KeyStates, LatentStates] | None,
                    problem: str, used: bool = True) -> tuple[KeyStates, LatentStates] | None:
        """What ``read_chat`` made of an indexed file (here or in a ``TierPreload``): None after
        deleting an unsound file, else ``states``; with ``used`` the file counts as used now."""
        if states is None:
            self.reject(name, problem)
            return None
        if used:
            self.chats.move_to_end(name)
            touch(self.folder / name)
        return states

    # ---- forgetting ------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        chat = self.chats.pop(name, None)
        if chat is not None:
            self.disk_bytes -= chat.size
        _unlink(self.folder / name)

    def drop(self, conversation: str) -> int:
        """Delete the conversation's files (any model's); returns how many."""
        return _drop_files(self.folder, conversation, self.delete)

    def _fit(self) -> None:
        while self.chats and self.disk_bytes > self.budget_bytes:
            self.delete(next(iter(self.chats)))

    def reject(self, name: str, problem: str) -> None:
        """Delete an unusable file (its tokens are computed again)."""
        logger.warning("long chat cache file %s is unusable (%s); deleting it and recomputing its tokens",
                       name, problem)
        self.files_rejected += 1
        self.delete(name)

    # ---- the index -------------------------------------------------------------------------

    def _add(self, chat: StoredChat) -> None:
        self.chats[chat.name] = chat
        self.disk_bytes += chat.size

    def _scan(self) -> None:
        """Index the folder's files, least recently used first: headers and token ids only. Unsound
        files and this model's stale ones are deleted."""
        start = time.perf_counter()
        try:
            self._scan_folder()
        finally:
            self.scan_ms += (time.perf_counter() - start) * 1e3

    def _scan_folder(self) -> None:
        found: list[tuple[float, StoredChat]] = []
        now = time.time()
        for path in self.folder.iterdir():
            try:
                stat = path.stat()
                if path.name.startswith(".tmp-"):
                    if now - stat.st_mtime > _STALE_TEMP_S:
                        path.unlink(missing_ok=True)
                    continue
                if not path.is_file() or not path.name.endswith(_SUFFIX):
                    continue
                chat: StoredChat | None = _read_index(path, stat.st_size)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as err:
                logger.warning("long chat cache file %s is unusable (%s); deleting it", path.name, err)
                chat = None
            if chat is None or (chat.model_key == self.key and chat.fingerprint != self.fingerprint):
                self.files_rejected += 1
                _unlink(path)
                continue
            found.append((stat.st_mtime, chat))
        for _, chat in sorted(found, key=lambda item: (item[0], item[1].name)):
            self._add(chat)
        self._fit()


class TierPreload:
    """Warm start of the parked long chats: read the tensors of ``chats`` (a store's newest usable
    files, newest first, planned by the engine thread: ``plan``) into host RAM in a background
    thread, so that a chat's next turn after a restart finds its states in RAM instead of reading,
    checksumming and allocating them on the request path.

    Threads. The store is not thread-safe, so the thread never touches it (nor the ``TierCache``):
    it reads each planned file with ``read_chat`` into tensors of its own (pinned with ``pin``) and
    sets the file's ``Future`` to ``read_chat``'s outcome. Only the engine thread ``claim``s
    outcomes and ``take``s one; the ``TierCache`` then checks each against the store's index (the
    file may have been deleted meanwhile) and rejects an unsound file exactly as a read of its own.
    A file the engine needs that the thread has not begun leaves the plan (``Future.cancel``: the
    engine reads it itself and the thread skips it); one whose read has begun is waited for. No
    file is read twice at once. ``cancel`` stops it: files not begun are skipped, a read under way
    stops at its next tensor, and the (daemon) thread is joined, at most ``timeout`` seconds. The
    thread, the futures and the taking back are ``warm_start.BackgroundReads``'s (shared with
    ``prefix_store.Preload``)."""

    def __init__(self, folder: Path, chats: list[StoredChat], *, pin: bool) -> None:
        self.folder = folder
        self.pin = pin
        self.tally = ReadTally()  # the thread's reads (and read_ms, ms); the engine thread only reports them
        self.read_ms = 0.0
        self._reads: BackgroundReads[StoredChat, Outcome] = BackgroundReads(
            "hearth-tier-preload", self._read, lambda chat: chat.name, chats)
        self.stopping = self._reads.stopping
        self._reads.start()

    @staticmethod
    def plan(store: TierStore, budget: int) -> list[StoredChat]:
        """The store's usable chats, newest first, up to ``budget`` bytes of states (stopping at the
        first that would exceed it)."""
        return _newest_within(reversed(list(store.usable())), budget)

    @staticmethod
    def plan_folder(folder: Path, key: str, budget: int) -> list[StoredChat]:
        """Before any store opens (``Engine.load`` starts the warm start before the weights load, when
        the tier config that makes the store's fingerprint is not known yet): the chat files of the
        model ``key`` in ``folder``, newest first, up to ``budget`` bytes. Read-only: files that are
        unsound or stale are the store's to delete, and the engine drops their copies
        (``TierCache.settle_preload``)."""
        found: list[tuple[float, StoredChat]] = []
        for path in folder.glob(f"*{_SUFFIX}") if folder.is_dir() else ():
            try:
                stat = path.stat()
                chat = _read_index(path, stat.st_size)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if chat.model_key == key:
                found.append((stat.st_mtime, chat))
        found.sort(key=lambda item: (item[0], item[1].name), reverse=True)
        return _newest_within((chat for _, chat in found), budget)

    @property
    def running(self) -> bool:
        """Whether outcomes are still to come or to be claimed."""
        return not self.stopping.is_set() and self._reads.outstanding

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every planned file was read or skipped; False on timeout."""
        return self._reads.wait(timeout)

    def cancel(self, timeout: float | None = 10.0) -> bool:
        """Stop, dropping every outcome not claimed; whether the thread ended within ``timeout``."""
        return self._reads.cancel(timeout)

    def set_busy(self, busy: bool) -> None:
        """(Engine thread.) Hold between tensors while the engine serves requests."""
        self._reads.set_busy(busy)

    def claim(self) -> list[tuple[StoredChat, Outcome]]:
        """(Engine thread.) The files read since the last claim, newest first (a file whose read
        failed for another reason than the file, or stopped, is left out: it stays on disk)."""
        return _read_outcomes(self._reads.claim())

    def take(self, name: str) -> tuple[StoredChat, Outcome] | None:
        """(Engine thread.) A file the engine needs now: its outcome, after waiting for its read when
        it has begun; None when the engine must read it itself (not begun: it leaves the plan, or
        never planned, or already claimed). Waits even after ``cancel`` (for the read under way to
        stop), so that the engine's read never overlaps the thread's."""
        self._reads.withdraw([name])
        found = _read_outcomes(self._reads.claim(name))
        return found[0] if found else None

    def _read(self, chat: StoredChat) -> Outcome:
        """(The thread.) One planned file."""
        start = time.perf_counter()
        try:
            return read_chat(self.folder / chat.name, chat, self.pin, self.tally, self.stopping,
                             between=lambda: self._reads.pause(chat.name))
        finally:
            self.read_ms += (time.perf_counter() - start) * 1e3


def _read_outcomes(claimed: list[tuple[StoredChat, Future[Outcome]]]) -> list[tuple[StoredChat, Outcome]]:
    """The claimed reads that ended with ``read_chat``'s outcome: not skipped, nor stopped
    (``Cancelled``), nor failed for another reason than the file (``HostMemoryError``, say)."""
    return [(chat, result.result()) for chat, result in claimed
            if not result.cancelled() and result.exception() is None]


def _newest_within(chats: Iterable[StoredChat], budget: int) -> list[StoredChat]:
    """``chats`` (newest first) up to ``budget`` bytes of states, stopping at the first that would exceed it."""
    taken: list[StoredChat] = []
    left = budget
    for chat in chats:
        if chat.state_bytes > left:
            break
        taken.append(chat)
        left -= chat.state_bytes
    return taken


def drop_tiers_from_folder(cache_dir: str | Path, conversation: str) -> int:
    """``TierStore.drop`` for a chat cache folder no engine has open: any model's files."""
    folder = tier_folder(cache_dir)
    return _drop_files(folder, conversation, lambda name: _unlink(folder / name)) if folder.is_dir() else 0


# ---- the file format -------------------------------------------------------------------------


def _conversation_key(conversation: str | None) -> str:
    """A file-name-safe name of a conversation (its id may hold ``:`` and ``.``)."""
    if conversation is None:
        return _NO_CONVERSATION
    return hashlib.blake2b(conversation.encode(), digest_size=12).hexdigest()


def _drop_files(folder: Path, conversation: str, delete: Any) -> int:
    names = [path.name for path in folder.glob(f"*-{_conversation_key(conversation)}-*{_SUFFIX}")]
    for name in names:
        delete(name)
    return len(names)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor's bytes, flat uint8 (a copy only when it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _empty(spec: Mapping[str, Any], pin: bool, extra_rows: int = 0) -> torch.Tensor:
    """A host tensor for ``spec`` with ``extra_rows`` more rows (room for the next turn's tokens)."""
    shape = [int(n) for n in spec["shape"]]
    if any(n < 0 for n in shape):
        raise ValueError("negative tensor shape")
    if extra_rows and shape:
        shape[0] += extra_rows
    return torch.empty(shape, dtype=_DTYPES[spec["dtype"]], pin_memory=pin)


def _spec_bytes(spec: Mapping[str, Any]) -> int:
    return int(np.prod([int(n) for n in spec["shape"]], dtype=np.int64)) * _DTYPES[spec["dtype"]].itemsize


def _specs(header: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every tensor's entry, in file order."""
    for layer in header["keys"]:
        yield layer["pool"]
        yield from (spec for spec in layer["summaries"] if spec is not None)
    for layer in header["latents"]:
        yield layer["host"]


def _state_bytes(header: Mapping[str, Any]) -> int:
    return sum(_spec_bytes(spec) for spec in _specs(header))


@dataclass
class ReadTally:
    """Host time (ms) and bytes of reading chats' tensors: ``alloc_ms`` allocating their (pinned)
    tensors, ``crc_ms`` checksumming them, ``bytes`` read."""

    alloc_ms: float = 0.0
    crc_ms: float = 0.0
    bytes: int = 0


_CHUNK = 16 << 20  # bytes read and checksummed at once (a warm start yields to requests between chunks)
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError)


class Cancelled(Exception):
    """A ``TierPreload`` stopped in the middle of a file (nothing is known about it)."""


class HostMemoryError(Exception):
    """The (pinned) host tensors of a file's states could not be allocated: not the file's fault
    (its sizes were checked against its length when indexed), so it stays on disk."""


def read_chat(path: Path, chat: StoredChat, pin: bool, tally: ReadTally, stopping: threading.Event | None = None,
              between: Callable[[], None] | None = None) -> tuple[tuple[KeyStates, LatentStates] | None, str]:
    """Read an indexed chat's tensors from its file into new host tensors (pinned with ``pin``),
    checking each one's checksum: its states, or None and what is wrong with the file. Touches no
    store (``TierStore.read`` and the ``TierPreload`` thread both use it). Calls ``between`` before
    each tensor and each ``_CHUNK`` of one (a warm start holds there while requests run); raises
    ``Cancelled`` when ``stopping`` is set then, and ``HostMemoryError`` when its tensors cannot be had."""
    try:
        states = _read_states(path, chat, pin, tally, stopping, between)
    except _READ_ERRORS as err:
        return None, str(err)
    return states, "corrupt"


def _read_states(path: Path, chat: StoredChat, pin: bool, tally: ReadTally, stopping: threading.Event | None,
                 between: Callable[[], None] | None) -> tuple[KeyStates, LatentStates] | None:
    header = chat.header
    keys: KeyStates = {}
    latents: LatentStates = {}

    def allocated(make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return make(*args, **kwargs)
        except RuntimeError as err:  # (out of host memory, or pinning refused)
            raise HostMemoryError(str(err)) from err
        finally:
            tally.alloc_ms += (time.perf_counter() - start) * 1e3

    def empty(spec: Mapping[str, Any], extra_rows: int = 0) -> torch.Tensor:
        return allocated(_empty, spec, pin, extra_rows)

    def pause() -> None:
        if between is not None:
            between()
        if stopping is not None and stopping.is_set():
            raise Cancelled

    def read_into(tensor: torch.Tensor, spec: Mapping[str, Any]) -> bool:
        ok, got, crc_s = _read_into(file, tensor, spec, pause)
        tally.bytes += got
        tally.crc_ms += crc_s * 1e3
        return ok

    with open(path, "rb", buffering=0) as file:
        file.seek(chat.data_offset)
        for layer in header["keys"]:
            pages, page_size = int(layer["pages"]), int(layer["page_size"])
            pool = allocated(PagePool, pages + headroom(pages), page_size, int(layer["head_dim"]),
                             str(layer["fmt"]), torch.device("cpu"), pin=pin)
            if not read_into(pool.buf[:pages], layer["pool"]):
                return None
            summaries = []
            for spec in layer["summaries"]:
                summary = None if spec is None else empty(spec)
                if summary is not None and not read_into(summary, spec):
                    return None
                summaries.append(summary)
            keys[int(layer["layer"])] = ParkedPages(pool, pages, tuple(summaries))
        for layer in header["latents"]:
            rows = int(layer["rows"])
            host = empty(layer["host"], headroom(rows))
            # (a row count the header's shape contradicts fails read_into's shape check)
            if host.dim() != 2 or not read_into(host[:rows], layer["host"]):
                return None
            latents[int(layer["layer"])] = ParkedRows(host, rows)
    return keys, latents


def _read_into(file: Any, tensor: torch.Tensor, spec: Mapping[str, Any],
               pause: Callable[[], None]) -> tuple[bool, int, float]:
    """Read the next tensor of the file into ``tensor`` (its dtype and shape as the header says),
    ``_CHUNK`` bytes at a time with ``pause`` before each: whether it is sound (False when they
    differ, the file is cut short or the checksum does not match), the bytes read and the seconds
    spent checksumming them."""
    if str(tensor.dtype).removeprefix("torch.") != spec["dtype"] or list(tensor.shape) != list(spec["shape"]):
        return False, 0, 0.0
    view = memoryview(_bytes_of(tensor).numpy())
    done, crc, crc_s = 0, 0, 0.0
    while done < len(view):
        pause()
        got = file.readinto(view[done:done + _CHUNK])
        if not got:
            return False, done, crc_s
        start = time.perf_counter()
        crc = zlib.crc32(view[done:done + got], crc)
        crc_s += time.perf_counter() - start
        done += got
    if not done:
        pause()
    return crc == int(spec["crc32"]), done, crc_s


def _read_index(path: Path, size: int) -> StoredChat:
    """A file's header and token ids, checked; ValueError when the file is not a sound one."""
    with open(path, "rb") as file:
        raw = read_header_frame(file, _MAGIC, _MAX_HEADER, "long chat cache")
        header = json.loads(raw)
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
            raise ValueError("another format")
        tokens = int(header["tokens"])
        expected = _PREFIX + len(raw) + 4 * tokens + _state_bytes(header)
        if tokens < 1 or expected != size:
            raise ValueError(f"{size} bytes long, not {expected}")
        ids = file.read(4 * tokens)
    if zlib.crc32(ids) != int(header["tokens_crc32"]):
        raise ValueError("token ids checksum mismatch")
    conversation = header["conversation"]
    if conversation is not None and not isinstance(conversation, str):
        raise ValueError("the conversation must be a string")
    state_bytes = _state_bytes(header)
    return StoredChat(path.name, str(header["model_key"]), str(header["fingerprint"]), conversation,
                      np.frombuffer(ids, dtype="<i4").tolist(), state_bytes, size, size - state_bytes, header)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        logger.warning("could not delete long chat cache file %s: %s", path.name, err)
