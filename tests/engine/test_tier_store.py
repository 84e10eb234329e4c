"""Parked long chats on disk (hearth.engine.tier_store): a chat's tiered keys and latents leave RAM
for a file when the RAM budget pushes them out or the engine stops, and a later engine (or the same
one) adopts them; the tokens equal a fresh engine's that reads the whole prompt. Unsound or stale
files are deleted and recomputed, never used; files are private, bounded by an LRU budget and
deleted with their chat."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hearth.engine import Engine, EngineConfig, tier_store
from hearth.engine import engine as engine_module
from hearth.engine.testing.tiny import write_tiny_model
from hearth.engine.tier_store import TierPreload, TierStore, drop_tiers_from_folder, tier_folder
from hearth.offload.coarse_index import PagePool
from hearth.offload.parked import ParkedPages, ParkedRows
from tests.engine.test_tier_cache import BASE, EXACT_KEYS, KEYS_AND_LATENTS, _covered, _fresh, _ids, _tier_stats, _turn


@pytest.fixture(scope="module")
def v32(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tier_store") / "v32", "deepseek_v32", seed=1))


def _config(cache: Path, tiers: dict, **options) -> EngineConfig:
    """(No warm start unless asked for: these tests read chats back on the request path.)"""
    return EngineConfig(**BASE, **tiers, prefix_cache_dir=str(cache), **{"prefix_cache_preload": False, **options})


def _files(cache: Path) -> list[Path]:
    return sorted(tier_folder(cache).glob("*.tiers"))


def _first_turn(v32: str, cache: Path, tiers: dict, conversation: str = "chat") -> tuple[list[int], list[int]]:
    """A chat's first turn on an engine that is then closed; returns the prompt and the answer."""
    engine = Engine.load(v32, _config(cache, tiers))
    prompt = _ids(60, 7)
    answer, _ = _turn(engine, prompt, conversation)
    assert engine.close() >= 1
    return prompt, answer


@pytest.mark.parametrize("tiers", [KEYS_AND_LATENTS, EXACT_KEYS], ids=["keys+latents", "keys"])
def test_a_parked_chat_survives_a_restart_and_its_next_turn_equals_a_full_prefill(v32, tmp_path, tiers):
    prompt, answer = _first_turn(v32, tmp_path, tiers)
    [file] = _files(tmp_path)
    assert file.stat().st_mode & 0o777 == 0o600
    assert tier_folder(tmp_path).stat().st_mode & 0o777 == 0o700

    engine = Engine.load(v32, _config(tmp_path, tiers))
    stats = _tier_stats(engine)
    assert stats["tier_cache_chats"] == 0 and stats["tier_cache_disk_chats"] == 1
    assert stats["tier_cache_disk_bytes"] == file.stat().st_size
    assert engine.stats().extra["prefix_cache_conversations"] == 1
    assert stats["tier_cache_disk_read_bytes"] == 0 and stats["tier_cache_restore_ms"] == 0
    assert stats["tier_cache_scan_ms"] > 0
    [chat] = engine.tier_cache.store.chats.values()
    tensor_bytes = file.stat().st_size - chat.data_offset
    follow_up = prompt + answer + _ids(15, 5)
    answer2, cached = _turn(engine, follow_up, "chat")
    assert cached == _covered(prompt)
    assert answer2 == _fresh(v32, follow_up)
    stats = _tier_stats(engine)
    assert stats["tier_cache_restored_chats"] == 1
    # the file's tensors were read (and checksummed) into pinned-or-not tensors, then adopted
    assert stats["tier_cache_disk_read_bytes"] == chat.state_bytes == tensor_bytes
    assert stats["tier_cache_disk_read_ms"] > 0
    assert stats["tier_cache_disk_read_ms"] >= stats["tier_cache_pin_alloc_ms"] + stats["tier_cache_disk_crc_ms"]
    assert stats["tier_cache_restore_ms"] >= stats["tier_cache_disk_read_ms"] + stats["tier_cache_resume_ms"]
    assert stats["tier_cache_resume_ms"] > 0 and stats["tier_cache_match_ms"] > 0
    assert stats["tier_cache_park_ms"] > 0  # the follow-up's own tiers, parked in RAM
    assert stats["tier_cache_spill_ms"] == stats["tier_cache_write_ms"] == stats["tier_cache_flush_ms"] == 0
    assert engine.close() >= 1
    stats = _tier_stats(engine)
    assert stats["tier_cache_flush_ms"] > 0 and stats["tier_cache_spill_ms"] == 0
    assert stats["tier_cache_write_ms"] >= stats["tier_cache_flush_ms"] - 1  # (the cache's time includes a sync)
    assert len(_files(tmp_path)) == 1  # the new turn's state replaced the file it extends
    assert stats["tier_cache_write_bytes"] == _files(tmp_path)[0].stat().st_size


