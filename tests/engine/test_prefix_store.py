"""A conversation's cache survives the GPU reusing its pages and the engine restarting: pages go to
host RAM, then to checksummed files, and come back instead of being recomputed (tiny DeepSeek-V3.2
with DSA and tiny Qwen3-MoE with GQA, on the CPU). The answers always equal a full recompute."""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, RequestError, SamplingParams, TokenDelta, prefix_store
from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import PagedCache
from hearth.engine.prefix_store import PrefixStore, Preload, _adjacent_runs
from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.conftest import TEST_DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BS = 16
# 7 pages of 16 tokens: one 40 + 24 token turn, then another chat's 70 + 24 tokens evict it all.
TIGHT = {"num_cache_blocks": 7, "max_num_seqs": 1}
TO_DISK = {"prefix_cache_host_gib": 1e-9}  # no page fits in RAM: every spilled page goes to a file


def _prompt(i: int, n: int = 40) -> list[int]:
    return [(7 * i + 13 * j) % 480 + 10 for j in range(n)]


def _engine(model: Path, **options) -> Engine:
    return Engine.load(str(model), EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=BS, **options))


def _preloaded(engine: Engine) -> dict[str, float]:
    """The engine's stats once its warm start has read everything it planned (and handed it over)."""
    assert engine.prefix_tier.store.preload.wait(timeout=120)
    return engine.stats().extra


def _run(engine: Engine, prompt: list[int], conversation: str | None = None) -> tuple[list[int], Finished]:
    request_id = engine.add_request(prompt_token_ids=prompt, sampling=GREEDY, conversation_id=conversation)
    tokens: list[int] = []
    for _ in range(1000):
        for event in engine.step():
            if isinstance(event, TokenDelta) and event.request_id == request_id:
                tokens += event.token_ids
            if isinstance(event, Finished) and event.request_id == request_id:
                return tokens, event
    raise AssertionError("the request did not finish")


def _first_turn_then_another_chat(engine: Engine, conversation: str = "chat-1") -> list[int]:
    """Answer turn 1 of ``conversation``, then a long prompt of another chat that evicts its pages;
    returns turn 2's prompt (turn 1, its answer and a new question)."""
    answer, _ = _run(engine, _prompt(1), conversation)
    _run(engine, _prompt(5, 70), "other-chat")
    return _prompt(1) + answer + _prompt(2, 9)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix_store")
    return {arch: write_tiny_model(root / arch, arch, seed=1) for arch in ("deepseek_v32", "qwen3_moe")}


@pytest.fixture(scope="module")
def recompute(models):
    """Greedy tokens of a prompt on a fresh engine that keeps nothing between turns."""
    engines = {arch: _engine(path, prefix_cache_offload=False) for arch, path in models.items()}

    def tokens(arch: str, prompt: list[int]) -> list[int]:
        return _run(engines[arch], prompt)[0]

    return tokens


# Turn 1 is 40 prompt + 24 answer tokens; 63 of them were fed through the model (the last answer
# token never was), so 3 whole pages (48 tokens) are cached and only the rest is computed.
CACHED = 48


