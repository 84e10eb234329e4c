"""Runahead decoding on the CPU: same greedy tokens as the layer-synchronous scheduler, no
starvation when some requests' experts arrive late, and abort in the middle of a runahead step
frees cache pages and expert leases.

Expert fetch latency is simulated by ``SlowResidency``: a real Residency over the model's own
experts whose leases become ready only after a number of polls chosen per (layer, expert), so the
scheduler's choices are exercised deterministically without a GPU. ``LinkResidency`` puts the real
(CPU) expert cache behind a simulated serial link, so bytes fetched can be compared with the
layer-synchronous scheduler on the same routing, and checks the cache cooperation (lead bound,
eviction plan).
"""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from hearth.engine.offload_setup import CacheResidency, EvictionPlan
from hearth.engine.runahead import NEEDED, PREDICTED
from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.experts import OffloadedExperts
from tests.engine.conftest import TEST_DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class SlowResidency:
    """Handles on the model's resident experts that land after ``delay(layer, expert)`` polls."""

    def __init__(self, engine: Engine, delay) -> None:
        self.model = engine.runner.model
        self.delay = delay
        self.outstanding: dict[int, dict] = {}
        self.acquired = self.released = self.copied = 0

    def plan(self, layer: int, tiers: dict[int, int]) -> None:
        pass

    def fetch_depth(self) -> int:
        return 4

    def copies(self) -> int:
        return self.copied

    def is_free(self, layer: int, experts: list[int]) -> list[bool]:
        return [self.delay(layer, e) == 0 for e in experts]

    def acquire(self, layer: int, experts: list[int]) -> list[dict]:
        handles = []
        for expert in experts:
            self.acquired += 1
            handle = {"layer": layer, "expert": expert, "polls": 0, "needed": self.delay(layer, expert)}
            self.copied += handle["needed"] > 0
            self.outstanding[id(handle)] = handle
            handles.append(handle)
        return handles

    def has_landed(self, handle) -> bool:
        handle["polls"] += 1
        return handle["polls"] > handle["needed"]

    def wait_any(self, handles) -> None:
        for handle in handles:
            handle["polls"] += 1

    def release(self, handle) -> None:
        self.released += 1
        self.outstanding.pop(id(handle))

    def compute(self, layer, x, handles, weights):
        experts = self.model.layers[layer].mlp.experts
        return torch.cat([experts[h["expert"]](x[p:p + 1]).float() * weights[p] for p, h in enumerate(handles)])


class LinkResidency(CacheResidency):
    """The engine's CPU expert cache behind a simulated serial link: a missed expert lands
    ``cost(layer, expert)`` ticks after the link is free; the clock ticks once per routed-experts
    call, and a wait jumps to the first waited copy's arrival. Records evictions of experts the plan
    marked as needed."""

    def __init__(self, engine: Engine, cost) -> None:
        base = engine.runner.residency
        super().__init__(base.cache, base.use_kernel, base.eviction_plan)
        self.cost = cost
        self.now = self.link_free = 0
        self.arrival: dict[tuple[int, int], int] = {}
        self.needed_evicted = 0
        self.held = 0

    capturable = False  # its clock ticks once per compute call: the decoder must call compute, not a graph

    def fetch_depth(self) -> int:
        return 2

    def acquire(self, layer: int, experts: list[int]):
        before = set(self.cache.resident(layer))
        handles = super().acquire(layer, experts)
        evicted = before - set(self.cache.resident(layer))
        needed = {e for e, tier in self.eviction_plan.tiers.get(layer, {}).items() if tier == NEEDED}
        self.needed_evicted += len(evicted & needed)
        for expert in experts:
            if expert not in before:
                self.link_free = max(self.link_free, self.now) + self.cost(layer, expert)
                self.arrival[(layer, expert)] = self.link_free
        self.held += len(handles)
        return handles

    def has_landed(self, handle) -> bool:
        return self.arrival.get((handle.layer, handle.experts[0]), 0) <= self.now

    def wait_any(self, handles) -> None:
        first = handles[0]
        self.now = max(self.now, self.arrival.get((first.layer, first.experts[0]), 0))

    def release(self, handle) -> None:
        self.held -= 1
        super().release(handle)

    def compute(self, *args):
        self.now += 1
        return super().compute(*args)