def test_a_chat_the_ram_budget_pushes_out_goes_to_disk_and_comes_back(v32, tmp_path):
    probe = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    chat_a, chat_b = _ids(60, 7), _ids(62, 11, 30)
    answer_a, _ = _turn(probe, chat_a, "a")
    one_chat = _tier_stats(probe)["tier_cache_bytes"]

    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, tier_cache_host_gib=1.5 * one_chat / 2**30))
    _turn(engine, chat_a, "a")
    assert not _files(tmp_path)  # RAM holds it
    _turn(engine, chat_b, "b")  # parking b pushes a out of RAM, onto disk
    stats = _tier_stats(engine)
    assert stats["tier_cache_chats"] == 1 and stats["tier_cache_evictions"] == 1
    assert stats["tier_cache_disk_chats"] == 1
    # parking b wrote a to disk on the request path: its park time holds the spill
    [file] = _files(tmp_path)
    assert stats["tier_cache_write_bytes"] == file.stat().st_size and stats["tier_cache_flush_ms"] == 0
    assert stats["tier_cache_park_ms"] >= stats["tier_cache_spill_ms"] > 0
    assert stats["tier_cache_spill_ms"] >= stats["tier_cache_write_ms"] >= stats["tier_cache_write_crc_ms"] > 0
    assert stats["tier_cache_disk_read_bytes"] == 0
    follow_up = chat_a + answer_a + _ids(15, 5)
    assert _turn(engine, follow_up, "a") == (_fresh(v32, follow_up), _covered(chat_a))
    stats = _tier_stats(engine)
    assert stats["tier_cache_restored_chats"] == 1 and stats["tier_cache_disk_read_bytes"] > 0
    assert stats["tier_cache_restore_ms"] >= stats["tier_cache_disk_read_ms"] > 0


@pytest.mark.parametrize("where", ["tensors", "header"])
def test_a_corrupt_file_is_deleted_and_its_tokens_recomputed(v32, tmp_path, where):
    prompt, answer = _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    [file] = _files(tmp_path)
    data = bytearray(file.read_bytes())
    data[-3 if where == "tensors" else 20] ^= 0x40
    file.write_bytes(bytes(data))

    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS))
    follow_up = prompt + answer + _ids(15, 5)
    answer2, cached = _turn(engine, follow_up, "chat")
    assert cached == 0
    assert answer2 == _fresh(v32, follow_up)
    assert _tier_stats(engine)["tier_cache_files_rejected"] == 1
    assert not file.exists()


def test_a_file_of_another_tier_config_is_stale_and_never_used(v32, tmp_path):
    prompt, answer = _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    [file] = _files(tmp_path)
    other = dict(KEYS_AND_LATENTS, latent_hot_rows=24)  # another tier config: another fingerprint
    engine = Engine.load(v32, _config(tmp_path, other))
    stats = _tier_stats(engine)
    assert stats["tier_cache_disk_chats"] == 0 and stats["tier_cache_files_rejected"] == 1
    assert not file.exists()
    assert _turn(engine, prompt + answer + _ids(15, 5), "chat")[1] == 0


def test_deleting_the_chat_deletes_its_files(v32, tmp_path):
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS, "gone")
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS, "kept")
    assert len(_files(tmp_path)) == 2
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS))
    assert engine.drop_conversation("gone") >= 1
    assert _tier_stats(engine)["tier_cache_disk_chats"] == 1
    assert engine.stats().extra["prefix_cache_conversations"] == 1
    # with no engine open (the engine host's path): any model's files of the conversation
    assert drop_tiers_from_folder(tmp_path, "kept") == 1
    assert not _files(tmp_path)


# ---- the store alone: LRU by size, across restarts ------------------------------------------------


def _states(seed: int) -> tuple[dict[int, ParkedPages], dict[int, ParkedRows]]:
    """One layer of key pages (fp8 pool + a summary) and one of latent rows, two pages of 4 tokens."""
    gen = torch.Generator().manual_seed(seed)
    pool = PagePool(3, 4, 8, "fp8", torch.device("cpu"))
    pool.buf.copy_(torch.randint(0, 256, pool.buf.shape, generator=gen, dtype=torch.uint8))
    summary = torch.randn(2, 8, generator=gen).to(torch.bfloat16)
    rows = torch.randn(10, 16, generator=gen)
    return {0: ParkedPages(pool, 2, (summary, None))}, {1: ParkedRows(rows, 8)}


