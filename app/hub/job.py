"""The three steps of one download, run by ``DownloadManager``'s threads: plan, fetch, verify.

plan: ``snapshot_download(dry_run=True)`` lists the files the patterns select, with sizes and
    whether each is already cached; ``model_info(files_metadata=True)`` adds each file's sha256 (LFS)
    or git object id; a repo Hearth could not load is refused here, before any weight is fetched (no
    ``.safetensors`` weights, or a ``model_type`` it does not run, read from the Hub's listing or else
    from config.json); the bytes still to fetch are checked against the free disk space.
fetch: files in parallel (``Settings.download_parallelism`` threads), each with retries and
    exponential backoff for transient failures (the counter restarts when bytes arrived).
verify: every file is hashed against the published checksum before the model counts as ready; a
    mismatching file is deleted from the cache and reported.
``RunControl`` is what the steps share with the manager: the stop flag and per-file byte counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TypeVar

from huggingface_hub import snapshot_download
from huggingface_hub.hf_api import ModelInfo

from hearth.app.hub import fit
from hearth.app.hub.catalog import DEFAULT_INCLUDE, NEVER_INCLUDE, fetch_config
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import (
    ChecksumError,
    DiskFullError,
    HubError,
    UnsupportedRepoError,
    is_transient,
    is_unreachable,
)
from hearth.app.hub.events import FileProgress
from hearth.app.hub.loadable import architecture_problem, weights_problem
from hearth.app.hub.transfer import (
    QuietTqdm,
    RepoCache,
    TransferStopped,
    discard,
    fetch_file,
    git_blob_sha1_of,
    sha256_of,
)
from hearth.app.hub.units import format_bytes

T = TypeVar("T")
DISK_MARGIN_BYTES = 256 * 1024 * 1024
PLAN_UNREACHABLE_RETRIES = 2  # planning's retries when no connection can be made at all (see is_unreachable)


@dataclass(frozen=True)
class PlannedFile:
    filename: str
    size: int
    sha256: str | None
    blob_id: str | None
    is_cached: bool

    @property
    def etag(self) -> str | None:
        """The blob name the Hub will give it: sha256 for LFS files, else the git object id."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class Plan:
    commit: str
    files: tuple[PlannedFile, ...]

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 8
    base_delay_s: float = 2.0
    max_delay_s: float = 120.0

    def delay(self, attempt: int) -> float:
        return min(self.base_delay_s * 2 ** (attempt - 1), self.max_delay_s)