def _engine(model_dir, scheduler: str, **options) -> Engine:
    """The engine; "runahead" runs the decoder itself (on a GPU cache auto's gate would first measure
    sync rounds: tests/engine/test_link_gate.py and the gate test at the end)."""
    engine = Engine.load(model_dir, EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16,
                                                 scheduler=scheduler, **options))
    engine.runahead_gate = None
    return engine


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


# 6 of each layer's 8 experts, every missed one fetched: with host_experts="auto" a CUDA engine computes
# some missed experts on the CPU when it measures that faster (sync fetched 38 experts on the H200 where
# the CPU run fetches 42), so the counts compared below would depend on the machine's speeds.
OFFLOAD = dict(offload="always", expert_cache_slots=6, host_experts="off")
LINKS = {"uniform": lambda layer, expert: 1, "slow_0_3": lambda layer, expert: 25 if expert < 4 else 1,
         "slow_even": lambda layer, expert: 10 if expert % 2 == 0 else 1}


def _bytes_fetched(engine: Engine) -> int:
    return engine.runner.expert_cache.stats()["total"]["bytes_fetched"]


@pytest.fixture(scope="module")
def sync_offloaded(model_dir):
    engine = _engine(model_dir, "sync", **OFFLOAD)
    tokens = _run(engine, _prompts())[0]
    return tokens, _bytes_fetched(engine)


def _runahead_bytes(model_dir, link: str, cooperate: bool, max_lead: int | None = None
                    ) -> tuple[list[list[int]], int, Engine]:
    engine = _engine(model_dir, "runahead", **OFFLOAD)
    residency = LinkResidency(engine, LINKS[link])
    if not cooperate:  # no eviction plan, no lead bound
        residency.plan = lambda layer, tiers: None
        engine.decoder.max_lead = 10**9
    if max_lead is not None:
        engine.decoder.max_lead = max_lead
    engine.decoder.residency = residency
    tokens = _run(engine, _prompts())[0]
    return tokens, _bytes_fetched(engine), engine


@pytest.mark.parametrize("link", sorted(LINKS))
def test_bytes_fetched_match_sync(model_dir, sync_tokens, sync_offloaded, link):
    """Same routing (same greedy tokens), real expert cache, a serial link with slow experts, a pool
    that holds about one layer-step (6 of 8 experts; 5 requests x top-2). Measured in fetches (sync 42):
    runahead 44 / 43 / 42 (slow_0_3 / slow_even / uniform); with a lead bound of one layer (experts
    computed one by one as they land, but no request starts a layer ahead of the others) 42 / 42 / 42.
    The extra fetches of running ahead are experts a request one token ahead evicted before a lagging
    one routed to them. The counts are the same on a CUDA cache, where copies land asynchronously: the
    cache's recency order does not depend on which copies had landed when a call was planned."""
    tokens, fetched, engine = _runahead_bytes(model_dir, link, cooperate=True)
    assert tokens == sync_tokens == sync_offloaded[0]
    assert engine.decoder.max_lead_seen < engine.decoder.max_lead
    assert fetched <= 1.08 * sync_offloaded[1]
    lockstep_tokens, lockstep, _ = _runahead_bytes(model_dir, link, cooperate=True, max_lead=1)
    assert lockstep_tokens == sync_tokens
    assert lockstep <= sync_offloaded[1]