def _store(folder: Path, budget: int) -> TierStore:
    return TierStore(folder, budget, fingerprint_="f", key="m")


def test_the_store_round_trips_the_used_part_of_each_state(tmp_path):
    store = _store(tmp_path, 1 << 20)
    keys, latents = _states(0)
    name = store.write(list(range(8)), "c", keys, latents)
    assert name is not None
    [chat] = TierStore(tmp_path, 1 << 20, fingerprint_="f", key="m").usable()
    assert chat.token_ids == list(range(8)) and chat.conversation == "c"
    read_keys, read_latents = store.read(name)
    assert read_keys[0].pages == 2 and torch.equal(read_keys[0].host.buf[:2], keys[0].host.buf[:2])
    assert torch.equal(read_keys[0].summaries[0], keys[0].summaries[0]) and read_keys[0].summaries[1] is None
    assert read_latents[1].rows == 8 and torch.equal(read_latents[1].host[:8], latents[1].host[:8])
    # room for the next turn's tokens (an eighth more, at least a row), so that resuming does not grow the pool
    assert read_keys[0].host.num_pages == 2 + 1 and read_latents[1].host.shape[0] == 8 + 1


def test_the_store_evicts_the_least_recently_used_files_beyond_its_budget(tmp_path):
    probe = _store(tmp_path / "probe", 1 << 20)
    size = probe.disk_bytes if probe.write(list(range(8)), "x", *_states(9)) else 0
    store = _store(tmp_path / "lru", int(2.5 * size))
    names = []
    for seed, conversation in enumerate(("a", "b")):
        names.append(store.write(list(range(8)), conversation, *_states(seed)))
        time.sleep(0.01)
    assert store.read(names[0]) is not None  # a is used: b is now the least recently used
    names.append(store.write(list(range(8)), "c", *_states(2)))
    assert list(store.chats) == [names[0], names[2]]
    assert store.disk_bytes == sum((tmp_path / "lru" / name).stat().st_size for name in store.chats)
    assert not (tmp_path / "lru" / names[1]).exists()
    # the order survives a restart (file times), and a smaller budget evicts the oldest at once
    reopened = _store(tmp_path / "lru", int(1.5 * size))
    assert list(reopened.chats) == [names[2]]
    assert sorted(os.listdir(tmp_path / "lru")) == [names[2]]
    # a chat larger than the whole budget is not written
    assert _store(tmp_path / "tiny", size // 2).write(list(range(8)), "d", *_states(3)) is None


def test_host_memory_refused_for_a_read_keeps_the_file(tmp_path, monkeypatch):
    """Pinned host memory refused while a file is read (out of memory, or a CUDA graph being captured
    under the global capture mode) is not the file's fault: it stays, and reads once memory is there."""
    store, names = _three_chats(tmp_path)
    real = tier_store._empty

    def refused(spec, pin, *extra_rows):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(tier_store, "_empty", refused)
    assert store.read(names[0]) is None
    preload = TierPreload(store.folder, TierPreload.plan(store, 1 << 20), pin=False)
    assert preload.wait(30) and preload.claim() == []  # (every read failed: nothing to adopt)
    assert store.files_rejected == 0 and sorted(os.listdir(store.folder)) == sorted(names)
    monkeypatch.setattr(tier_store, "_empty", real)
    keys, latents = store.read(names[0])
    assert keys[0].pages == 2 and latents[1].rows == 8


# ---- the warm start: a restarted engine reads the newest chats into RAM in the background -----------


def _preloaded(engine: Engine) -> dict[str, float]:
    assert engine.tier_cache.wait_preload(60)
    return _tier_stats(engine)


@pytest.mark.parametrize("tiers", [KEYS_AND_LATENTS, EXACT_KEYS], ids=["keys+latents", "keys"])
def test_a_restarted_engine_preloads_a_chat_and_its_follow_up_reads_no_disk(v32, tmp_path, tiers):
    prompt, answer = _first_turn(v32, tmp_path, tiers)
    engine = Engine.load(v32, _config(tmp_path, tiers, prefix_cache_preload=True))
    [chat] = engine.tier_cache.store.chats.values()
    stats = _preloaded(engine)
    assert stats["tier_cache_chats"] == 1 and stats["tier_cache_preloaded_chats"] == 1
    # (read with an eighth more room than the file's states, for the next turn's tokens)
    assert stats["tier_cache_preloaded_bytes"] == stats["tier_cache_bytes"]
    assert chat.state_bytes < stats["tier_cache_bytes"] <= 1.25 * chat.state_bytes
    assert stats["tier_cache_preload_running"] == 0 and stats["tier_cache_preload_read_ms"] > 0
    follow_up = prompt + answer + _ids(15, 5)
    assert _turn(engine, follow_up, "chat") == (_fresh(v32, follow_up), _covered(prompt))
    stats = _tier_stats(engine)
    # adopted from RAM: nothing read, checksummed or allocated on the request path
    assert stats["tier_cache_disk_read_bytes"] == 0 and stats["tier_cache_disk_read_ms"] == 0
    assert stats["tier_cache_restored_chats"] == 1 and stats["tier_cache_files_rejected"] == 0
    assert engine.close() >= 1


def test_a_corrupt_file_the_preload_reads_is_deleted_and_its_tokens_recomputed(v32, tmp_path):
    prompt, answer = _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    [file] = _files(tmp_path)
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40
    file.write_bytes(bytes(data))
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True))
    stats = _preloaded(engine)
    assert stats["tier_cache_files_rejected"] == 1 and stats["tier_cache_preloaded_chats"] == 0
    assert stats["tier_cache_chats"] == stats["tier_cache_disk_chats"] == 0
    assert not file.exists()
    follow_up = prompt + answer + _ids(15, 5)
    assert _turn(engine, follow_up, "chat") == (_fresh(v32, follow_up), 0)


