"""The engine with its routed experts offloaded (host store + a device expert cache smaller than
the experts): same greedy tokens as with all experts resident, for every scheduler and for FP8
checkpoints, also with more requests and longer prompts than the cache holds at once; the cache
really misses and evicts; a model too big for the machine fails before loading with the numbers."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, Finished, HearthError, SamplingParams, TokenDelta, api
from hearth.offload.cpu_experts import HostSpeeds
from tests.engine.conftest import TEST_DEVICE, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _run(engine: Engine, prompts) -> list[list[int]]:
    return run_to_completion(engine, prompts, GREEDY)


PROMPTS = [[(13 * i + 7 * j) % 450 + 30 for j in range(20 + 3 * i)] for i in range(4)]


@pytest.mark.parametrize("scheduler", ["sync", "runahead", "prefetch"])
def test_offloaded_experts_give_the_same_tokens(tiny_models, scheduler):
    path = str(tiny_models["deepseek_v32"])
    base = EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16)
    expected = _run(Engine.load(path, base), PROMPTS)
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16, offload="always",
                                            expert_cache_slots=3, scheduler=scheduler))
    assert engine.runner.placement.offload
    assert _run(engine, PROMPTS) == expected
    stats = engine.stats().extra
    assert stats["expert_cache_misses"] > 0 and stats["expert_cache_evictions"] > 0
    assert 0 < stats["expert_cache_hit_rate"] < 1
    if scheduler == "prefetch":
        assert engine.runner.model.layers[1].mlp.backend.predicted > 0


# Six requests of 40-85 tokens, read 48 prompt tokens per step: prompt chunks run between decode steps.
CROWD = [[(17 * i + 5 * j) % 450 + 30 for j in range(40 + 9 * i)] for i in range(6)]
CROWD_GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def crowd_tokens(tiny_models):
    engine = Engine.load(str(tiny_models["deepseek_v32"]), EngineConfig(
        device=TEST_DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=48))
    return run_to_completion(engine, CROWD, CROWD_GREEDY)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("scheduler", ["sync", "runahead", "prefetch", "auto"])
def test_more_requests_and_longer_prompts_than_the_cache_holds(tiny_models, crowd_tokens, scheduler, slots):
    """1-2 slots per layer for top-2 of 8 experts, six requests at once, each prompt chunk routed to
    every expert: every request completes with the resident tokens and no CacheFullError escapes
    (one slot cannot double-buffer a streamed call; runahead flights hold slots while prompts run)."""
    engine = Engine.load(str(tiny_models["deepseek_v32"]), EngineConfig(
        device=TEST_DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=48, offload="always",
        expert_cache_slots=slots, scheduler=scheduler))
    assert run_to_completion(engine, CROWD, CROWD_GREEDY) == crowd_tokens
    cache = engine.runner.expert_cache
    assert all(cache.available(layer) == slots for layer in cache.store.layers)  # nothing left held


def _one_long_among_short(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """PROMPTS at once, the first answering 16 tokens, the others 4: (tokens of each; [decoder
    micro-steps, prefetch guesses, tokens] counted in the steps where the first request was the only
    one left and had no token in flight in the decoder)."""
    ids = [engine.add_request(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0, max_tokens=4 if i else 16, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished: set[str] = set()
    decoder, prefetcher = engine.decoder, engine.runner.prefetcher
    alone = [0, 0, 0]
    while engine.has_unfinished():
        before = (decoder.micro_steps if decoder else 0, prefetcher.predicted if prefetcher else 0)
        was_alone = finished == set(ids[1:]) and not (decoder and decoder.flights)
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
                alone[2] += was_alone
            elif isinstance(event, Finished):
                finished.add(event.request_id)
        if was_alone:
            alone[0] += (decoder.micro_steps if decoder else 0) - before[0]
            alone[1] += (prefetcher.predicted if prefetcher else 0) - before[1]
    return [tokens[i] for i in ids], alone


def test_auto_rule():
    assert api.auto_scheduler(0) == api.auto_scheduler(1) == "sync"
    assert api.auto_scheduler(2) == api.auto_scheduler(32) == api.AUTO_SEVERAL_REQUESTS
    assert EngineConfig().scheduler == "auto"
    # runahead only where some layer's pool cannot hold every request's experts at once
    assert api.auto_scheduler(8, "runahead", pool_requests=8) == "sync"
    assert api.auto_scheduler(9, "runahead", pool_requests=8) == "runahead"
    assert api.auto_scheduler(2, "prefetch", pool_requests=8) == "prefetch"


@pytest.mark.parametrize("several", ["runahead", "prefetch", "sync"])
def test_auto_decodes_one_request_synchronously_and_several_by_the_rule(tiny_models, monkeypatch, several):
    """scheduler auto (the default) with AUTO_SEVERAL_REQUESTS set to each choice: several requests run
    with that scheduler; once one request is left (and the tokens in flight have finished) it decodes
    synchronously: no runahead micro-step, no prefetch guess. Tokens equal the resident run."""
    monkeypatch.setattr(api, "AUTO_SEVERAL_REQUESTS", several)
    path = str(tiny_models["deepseek_v32"])
    expected, _ = _one_long_among_short(Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32",
                                                                          block_size=16)))
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16, offload="always",
                                            expert_cache_slots=3))
    engine.runahead_gate = None  # several requests run by the rule (the gate: tests/engine/test_link_gate.py)
    tokens, alone = _one_long_among_short(engine)
    assert tokens == expected
    assert alone[:2] == [0, 0] and alone[2] >= 8  # the long request's last tokens: sync, nothing extra
    assert (engine.decoder is not None) == (several == "runahead")  # built only where auto may run it
    if engine.decoder is not None:
        assert engine.decoder.micro_steps > 0
        assert not engine.decoder.flights and engine.decoder.num_held == 0
    assert (engine.runner.prefetcher.predicted > 0) == (several == "prefetch")


def test_resident_experts_ignore_auto(tiny_models):
    engine = Engine.load(str(tiny_models["deepseek_v32"]), EngineConfig(device=TEST_DEVICE, dtype="float32"))
    assert engine.config.scheduler == "auto" and engine.decoder is None and engine.runner.prefetcher is None


def test_offloaded_fp8_checkpoint(tiny_fp8_model):
    path = str(tiny_fp8_model)
    expected = _run(Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32")), PROMPTS[:2])
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", offload="always",
                                            expert_cache_slots=4))
    assert _run(engine, PROMPTS[:2]) == expected


def test_model_that_cannot_fit_fails_before_loading(tiny_models):
    with pytest.raises(HearthError, match="does not fit"):
        Engine.load(str(tiny_models["deepseek_v32"]), EngineConfig(device=TEST_DEVICE, host_memory_gib=1e-6,
                                                                    gpu_memory_gib=1e-6))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_offloaded_experts_of_gqa_models(tiny_models, arch):
    """Mixtral's block_sparse_moe.experts.E.w1/w3/w2, Qwen3's and GLM-4.5's names (GLM-4.5 behind a
    dense first layer, with a shared expert and an MTP layer that stays on disk) fill the expert store."""
    path = str(tiny_models[arch])
    expected = _run(Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32")), PROMPTS[:2])
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", offload="always",
                                            expert_cache_slots=3))
    assert _run(engine, PROMPTS[:2]) == expected
    assert engine.stats().extra["expert_cache_misses"] > 0


def test_missed_experts_computed_on_the_host(tiny_models):
    """host_experts="on": missed experts run on the CPU from the host store instead of being fetched;
    the answer is the resident one (same greedy tokens)."""
    path = str(tiny_models["deepseek_v32"])
    expected = _run(Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16)), PROMPTS[:2])
    engine = Engine.load(path, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16, offload="always",
                                            expert_cache_slots=3, host_experts="on"))
    assert _run(engine, PROMPTS[:2]) == expected
    assert engine.runner.expert_stats().get("cpu_computed", 0) > 0


def test_host_experts_setting_is_checked():
    with pytest.raises(HearthError, match="host_experts"):
        EngineConfig(host_experts="sometimes")


def test_stats_show_the_host_experts_probe_when_it_ran(tiny_models):
    """/hearth/stats carries the start-up probe that decides which missed experts the host computes
    (``--host-experts auto`` on CUDA), so two servers' choices can be told apart; none without a probe."""
    engine = Engine.load(str(tiny_models["deepseek_v32"]), EngineConfig(
        device=TEST_DEVICE, dtype="float32", offload="always", expert_cache_slots=3, host_experts="off",
        scheduler="sync"))
    backend = engine.runner.expert_backend
    assert all(layer.mlp.backend is backend for layer in engine.runner.model.layers if layer.is_moe)
    assert not any(key.startswith("expert_cache_host_") for key in engine.stats().extra)
    backend.host_speeds = HostSpeeds(link_ms_per_expert=0.83, cpu_fixed_ms=58.3, cpu_ms_per_token=1.2, transfer_ms=0.1)
    extra = engine.stats().extra
    names = ("link_per_expert_ms", "cpu_fixed_ms", "cpu_per_token_ms", "transfer_ms")
    assert [extra[f"expert_cache_host_{name}"] for name in names] == [0.83, 58.3, 1.2, 0.1]
