"""DownloadManager against the fake Hub: full download + verification, pause/restart/resume with a
Range request, dropped connections, 500s with backoff, stalls, checksum mismatches, gated repos,
full disks, cancel, and offline mode. Every wait is bounded."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from hearth.app.hub import events as ev
from hearth.app.hub import fit, job, transfer
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError, OfflineError
from hearth.app.hub.installed import list_installed, resolve_model
from hearth.app.hub.manager import DownloadManager, ItemState
from hearth.app.hub.state import QueueFile, Registry
from hearth.app.hub.transfer import RepoCache
from tests.app.conftest import FAST, GATED_REPO, TINY_REPO, EventLog, add_unloadable_repos
from tests.app.fakehub import FakeHub, Fault

WEIGHTS = "model.safetensors"


def _cache(manager: DownloadManager, repo_id: str = TINY_REPO) -> RepoCache:
    return RepoCache(manager.ctx.cache_dir, repo_id)


def _is_ready(manager: DownloadManager, repo_id: str = TINY_REPO) -> bool:
    return repo_id in Registry(manager.ctx.registry_path).ready()


def test_full_download_is_verified_listed_and_resolvable(make_manager, fake_hub: FakeHub):
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.READY

    snapshot = _cache(manager).snapshot("a" * 40)
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", WEIGHTS, "tokenizer.json"]
    assert (snapshot / WEIGHTS).read_bytes() == fake_hub.repos[TINY_REPO].files[WEIGHTS].content
    assert not fake_hub.file_requests(TINY_REPO, "pytorch_model.bin")  # pickles are never fetched
    assert not fake_hub.file_requests(TINY_REPO, "README.md")
    ready = log.of(ev.DownloadReady)
    assert len(ready) == 1 and Path(ready[0].path) == snapshot
    started = log.of(ev.DownloadStarted)[0]
    assert started.num_files == 3 and started.bytes_to_download == started.bytes_total
    assert _is_ready(manager)

    [model] = list_installed(manager.ctx)
    assert (model.name, model.source, model.model_type) == (TINY_REPO, "hub", "deepseek_v3")
    assert model.is_ready and model.is_supported and model.size_bytes >= started.bytes_total
    assert resolve_model(TINY_REPO, manager.ctx) == snapshot
    assert manager.ctx.queue_path.exists() and TINY_REPO not in manager.ctx.queue_path.read_text()


def test_pause_restart_resume_continues_from_the_partial_file(make_manager, fake_hub: FakeHub, settings):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("slow", chunk=16 * 1024, seconds=0.05))
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    log.wait_for(lambda e: isinstance(e, ev.DownloadProgress)
                 and any(f.filename == WEIGHTS and 0 < f.bytes_done < f.bytes_total // 2 for f in e.files))
    manager.pause(item_id)
    assert manager.wait(item_id, timeout=10) == ItemState.PAUSED
    manager.close()

    etag = fake_hub.repos[TINY_REPO].files[WEIGHTS].etag
    partial = _cache(manager).partial(etag)
    kept = partial.stat().st_size
    total = len(fake_hub.repos[TINY_REPO].files[WEIGHTS].content)
    assert 0 < kept < total
    assert not _is_ready(manager)

    # A new manager (an app restart) finds the item paused and resumes it with a Range request.
    restarted, log2 = make_manager()
    [item] = restarted.items()
    assert (item.item_id, item.state) == (item_id, ItemState.PAUSED)
    restarted.resume(item_id)
    assert restarted.wait(item_id, timeout=20) == ItemState.READY
    ranges = [r.headers.get("range") for r in fake_hub.file_requests(TINY_REPO, WEIGHTS)]
    assert ranges[-1] == f"bytes={kept}-"
    assert log2.of(ev.DownloadStarted)[0].bytes_to_download == total - kept
    assert not partial.exists() and _is_ready(restarted)


def test_dropped_connection_resumes_with_range(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("drop", after_bytes=100_000))
    manager, _ = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.READY
    ranges = [r.headers.get("range") for r in fake_hub.file_requests(TINY_REPO, WEIGHTS)]
    assert ranges[0] is None and ranges[-1] is not None
    assert int(ranges[-1].removeprefix("bytes=").rstrip("-")) >= 16 * 1024  # kept what arrived


def test_server_errors_are_retried_with_backoff(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("status", status=500, times=2))
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.READY
    retries = log.of(ev.DownloadRetrying)
    assert [r.attempt for r in retries] == [1, 2]
    assert retries[1].delay_s == 2 * retries[0].delay_s  # exponential
    assert all(r.filename == WEIGHTS and "500" in r.reason for r in retries)
    assert len(fake_hub.file_requests(TINY_REPO, WEIGHTS)) == 3


def test_persistent_server_errors_fail_resumable_and_not_ready(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("status", status=503, times=100))
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.FAILED
    failed = log.of(ev.DownloadFailed)[0]
    assert failed.is_resumable and "503" in failed.message
    assert len(log.of(ev.DownloadRetrying)) == FAST.max_retries
    assert not _is_ready(manager)


def test_stall_is_reported_and_the_transfer_reconnects(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("stall", after_bytes=50_000, seconds=10))
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.READY
    stall = log.of(ev.DownloadStalled)
    assert stall and stall[0].filename == WEIGHTS and stall[0].idle_s >= FAST.stall_timeout_s
    requests = fake_hub.file_requests(TINY_REPO, WEIGHTS)
    assert len(requests) >= 2 and requests[-1].headers.get("range", "").startswith("bytes=")


def test_checksum_mismatch_deletes_the_file_and_nothing_is_ready(make_manager, fake_hub: FakeHub):
    f = fake_hub.repos[TINY_REPO].files[WEIGHTS]
    f.served = bytes([f.content[0] ^ 0xFF]) + f.content[1:]
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.FAILED
    failed = log.of(ev.DownloadFailed)[0]
    assert WEIGHTS in failed.message and "checksum" in failed.message
    cache = _cache(manager)
    assert not cache.blob(f.etag).exists() and not cache.pointer("a" * 40, WEIGHTS).exists()
    assert (cache.pointer("a" * 40, "config.json")).exists()  # good files stay
    assert not _is_ready(manager)
    assert not [m for m in list_installed(manager.ctx) if m.is_ready]


def test_gated_repo_without_token_explains_how_to_get_access(make_manager, fake_hub: FakeHub):
    manager, log = make_manager()
    item_id = manager.enqueue(GATED_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.FAILED
    message = log.of(ev.DownloadFailed)[0].message
    assert "gated" in message and f"{fake_hub.url}/{GATED_REPO}" in message and "HF_TOKEN" in message
    assert not log.of(ev.DownloadRetrying)


def test_gated_repo_with_a_granted_token_downloads(make_manager, fake_hub: FakeHub, monkeypatch):
    fake_hub.granted_tokens["hf_test_granted"] = {GATED_REPO}
    monkeypatch.setenv("HF_TOKEN", "hf_test_granted")
    manager, log = make_manager()
    item_id = manager.enqueue(GATED_REPO)
    assert manager.wait(item_id, timeout=20) == ItemState.READY
    assert all("hf_test_granted" not in repr(e) for e in log.events)


def test_gated_repo_with_an_ungranted_token_says_so(make_manager, fake_hub: FakeHub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_not_granted")
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(GATED_REPO), timeout=20) == ItemState.FAILED
    message = log.of(ev.DownloadFailed)[0].message
    assert "no access yet" in message and "hf_test_not_granted" not in message


def test_too_little_free_space_is_refused_before_downloading(make_manager, fake_hub: FakeHub, monkeypatch):
    monkeypatch.setattr(fit, "free_disk_bytes", lambda path: 1000)
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.FAILED
    message = log.of(ev.DownloadFailed)[0].message
    assert "free" in message and str(manager.ctx.cache_dir) in message
    assert not fake_hub.file_requests(TINY_REPO, WEIGHTS) and not _is_ready(manager)


def test_disk_full_mid_download_keeps_the_partial_and_marks_nothing_ready(make_manager, fake_hub, monkeypatch):
    real_open = transfer.open_partial

    class FillingUp:
        def __init__(self, raw):
            self.raw = raw

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.raw.close()

        def write(self, data):
            if self.raw.tell() + len(data) > 40_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.write(data)

    monkeypatch.setattr(transfer, "open_partial", lambda path: FillingUp(real_open(path)))
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.FAILED
    failed = log.of(ev.DownloadFailed)[0]
    assert "disk filled up" in failed.message and failed.is_resumable
    assert not log.of(ev.DownloadRetrying)  # a full disk is not retried
    etag = fake_hub.repos[TINY_REPO].files[WEIGHTS].etag
    assert 0 < _cache(manager).partial(etag).stat().st_size <= 40_000
    assert not _is_ready(manager)


def test_cancel_can_delete_partials(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("slow", chunk=8 * 1024, seconds=0.05))
    manager, log = make_manager()
    item_id = manager.enqueue(TINY_REPO)
    log.wait_for(lambda e: isinstance(e, ev.DownloadProgress)
                 and any(f.filename == WEIGHTS and f.bytes_done > 0 for f in e.files))
    manager.cancel(item_id, delete_partials=True)
    assert manager.wait(item_id, timeout=10) == ItemState.CANCELLED
    assert log.of(ev.DownloadCancelled)[0].partials_deleted
    assert not list((_cache(manager).folder / "blobs").glob("*.incomplete"))
    assert manager.items() == [] and not _is_ready(manager)


def test_offline_mode_makes_no_request(make_manager, fake_hub: FakeHub, settings, tmp_path):
    offline = settings.replace(offline=True)
    manager, _ = make_manager(settings_=offline)
    with pytest.raises(OfflineError):
        manager.enqueue(TINY_REPO)
    ctx = HubContext.from_settings(offline)
    assert list_installed(ctx) == []
    assert fake_hub.requests == []


def test_events_report_speed_and_eta(make_manager, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, WEIGHTS, Fault("slow", chunk=16 * 1024, seconds=0.06))
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.READY
    timed = [e for e in log.of(ev.DownloadProgress) if e.speed_bps]
    assert timed, "progress events carry a speed once measurable"
    assert all(e.eta_s is None or e.eta_s >= 0 for e in timed)
    assert max(e.bytes_done for e in log.of(ev.DownloadProgress)) <= timed[0].bytes_total


def test_queue_survives_a_restart_paused(settings):
    manager = DownloadManager(settings, options=FAST)  # not started: the item stays queued
    manager.pause(manager.enqueue(TINY_REPO))
    reloaded = EventLog()
    again = DownloadManager(settings, on_event=reloaded, options=FAST)
    assert [(i.repo_id, i.state) for i in again.items()] == [(TINY_REPO, ItemState.PAUSED)]


# ---- repos Hearth could not load are refused before their weights are fetched ----------------


@pytest.mark.parametrize(("repo_id", "words"), [
    ("hearth-test/pickle-only", "has no .safetensors weights (only .bin files): Hearth never loads pickle files"),
    ("hearth-test/gguf-only", "has no .safetensors weights (only .gguf files): Hearth never loads pickle files; "
                              "GGUF is not supported"),
])
def test_a_repo_without_safetensors_is_refused_for_good(make_manager, fake_hub: FakeHub, repo_id, words):
    add_unloadable_repos(fake_hub)
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(repo_id), timeout=20) == ItemState.FAILED
    failed = log.of(ev.DownloadFailed)[0]
    assert words in failed.message and not failed.is_resumable
    assert not log.of(ev.DownloadStarted) and not log.of(ev.DownloadRetrying)
    assert not [r for r in fake_hub.requests if r.method == "GET" and "/resolve/" in r.path]  # nothing fetched
    assert list_installed(manager.ctx) == [] and not _is_ready(manager, repo_id)
    assert QueueFile(manager.ctx.queue_path).unfinished(repo_id) == []  # pulling again cannot continue it


def test_an_architecture_hearth_cannot_run_is_refused_unless_forced(make_manager, fake_hub: FakeHub):
    add_unloadable_repos(fake_hub)
    manager, log = make_manager()
    for repo_id in ("meta/llama-tiny", "meta/llama-unlisted"):  # from the listing, or else config.json
        assert manager.wait(manager.enqueue(repo_id), timeout=20) == ItemState.FAILED
        message = log.of(ev.DownloadFailed)[-1].message
        assert f"{repo_id} is a llama model, an architecture Hearth cannot run (it runs deepseek_v2, " in message
        assert f"`hearth --cli pull --force {repo_id}`" in message
        assert not fake_hub.file_requests(repo_id, WEIGHTS)
    assert not fake_hub.file_requests("meta/llama-tiny", "config.json")  # the listing said it
    assert list_installed(manager.ctx) == []

    item_id = manager.enqueue("meta/llama-tiny", force=True)
    assert manager.wait(item_id, timeout=20) == ItemState.READY
    [model] = list_installed(manager.ctx)
    assert (model.name, model.model_type, model.is_ready, model.is_supported) == ("meta/llama-tiny", "llama",
                                                                                  True, False)


def test_a_pull_of_only_some_files_is_not_ready_to_run(make_manager, fake_hub: FakeHub):
    """--include may leave the weights out: verified, but neither ready nor supported."""
    manager, _ = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO, include=("*.json",)), timeout=20) == ItemState.READY
    [model] = list_installed(manager.ctx)
    assert not model.has_weights and not model.is_ready and not model.is_supported
    with pytest.raises(HubError, match=r"has no \.safetensors weights .*hearth --cli rm hearth-test/tiny-deepseek"):
        resolve_model(TINY_REPO, manager.ctx)


# ---- failures: what is kept, how fast an unreachable Hub gives up, what the messages say --------


def test_failures_for_good_are_not_taken_for_unfinished_downloads(make_manager, fake_hub: FakeHub, settings):
    """They stay listed (the app shows why after a restart) but nothing resolves them as "resume it"."""
    manager, log = make_manager()
    failures = (("nobody/nothing", None), (GATED_REPO, None), (TINY_REPO, "no-such-branch"))
    for repo_id, revision in failures:
        assert manager.wait(manager.enqueue(repo_id, revision=revision), timeout=20) == ItemState.FAILED
    assert [e.is_resumable for e in log.of(ev.DownloadFailed)] == [False, False, False]
    queue = QueueFile(manager.ctx.queue_path)
    assert all(queue.unfinished(repo_id) == [] for repo_id, _ in failures)
    restarted = DownloadManager(settings, options=FAST).items()
    assert sorted((i.repo_id, i.state, i.is_resumable) for i in restarted) == sorted(
        (repo_id, ItemState.FAILED, False) for repo_id, _ in failures)
    with pytest.raises(HubError, match="No model called nobody/nothing"):
        resolve_model("nobody/nothing", manager.ctx)


def test_an_old_failed_entry_without_a_plan_is_not_resumable(settings):
    ctx = HubContext.from_settings(settings)
    old = {"item_id": "nobody/nothing@main", "repo_id": "nobody/nothing", "revision": None, "include": None,
           "exclude": None, "state": "failed", "commit": None, "bytes_done": 0, "bytes_total": 0,
           "message": "nobody/nothing was not found", "path": None}  # what an older Hearth wrote
    QueueFile(ctx.queue_path).put(old["item_id"], old)
    [item] = DownloadManager(settings, options=FAST).items()
    assert not item.is_resumable and QueueFile(ctx.queue_path).unfinished("nobody/nothing") == []
    with pytest.raises(HubError, match="No model called nobody/nothing"):
        resolve_model("nobody/nothing", ctx)


def test_an_unreachable_hub_fails_after_a_short_try(make_manager, settings, tmp_path):
    with socket.socket() as sock:  # a port nothing listens on: the connection is refused
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    manager, log = make_manager(settings_=settings.replace(hf_endpoint=closed))
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.FAILED
    assert len(log.of(ev.DownloadRetrying)) == job.PLAN_UNREACHABLE_RETRIES < FAST.max_retries
    failed = log.of(ev.DownloadFailed)[0]
    assert failed.message.startswith(f"Cannot reach {closed} to download {TINY_REPO} (")
    assert "HF_ENDPOINT" in failed.message
    assert failed.is_resumable  # worth a retry, but nothing was planned that a later pull could continue
    assert not manager.items()[0].is_resumable and QueueFile(manager.ctx.queue_path).unfinished(TINY_REPO) == []


def test_the_disk_space_message_names_the_margin(make_manager, fake_hub: FakeHub, monkeypatch):
    needed = sum(len(f.content) for p, f in fake_hub.repos[TINY_REPO].files.items()
                 if p in ("config.json", WEIGHTS, "tokenizer.json"))
    monkeypatch.setattr(fit, "free_disk_bytes", lambda path: needed + job.DISK_MARGIN_BYTES // 2)
    manager, log = make_manager()
    assert manager.wait(manager.enqueue(TINY_REPO), timeout=20) == ItemState.FAILED
    message = log.of(ev.DownloadFailed)[0].message
    assert f"needs 262.6 kB more, plus 268.4 MB kept free as a margin, but {manager.ctx.cache_dir} has only " \
           "134.5 MB free" in message