@pytest.mark.parametrize("arch", ["deepseek_v32", "qwen3_moe"])
def test_follow_up_restored_from_ram_equals_recompute(models, recompute, arch):
    engine = _engine(models[arch], **TIGHT)
    second = _first_turn_then_another_chat(engine)
    before = engine.stats().extra
    assert before["prefix_cache_host_bytes"] > 0 and before["prefix_cache_disk_bytes"] == 0
    assert before["prefix_cache_spill_ms"] > 0  # the first chat's pages left the device, timed
    assert before["prefix_cache_disk_read_bytes"] == 0  # (no folder: nothing was ever read from one)
    tokens, finished = _run(engine, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED  # only the new tokens were computed
    after = engine.stats().extra
    assert after["prefix_cache_restored_tokens"] - before["prefix_cache_restored_tokens"] >= CACHED - BS
    assert tokens == recompute(arch, second)


@pytest.mark.parametrize("arch", ["deepseek_v32", "qwen3_moe"])
def test_follow_up_restored_from_disk_equals_recompute(models, recompute, tmp_path, arch):
    engine = _engine(models[arch], **TIGHT, **TO_DISK, prefix_cache_dir=str(tmp_path / "cache"))
    second = _first_turn_then_another_chat(engine)
    assert engine.stats().extra["prefix_cache_disk_bytes"] > 0
    restored_before = engine.stats().extra["prefix_cache_restored_tokens"]
    tokens, finished = _run(engine, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED
    assert engine.stats().extra["prefix_cache_restored_tokens"] > restored_before
    assert tokens == recompute(arch, second)


def _saved_first_turn(model: Path, folder: Path) -> list[int]:
    """Turn 1 on an engine that then stops (saving its cache); returns turn 2's prompt."""
    engine = _engine(model, prefix_cache_dir=str(folder))
    answer, _ = _run(engine, _prompt(1), "chat-1")
    assert engine.close() >= 3
    return _prompt(1) + answer + _prompt(2, 9)


def test_restart_serves_the_follow_up_from_disk_with_private_files(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    second = _saved_first_turn(models["deepseek_v32"], folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = list(folder.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder), prefix_cache_preload=False)
    assert restarted.prefix_tier.store.preload is None
    assert restarted.stats().extra["prefix_cache_conversations"] == 1
    tokens, finished = _run(restarted, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED
    stats = restarted.stats().extra
    assert stats["prefix_cache_restored_tokens"] == CACHED
    assert stats["prefix_cache_preloaded_pages"] == 0 and stats["prefix_cache_preload_running"] == 0
    # the pages came from the files: their bytes counted, the read timed within the whole restore
    page_bytes = restarted.prefix_tier.store.page_bytes
    assert stats["prefix_cache_disk_read_bytes"] == CACHED // restarted.blocks.block_size * page_bytes
    restore_ms = stats["prefix_cache_restore_ms"]
    assert 0 < stats["prefix_cache_disk_read_ms"] <= restore_ms < finished.stats.total_time_s * 1e3
    assert tokens == recompute("deepseek_v32", second)


def test_warm_start_reads_the_saved_pages_into_ram_before_the_follow_up(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    second = _saved_first_turn(models["deepseek_v32"], folder)
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    page_bytes = restarted.prefix_tier.store.page_bytes
    stats = _preloaded(restarted)
    assert stats["prefix_cache_preloaded_pages"] == CACHED // BS and stats["prefix_cache_preload_running"] == 0
    assert stats["prefix_cache_preloaded_bytes"] == stats["prefix_cache_host_bytes"] == CACHED // BS * page_bytes
    tokens, finished = _run(restarted, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED
    stats = restarted.stats().extra
    assert stats["prefix_cache_restored_tokens"] == CACHED
    assert stats["prefix_cache_disk_read_bytes"] == 0 and stats["prefix_cache_disk_read_ms"] == 0  # all from RAM
    assert 0 < stats["prefix_cache_restore_ms"] < finished.stats.total_time_s * 1e3
    assert tokens == recompute("deepseek_v32", second)


def test_a_corrupt_file_found_by_the_warm_start_is_deleted_and_recomputed(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    second = _saved_first_turn(models["deepseek_v32"], folder)
    [segment] = _segments(folder)
    data = bytearray(segment.read_bytes())
    data[-100] ^= 0x08  # inside the last page
    segment.write_bytes(bytes(data))
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    stats = _preloaded(restarted)
    assert stats["prefix_cache_files_rejected"] == 1 and not segment.exists()
    assert stats["prefix_cache_preloaded_pages"] == 0 and stats["prefix_cache_host_bytes"] == 0
    tokens, finished = _run(restarted, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == 0
    assert tokens == recompute("deepseek_v32", second)


def _two_saved_chats(model: Path, folder: Path) -> list[int]:
    """Turn 1 of chat-1 (3 pages), then, on a second engine, of "other-chat" (5 pages), each engine
    stopping after it: two segments, other-chat's the newer. Returns chat-1's turn 2 prompt."""
    second = _saved_first_turn(model, folder)
    engine = _engine(model, prefix_cache_dir=str(folder), prefix_cache_preload=False)
    _run(engine, _prompt(5, 70), "other-chat")
    assert engine.close() == 5
    return second


def test_warm_start_stops_at_the_ram_budget(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    second = _two_saved_chats(models["deepseek_v32"], folder)
    page_bytes = _engine(models["deepseek_v32"], prefix_cache_offload=False).runner.cache.page_bytes
    # room for 6 pages: the newest chat's 5 fit, chat-1's 3 more would not (none are evicted for them)
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder),
                        prefix_cache_host_gib=6 * page_bytes / 2**30)
    stats = _preloaded(restarted)
    assert stats["prefix_cache_preloaded_pages"] == 5 and stats["prefix_cache_host_bytes"] == 5 * page_bytes
    tokens, finished = _run(restarted, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED
    assert restarted.stats().extra["prefix_cache_disk_read_bytes"] == CACHED // BS * page_bytes  # not preloaded
    assert tokens == recompute("deepseek_v32", second)


def test_close_during_the_warm_start_stops_it_and_keeps_the_files(models, recompute, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    second = _two_saved_chats(models["deepseek_v32"], folder)
    reads: list[str] = []
    started, release = threading.Event(), threading.Event()
    read = prefix_store._read_task

    def first_read_held(task):  # the warm start's first read lasts until the engine closes
        reads.append(task.path.name)
        if len(reads) == 1:
            started.set()
            assert release.wait(timeout=120)
        return read(task)

    monkeypatch.setattr(prefix_store, "_read_task", first_read_held)
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    preload = restarted.prefix_tier.store.preload
    assert started.wait(timeout=120)
    threading.Thread(target=lambda: preload.stopping.wait() and release.set(), daemon=True).start()
    closing = threading.Thread(target=restarted.close)
    closing.start()
    closing.join(timeout=120)
    assert not closing.is_alive() and preload.wait(timeout=0)
    assert len(reads) == 1  # the older segment was never read
    assert restarted.prefix_tier.store.counters.pages_preloaded == 0
    assert len(_segments(folder)) == 2
    again = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    assert _preloaded(again)["prefix_cache_preloaded_pages"] == 8
    tokens, finished = _run(again, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == CACHED
    assert tokens == recompute("deepseek_v32", second)


def test_a_corrupt_file_is_recomputed_and_deleted(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    second = _saved_first_turn(models["deepseek_v32"], folder)
    for path in folder.iterdir():  # flip one byte deep in every page's contents
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    tokens, finished = _run(restarted, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == 0  # the first page is unusable: nothing after it is
    assert restarted.stats().extra["prefix_cache_files_rejected"] >= 1
    assert tokens == recompute("deepseek_v32", second)
    restarted.close()
    for path in folder.iterdir():  # what is there now was written by the restarted engine
        restarted_page = PrefixStore(restarted.runner.cache.page_bytes, 0, folder=folder, disk_bytes=1 << 30,
                                     fingerprint_=restarted.prefix_tier.store.fingerprint,
                                     key=restarted.prefix_tier.store.key)
        assert path.name in restarted_page._disk


def _chat_turn(engine: Engine, messages: list[dict[str, str]]) -> tuple[list[int], str]:
    """Greedy tokens and text of a chat turn of conversation "chat-1"."""
    request_id = engine.add_request(messages, sampling=GREEDY, conversation_id="chat-1")
    tokens: list[int] = []
    text = ""
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta) and event.request_id == request_id:
                tokens += event.token_ids
                text += event.text
    return tokens, text


def _saved_chat(model: Path, folder: Path) -> list[dict[str, str]]:
    """A chat's first turn on an engine that then stops; returns the follow-up's messages."""
    engine = _engine(model, prefix_cache_dir=str(folder))
    first = [{"role": "user", "content": "Tell me about the kettle on the hearth. " * 6}]
    _, answer = _chat_turn(engine, first)
    engine.close()
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the mill?"}]


def _prompt_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.prompt"))


def test_restart_reuses_the_saved_prompt_tokens_with_the_same_ids(models, tmp_path):
    folder = tmp_path / "cache"
    follow_up = _saved_chat(models["deepseek_v32"], folder)
    [record] = _prompt_files(folder)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    whole = restarted.tokenizer.encode(restarted.tokenizer.chat_prompt(follow_up), add_special_tokens=False)
    assert restarted.encode(follow_up, conversation_id="chat-1") == whole
    assert restarted._prompt_tokens.reused_tokens > 0  # the first turn's ids came from the file
    tokens, _ = _chat_turn(restarted, follow_up)
    fresh = _engine(models["deepseek_v32"], prefix_cache_offload=False)
    assert tokens == _run(fresh, whole)[0]


def test_a_corrupt_prompt_record_is_deleted_and_the_prompt_tokenised_whole(models, tmp_path):
    folder = tmp_path / "cache"
    follow_up = _saved_chat(models["deepseek_v32"], folder)
    [record] = _prompt_files(folder)
    data = bytearray(record.read_bytes())
    data[-3] ^= 0x01  # inside the saved text
    record.write_bytes(bytes(data))
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    whole = restarted.tokenizer.encode(restarted.tokenizer.chat_prompt(follow_up), add_special_tokens=False)
    assert restarted.encode(follow_up, conversation_id="chat-1") == whole
    assert restarted._prompt_tokens.reused_tokens == 0
    assert not record.exists()


def test_prompt_records_go_with_their_conversations_pages(models, tmp_path):
    folder = tmp_path / "cache"
    _saved_chat(models["deepseek_v32"], folder)
    assert len(_prompt_files(folder)) == 1
    restarted = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    assert restarted.drop_conversation("chat-1") > 0
    assert _prompt_files(folder) == []
    _saved_chat(models["deepseek_v32"], folder)
    for segment in _segments(folder):  # the pages are gone (evicted): the record is useless
        segment.unlink()
    _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    assert _prompt_files(folder) == []


def test_files_of_another_model_version_are_ignored_and_deleted(tmp_path):
    model = write_tiny_model(tmp_path / "model", "deepseek_v32", seed=1)
    folder = tmp_path / "cache"
    second = _saved_first_turn(model, folder)
    stale = {p.name for p in folder.iterdir()}
    write_tiny_model(model, "deepseek_v32", seed=7)  # new weights in the same folder
    engine = _engine(model, prefix_cache_dir=str(folder))
    assert not stale & {p.name for p in folder.iterdir()}  # deleted, not used
    tokens, finished = _run(engine, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == 0
    assert tokens == _run(_engine(model, prefix_cache_offload=False), second)[0]


def test_another_dtype_does_not_use_the_files(models, tmp_path):
    folder = tmp_path / "cache"
    second = _saved_first_turn(models["deepseek_v32"], folder)
    engine = Engine.load(str(models["deepseek_v32"]), EngineConfig(device=TEST_DEVICE, dtype="bfloat16",
                                                                   block_size=BS, prefix_cache_dir=str(folder)))
    _, finished = _run(engine, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == 0


def test_drop_deletes_a_conversations_pages_everywhere(models, recompute, tmp_path):
    folder = tmp_path / "cache"
    engine = _engine(models["deepseek_v32"], **TIGHT, **TO_DISK, prefix_cache_dir=str(folder))
    second = _first_turn_then_another_chat(engine)
    assert engine.stats().extra["prefix_cache_conversations"] == 2
    files = len(list(folder.iterdir()))
    assert engine.drop_conversation("chat-1") >= 3
    assert len(list(folder.iterdir())) < files
    assert engine.stats().extra["prefix_cache_conversations"] == 1
    tokens, finished = _run(engine, second, "chat-1")
    assert finished.stats.cached_prompt_tokens == 0  # nothing of it is left
    assert tokens == recompute("deepseek_v32", second)
    engine.drop_conversation("chat-1")
    engine.drop_conversation("other-chat")
    engine.close()
    assert not list(folder.iterdir())


def test_bad_conversation_ids_are_refused(models):
    engine = _engine(models["deepseek_v32"])
    for bad in ("", "a b", "x" * 129, "../etc"):
        with pytest.raises(RequestError):
            engine.add_request(prompt_token_ids=[1, 2, 3], sampling=GREEDY, conversation_id=bad)


# ---- the store and the page copies ---------------------------------------------------------


def _page(value: int, size: int = 1000) -> torch.Tensor:
    return torch.full((size,), value, dtype=torch.uint8)


def test_disk_budget_evicts_least_recently_used_files(tmp_path):
    store = PrefixStore(1000, 0, folder=tmp_path, disk_bytes=3900, fingerprint_="f", key="k")
    for h in range(3):
        store.put(h, _page(h), {"c"})
    assert all(h in store for h in range(3))
    assert store.get(0)[0][0] == 0  # page 0 is now the most recently used
    store.put(3, _page(3), {"c"})
    assert 1 not in store and all(h in store for h in (0, 2, 3))
    assert store.disk_bytes <= 3900 and len(list(tmp_path.iterdir())) == 3
    reopened = PrefixStore(1000, 0, folder=tmp_path, disk_bytes=2600, fingerprint_="f", key="k")
    assert 2 not in reopened and 0 in reopened and 3 in reopened  # file times keep the order
    assert os.listdir(tmp_path) and reopened.get(3)[0][0] == 3


def test_host_budget_moves_old_pages_to_disk_and_drop_keeps_shared_pages(tmp_path):
    store = PrefixStore(1000, 2000, folder=tmp_path, disk_bytes=10_000, fingerprint_="f", key="k")
    store.put(1, _page(1), {"a"})
    store.put(2, _page(2), {"a", "b"})
    store.put(3, _page(3), {"b"})
    assert store.host_bytes == 2000 and store.disk_bytes > 0  # page 1 went to disk
    assert store.conversations() == {"a", "b"}
    assert store.drop("a") == 1  # page 1; page 2 keeps "b"
    assert 1 not in store and 2 in store and store.conversations() == {"b"}
    store.flush()
    reopened = PrefixStore(1000, 2000, folder=tmp_path, disk_bytes=10_000, fingerprint_="f", key="k")
    assert reopened.get(2)[1] == frozenset({"b"})
    assert reopened.drop("b") == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("index_fp8", [False, True])
def test_pages_copy_out_and_back_bit_exactly(models, index_fp8):
    config = ModelConfig.from_file(models["deepseek_v32"])
    cache = PagedCache(config, 6, BS, torch.float32, torch.device("cpu"), index_fp8=index_fp8)
    for tensor in cache.latent + cache.index_keys:
        if tensor is not None:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    pages = cache.read_pages([1, 4], pin=False)
    assert pages.shape == (2, cache.page_bytes)
    cache.write_pages([0, 2], pages)
    for tensor in cache.latent + cache.index_keys:
        if tensor is not None:
            rows = tensor.view(6, -1).view(torch.uint8)  # bytes: random bits include NaNs
            assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[4])


# ---- segment files ---------------------------------------------------------------------------


def _segments(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pages"))


def _store(folder: Path, disk_bytes: int = 1 << 20, fingerprint: str = "f", host_bytes: int = 0) -> PrefixStore:
    return PrefixStore(1000, host_bytes, folder=folder, disk_bytes=disk_bytes, fingerprint_=fingerprint, key="k")


def _saved(folder: Path, pages: dict[int, set[str]]) -> None:
    store = _store(folder, host_bytes=1 << 20)
    for block_hash, conversations in pages.items():
        store.put(block_hash, _page(block_hash), conversations)
    store.flush()


def test_pages_saved_together_share_a_segment_and_come_back_in_one_buffer(tmp_path):
    _saved(tmp_path, {h: {"a"} for h in range(10)} | {10: {"b"}})
    assert len(_segments(tmp_path)) == 2  # one per set of conversations
    store = _store(tmp_path)
    found = store.take([*range(10), 99, 10])
    assert [int(row[0]) for row, _ in found] == list(range(10))  # stops at the first page it lacks
    assert all(tags == {"a"} for _, tags in found)
    runs = _adjacent_runs([row for row, _ in found])
    assert len(runs) == 1 and runs[0][1].shape == (10, 1000)  # one buffer, read in file order


def test_a_corrupt_page_rejects_its_whole_segment(tmp_path):
    _saved(tmp_path, {h: {"a"} for h in range(4)} | {7: {"b"}})
    victim = next(p for p in _segments(tmp_path) if p.stat().st_size > 3000)
    data = bytearray(victim.read_bytes())
    data[-1500] ^= 0x01  # one bit of page 2 of 4
    victim.write_bytes(bytes(data))
    store = _store(tmp_path)
    assert store.take([0, 1, 2, 3]) == []  # nothing of a segment with a bad page is used
    assert store.counters.files_rejected == 1 and not victim.exists()
    assert 0 not in store and store.get(7)[0][0] == 7  # the other segment is untouched


def test_a_cut_short_or_garbled_segment_is_deleted_at_start(tmp_path):
    _saved(tmp_path, {1: {"a"}, 2: {"b"}, 3: {"c"}})
    cut, garbled, sound = _segments(tmp_path)
    cut.write_bytes(cut.read_bytes()[:-10])
    data = bytearray(garbled.read_bytes())
    data[20] ^= 0x20  # inside the header
    garbled.write_bytes(bytes(data))
    store = _store(tmp_path)
    assert store.counters.files_rejected == 2 and _segments(tmp_path) == [sound]
    assert sum(h in store for h in (1, 2, 3)) == 1


def test_a_stale_fingerprint_deletes_this_models_segments_only(tmp_path):
    _saved(tmp_path, {1: {"a"}})
    other_model = PrefixStore(1000, 1 << 20, folder=tmp_path, disk_bytes=1 << 20, fingerprint_="g", key="other")
    other_model.put(2, _page(2), {"a"})
    other_model.flush()
    store = _store(tmp_path, fingerprint="f2")  # this model changed
    assert 1 not in store and store.counters.files_rejected == 1
    assert len(_segments(tmp_path)) == 1 and store.conversations() == {"a"}  # the other model's stays


def test_disk_lru_evicts_whole_segments_oldest_first(tmp_path):
    store = _store(tmp_path, disk_bytes=12_000)
    for group in range(3):  # three segments of three pages (~3.3 KB each)
        store.put_many([(10 * group + i, _page(10 * group + i), {f"c{group}"}) for i in range(3)])
    assert len(_segments(tmp_path)) == 3
    assert store.get(0)[0][0] == 0  # segment 0 is now the most recently used
    store.put_many([(30 + i, _page(30 + i), {"c3"}) for i in range(3)])
    assert all(h in store for h in (0, 1, 2, 30, 31, 32, 20)) and not any(h in store for h in (10, 11, 12))
    assert store.disk_bytes <= 12_000 and len(_segments(tmp_path)) == 3


def test_drop_deletes_or_rewrites_segments(tmp_path):
    _saved(tmp_path, {1: {"a"}, 2: {"a", "b"}, 3: {"b"}, 4: {"a"}})
    store = _store(tmp_path)
    assert store.drop("a") == 2  # pages 1 and 4; page 2 stays for b
    assert len(_segments(tmp_path)) == 2
    reopened = _store(tmp_path)
    assert reopened.get(2) is not None and reopened.get(2)[1] == {"b"} and 1 not in reopened
    assert reopened.conversations() == {"b"}
    assert reopened.drop("b") == 2 and not list(tmp_path.iterdir())


def test_old_one_page_files_are_deleted(tmp_path):
    (tmp_path / "k-0123.page").write_bytes(b"HRTHPG01" + bytes(100))
    store = _store(tmp_path)
    assert store.counters.files_rejected == 1 and not list(tmp_path.iterdir())


# ---- the warm start's reads and the store's own ------------------------------------------------


def _held_first_read(monkeypatch) -> tuple[list[str], threading.Event, threading.Event]:
    """Every read task's file name, in order; the first read waits for ``release`` (``started`` says it began)."""
    reads: list[str] = []
    started, release = threading.Event(), threading.Event()
    read = prefix_store._read_task

    def held(task):
        reads.append(task.path.name)
        if len(reads) == 1:
            started.set()
            assert release.wait(timeout=60)
        return read(task)

    monkeypatch.setattr(prefix_store, "_read_task", held)
    pool = ThreadPoolExecutor(4)  # a thread for the other reads while the first is held, on any machine
    monkeypatch.setattr(prefix_store, "_io_pool", lambda: pool)
    return reads, started, release


def _two_segments(folder: Path) -> tuple[str, str]:
    """Segments of pages 0-3 (conversation a) and 10-11 (b, written after a); their names."""
    _saved(folder, {0: {"a"}, 1: {"a"}, 2: {"a"}, 3: {"a"}, 10: {"b"}, 11: {"b"}})
    older, newer = sorted(_segments(folder), key=lambda p: p.stat().st_mtime_ns)
    return older.name, newer.name


def test_a_request_waits_for_the_segment_being_preloaded(tmp_path, monkeypatch):
    _, newer = _two_segments(tmp_path)
    reads, started, release = _held_first_read(monkeypatch)
    store = _store(tmp_path, host_bytes=1 << 20)
    store.attach_preload(Preload(tmp_path, "k", 1 << 20, pin=False))
    assert started.wait(timeout=60) and reads == [newer]  # newest first
    found = []
    request = threading.Thread(target=lambda: found.extend(store.take([10, 11])))
    request.start()  # its segment's read has begun: it waits for it
    release.set()
    request.join(timeout=60)
    assert not request.is_alive() and [int(row[0]) for row, _ in found] == [10, 11]
    assert store.counters.disk_read_bytes == 0 and store.counters.pages_preloaded >= 2
    assert store.preload.wait(timeout=60)
    store.settle_preload()
    assert store.counters.pages_preloaded == 6 and len(reads) == 2  # each segment read once
    assert [int(row[0]) for row, _ in store.take([0, 1, 2, 3])] == [0, 1, 2, 3]
    assert store.counters.disk_read_bytes == 0


def test_a_request_reads_a_segment_the_preload_has_not_begun_itself(tmp_path, monkeypatch):
    older, newer = _two_segments(tmp_path)
    reads, started, release = _held_first_read(monkeypatch)
    store = _store(tmp_path, host_bytes=1 << 20)
    store.attach_preload(Preload(tmp_path, "k", 1 << 20, pin=False))
    assert started.wait(timeout=60)
    assert [int(row[0]) for row, _ in store.take([0, 1, 2, 3])] == [0, 1, 2, 3]  # the older one, not begun
    assert store.counters.disk_read_bytes == 4000
    release.set()
    assert store.preload.wait(timeout=60)
    store.settle_preload()
    assert reads == [newer, older]  # the preload skipped the segment the request read
    assert store.counters.pages_preloaded == 2 and not store.preload_running
    assert store.get(10)[0][0] == 10 and store.counters.disk_read_bytes == 4000


def test_the_preload_fits_its_budget_and_never_evicts(tmp_path):
    _two_segments(tmp_path)
    store = _store(tmp_path, host_bytes=3000)
    store.attach_preload(Preload(tmp_path, "k", 3000, pin=False))  # b's 2 pages fit, a's 4 more do not
    assert store.preload.wait(timeout=60)
    store.settle_preload()
    assert store.counters.pages_preloaded == 2 and store.host_bytes == 2000
    busy = _store(tmp_path, host_bytes=3000)
    busy.put_many([(20, _page(20), {"c"}), (21, _page(21), {"c"})])  # RAM in use before the pages arrive
    busy.attach_preload(Preload(tmp_path, "k", 3000, pin=False))
    assert busy.preload.wait(timeout=60)
    busy.settle_preload()
    assert busy.counters.pages_preloaded == 0 and 20 in busy._host and 21 in busy._host
    assert not busy.preload_running
