"""The engine's warm-up (hearth.engine.warm_up): synthetic requests through the ordinary step loop
before the first user request, leaving nothing behind: the same greedy answers, no page a user's
prompt can hit, counters at zero, nothing written to the chat cache's folder and a warm start's pages
kept. The engine host runs it while it still says "loading", and a warm-up that fails fails the load.
Real tiny engines on the CPU (``warm_up="true"``); the graph captures it exists for on a GPU."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from pathlib import Path

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, HearthError, SamplingParams, TokenDelta
from hearth.engine.cuda_graphs import batch_buckets
from hearth.engine.server.host import EngineHost, StillLoadingError
from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model
from hearth.engine.warm_up import ANSWER_TOKENS, Limits, warm_up_rounds, warm_up_token_ids
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_server_support import serving_client, wait_until

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MAX_NUM_SEQS = 4  # warm-up rounds at batch 1, 2 and 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("warm_up")
    return {arch: write_tiny_model(root / arch, arch, seed=1) for arch in ("deepseek_v32", "qwen3_moe")}


def _engine(model: Path, **options) -> Engine:
    options = {"block_size": BS, "max_num_seqs": MAX_NUM_SEQS, **options}
    return Engine.load(str(model), EngineConfig(device=TEST_DEVICE, dtype="float32", **options))


PROBE = ("expert_cache_host_link_per_expert_ms", "expert_cache_host_cpu_fixed_ms",
         "expert_cache_host_cpu_per_token_ms", "expert_cache_host_transfer_ms")


def _counters(engine: Engine) -> dict[str, float]:
    """``stats().extra`` less the start-up probe's speeds (measured per engine on a GPU, so two engines differ)."""
    extra = engine.stats().extra
    assert all((key in extra) == (PROBE[0] in extra) for key in PROBE)
    return {key: value for key, value in extra.items() if key not in PROBE}