def test_experts_computed_as_they_land_and_shared(model_dir, sync_tokens):
    """A request computes its resident experts before its slow ones land, and one held expert serves
    every waiting request of its layer (the decoder never holds an expert twice)."""
    engine = _engine(model_dir, "runahead", **OFFLOAD)
    residency = LinkResidency(engine, LINKS["slow_0_3"])
    engine.decoder.residency = residency
    decoder = engine.decoder
    partial = shared = 0
    compute = residency.compute

    def recording(layer, x, handles, weights):
        nonlocal partial, shared
        experts = [h.experts[0] for h in handles]
        waiting = [f for f in decoder.flights.values() if f.phase == "moe" and f.layer == layer]
        partial += any(sum(f.experts[k] in experts for k in f.todo) < len(f.todo) for f in waiting)
        shared += len(experts) > len(set(experts))  # one expert, pairs of several requests
        assert residency.held <= residency.cache.capacity(layer) * len(decoder._held)
        return compute(layer, x, handles, weights)

    residency.compute = recording
    tokens, _, _ = _run(engine, _prompts())
    assert tokens == sync_tokens
    assert partial > 0 and shared > 0
    assert decoder.num_held == 0 and residency.held == 0


def test_abort_with_real_cache_frees_every_expert(model_dir):
    engine = _engine(model_dir, "runahead", **OFFLOAD)
    residency = LinkResidency(engine, LINKS["slow_even"])
    engine.decoder.residency = residency
    ids = [engine.add_request(prompt_token_ids=p, sampling=GREEDY) for p in _prompts()]
    steps = 0
    while engine.decoder.num_held == 0 or steps < 40:  # abort while experts are held for waiting pairs
        steps += 1
        assert steps < 5_000
        engine.step()
    for request_id in ids[:3]:
        engine.abort(request_id)
    engine.step()
    assert all(f.request_id not in ids[:3] for f in engine.decoder.flights.values())
    while engine.has_unfinished():
        engine.step()
    assert engine.decoder.num_held == 0 and residency.held == 0
    cache = residency.cache
    assert all(cache.refcount(layer, e) == 0 for layer in cache.store.layers for e in range(cache.store.num_experts))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_lead_bound_holds_under_late_experts(model_dir, sync_tokens):
    engine = _engine(model_dir, "runahead")
    engine.decoder.max_lead = 2
    engine.decoder.residency = SlowResidency(engine, lambda layer, expert: 30 if expert < 3 else 0)
    gaps: dict[str, int] = {}
    last: dict[str, int] = {}
    ids = [engine.add_request(prompt_token_ids=p, sampling=GREEDY) for p in _prompts()]
    tokens = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 20_000, "engine stalled"
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
                gaps[event.request_id] = max(gaps.get(event.request_id, 0), steps - last.get(event.request_id, 0))
                last[event.request_id] = steps
        flights = list(engine.decoder.flights.values())
        if flights:
            progress = [f.progress(engine.decoder.num_layers) for f in flights if f.phase == "attn"]
            floor = min(f.progress(engine.decoder.num_layers) for f in flights)
            assert all(p - floor <= engine.decoder.max_lead for p in progress)
    assert [tokens[i] for i in ids] == sync_tokens
    assert engine.decoder.max_lead_seen < 2
    # bounded wait: no request went longer between two tokens than everyone's slow fetches in a row
    assert max(gaps.values()) < 5 * (30 + 10) * engine.decoder.num_layers


def _use(residency: CacheResidency, experts: list[int]) -> None:
    for handle in residency.acquire(0, experts):
        residency.release(handle)


def test_eviction_plan_keeps_needed_then_predicted_experts():
    store = ExpertStore(ExpertLayout(32, 16, torch.bfloat16), [0], 8)
    plan = EvictionPlan()
    cache = ExpertCache(store, "cpu", slots_per_layer=3, policy=plan.policy("lru"))
    residency = CacheResidency(cache, use_kernel=False, plan=plan)
    for expert in (0, 1, 2):  # 0 is least recently used
        _use(residency, [expert])
    residency.plan(0, {0: NEEDED, 1: PREDICTED})
    _use(residency, [3])
    assert cache.resident(0) == [0, 1, 3]  # 2: nobody expects it
    residency.plan(0, {0: NEEDED, 1: PREDICTED, 3: PREDICTED})
    _use(residency, [4])
    assert cache.resident(0) == [0, 3, 4]  # then the least recently used predicted one, never the needed one
    held = residency.acquire(0, [0])
    residency.plan(0, {})
    _use(residency, [5, 6])
    assert cache.resident(0) == [0, 5, 6]  # an empty plan is plain LRU; the held expert stays
    for handle in held:
        residency.release(handle)


