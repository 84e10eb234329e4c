"""The download queue: one repo at a time, its files in parallel, pause/resume/cancel, events.

Threads: a scheduler runs the queued items in order (``job.py`` does the work); a ticker reports
progress (bytes, speed over the last seconds, ETA) every ``progress_interval_s`` and notices
stalls. Events go to ``on_event`` from these threads (see ``events.py``).

Stalls: the library's read timeout is set to ``stall_timeout_s``, so a transfer that receives
nothing for that long is reconnected with a Range request (by ``http_get`` itself, then by Hearth's
retry with exponential backoff); the ticker reports each stall as ``DownloadStalled``.

Restart: every unfinished item is kept in ``downloads.json``; a new manager loads them paused, and
``resume`` continues from the partial files. A failed item is kept too (the GUI shows its reason
after a restart), marked ``is_resumable=False`` when pulling again has nothing to continue (no such
repo, no access, nothing Hearth can load, or a failure before any plan was made): name resolution
does not take such an entry for an unfinished download, and ``hearth --cli pull`` drops it.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hf_constants

from hearth.app.hub import events as ev
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import ChecksumError, check_repo_id, describe
from hearth.app.hub.job import RetryPolicy, RunControl, fetch_all, plan_with_retry, verify_all
from hearth.app.hub.state import QueueFile, Registry
from hearth.app.hub.transfer import RepoCache, TransferStopped
from hearth.app.store.settings import Settings

logger = logging.getLogger(__name__)
SPEED_WINDOW_S = 5.0


class ItemState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


SETTLED = frozenset({ItemState.PAUSED, ItemState.READY, ItemState.FAILED, ItemState.CANCELLED})


@dataclass
class DownloadItem:
    """One repo to download. Mutable and owned by the manager; ``items()`` hands out copies."""

    item_id: str
    repo_id: str
    revision: str | None
    include: tuple[str, ...] | None
    exclude: tuple[str, ...] | None
    state: ItemState = ItemState.QUEUED
    commit: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    message: str | None = None
    path: str | None = None
    force: bool = False  # download even an architecture Hearth does not run
    is_resumable: bool = True  # False after a failure that pulling again has nothing to continue from

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "state": str(self.state)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DownloadItem:
        fields = {f.name for f in dataclasses.fields(cls)}
        item = cls(**{k: v for k, v in data.items() if k in fields})
        item.state = ItemState(item.state)
        item.include = tuple(item.include) if item.include else None
        item.exclude = tuple(item.exclude) if item.exclude else None
        if "is_resumable" not in data:  # written by an older Hearth: resumable once it had a plan
            item.is_resumable = item.commit is not None
        return item


@dataclass(frozen=True)
class DownloadOptions:
    stall_timeout_s: float = 30.0
    max_retries: int = 8
    backoff_base_s: float = 2.0
    backoff_max_s: float = 120.0
    progress_interval_s: float = 0.5
    chunk_bytes: int = 1024 * 1024

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_retries, self.backoff_base_s, self.backoff_max_s)


class DownloadManager:
    """Queue of Hub downloads. Call ``start()`` once; ``close()`` pauses and stops the threads."""

    def __init__(self, settings: Settings, *, on_event: Callable[[ev.DownloadEvent], None] | None = None,
                 options: DownloadOptions = DownloadOptions(), state_dir: Path | None = None) -> None:
        self.ctx = HubContext.from_settings(settings, state_dir)
        self.options = options
        self._on_event = on_event
        self._queue_file = QueueFile(self.ctx.queue_path)
        self._registry = Registry(self.ctx.registry_path)
        self._cond = threading.Condition(threading.RLock())  # re-entrant: listeners may call back
        self._closed = threading.Event()
        self._running: tuple[DownloadItem, RunControl] | None = None
        self._threads: list[threading.Thread] = []
        self._items = self._load_items()
        _tune_library(options)

    # ---- public API -------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._schedule, "hearth-download-queue"), (self._tick, "hearth-download-ticker")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float = 30.0) -> None:
        """Pause the running download (partials kept) and stop the threads."""
        with self._cond:
            if self._running is not None:
                self._request_stop(self._running[1], "pause")
            self._closed.set()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    def enqueue(self, repo_id: str, *, revision: str | None = None, include: tuple[str, ...] | None = None,
                exclude: tuple[str, ...] | None = None, force: bool = False) -> str:
        """Queue ``repo_id`` (again); returns its item id. A paused or failed item resumes. ``force``:
        download it even when its architecture is not one Hearth runs."""
        self.ctx.require_online(f"download {repo_id}")
        check_repo_id(repo_id)
        item_id = f"{repo_id}@{revision or 'main'}"
        with self._cond:
            item = self._items.get(item_id)
            if item is not None and item.state in (ItemState.QUEUED, ItemState.RUNNING):
                return item_id
            new = DownloadItem(item_id, repo_id, revision, tuple(include) if include else None,
                               tuple(exclude) if exclude else None, force=force)
            if item is not None and item.include == new.include and item.exclude == new.exclude:
                # Resume the same commit, not whatever main is now (what is kept counts until the plan).
                new.commit, new.bytes_done, new.bytes_total = item.commit, item.bytes_done, item.bytes_total
            self._items[item_id] = new
            self._persist(new)
            self._emit(ev.DownloadQueued(item_id, repo_id))
            self._cond.notify_all()
        return item_id

    def pause(self, item_id: str) -> None:
        with self._cond:
            item = self._items[item_id]
            if self._running is not None and self._running[0] is item:
                self._request_stop(self._running[1], "pause")
                return
            if item.state != ItemState.QUEUED:
                return
            item.state = ItemState.PAUSED
            self._persist(item)
            self._emit(ev.DownloadPaused(item_id, item.repo_id, item.bytes_done, item.bytes_total))
            self._cond.notify_all()

    def resume(self, item_id: str) -> None:
        with self._cond:
            item = self._items[item_id]
            if item.state not in (ItemState.PAUSED, ItemState.FAILED):
                return
            item.state, item.message, item.is_resumable = ItemState.QUEUED, None, True
            self._persist(item)
            self._emit(ev.DownloadQueued(item_id, item.repo_id))
            self._cond.notify_all()

    def cancel(self, item_id: str, *, delete_partials: bool = False) -> None:
        """Drop the item; with ``delete_partials`` also its ``.incomplete`` files."""
        with self._cond:
            item = self._items[item_id]
            if self._running is not None and self._running[0] is item:
                self._running[1].delete_partials = delete_partials
                self._request_stop(self._running[1], "cancel")
                return
            item.state = ItemState.CANCELLED  # under the lock: the scheduler will not pick it now
        self._finish_cancel(item, delete_partials)

    def items(self) -> list[DownloadItem]:
        with self._cond:
            return [dataclasses.replace(item) for item in self._items.values()]

    def item(self, item_id: str) -> DownloadItem:
        with self._cond:
            return dataclasses.replace(self._items[item_id])

    def wait(self, item_id: str, timeout: float | None = None) -> ItemState:
        """Block until the item is paused, ready, failed or cancelled (gone from the queue);
        TimeoutError when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (item := self._items.get(item_id)) is not None and item.state not in SETTLED:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{item_id} is still {item.state}")
                self._cond.wait(remaining)
            return ItemState.CANCELLED if item is None else item.state

    # ---- scheduler --------------------------------------------------------------------------
    def _schedule(self) -> None:
        while True:
            with self._cond:
                item = self._next_queued()
                while item is None and not self._closed.is_set():
                    self._cond.wait()
                    item = self._next_queued()
                if self._closed.is_set():
                    return
                ctl = RunControl()
                item.state = ItemState.RUNNING
                self._running = (item, ctl)
                self._persist(item)
            try:
                self._execute(item, ctl)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _next_queued(self) -> DownloadItem | None:
        return next((i for i in self._items.values() if i.state == ItemState.QUEUED), None)

    def _execute(self, item: DownloadItem, ctl: RunControl) -> None:
        try:
            self._download(item, ctl)
        except TransferStopped:
            if ctl.request == "cancel":
                self._finish_cancel(item, ctl.delete_partials, ctl)
            else:
                item.bytes_done = ctl.bytes_done()
                self._close(item, ctl, ev.DownloadPaused(item.item_id, item.repo_id, item.bytes_done,
                                                         item.bytes_total), ItemState.PAUSED)
        except Exception as exc:
            error = describe(exc, item.repo_id, self.ctx.endpoint)
            # The message is the user's one line (the CLI prints it, the GUI shows it); the
            # traceback is for --debug only.
            logger.debug("Download of %s failed", item.repo_id, exc_info=exc)
            if isinstance(error, ChecksumError):
                self._registry.unmark_ready(item.repo_id)  # a re-pull found a bad file
            item.bytes_done = ctl.bytes_done()
            # Kept for a later pull only when there is something to continue: a plan, maybe partial files.
            item.is_resumable = error.is_resumable and item.commit is not None
            self._close(item, ctl, ev.DownloadFailed(item.item_id, item.repo_id, str(error), error.is_resumable),
                        ItemState.FAILED, message=str(error))

    def _download(self, item: DownloadItem, ctl: RunControl) -> None:
        policy = self.options.retry_policy

        def on_retry(filename: str | None, attempt: int, delay: float, exc: BaseException) -> None:
            reason = str(describe(exc, item.repo_id, self.ctx.endpoint))
            self._emit(ev.DownloadRetrying(item.item_id, item.repo_id, filename, attempt, delay, reason))

        plan = plan_with_retry(self.ctx, item.repo_id, item.commit or item.revision, item.include,
                               item.exclude, ctl, policy, lambda a, d, e: on_retry(None, a, d, e), item.force)
        cache = RepoCache(self.ctx.cache_dir, item.repo_id)
        item.commit, item.bytes_total = plan.commit, plan.bytes_total
        ctl.set_plan(plan, cache)
        with self._cond:
            self._persist(item)
        to_download = plan.bytes_total - ctl.bytes_done()
        self._emit(ev.DownloadStarted(item.item_id, item.repo_id, plan.commit, len(plan.files),
                                      plan.bytes_total, to_download))
        ctl.phase = "downloading"
        fetch_all(self.ctx, item.repo_id, plan, ctl, policy, on_retry)
        ctl.phase = "verifying"
        verify_all(self.ctx, item.repo_id, plan, ctl)
        self._registry.mark_ready(item.repo_id, commit=plan.commit, revision=item.revision or "main",
                                  num_files=len(plan.files), size_bytes=plan.bytes_total)
        item.bytes_done = plan.bytes_total
        path = str(cache.snapshot(plan.commit))
        self._close(item, ctl, ev.DownloadReady(item.item_id, item.repo_id, path, plan.bytes_total),
                    ItemState.READY, path=path)

    def _close(self, item: DownloadItem, ctl: RunControl | None, event: ev.DownloadEvent, state: ItemState,
               **fields: str | None) -> None:
        """The item's closing event, then its new state, atomically: no progress event follows it,
        and ``wait`` returns only after the listener has seen it."""
        with self._cond:
            if ctl is not None:
                ctl.phase = "done"
            self._emit(event)
            self._settle(item, state, **fields)

    def _settle(self, item: DownloadItem, state: ItemState, *, message: str | None = None,
                path: str | None = None) -> None:
        with self._cond:
            item.state, item.message, item.path = state, message, path
            self._persist(item)
            if state == ItemState.CANCELLED:
                self._items.pop(item.item_id, None)
            self._cond.notify_all()

    def _finish_cancel(self, item: DownloadItem, delete_partials: bool, ctl: RunControl | None = None) -> None:
        if delete_partials:
            blobs = RepoCache(self.ctx.cache_dir, item.repo_id).folder / "blobs"
            for partial in blobs.glob("*.incomplete"):
                partial.unlink(missing_ok=True)
            _remove_if_empty(blobs.parent)
        self._close(item, ctl, ev.DownloadCancelled(item.item_id, item.repo_id, delete_partials),
                    ItemState.CANCELLED)

    def _request_stop(self, ctl: RunControl, request: str) -> None:
        ctl.request = ctl.request or request
        ctl.stop.set()

    # ---- progress ticker --------------------------------------------------------------------
    def _tick(self) -> None:
        history: deque[tuple[float, int]] = deque()
        current: RunControl | None = None
        while not self._closed.wait(self.options.progress_interval_s):
            with self._cond:  # ordered with the closing events (see _close)
                running = self._running
                if running is None:
                    continue
                item, ctl = running
                if ctl is not current:
                    current, history = ctl, deque()
                if ctl.phase == "downloading":
                    self._report_download(item, ctl, history)
                elif ctl.phase == "verifying":
                    self._emit(ev.DownloadVerifying(item.item_id, item.repo_id, ctl.verified_bytes,
                                                    item.bytes_total))

    def _report_download(self, item: DownloadItem, ctl: RunControl, history: deque[tuple[float, int]]) -> None:
        now, done = time.monotonic(), ctl.bytes_done()
        item.bytes_done = done
        history.append((now, done))
        while len(history) > 2 and now - history[0][0] > SPEED_WINDOW_S:
            history.popleft()
        speed = eta = None
        span = now - history[0][0]
        if span >= 0.5:
            speed = max(done - history[0][1], 0) / span
            eta = (item.bytes_total - done) / speed if speed > 0 else None
        self._emit(ev.DownloadProgress(item.item_id, item.repo_id, done, item.bytes_total, speed, eta,
                                       ctl.files()))
        for filename, idle in ctl.new_stalls(self.options.stall_timeout_s):
            self._emit(ev.DownloadStalled(item.item_id, item.repo_id, filename, idle))

    # ---- persistence and events -------------------------------------------------------------
    def _load_items(self) -> dict[str, DownloadItem]:
        items = {}
        for item_id, data in self._queue_file.load().items():
            try:
                item = DownloadItem.from_json(data)
            except (TypeError, ValueError):
                logger.warning("Dropping an unreadable download entry %s", item_id)
                continue
            if item.state in (ItemState.QUEUED, ItemState.RUNNING):
                item.state = ItemState.PAUSED  # nothing starts by itself after a restart
            items[item_id] = item
        return items

    def _persist(self, item: DownloadItem) -> None:
        """Write the item's current state; callers hold ``_cond`` so file order = state order."""
        if item.state in (ItemState.READY, ItemState.CANCELLED):
            self._queue_file.remove(item.item_id)
        else:
            self._queue_file.put(item.item_id, item.to_json())

    def _emit(self, event: ev.DownloadEvent) -> None:
        if self._on_event is None:
            return
        try:
            with self._cond:  # one event at a time, in state order
                self._on_event(event)
        except Exception:
            logger.exception("A download event listener failed on %s", type(event).__name__)


def _tune_library(options: DownloadOptions) -> None:
    # NOTE: process-wide huggingface_hub settings, read by http_get at each call. The read timeout
    # is the stall detector (no byte for that long -> reconnect with Range); smaller chunks make
    # progress, pause and stall checks responsive (the default is 10 MB between writes).
    hf_constants.HF_HUB_DOWNLOAD_TIMEOUT = options.stall_timeout_s
    hf_constants.DOWNLOAD_CHUNK_SIZE = min(hf_constants.DOWNLOAD_CHUNK_SIZE, options.chunk_bytes)


def _remove_if_empty(folder: Path) -> None:
    """Remove a repo folder that holds no file at all (a cancelled first download)."""
    if folder.is_dir() and not any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)