def _answers(engine: Engine, prompts: list[list[int]], conversation: str | None = None) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and cached prompt tokens, all submitted at once."""
    ids = [engine.add_request(prompt_token_ids=p, sampling=GREEDY, conversation_id=conversation) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id] += event.token_ids
            elif isinstance(event, Finished):
                cached[event.request_id] = event.stats.cached_prompt_tokens
    return [(tokens[i], cached[i]) for i in ids]


def _warm_up_prompts(engine: Engine) -> list[list[int]]:
    limits = Limits(BS, engine.max_model_len, engine.blocks.num_blocks, MAX_NUM_SEQS)
    return [p for round_ in warm_up_rounds(warm_up_token_ids(engine.tokenizer, engine.model_config.vocab_size),
                                           limits) for p in round_]


def _user_prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 480 + 10 for j in range(n)] for i, n in ((1, 40), (2, 9), (3, 23))]


@pytest.mark.parametrize("limits", [Limits(64, 8192, 1024, 8), Limits(16, 256, 5, 4), Limits(64, 8, 1, 3),
                                    Limits(4, 2, 64, 1), Limits(4, 2, 64, 8), Limits(64, 8192, 1024, 8, 2048),
                                    Limits(16, 256, 5, 4, 2048), Limits(64, 8, 1, 3, 2048), Limits(16, 256, 64, 2, 40)])
def test_the_rounds_fit_the_engine(limits):
    """A prompt of a few pages and an odd remainder, the same prompt a page longer, with `chunk_tokens` one prompt
    each of an eighth, a quarter, half and all of a chunk and a remainder (as much as fits, where longer than the
    second), then one round per larger batch bucket; every prompt fits the context and the cache with its answer."""
    rounds = warm_up_rounds([5, 6, 7], limits)
    if limits.max_model_len < 3:  # room for one-token prompts only: no prompt to extend
        (first,), *batches = rounds
        assert first == [5]
    else:
        (first,), (second,), *batches = rounds
        assert second[:len(first)] == first and len(second) > len(first)
    if limits.max_model_len >= 256:
        assert len(first) == 2 * limits.block_size + 3 and len(second) == len(first) + limits.block_size + 2
    room = min(limits.max_model_len, limits.num_blocks * limits.block_size)
    if limits.chunk_tokens and limits.max_model_len >= 3:
        lengths = sorted({min(limits.chunk_tokens // part + 3, room - ANSWER_TOKENS - 1) for part in (8, 4, 2, 1)})
        lengths = [n for n in lengths if n > len(second)]
        chunks, batches = batches[:len(lengths)], batches[len(lengths):]
        assert [[len(p) for p in round_] for round_ in chunks] == [[n] for n in lengths]
    if limits == Limits(64, 8192, 1024, 8, 2048):  # up to a whole chunk, then a step of 3 past the indexer's 2048
        assert lengths == [259, 515, 1027, 2051]
    if limits == Limits(16, 256, 5, 4, 2048):  # as much as the cache holds, once
        assert lengths == [75]
    assert [len(batch) for batch in batches] == batch_buckets(limits.max_num_seqs)[1:]
    room = min(limits.max_model_len, limits.num_blocks * limits.block_size)
    for prompt in [p for round_ in rounds for p in round_]:
        assert prompt and set(prompt) <= {5, 6, 7}
        assert len(prompt) < limits.max_model_len and (len(prompt) + ANSWER_TOKENS <= room or len(prompt) == 1)


def test_auto_warms_up_on_cuda_only(models):
    for value, wanted in (("auto", TEST_DEVICE == "cuda"), ("true", True), ("false", False)):
        assert _engine(models["qwen3_moe"], warm_up=value).wants_warm_up is wanted, value
    with pytest.raises(HearthError, match="warm_up must be auto, true or false"):
        EngineConfig(warm_up="yes")


@pytest.mark.parametrize("arch", ["deepseek_v32", "qwen3_moe"])
def test_after_the_warm_up_the_engine_answers_and_counts_as_a_fresh_one(models, arch):
    fresh = _engine(models[arch], warm_up="false")
    warmed = _engine(models[arch], warm_up="true")
    assert warmed.warm_up() == warmed.warm_up_s > 0
    stats, before = warmed.stats(), fresh.stats()
    # no page of the warm-up is left for a prompt to hit, none is held, every counter is untouched (graph
    # captures included: on a GPU the warm-up captured them, and the users' requests capture none)
    assert warmed.blocks.cached_blocks() == [] and stats.cache_blocks_free == before.cache_blocks_free
    assert stats.generated_tokens == 0 and stats.running == stats.waiting == 0
    assert stats.extra["warm_up_s"] == warmed.warm_up_s and "warm_up_s" not in before.extra
    extra = _counters(warmed)
    extra.pop("warm_up_s")
    assert extra == _counters(fresh)
    # the warm-up's first prompt (two whole pages) is computed again, and every answer is the fresh engine's
    prompts = _user_prompts() + _warm_up_prompts(warmed)[:1]
    got = _answers(warmed, prompts)
    assert [cached for _, cached in got] == [0] * len(prompts)
    assert got == _answers(fresh, prompts)
    assert warmed.stats().extra.get("decode_graph_captures", 0) == 0  # every batch bucket was captured before


@pytest.mark.parametrize("features", [
    {"offload": "always", "expert_cache_slots": 3, "scheduler": "runahead"},
    {"offload": "always", "expert_cache_slots": 3, "scheduler": "auto"},
    {"index_key_hot_pages": 1, "index_key_cache_pages": 2, "latent_hot_rows": 20},
], ids=["offload-runahead", "offload-auto", "tiers"])
def test_the_warm_up_runs_with_the_configured_features(models, features):
    """Offloaded experts (their cache counters start at zero after it) and tiered keys and latents."""
    fresh = _engine(models["deepseek_v32"], warm_up="false", **features)
    warmed = _engine(models["deepseek_v32"], warm_up="true", **features)
    warmed.warm_up()
    extra = _counters(warmed)
    extra.pop("warm_up_s")
    assert extra == _counters(fresh)
    assert _answers(warmed, _user_prompts()) == _answers(fresh, _user_prompts())


def test_running_out_of_gpu_memory_in_the_warm_up_is_one_clear_error(models, monkeypatch):
    engine = _engine(models["qwen3_moe"], warm_up="true")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine.runner, "run", out_of_memory)
    with pytest.raises(HearthError, match="^the engine's warm-up failed: the GPU ran out of memory; lower"):
        engine.warm_up()


def test_the_warm_up_runs_a_prefix_hit_and_every_decode_bucket(models):
    """The second prompt finds the first one's pages in the prefix cache, and decode steps run at
    every batch bucket up to max_num_seqs."""
    engine = _engine(models["deepseek_v32"], warm_up="true")
    allocate, run = engine.blocks.allocate, engine.runner.run
    cached: list[int] = []
    decode_batches: set[int] = set()

    def spy_allocate(*args, **kwargs) -> int:
        cached.append(allocate(*args, **kwargs))
        return cached[-1]

    def spy_run(inputs, *args, **kwargs):
        if all(len(s.token_ids) == 1 for s in inputs):
            decode_batches.add(len(inputs))
        return run(inputs, *args, **kwargs)

    engine.blocks.allocate, engine.runner.run = spy_allocate, spy_run
    engine.warm_up()
    assert cached[0] == 0 and cached[1] == 2 * BS  # the first prompt's two whole pages
    assert len(cached) > 2 + 4 and not any(cached[2:])  # round 3's prompts (4 here) and the batches are read whole
    assert decode_batches == set(batch_buckets(MAX_NUM_SEQS))


@pytest.mark.parametrize("features", [{}, {"offload": "always", "expert_cache_slots": 3},
                                      {"offload": "always", "expert_cache_slots": 3, "scheduler": "runahead"}],
                         ids=["resident", "offload", "offload-runahead"])
def test_a_whole_prefill_chunk_is_warmed_and_no_expert_crosses_the_link(models, features):
    """The warm-up reads one whole chunk (max_num_batched_tokens) in a step, so a user's first long prompt compiles
    nothing. With experts in RAM, where such a chunk routes to every expert of every layer, the warm-up's fetches
    copy nothing (ExpertCache.dry_copies) and leave no expert in the cache; the answers after it are a fresh
    engine's (test_the_warm_up_runs_with_the_configured_features)."""
    engine = _engine(models["deepseek_v32"], warm_up="true", max_num_batched_tokens=512, **features)
    cache = engine.runner.expert_cache
    run, steps, fetched = engine.runner.run, [], []

    def spy_run(inputs, *args, **kwargs):
        steps.append(sum(len(s.token_ids) for s in inputs))
        return run(inputs, *args, **kwargs)

    engine.runner.run = spy_run
    if cache is not None:
        assert cache.copies == 0 and all(cache.resident(layer) == [] for layer in cache.store.layers)
        fetch = cache._fetch

        def spy_fetch(lease, todo, stats):
            fetched.append(len(todo))
            return fetch(lease, todo, stats)

        cache._fetch = spy_fetch
    engine.warm_up()
    assert max(steps) == 512  # an eighth, a quarter, half and all of a chunk and 3 (the last in two steps: 512, 3)
    assert {67, 131, 259, 512} <= set(steps)
    if cache is not None:
        assert sum(fetched) > 3 * len(cache.store.layers)  # (3 slots a layer: the pools were cycled through)
        assert cache.copies == 0 and all(cache.resident(layer) == [] for layer in cache.store.layers)
        assert all(cache.available(layer) == 3 for layer in cache.store.layers)


