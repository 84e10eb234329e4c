"""Tiered indexer keys and latents in the engine: recent key pages on the device, the rest in
host RAM behind compact summaries; all latents in host RAM with a small device hot buffer of rows.
With tiny device budgets and exact selection, long greedy generations equal the all-on-device engine
token for token (no token is ever lost by the tier bookkeeping)."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, SamplingParams, load_model
from tests.engine.conftest import TEST_DEVICE, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _run(engine: Engine, prompts) -> list[list[int]]:
    return run_to_completion(engine, prompts, GREEDY)


PROMPTS = [[(17 * i + 5 * j) % 460 + 20 for j in range(60 + 25 * i)] for i in range(3)]


@pytest.mark.parametrize("scheduler,lagged", [("sync", False), ("runahead", False), ("sync", True), ("runahead", True)])
def test_tiny_key_budget_with_exact_selection_equals_all_on_device(tiny_models, scheduler, lagged):
    path = str(tiny_models["glm_moe_dsa"])  # IndexCache layers too
    base = dict(device=TEST_DEVICE, dtype="float32", block_size=16, scheduler=scheduler)
    expected = _run(Engine.load(path, EngineConfig(**base)), PROMPTS)
    tiered = Engine.load(path, EngineConfig(**base, index_key_hot_pages=1, index_key_cache_pages=2,
                                            index_key_candidate_pages=1, index_key_exact=True,
                                            index_key_lagged_fetch=lagged, max_num_batched_tokens=50))
    key_tiers = tiered.runner.key_tiers
    assert tiered.runner.cache.index_keys[0] is None  # nothing of the keys in the paged cache
    seen = {}
    drop = key_tiers.drop

    def drop_and_count(seq_id):  # the counters of a request's tiers, read before they are released
        for (sid, layer), tiers in key_tiers.tiers.items():
            if sid == seq_id:
                seen[(sid, layer)] = tiers.stats()
        drop(seq_id)

    key_tiers.drop = drop_and_count
    assert _run(tiered, PROMPTS) == expected
    assert not key_tiers.tiers  # every request's tiers were released
    lagged_steps = sum(s["lagged_steps"] for s in seen.values())
    assert (lagged_steps > 0 and sum(s["demoted_pages"] for s in seen.values()) > 0) if lagged else lagged_steps == 0


@pytest.mark.parametrize("scheduler", ["sync", "runahead"])
def test_tiny_latent_hot_buffer_equals_all_on_device(tiny_models, scheduler):
    path = str(tiny_models["deepseek_v32"])
    base = dict(device=TEST_DEVICE, dtype="float32", block_size=16, scheduler=scheduler)
    expected = _run(Engine.load(path, EngineConfig(**base)), PROMPTS)
    tiered = Engine.load(path, EngineConfig(**base, latent_hot_rows=20, index_key_hot_pages=1,
                                            index_key_cache_pages=2, index_key_candidate_pages=1,
                                            index_key_exact=True))
    assert tiered.runner.cache.latent[0] is None  # no latent rows in the paged cache
    assert _run(tiered, PROMPTS) == expected
    assert not tiered.runner.latent_tiers.tiers


def test_coarse_to_fine_budget_keeps_most_of_the_selection(tiny_models):
    path = str(tiny_models["deepseek_v32"])
    ids = [(11 * j) % 470 + 20 for j in range(200)]
    exact = load_model(path, device=TEST_DEVICE, dtype="float32").logits(ids, chunk_size=1)
    tiered = load_model(path, device=TEST_DEVICE, dtype="float32", index_key_hot_pages=1,
                        index_key_candidate_pages=4, index_key_cache_pages=8, block_size=16)
    got = tiered.logits(ids, chunk_size=1)  # every position through the coarse-to-fine decode path
    assert got.shape == exact.shape
    # Random tiny models have no structure for page summaries to exploit; still most tokens agree.
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.5
