"""What ``DownloadManager`` tells its listener: plain frozen dataclasses, one per happening.

Events are delivered to the ``on_event`` callback from the manager's worker threads; a GUI re-emits
them as queued Qt signals, the CLI prints them. Every event names its ``item_id`` and ``repo_id``.
An item's closing event (paused, ready, failed, cancelled) is delivered just before the manager's
state changes, so ``DownloadManager.wait`` returns only after the listener has seen it.
Listeners are called one at a time under the manager's (re-entrant) lock: they may call the manager,
but must not block on another thread that does (post to a queue or a queued Qt signal instead).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileProgress:
    """One file of a download: bytes on disk so far (partial included) out of its size."""

    filename: str
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class DownloadQueued:
    item_id: str
    repo_id: str


@dataclass(frozen=True)
class DownloadStarted:
    """The plan is known: ``bytes_to_download`` excludes files (and partial bytes) already here."""

    item_id: str
    repo_id: str
    commit: str
    num_files: int
    bytes_total: int
    bytes_to_download: int


@dataclass(frozen=True)
class DownloadProgress:
    """Periodic: totals, speed over the last seconds (None until measurable) and ETA."""

    item_id: str
    repo_id: str
    bytes_done: int
    bytes_total: int
    speed_bps: float | None
    eta_s: float | None
    files: tuple[FileProgress, ...]


@dataclass(frozen=True)
class DownloadStalled:
    """No byte arrived for ``idle_s`` seconds; the transfer is reconnected with a Range request."""

    item_id: str
    repo_id: str
    filename: str
    idle_s: float


@dataclass(frozen=True)
class DownloadRetrying:
    item_id: str
    repo_id: str
    filename: str | None
    attempt: int
    delay_s: float
    reason: str


@dataclass(frozen=True)
class DownloadVerifying:
    """Checksums are being computed: ``bytes_done`` hashed out of ``bytes_total``."""

    item_id: str
    repo_id: str
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class DownloadPaused:
    """Stopped on request (or by a restart); partial files are kept for ``resume``."""

    item_id: str
    repo_id: str
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class DownloadReady:
    """Downloaded and every file verified; ``path`` is the snapshot folder to load."""

    item_id: str
    repo_id: str
    path: str
    bytes_total: int


@dataclass(frozen=True)
class DownloadFailed:
    """Gave up; ``message`` is one line for people. ``is_resumable``: partial data was kept."""

    item_id: str
    repo_id: str
    message: str
    is_resumable: bool


@dataclass(frozen=True)
class DownloadCancelled:
    item_id: str
    repo_id: str
    partials_deleted: bool


DownloadEvent = (
    DownloadQueued | DownloadStarted | DownloadProgress | DownloadStalled | DownloadRetrying
    | DownloadVerifying | DownloadPaused | DownloadReady | DownloadFailed | DownloadCancelled
)
