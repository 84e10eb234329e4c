"""Runahead decoding (R1) on the CPU: same greedy tokens as the layer-synchronous scheduler, no
starvation when some requests' experts arrive late, and abort in the middle of a runahead step
frees cache pages and expert leases.

Expert fetch latency is simulated by ``SlowResidency``: a real Residency over the model's own
experts whose leases become ready only after a number of polls chosen per (layer, expert), so the
scheduler's choices are exercised deterministically without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from tests.engine.conftest import TEST_DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class SlowResidency:
    """Leases on the model's resident experts that turn ready after ``delay(layer, expert)`` polls."""

    def __init__(self, engine: Engine, delay) -> None:
        self.model = engine.runner.model
        self.delay = delay
        self.outstanding: dict[int, list] = {}
        self.acquired = self.released = 0

    def acquire(self, layer: int, experts: list[int]):
        self.acquired += 1
        lease = {"layer": layer, "experts": experts, "polls": 0,
                 "needed": max(self.delay(layer, e) for e in experts)}
        self.outstanding[id(lease)] = lease
        return lease

    def is_ready(self, lease) -> bool:
        lease["polls"] += 1
        return lease["polls"] > lease["needed"]

    def wait_any(self, leases) -> None:
        for lease in leases:
            lease["polls"] += 1

    def release(self, lease) -> None:
        self.released += 1
        self.outstanding.pop(id(lease))

    def compute(self, layer, x, ids, weights, leases):
        return self.model.layers[layer].mlp.local_experts(layer, x, ids, weights)


def _engine(model_dir, scheduler: str, **options) -> Engine:
    return Engine.load(model_dir, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16,
                                               scheduler=scheduler, **options))


def _prompts():
    return [[(11 * i + 5 * j) % 470 + 20 for j in range(18 + 5 * i)] for i in range(5)]


def _run(engine: Engine, prompts, sampling=GREEDY, abort_after: int | None = None):
    ids = [engine.add_request(prompt_token_ids=p, sampling=sampling) for p in prompts]
    tokens = {i: [] for i in ids}
    finished, order, steps = {}, [], 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 20_000, "engine stalled"
        if abort_after is not None and steps == abort_after:
            engine.abort(ids[0])
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
                order.append(event.request_id)
            elif isinstance(event, Finished):
                finished[event.request_id] = event
    return [tokens[i] for i in ids], [finished[i] for i in ids], order


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["deepseek_v32"])


@pytest.fixture(scope="module")
def sync_tokens(model_dir):
    return _run(_engine(model_dir, "sync"), _prompts())[0]


def test_runahead_with_resident_experts_equals_sync(model_dir, sync_tokens):
    tokens, finished, _ = _run(_engine(model_dir, "runahead"), _prompts())
    assert tokens == sync_tokens
    assert all(f.reason == "length" for f in finished)


def test_runahead_with_late_experts_equals_sync_and_reorders(model_dir, sync_tokens):
    engine = _engine(model_dir, "runahead")
    # Adversarial: experts 0-3 of every layer take 25 polls to arrive, the rest are instant.
    slow = SlowResidency(engine, lambda layer, expert: 25 if expert < 4 else 0)
    engine.decoder.residency = slow
    tokens, finished, order = _run(engine, _prompts())
    assert tokens == sync_tokens
    assert slow.acquired == slow.released and not slow.outstanding
    # Requests did not advance in lock step: somebody produced two tokens in a row while others waited.
    assert any(a == b for a, b in zip(order, order[1:]))


def test_no_starvation_when_one_request_always_waits(model_dir, sync_tokens):
    engine = _engine(model_dir, "runahead")
    first_prompt_experts: set[tuple[int, int]] = set()

    def delay(layer, expert):
        # whichever experts show up first are slow forever after: the request using them lags
        if len(first_prompt_experts) < 6:
            first_prompt_experts.add((layer, expert))
        return 40 if (layer, expert) in first_prompt_experts else 0

    engine.decoder.residency = SlowResidency(engine, delay)
    tokens, finished, _ = _run(engine, _prompts())
    assert tokens == sync_tokens  # everyone finished, with the right tokens
    assert all(f.stats.completion_tokens == GREEDY.max_tokens for f in finished)


def test_abort_during_runahead_frees_pages_and_leases(model_dir):
    engine = _engine(model_dir, "runahead")
    slow = SlowResidency(engine, lambda layer, expert: 5)
    engine.decoder.residency = slow
    tokens, finished, _ = _run(engine, _prompts()[:3], SamplingParams(temperature=0, max_tokens=40,
                                                                      ignore_eos=True), abort_after=60)
    assert finished[0].reason == "abort" and finished[1].reason == "length"
    assert not slow.outstanding and slow.acquired == slow.released
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.decoder) == 0


def test_runahead_preemption_under_tight_cache_keeps_tokens(model_dir, sync_tokens):
    engine = _engine(model_dir, "runahead", num_cache_blocks=9, max_num_seqs=5)
    tokens, finished, _ = _run(engine, _prompts())
    assert tokens == sync_tokens
    assert engine.blocks.num_free_blocks == 9


def test_runahead_batches_requests_at_the_same_layer(model_dir):
    engine = _engine(model_dir, "runahead")
    _run(engine, _prompts())
    layers = engine.model_config.num_hidden_layers
    moe_layers = sum(engine.model_config.is_moe_layer(i) for i in range(layers))
    per_token = layers + moe_layers  # attention micro-steps + MoE micro-steps of one token
    total_tokens = 5 * (GREEDY.max_tokens - 1)  # the first token of each comes from prefill
    # Five requests in lock step would need per_token micro-steps per token *round*, not per token.
    assert engine.decoder.micro_steps < per_token * total_tokens / 2
    torch.testing.assert_close(torch.tensor(len(engine.decoder)), torch.tensor(0))