def test_a_chat_deleted_before_its_preloaded_copy_is_claimed_is_not_adopted(v32, tmp_path):
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS, "gone")
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True))
    assert engine.tier_cache._preload.wait(60)  # read, not yet claimed by the engine thread
    assert engine.drop_conversation("gone") >= 1
    stats = _preloaded(engine)
    assert stats["tier_cache_chats"] == stats["tier_cache_preloaded_chats"] == 0
    assert stats["tier_cache_files_rejected"] == 0 and not _files(tmp_path)


def test_the_preload_reads_the_newest_chats_that_fit_the_ram_budget(v32, tmp_path):
    for conversation, seed in (("old", 7), ("mid", 9), ("new", 11)):
        engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS))
        _turn(engine, _ids(60, seed), conversation)
        engine.close()
        time.sleep(0.02)  # (file times order them)
    one_chat = max(chat.state_bytes for chat in engine.tier_cache.store.chats.values())
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True,
                                      tier_cache_host_gib=2.5 * one_chat / 2**30))
    stats = _preloaded(engine)
    assert stats["tier_cache_preloaded_chats"] == 2 and stats["tier_cache_bytes"] <= 2.5 * one_chat
    # the newest is the least likely evicted
    assert [p.conversation for p in engine.tier_cache._parked.values()] == ["mid", "new"]
    assert stats["tier_cache_disk_chats"] == 3 and stats["tier_cache_disk_read_bytes"] == 0


def test_engine_close_stops_a_running_preload(v32, tmp_path, monkeypatch):
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    started = threading.Event()
    real = tier_store.read_chat

    def stuck(path, chat, pin, tally, stopping, **kwargs):  # (a read that lasts until the preload is stopped)
        started.set()
        stopping.wait(30)
        return real(path, chat, pin, tally, stopping, **kwargs)

    monkeypatch.setattr(tier_store, "read_chat", stuck)
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True))
    assert started.wait(30) and engine.tier_cache.preload_running
    engine.close()
    assert engine.tier_cache._preload.wait(timeout=0)  # (its thread ended)
    stats = _tier_stats(engine)
    assert stats["tier_cache_preload_running"] == 0 and stats["tier_cache_preloaded_chats"] == 0
    assert stats["tier_cache_files_rejected"] == 0 and len(_files(tmp_path)) == 1  # (stopped: not judged)


def _three_chats(folder: Path) -> tuple[TierStore, list[str]]:
    store = _store(folder, 1 << 20)
    return store, [store.write(list(range(8)), conversation, *_states(seed))
                   for seed, conversation in enumerate("abc")]