class RunControl:
    """Shared state of the one running download: stop flag, per-file bytes on disk, activity times."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.request: str | None = None  # "pause" or "cancel" once the user asked
        self.delete_partials = False  # with "cancel": also delete the .incomplete files
        self.phase = "planning"
        self.verified_bytes = 0
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._totals: dict[str, int] = {}
        self._last_change: dict[str, float] = {}  # files being transferred now
        self._reported_stalls: set[str] = set()

    def set_plan(self, plan: Plan, cache: RepoCache) -> None:
        with self._lock:
            for f in plan.files:
                self._totals[f.filename] = f.size
                partial = cache.partial(f.etag) if f.etag else None
                on_disk = partial.stat().st_size if partial and partial.exists() else 0
                self._sizes[f.filename] = f.size if f.is_cached else min(on_disk, f.size)

    def file_started(self, filename: str) -> None:
        with self._lock:
            self._last_change[filename] = time.monotonic()

    def file_waiting(self, filename: str) -> None:
        """The file waits out a retry back-off: nothing is being transferred, so it cannot stall."""
        with self._lock:
            self._last_change.pop(filename, None)
            self._reported_stalls.discard(filename)

    def file_size(self, filename: str, size: int) -> None:
        with self._lock:
            if self._sizes.get(filename) != size:
                self._sizes[filename] = size
                self._last_change[filename] = time.monotonic()
                self._reported_stalls.discard(filename)

    def file_finished(self, filename: str, completed: bool) -> None:
        with self._lock:
            self._last_change.pop(filename, None)
            if completed:
                self._sizes[filename] = self._totals.get(filename, self._sizes.get(filename, 0))

    def bytes_done(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def progress(self, filename: str) -> int:
        with self._lock:
            return self._sizes.get(filename, 0)

    def files(self) -> tuple[FileProgress, ...]:
        with self._lock:
            return tuple(FileProgress(n, self._sizes.get(n, 0), t) for n, t in self._totals.items())

    def new_stalls(self, timeout_s: float) -> list[tuple[str, float]]:
        """Files idle for ``timeout_s`` not reported yet (each stall is reported once)."""
        now = time.monotonic()
        with self._lock:
            stalls = [(n, now - t) for n, t in self._last_change.items()
                      if now - t >= timeout_s and n not in self._reported_stalls]
            self._reported_stalls.update(n for n, _ in stalls)
        return stalls

    def add_verified(self, n: int) -> None:
        if self.stop.is_set():
            raise TransferStopped()
        with self._lock:
            self.verified_bytes += n


def call_with_retry(fn: Callable[[], T], policy: RetryPolicy, stop: threading.Event,
                    on_retry: Callable[[int, float, BaseException], None],
                    progress: Callable[[], int] = lambda: 0,
                    max_retries: Callable[[BaseException], int] | None = None) -> T:
    """``fn()``, retried with exponential backoff while it fails transiently; stop ends the wait.
    ``max_retries(exc)``: how many retries a failure like ``exc`` gets (default: the policy's)."""
    attempt = 0
    while True:
        before = progress()
        try:
            return fn()
        except TransferStopped:
            raise
        except Exception as exc:
            if stop.is_set():
                raise TransferStopped() from exc
            if not is_transient(exc):
                raise
            attempt = 1 if progress() > before else attempt + 1
            if attempt > (max_retries(exc) if max_retries is not None else policy.max_retries):
                raise
            delay = policy.delay(attempt)
            on_retry(attempt, delay, exc)
            if stop.wait(delay):
                raise TransferStopped() from exc


def plan_download(ctx: HubContext, repo_id: str, revision: str | None, include: tuple[str, ...] | None,
                  exclude: tuple[str, ...] | None, force: bool = False) -> Plan:
    """Which files, how big, what is cached; raises ``UnsupportedRepoError`` for a repo Hearth could
    not load (``force``: not for its architecture) and ``DiskFullError`` if the rest cannot fit."""
    allow = list(include or DEFAULT_INCLUDE)
    ignore = [*(exclude or ()), *NEVER_INCLUDE]
    dry = snapshot_download(repo_id, revision=revision, cache_dir=ctx.cache_dir, endpoint=ctx.endpoint,
                            allow_patterns=allow, ignore_patterns=ignore, max_workers=ctx.parallelism,
                            library_name="hearth", tqdm_class=QuietTqdm, dry_run=True)
    if not dry:
        if include is None:
            listing = [s.rfilename for s in ctx.api().model_info(repo_id, revision=revision).siblings or ()]
            raise UnsupportedRepoError(f"{weights_problem(repo_id, (), listing)}; nothing was downloaded")
        raise HubError(f"No file of {repo_id} matches {', '.join(allow)}")
    commit = dry[0].commit_hash
    cache = RepoCache(ctx.cache_dir, repo_id)
    for d in dry:  # every name from the Hub must stay a file inside the snapshot (UnsafeNameError)
        cache.pointer(commit, d.filename)
    info = ctx.api().model_info(repo_id, revision=commit, files_metadata=True)
    remote = {s.rfilename: s for s in info.siblings or ()}
    files = []
    for d in sorted(dry, key=lambda d: d.filename):
        s = remote.get(d.filename)
        size = d.file_size if d.file_size is not None else (s.size if s and s.size else 0)
        files.append(PlannedFile(d.filename, size, s.lfs.sha256 if s and s.lfs else None,
                                 s.blob_id if s else None, is_cached=not d.will_download))
    plan = Plan(commit, tuple(files))
    _check_loadable(ctx, repo_id, plan, info, weights_required=include is None, force=force)
    _check_disk_space(plan, cache, repo_id)
    cache.snapshot(commit).mkdir(parents=True, exist_ok=True)  # scan_cache_dir wants the folder
    return plan


def plan_with_retry(ctx: HubContext, repo_id: str, revision: str | None, include: tuple[str, ...] | None,
                    exclude: tuple[str, ...] | None, ctl: RunControl, policy: RetryPolicy,
                    on_retry: Callable[[int, float, BaseException], None], force: bool = False) -> Plan:
    """``plan_download`` with retries (only ``PLAN_UNREACHABLE_RETRIES`` when the endpoint cannot be
    reached at all); a stop request made while planning counts once it returns."""

    def max_retries(exc: BaseException) -> int:
        return min(policy.max_retries, PLAN_UNREACHABLE_RETRIES) if is_unreachable(exc) else policy.max_retries

    plan = call_with_retry(lambda: plan_download(ctx, repo_id, revision, include, exclude, force), policy,
                           ctl.stop, on_retry, max_retries=max_retries)
    if ctl.stop.is_set():
        raise TransferStopped()
    return plan


def _check_loadable(ctx: HubContext, repo_id: str, plan: Plan, info: ModelInfo, *, weights_required: bool,
                    force: bool) -> None:
    """Refuse a repo Hearth could not load before any weight is fetched: one without safetensors
    weights (unless ``--include`` chose the files), or one of an architecture Hearth does not run
    (unless ``force``). The model_type comes from the Hub's listing, else from config.json (small)."""
    listing = [s.rfilename for s in info.siblings or ()]
    if weights_required and (problem := weights_problem(repo_id, [f.filename for f in plan.files], listing)):
        raise UnsupportedRepoError(f"{problem}; nothing was downloaded")
    if force:
        return
    model_type = info.config.get("model_type") if isinstance(info.config, dict) else None
    if model_type is None and "config.json" in listing:
        model_type = fetch_config(ctx, repo_id, plan.commit).get("model_type")
    if problem := architecture_problem(repo_id, model_type):
        raise UnsupportedRepoError(f"{problem}; nothing was downloaded; `hearth --cli pull --force {repo_id}` "
                                   "downloads it anyway")


def _check_disk_space(plan: Plan, cache: RepoCache, repo_id: str) -> None:
    missing = 0
    for f in plan.files:
        if not f.is_cached:
            partial = cache.partial(f.etag) if f.etag else None
            missing += f.size - (partial.stat().st_size if partial and partial.exists() else 0)
    free = fit.free_disk_bytes(cache.cache_dir)
    if missing + DISK_MARGIN_BYTES > free:
        raise DiskFullError(f"{repo_id} needs {format_bytes(missing)} more, plus {format_bytes(DISK_MARGIN_BYTES)} "
                            f"kept free as a margin, but {cache.cache_dir} has only {format_bytes(free)} free; free "
                            "some space or pick another cache folder")


def fetch_all(ctx: HubContext, repo_id: str, plan: Plan, ctl: RunControl, policy: RetryPolicy,
              on_retry: Callable[[str, int, float, BaseException], None]) -> None:
    """Download every planned file not yet in the snapshot; the first real error stops the rest."""
    cache = RepoCache(ctx.cache_dir, repo_id)
    todo = sorted((f for f in plan.files if not cache.pointer(plan.commit, f.filename).exists()),
                  key=lambda f: f.size)

    def fetch_one(f: PlannedFile) -> None:
        def attempt() -> None:
            ctl.file_started(f.filename)
            fetch_file(cache=cache, filename=f.filename, commit=plan.commit, endpoint=ctx.endpoint, stop=ctl.stop,
                       on_size=lambda n: ctl.file_size(f.filename, n))

        def retrying(attempt: int, delay: float, exc: BaseException) -> None:
            ctl.file_waiting(f.filename)  # the back-off is not a stall
            on_retry(f.filename, attempt, delay, exc)

        completed = False
        try:
            call_with_retry(attempt, policy, ctl.stop, retrying, progress=lambda: ctl.progress(f.filename))
            completed = True
        finally:
            ctl.file_finished(f.filename, completed)

    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=ctx.parallelism, thread_name_prefix="hearth-download") as pool:
        for future in as_completed([pool.submit(fetch_one, f) for f in todo]):
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
                ctl.stop.set()  # siblings stop at their next chunk, keeping their partials
    real = [e for e in errors if not isinstance(e, TransferStopped)]
    if real or errors:
        raise (real or errors)[0]


def verify_all(ctx: HubContext, repo_id: str, plan: Plan, ctl: RunControl) -> None:
    """Hash every file against its published checksum; delete and report the ones that differ."""
    cache = RepoCache(ctx.cache_dir, repo_id)

    def check(f: PlannedFile) -> str | None:
        pointer = cache.pointer(plan.commit, f.filename)
        if not pointer.exists():
            return f"{f.filename} (missing)"
        if f.sha256:
            ok = sha256_of(pointer, ctl.add_verified) == f.sha256
        elif f.blob_id:
            ok = git_blob_sha1_of(pointer, ctl.add_verified) == f.blob_id
        else:
            ok = True  # the Hub published no checksum for it
        if not ok:
            discard(pointer)
        return None if ok else f.filename

    with ThreadPoolExecutor(max_workers=ctx.parallelism, thread_name_prefix="hearth-verify") as pool:
        bad = [name for name in pool.map(check, plan.files) if name]
    if bad:
        raise ChecksumError(f"{repo_id}: {', '.join(bad)} did not match the published checksum and was "
                            "deleted; pull again to download it anew")