def test_the_warm_up_writes_no_chat_cache_file(models, tmp_path):
    """Five pages: the batch of four evicts the pages the prompts before left cached, yet nothing goes to
    RAM or disk (every page spilled would go straight to a file: there is no RAM for them)."""
    folder = tmp_path / "cache"
    engine = _engine(models["deepseek_v32"], warm_up="true", num_cache_blocks=5, prefix_cache_host_gib=1e-9,
                     prefix_cache_dir=str(folder))
    engine.warm_up()
    assert engine.prefix_tier.store.host_bytes == 0 and engine.prefix_tier.store.counters.pages_spilled == 0
    assert engine.close() == 0
    assert not folder.exists() or list(folder.iterdir()) == []


def test_a_warm_starts_pages_stay_and_serve_the_follow_up_from_ram(models, tmp_path):
    folder = tmp_path / "cache"
    first = _user_prompts()[0]
    before = _engine(models["deepseek_v32"], prefix_cache_dir=str(folder))
    (answer, _), = _answers(before, [first], "chat-1")
    assert before.close() >= 2
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    restarted = _engine(models["deepseek_v32"], warm_up="true", prefix_cache_dir=str(folder))
    store = restarted.prefix_tier.store
    assert store.preload.wait(timeout=120)
    preloaded = restarted.stats().extra
    restarted.warm_up()
    after = restarted.stats().extra
    for key in ("prefix_cache_preloaded_pages", "prefix_cache_host_bytes", "prefix_cache_conversations"):
        assert after[key] == preloaded[key] > 0, key
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    follow_up = first + answer + _user_prompts()[1]
    (tokens, cached), = _answers(restarted, [follow_up], "chat-1")
    assert cached == (len(first) + len(answer) - 1) // BS * BS  # its pages, restored from RAM
    assert restarted.stats().extra["prefix_cache_disk_read_bytes"] == 0
    assert tokens == _answers(_engine(models["deepseek_v32"], prefix_cache_offload=False), [follow_up])[0][0]


