"""The engine with its routed experts offloaded (host store + a device expert cache smaller than
the experts): same greedy tokens as with all experts resident, for both schedulers and for FP8
checkpoints; the cache really misses and evicts; a model too big for the machine fails before
loading with the numbers."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, HearthError, SamplingParams
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
