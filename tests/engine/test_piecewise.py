"""Piecewise decode steps (hearth.engine.piecewise) with offloaded experts: on the CPU the pieces run
eagerly ("eager pieces") with the same buckets, padding rows, slot tables and streaming fallback as the
captured ones, and give the resident run's greedy tokens for the sync and the runahead scheduler; a
request alone in the runahead decoder runs exactly the sync step (same fetches)."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, SamplingParams, TokenDelta
from tests.engine.conftest import TEST_DEVICE, run_to_completion

PROMPTS = [[(13 * i + 7 * j) % 450 + 30 for j in range(20 + 3 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _config(**options) -> EngineConfig:
    # host_experts="off": computing a missed expert on the host instead of fetching it is a timing
    # decision (measured speeds), which made the cache counters of two identical runs differ on a GPU.
    return EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16, host_experts="off", **options)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["deepseek_v32"])


@pytest.fixture(scope="module")
def resident_tokens(model_dir):
    return run_to_completion(Engine.load(model_dir, _config()), PROMPTS, GREEDY)


@pytest.mark.parametrize("slots", [3, 8])
def test_eager_pieces_give_the_resident_tokens(model_dir, resident_tokens, slots):
    """Three requests decode in the bucket of four (one padding row). With every expert fitting the
    pool (8 of 8) each MoE layer runs through the slot table; with 3 of 8 slots the layers whose
    experts do not fit at once stream through the backend instead, and the others still use slots."""
    engine = Engine.load(model_dir, _config(offload="always", expert_cache_slots=slots, scheduler="sync"))
    pieces = engine.runner.pieces
    assert pieces is not None and not pieces.capture
    assert run_to_completion(engine, PROMPTS, GREEDY) == resident_tokens
    assert ("attn", 0, 4) in pieces._pieces  # three requests padded to the bucket of four
    through_slots = {(layer, b) for kind, layer, b in pieces._pieces if kind == "experts"}
    if slots == 8:
        assert through_slots == {(layer, 4) for layer in pieces.offloaded}
    else:
        assert through_slots  # some layer-steps fit the pool, some streamed
    assert (pieces.fallbacks > 0) == (slots == 3)
    cache = engine.runner.expert_cache
    assert all(cache.available(layer) == slots for layer in cache.store.layers)  # every lease released


def test_padding_rows_fetch_nothing(model_dir):
    """A step of three requests in the bucket of four fetches exactly what the three need: the same
    cache requests as the same steps without pieces (which route the same tokens: checked first, since
    a different token would route differently)."""
    stats, tokens = [], []
    for pieces_on in (True, False):
        engine = Engine.load(model_dir, _config(offload="always", expert_cache_slots=8, scheduler="sync"))
        if not pieces_on:
            engine.runner.pieces = None
        tokens.append(run_to_completion(engine, PROMPTS, GREEDY))
        stats.append(engine.runner.expert_stats())
    assert tokens[0] == tokens[1]
    assert stats[0]["requests"] == stats[1]["requests"] and stats[0]["misses"] == stats[1]["misses"]


def test_runahead_micro_steps_run_the_pieces(model_dir, resident_tokens):
    # 5 slots: room for two requests' experts (top-2) at once, not three (those would decode as sync)
    engine = Engine.load(model_dir, _config(offload="always", expert_cache_slots=5, scheduler="runahead"))
    engine.runahead_gate = None  # the decoder itself (auto's gate: tests/engine/test_link_gate.py)
    pieces = engine.runner.pieces
    calls = []
    attend_rows = pieces.attend_rows

    def recording(layer, rows, hidden, selections, tiers=None):
        calls.append(len(rows))
        return attend_rows(layer, rows, hidden, selections, tiers)

    pieces.attend_rows = recording
    assert run_to_completion(engine, PROMPTS, GREEDY) == resident_tokens
    assert calls and max(calls) > 1  # groups of several requests went through the pieces
    assert engine.decoder.num_held == 0


def _counts(stats: dict[str, float]) -> dict[str, float]:
    """The expert-cache counters without the measured times (``copy_ms`` is the copy stream's clock)."""
    return {key: value for key, value in stats.items() if not key.endswith("_ms")}


def _decode_alone(engine: Engine) -> list[int]:
    request = engine.add_request(prompt_token_ids=PROMPTS[1], sampling=GREEDY)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for e in engine.step() if isinstance(e, TokenDelta) and e.request_id == request
                   for t in e.token_ids]
    return tokens


def test_one_request_under_runahead_is_the_sync_step(model_dir, resident_tokens):
    """One request: with offloaded experts "runahead" decodes a lone request as "sync" (the decoder
    never runs), so its fetches and its steps, overlapped decode included, are the sync scheduler's."""
    runs = {}
    for scheduler in ("sync", "runahead"):
        engine = Engine.load(model_dir, _config(offload="always", expert_cache_slots=3, scheduler=scheduler))
        runs[scheduler] = (_decode_alone(engine), engine.runner.expert_stats(), engine)
    assert runs["sync"][0] == runs["runahead"][0] == resident_tokens[1]
    assert _counts(runs["sync"][1]) == _counts(runs["runahead"][1])
    decoder = runs["runahead"][2].decoder
    assert decoder.sync_steps == decoder.micro_steps == 0
    assert runs["runahead"][2].decode_steps == runs["sync"][2].decode_steps