class PairedGate(torch.nn.Module):
    """Adversarial routing: the real gate's weights, but each token's experts are the pair {2p, 2p+1}
    where p is its real top-1 expert // 2, so tokens routed to different pairs share no expert."""

    def __init__(self, gate: torch.nn.Module) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = self.gate(x)
        first = ids[:, :1] - ids[:, :1] % 2  # (T, 1)
        return torch.cat([first, first + 1], dim=1), weights


def _paired_routing(engine: Engine) -> Engine:
    for layer in engine.runner.model.layers:
        if layer.is_moe:
            layer.mlp.gate = PairedGate(layer.mlp.gate)
    return engine


@pytest.mark.parametrize("slots", [1, 2])
def test_adversarial_routing_through_a_tiny_cache(model_dir, slots):
    """Every pool holds at most one pair (or half of one) while the requests want four disjoint pairs
    of experts, behind a slow serial link, with prompt chunks running between decode micro-steps
    while flights wait for experts: every request completes with the resident tokens, no
    CacheFullError escapes and every slot is released at the end."""
    options = dict(max_num_batched_tokens=16)
    expected = _run(_paired_routing(_engine(model_dir, "sync", **options)), _prompts())[0]
    engine = _paired_routing(_engine(model_dir, "runahead", offload="always", expert_cache_slots=slots, **options))
    residency = LinkResidency(engine, LINKS["slow_even"])
    engine.decoder.residency = residency
    prompts_while_waiting = []
    run = engine.runner.run

    def run_and_record(inputs, *args, **kwargs):
        prompts_while_waiting.append(any(f.phase == "moe" for f in engine.decoder.flights.values()))
        return run(inputs, *args, **kwargs)

    engine.runner.run = run_and_record
    tokens, finished, _ = _run(engine, _prompts())
    assert tokens == expected
    assert all(f.reason == "length" for f in finished)
    assert any(prompts_while_waiting)  # a prompt chunk ran while flights waited for experts
    cache = residency.cache
    assert engine.decoder.num_held == 0 and residency.held == 0
    assert all(cache.available(layer) == slots for layer in cache.store.layers)


def test_runahead_decoder_calls_are_counted(model_dir):
    """The engine's totals count the runahead decoder's calls and the tokens they finish (every token
    after each request's first, which its prompt step samples), so a client can take time per token
    from a window of runahead decoding."""
    engine = _engine(model_dir, "runahead")
    _run(engine, _prompts())
    stats = engine.stats().extra
    assert stats["runahead_tokens"] == 5 * (GREEDY.max_tokens - 1)
    assert stats["runahead_steps"] == engine.decoder.micro_steps > 0  # one micro-step a call
    assert stats["runahead_step_ms_sum"] > 0


def test_one_request_after_several_costs_what_sync_costs(model_dir):
    """A lone request after several decodes through the sync step, one model call per token and no
    micro-step, and the eviction plan the decoder set for the several is gone (a stale plan kept
    experts nobody expected any more and cost the lone request extra fetches)."""
    engine = _engine(model_dir, "runahead", offload="always", expert_cache_slots=4, host_experts="off")
    _run(engine, _prompts()[:4])
    assert engine.decoder.micro_steps > 0 and engine.runner.residency.eviction_plan.tiers == {}
    calls = []
    run = engine.runner.run
    engine.runner.run = lambda inputs, *args, **kwargs: calls.append(len(inputs)) or run(inputs, *args, **kwargs)
    micro_steps = engine.decoder.micro_steps
    tokens, _, _ = _run(engine, _prompts()[4:])
    assert engine.decoder.micro_steps == micro_steps
    assert len(calls) == len(tokens[0])  # the prompt's step (its first token), then one per token
    assert engine.runner.residency.eviction_plan.tiers == {}