# ---- the engine host ---------------------------------------------------------------------


def _host(**options) -> EngineHost:
    return EngineHost(EngineConfig(device=TEST_DEVICE, max_model_len=256, max_num_seqs=2, **options))


def test_the_host_says_loading_until_the_warm_up_is_done(models, monkeypatch, caplog):
    host = _host(warm_up="true")
    host.start()
    entered, release = threading.Event(), threading.Event()
    real = Engine.warm_up

    def held_warm_up(engine: Engine) -> float:
        entered.set()
        release.wait(60)
        return real(engine)

    monkeypatch.setattr(Engine, "warm_up", held_warm_up)
    loader = threading.Thread(target=host.load, args=(models["deepseek_v32"], "tiny"))
    caplog.set_level(logging.INFO, logger="hearth.engine.server")
    loader.start()
    try:
        assert entered.wait(60)
        assert host.state == "loading" and host.model is None
        with pytest.raises(StillLoadingError):
            host.submit(lambda event: None, sampling={}, prompt="Hi")
        for client in serving_client(host):
            assert client.get("/health").json() == {"status": "loading", "model": None}
            assert client.get("/v1/models").json()["data"] == []
        release.set()
        loader.join(60)
        assert host.state == "ready" and host.model.name == "tiny"
        assert wait_until(lambda: host.stats().get("warm_up_s"), what="warm_up_s in the stats") > 0
        assert any("warmed up in" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        loader.join(60)
        host.close()


@pytest.mark.parametrize("failure", [HearthError, RuntimeError])
def test_a_failing_warm_up_fails_the_load_in_one_line_and_frees_the_engine(models, monkeypatch, caplog, failure):
    host = _host(warm_up="true")
    engines: list[weakref.ref[Engine]] = []

    def failing_warm_up(engine: Engine) -> float:
        engines.append(weakref.ref(engine))
        if failure is HearthError:  # (what a warm-up request that ran out of GPU memory raises)
            raise HearthError("the engine's warm-up failed: the GPU ran out of memory")
        raise RuntimeError("a kernel\nthat cannot build")

    monkeypatch.setattr(Engine, "warm_up", failing_warm_up)
    with pytest.raises(HearthError) as raised:
        host.load(models["deepseek_v32"], "tiny")
    message = str(raised.value)
    assert message.startswith("the engine's warm-up failed: ") and "\n" not in message
    if failure is RuntimeError:  # a bug: the message names it, the log has its traceback
        assert message.endswith("RuntimeError: a kernel that cannot build")
        assert "Traceback" in caplog.text and "in failing_warm_up" in caplog.text
    assert host.state == "no_model" and host.model is None and host.stats()["model"] is None
    del raised
    gc.collect()
    assert engines and engines[0]() is None  # its memory is given back, not held until the next load
    host.close()


def test_the_warm_up_is_off_when_the_config_says_so(models, monkeypatch):
    host = _host(warm_up="false")
    host.start()
    monkeypatch.setattr(Engine, "warm_up", lambda engine: pytest.fail("the warm-up ran"))
    host.load(models["deepseek_v32"], "tiny")
    wait_until(lambda: "cache_blocks_total" in host.stats(), what="the engine's stats")
    assert host.state == "ready" and "warm_up_s" not in host.stats()
    host.close()


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs are captured on a GPU only")
def test_the_warm_up_captures_the_decode_graphs_a_first_request_needs(tmp_path):
    model = write_tiny_model(tmp_path / "kernels", "deepseek_v32", seed=7, overrides=KERNEL_SHAPES)
    engine = Engine.load(str(model), EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS))
    assert engine.wants_warm_up  # auto, on CUDA
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.captures == 0
    engine.warm_up()
    assert set(graphs.graphs) == set(batch_buckets(MAX_NUM_SEQS))
    captures = graphs.captures
    _answers(engine, _user_prompts()[:1])
    assert graphs.captures == captures and graphs.replays > 0  # batch 1 replayed, nothing captured