def test_the_preload_plans_the_newest_chats_up_to_its_budget(tmp_path):
    store, names = _three_chats(tmp_path)
    size = store.chats[names[0]].state_bytes
    assert [chat.name for chat in TierPreload.plan(store, int(2.5 * size))] == [names[2], names[1]]
    assert TierPreload.plan(store, size // 2) == []


def test_a_request_waits_for_a_file_being_preloaded_and_reads_one_not_begun_itself(tmp_path, monkeypatch):
    store, names = _three_chats(tmp_path)
    started, release = threading.Event(), threading.Event()
    reads = []
    real = tier_store.read_chat

    def slow(path, chat, *args, **kwargs):
        reads.append(chat.name)
        started.set()
        assert release.wait(30)
        return real(path, chat, *args, **kwargs)

    monkeypatch.setattr(tier_store, "read_chat", slow)
    preload = TierPreload(store.folder, TierPreload.plan(store, 1 << 20), pin=False)
    assert started.wait(30)  # c's read has begun (newest first)
    assert preload.take(names[1]) is None  # b's has not: the request reads it, the preload skips it
    threading.Timer(0.2, release.set).start()
    chat, (states, _) = preload.take(names[2])  # waits for c's read
    assert chat.name == names[2] and states is not None and states[1][1].rows == 8
    assert preload.wait(30)
    [(chat, (states, _))] = preload.claim()
    assert chat.name == names[0] and states is not None
    assert reads == [names[2], names[0]] and not preload.running
    assert preload.take(names[0]) is None  # (claimed already)


def test_cancel_stops_a_read_under_way_and_skips_the_rest(tmp_path, monkeypatch):
    store, names = _three_chats(tmp_path)
    started = threading.Event()
    reads = []
    real = tier_store.read_chat

    def slow(path, chat, pin, tally, stopping, **kwargs):
        reads.append(chat.name)
        started.set()
        stopping.wait(30)
        return real(path, chat, pin, tally, stopping, **kwargs)  # (raises Cancelled: stopping is set)

    monkeypatch.setattr(tier_store, "read_chat", slow)
    preload = TierPreload(store.folder, TierPreload.plan(store, 1 << 20), pin=False)
    assert started.wait(30) and preload.running
    assert preload.cancel(timeout=30)
    assert reads == [names[2]] and not preload.running
    assert preload.claim() == [] and preload.take(names[2]) is None and preload.take(names[1]) is None
    assert all((tmp_path / name).exists() for name in names)


def test_the_preload_holds_while_the_engine_serves_requests(v32, tmp_path, monkeypatch):
    """Steps with requests hold the warm start (it shares the host with the request path it is meant
    to shorten); the step that leaves none lets it go on."""
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True))
    reads = engine.tier_cache._preload._reads
    seen = []
    real = engine._step
    monkeypatch.setattr(engine, "_step", lambda launched: seen.append(reads._busy) or real(launched))
    assert not reads._busy
    _turn(engine, _ids(30, 9), "other")
    assert seen and all(seen) and not reads._busy
    assert engine.close() >= 1


def test_the_warm_start_reads_the_chat_files_while_the_weights_load(v32, tmp_path, monkeypatch):
    """``Engine.load`` starts the tier files' warm start from the folder alone, before the weights load
    (the store, whose fingerprint needs the loaded runner, checks each file as its copy is placed)."""
    prompt, answer = _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    events: list[str] = []
    read, load = tier_store.read_chat, engine_module.ModelRunner.load

    def reading(*args, **kwargs):
        events.append("read")
        return read(*args, **kwargs)

    def loading(*args, **kwargs):
        deadline = time.monotonic() + 30
        while "read" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        events.append("weights")
        return load(*args, **kwargs)

    monkeypatch.setattr(tier_store, "read_chat", reading)
    monkeypatch.setattr(engine_module.ModelRunner, "load", loading)
    engine = Engine.load(v32, _config(tmp_path, KEYS_AND_LATENTS, prefix_cache_preload=True))
    assert events == ["read", "weights"]
    stats = _preloaded(engine)
    assert stats["tier_cache_preloaded_chats"] == 1 and stats["tier_cache_files_rejected"] == 0
    follow_up = prompt + answer + _ids(15, 5)
    assert _turn(engine, follow_up, "chat") == (_fresh(v32, follow_up), _covered(prompt))
    assert _tier_stats(engine)["tier_cache_disk_read_bytes"] == 0  # (its copy was in RAM)
    assert engine.close() >= 1


def test_an_early_warm_start_s_stale_copy_is_never_used(v32, tmp_path):
    """A file of another tier config is read by the warm start begun before the store knew the
    config (it plans by model only); the store finds it stale: deleted, its copy dropped, recomputed."""
    _first_turn(v32, tmp_path, KEYS_AND_LATENTS)
    engine = Engine.load(v32, _config(tmp_path, EXACT_KEYS, prefix_cache_preload=True))
    stats = _preloaded(engine)
    assert stats["tier_cache_preloaded_chats"] == 0 and stats["tier_cache_chats"] == 0
    assert stats["tier_cache_files_rejected"] == 1 and _files(tmp_path) == []
    assert engine.close() == 0