def test_rounds_with_every_expert_resident_run_as_one_sync_step(model_dir, sync_tokens):
    """Once a round copied nothing over the link (every expert resident), the next round of all the
    requests runs as one sync step (one call, as sync runs it), not one micro-step per layer and phase."""
    engine = _engine(model_dir, "runahead", offload="always", expert_cache_slots=8, host_experts="off")
    engine.decoder.residency = LinkResidency(engine, LINKS["slow_even"])
    tokens, _, _ = _run(engine, _prompts())
    assert tokens == sync_tokens
    decoder = engine.decoder
    layers = engine.model_config.num_hidden_layers
    per_round = layers + sum(engine.model_config.is_moe_layer(i) for i in range(layers))
    rounds = GREEDY.max_tokens - 1  # every request decodes in every round (their prompts share one step)
    # The first round copies experts the prompts did not use and runs in micro-steps; none after it does.
    assert decoder.sync_steps == rounds - 1
    assert decoder.micro_steps - decoder.sync_steps == per_round
    assert decoder.sync_rows == 5 * (rounds - 1)


def test_requests_whose_experts_fit_the_pool_decode_as_sync(model_dir, sync_tokens):
    """Three requests, top-2, 6 slots per layer: every layer's pool holds all their experts at once, so
    the sync step queues each layer's copies together and running ahead has nothing to add. They decode
    as sync does: the same model calls (one per token round), the same bytes over the link, no
    micro-step (the decoder made ~100 micro-steps for the 15 rounds sync runs in 15 calls)."""
    prompts = _prompts()[:3]
    counts = {}
    for scheduler in ("sync", "runahead"):
        engine = _engine(model_dir, scheduler, **OFFLOAD)
        if engine.decoder is not None:
            engine.decoder.residency = LinkResidency(engine, LINKS["slow_even"])
        calls: list[int] = []

        def counted(inputs, *args, _calls=calls, _forward=engine.runner.run, **kwargs):
            _calls.append(len(inputs))
            return _forward(inputs, *args, **kwargs)

        engine.runner.run = counted
        tokens = _run(engine, prompts)[0]
        assert tokens == sync_tokens[:3]
        counts[scheduler] = (calls, _bytes_fetched(engine))
        if engine.decoder is not None:
            assert engine.decoder.micro_steps == 0
    assert counts["runahead"] == counts["sync"]


def test_a_lone_prompt_after_several_requests_is_read_as_under_sync(model_dir, monkeypatch):
    """A prompt sent alone after several requests decoded (behind a simulated link, so the decoder held
    and queued experts) is read exactly as under sync: the same prompt chunks, the same routed-experts
    calls with the whole pool free for each, the same experts copied, the same first tokens."""
    long_prompt = [(29 * j) % 470 + 20 for j in range(120)]
    calls: list[tuple[int, int, int]] = []  # (layer, tokens, free slots) of each routed-experts call
    forward = OffloadedExperts.__call__

    def counted(self, layer, x, ids, weights):
        calls.append((layer, x.shape[0], self.cache.available(layer)))
        return forward(self, layer, x, ids, weights)

    monkeypatch.setattr(OffloadedExperts, "__call__", counted)
    seen = {}
    for scheduler in ("sync", "runahead"):
        engine = _engine(model_dir, scheduler, max_num_batched_tokens=48, **OFFLOAD)
        if engine.decoder is not None:
            engine.decoder.residency = LinkResidency(engine, LINKS["slow_even"])
        _run(engine, _prompts())
        assert engine.decoder is None or engine.decoder.micro_steps > 0
        cache = engine.runner.expert_cache
        calls.clear()
        copies = cache.copies
        tokens = _run(engine, [long_prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
        seen[scheduler] = (tokens, list(calls), cache.copies - copies)
    assert seen["runahead"] == seen["sync"]
    assert len(seen["sync"][1]) >= 3 * 2  # three chunks through both MoE layers
    assert all(free == OFFLOAD["expert_cache_slots"] for _, _, free in seen["sync"][1])


@pytest.mark.parametrize("link", ["busy", "half", "unused"])
def test_auto_gate_runs_runahead_only_where_overlap_could_pay(model_dir, sync_tokens, link):
    """The engine's runahead gate (hearth.engine.link_gate; on a GPU cache it reads the copy stream's
    busy time, here a simulated link): five requests, more than the 6-slot pools hold at once. A link
    busy for the whole of every sync round, or never used, leaves nothing to overlap: the decoder never
    starts, every token is a sync step. A link busy half of each round starts a runahead trial after a
    window of sync rounds. Tokens equal sync's either way."""
    from time import perf_counter

    from hearth.engine.link_gate import RunaheadGate

    busy = {"busy": perf_counter, "half": lambda: perf_counter() / 2, "unused": lambda: 0.0}[link]
    engine = _engine(model_dir, "runahead", **OFFLOAD)
    engine.decoder.residency = LinkResidency(engine, LINKS["slow_even"])
    engine.runahead_gate = gate = RunaheadGate(busy, window=2)
    tokens = _run(engine, _prompts())[0]
    assert tokens == sync_tokens
    assert engine._gate_interval is None  # idle until the next request: nothing for the gate to time
    if link == "half":
        assert gate.trials >= 1 and engine.decoder.micro_steps > 0
        assert gate.state(5).busy == pytest.approx(0.5, abs=0.05)
    else:
        assert gate.trials == 0 and engine.decoder.micro_steps == 0
        assert len(gate.state(5).rounds) == 2 and gate.state(5).idle in (pytest.approx(0, abs=0.05), 1.0)


def test_the_gate_is_on_only_where_a_link_is_measured(model_dir):
    """runahead gets the gate over a GPU cache (it reads the copy stream's busy time); over a host-memory
    cache nothing crosses a link, so runahead runs as asked; sync needs none, nor auto, which runs sync for
    several requests (api.AUTO_SEVERAL_REQUESTS) and so has no decoder either."""
    config = dict(device=TEST_DEVICE, dtype="float32", block_size=16, **OFFLOAD)
    for scheduler in ("auto", "runahead", "sync"):
        engine = Engine.load(model_dir, EngineConfig(scheduler=scheduler, **config))
        assert (engine.runahead_gate is not None) == (scheduler == "runahead" and TEST_DEVICE == "cuda")
        assert (engine.decoder is not None) == (scheduler == "runahead")


@pytest.mark.parametrize("options", [{}, dict(offload="always", expert_cache_slots=2, host_experts="off")],
                         ids=["resident", "offloaded"])
def test_a_prompt_whose_last_chunk_leaves_one_token_is_read_at_once(model_dir, options):
    """The decoder takes a request only once it has a sampled token, and the step loop leaves decodes to
    it. A 33-token prompt read in 32-token chunks has one token left after its first chunk: that token is
    read in the next step, as under sync (it was left to nobody: with resident experts the request never
    answered, with offloaded ones it waited until the two decoding requests had finished), with sync's
    tokens."""
    steps: dict[str, int] = {}
    answers: dict[str, list[int]] = {}
    for scheduler in ("sync", "runahead"):
        engine = _engine(model_dir, scheduler, max_num_batched_tokens=32, **options)
        long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for first in (100, 200):  # two requests decoding (runahead runs the decoder for them)
            engine.add_request(prompt_token_ids=list(range(first, first + 10)), sampling=long)
        for _ in range(3):
            engine.step()
        late = engine.add_request(prompt_token_ids=list(range(40, 73)), sampling=GREEDY)
        answers[scheduler], step = [], 0
        while engine.has_unfinished():
            step += 1
            assert step < 500, "engine stalled"
            for event in engine.step():
                if isinstance(event, TokenDelta) and event.request_id == late:
                    steps.setdefault(scheduler, step)
                    answers[scheduler].extend(event.token_ids)
    assert steps["runahead"] == steps["sync"] == 2  # its first chunk, then its last token
    assert answers["runahead"] == answers["sync"] and len(answers["sync"]) == GREEDY.max_tokens
