"""A long chat with tiered keys / latents keeps its cache across turns (hearth.engine.tier_cache): a
finished request's tiers are parked in RAM and the next turn of its chat adopts them, prefilling only
the new tokens. With exact selection (``index_key_exact``) tiered engines equal the all-on-device
engine token for token, so every follow-up turn must give the tokens of a fresh engine that reads
the whole prompt."""

from __future__ import annotations

import pytest

from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from tests.engine.conftest import TEST_DEVICE

BS = 16
ANSWER = 20
GREEDY = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
BASE = dict(device=TEST_DEVICE, dtype="float32", block_size=BS)
EXACT_KEYS = dict(index_key_hot_pages=1, index_key_cache_pages=2, index_key_candidate_pages=1, index_key_exact=True)
KEYS_AND_LATENTS = dict(EXACT_KEYS, latent_hot_rows=20)
LATENTS = dict(latent_hot_rows=20)  # the indexer keys in the pages (the prefix cache on for them)


def _ids(n: int, a: int, b: int = 20) -> list[int]:
    return [(a * j) % 460 + b for j in range(n)]


def _turn(engine: Engine, ids: list[int], conversation: str | None = None,
          sampling: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """Run one request to its end: its tokens and its cached prompt tokens."""
    tokens: list[int] = []
    for event in engine.generate(prompt_token_ids=ids, sampling=sampling, conversation_id=conversation):
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            assert event.reason == "length", event.error
            return tokens, event.stats.cached_prompt_tokens
    raise AssertionError("no Finished event")


def _covered(prompt: list[int]) -> int:
    """Tokens a finished turn parks: prompt + answer minus the last token, whole pages."""
    return (len(prompt) + ANSWER - 1) // BS * BS


def _fresh(path, prompt: list[int]) -> list[int]:
    return _turn(Engine.load(path, EngineConfig(**BASE)), prompt)[0]


def _tier_stats(engine: Engine) -> dict[str, float]:
    return {k: v for k, v in engine.stats().extra.items() if k.startswith("tier_cache_")}


@pytest.fixture(scope="module")
def v32(tiny_models) -> str:
    return str(tiny_models["deepseek_v32"])


@pytest.mark.parametrize("tiers", [KEYS_AND_LATENTS, EXACT_KEYS, LATENTS], ids=["keys+latents", "keys", "latents"])
def test_follow_up_turns_adopt_the_parked_tiers_and_equal_a_full_prefill(v32, tiers):
    engine = Engine.load(v32, EngineConfig(**BASE, **tiers))
    prompt = _ids(60, 7)
    answer, cached = _turn(engine, prompt, "chat")
    assert cached == 0
    stats = _tier_stats(engine)
    assert stats["tier_cache_chats"] == 1 and stats["tier_cache_bytes"] > 0
    assert engine.stats().extra["prefix_cache_conversations"] == 1
    for turn in range(2):  # a second and a third turn, each extending the last
        covered = _covered(prompt)
        prompt = prompt + answer + _ids(15, 5 + turn)
        answer, cached = _turn(engine, prompt, "chat")
        assert cached == covered
        assert answer == _fresh(v32, prompt)
    assert _tier_stats(engine)["tier_cache_hits_tokens"] == _covered(_ids(60, 7)) + cached
    stats = _tier_stats(engine)  # adopted from RAM twice: host time, no disk (no store at all)
    assert stats["tier_cache_restore_ms"] >= stats["tier_cache_resume_ms"] > 0
    assert stats["tier_cache_park_ms"] > 0 and stats["tier_cache_match_ms"] > 0
    assert "tier_cache_disk_read_bytes" not in stats and "tier_cache_spill_ms" not in stats
    assert _tier_stats(engine)["tier_cache_chats"] == 1  # each turn's state replaced the one it adopted
    for kept in (engine.runner.key_tiers, engine.runner.latent_tiers):  # nothing of a finished request is left
        assert kept is None or not kept.tiers


def test_a_chat_switch_keeps_both_chats_when_the_budget_allows_and_evicts_the_oldest_when_not(v32):
    chat_a, chat_b = _ids(60, 7), _ids(62, 11, 30)
    probe = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    answer_a, _ = _turn(probe, chat_a, "a")
    one_chat = _tier_stats(probe)["tier_cache_bytes"]
    _turn(probe, chat_b, "b")
    assert _tier_stats(probe)["tier_cache_chats"] == 2
    follow_up = chat_a + answer_a + _ids(15, 5)
    expected = _fresh(v32, follow_up)
    assert _turn(probe, follow_up, "a") == (expected, _covered(chat_a))

    small = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS, tier_cache_host_gib=1.5 * one_chat / 2**30))
    assert _turn(small, chat_a, "a")[0] == answer_a
    _turn(small, chat_b, "b")  # parking b evicts a
    stats = _tier_stats(small)
    assert stats["tier_cache_chats"] == 1 and stats["tier_cache_evictions"] == 1
    assert stats["tier_cache_bytes"] <= 1.5 * one_chat
    assert _turn(small, follow_up, "a") == (expected, 0)  # re-prefilled, same tokens


def test_drop_conversation_frees_its_parked_tiers(v32):
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(60, 7)
    answer, _ = _turn(engine, prompt, "gone")
    assert engine.drop_conversation("gone") >= 1
    stats = _tier_stats(engine)
    assert stats["tier_cache_chats"] == 0 and stats["tier_cache_bytes"] == 0
    assert engine.stats().extra["prefix_cache_conversations"] == 0
    assert _turn(engine, prompt + answer + _ids(15, 5), "gone")[1] == 0


def test_a_prompt_that_diverges_adopts_only_the_whole_pages_before_the_divergence(v32):
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(60, 7)
    _turn(engine, prompt)
    edited = prompt[:40] + _ids(30, 3, 25)  # an earlier message edited at token 40
    assert edited[40] != prompt[40]
    answer, cached = _turn(engine, edited)
    assert cached == 32  # pages 0-1; page 2 holds the divergence
    assert answer == _fresh(v32, edited)


def test_a_conversation_id_narrows_the_search(v32):
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(60, 7)
    answer, _ = _turn(engine, prompt, "mine")
    follow_up = prompt + answer + _ids(15, 5)
    assert _turn(engine, follow_up, "other")[1] == 0  # another chat's state is not used
    assert _turn(engine, follow_up, "mine")[1] == _covered(prompt)


def test_a_parked_state_serves_one_request_at_a_time(v32):
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(60, 7)
    answer, _ = _turn(engine, prompt)
    follow_ups = [prompt + answer + _ids(15, 5), prompt + answer + _ids(18, 9)]
    ids = [engine.add_request(prompt_token_ids=p, sampling=GREEDY) for p in follow_ups]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
            elif isinstance(event, Finished):
                cached[event.request_id] = event.stats.cached_prompt_tokens
    assert sorted(cached.values()) == [0, _covered(prompt)]  # the second prefilled everything
    assert [tokens[i] for i in ids] == [_fresh(v32, p) for p in follow_ups]


def test_an_aborted_request_parks_what_it_wrote(v32):
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(60, 7)
    request_id = engine.add_request(prompt_token_ids=prompt, sampling=GREEDY)
    produced: list[int] = []
    while len(produced) < 5:
        produced += [t for e in engine.step() if isinstance(e, TokenDelta) for t in e.token_ids]
    engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert _tier_stats(engine)["tier_cache_chats"] == 1
    # its state covers the whole pages its tiers had written when it ended: 64 of 60 + 5 tokens
    follow_up = prompt + produced[:4] + _ids(20, 5)
    answer, cached = _turn(engine, follow_up)
    assert cached == 64
    assert answer == _fresh(v32, follow_up)


@pytest.mark.parametrize("tiers", [KEYS_AND_LATENTS, LATENTS], ids=["keys+latents", "latents"])
def test_preempted_requests_resume_their_own_parked_tiers(v32, tiers):
    """Ten pages for two requests that need seven each: the later one is preempted, parks its tiers,
    and when it is admitted again adopts them instead of starting over (with tiered latents only, as far
    as the prefix cache still holds the pages of its indexer keys, here all)."""
    prompts = [_ids(60, 7), _ids(62, 11, 30)]
    engine = Engine.load(v32, EngineConfig(**BASE, **tiers, num_cache_blocks=10))
    preempted = []
    engine.scheduler.on_preempt.append(lambda seq: preempted.append(seq.request_id))
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, sampling=sampling) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
    assert preempted
    assert _tier_stats(engine)["tier_cache_hits_tokens"] > 0
    plain = Engine.load(v32, EngineConfig(**BASE))
    assert [tokens[i] for i in ids] == [_turn(plain, p, sampling=sampling)[0] for p in prompts]


@pytest.mark.parametrize("ram_tier", [False, True])
def test_keys_only_adoption_is_cut_to_the_latent_pages_still_cached(v32, ram_tier):
    """With tiered keys only, the latents are in the paged cache. Another chat takes most of the
    first chat's pages: without a RAM tier behind them the parked keys are cut to the pages the GPU
    still caches; with it the pages come back from RAM and the whole state is adopted."""
    engine = Engine.load(v32, EngineConfig(**BASE, **EXACT_KEYS, num_cache_blocks=8, prefix_cache_offload=ram_tier))
    prompt = _ids(60, 7)
    answer, _ = _turn(engine, prompt, "a")  # 5 pages, the 4 full ones cached
    _turn(engine, _ids(90, 11, 30), "b")  # 7 of the 8 pages: the 4 never cached, then 3 of a's 4
    follow_up = prompt + answer + _ids(15, 5)
    answer2, cached = _turn(engine, follow_up, "a")
    assert cached == (_covered(prompt) if ram_tier else BS)
    assert answer2 == _fresh(v32, follow_up)


@pytest.mark.slow  # a few minutes under the CPU Triton interpreter
def test_follow_up_turn_on_the_kernel_path_adopts_the_planned_tiers(tmp_path_factory, kernel_path):
    """The planned tiers the GPU runs (hearth.offload.planned_tiers): the follow-up resumes the host
    pools, the summaries and the hot ring, and prefills the rest through the history buffers. Every
    cold page is a candidate, so selection is exact and the tokens equal a fresh engine's."""
    from hearth.engine.testing.tiny import KERNEL_SHAPES, write_tiny_model

    path = str(write_tiny_model(tmp_path_factory.mktemp("tier_cache_k") / "v32", "deepseek_v32", seed=3,
                                overrides=KERNEL_SHAPES))
    config = EngineConfig(device=TEST_DEVICE, dtype="bfloat16", block_size=BS, max_num_batched_tokens=64,
                          cuda_graphs=TEST_DEVICE == "cuda", index_key_hot_pages=1, index_key_candidate_pages=12,
                          index_key_cache_pages=12, latent_hot_rows=112)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine.load(path, config)
    assert engine.runner.key_tiers.planned and engine.runner.latent_tiers.planned
    prompt = _ids(70, 13)
    answer, _ = _turn(engine, prompt, sampling=sampling)
    follow_up = prompt + answer + _ids(20, 5)
    adopted, cached = _turn(engine, follow_up, sampling=sampling)
    assert cached == (70 + 8 - 1) // BS * BS
    assert adopted == _turn(Engine.load(path, config), follow_up, sampling=sampling)[0]


def test_a_request_s_tiers_start_with_room_for_its_prompt(v32):
    """Host pools sized at admission for the prompt and an eighth more: the prefill and a short answer
    grow none (growing doubled from a few pages, pinning and copying several times the prompt)."""
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(300, 11)
    _turn(engine, prompt, "long")
    [parked] = engine.tier_cache._parked.values()
    room = 300 + 300 // 8
    assert {state.host.num_pages for state in parked.keys.values()} == {-(-room // BS)}
    assert {state.host.shape[0] for state in parked.latents.values()} == {room}
    assert not engine.tier_cache.key_tiers._reserved  # (forgotten with the request)


def test_a_resumed_request_s_tiers_take_the_parked_pools_without_pinning_their_own(v32, monkeypatch):
    """A follow-up that resumes parked tiers makes its tier objects with the least host room (their
    pools are replaced by the parked ones at once): none is sized for the prompt, and each layer's
    host pool afterwards is the parked state's own buffer."""
    engine = Engine.load(v32, EngineConfig(**BASE, **KEYS_AND_LATENTS))
    prompt = _ids(300, 11)
    answer, _ = _turn(engine, prompt, "long")
    [parked] = engine.tier_cache._parked.values()
    parked_host = {id(state.host.buf) for state in parked.keys.values()} | {id(s.host) for s in parked.latents.values()}
    made: list[int] = []
    held: set[int] = set()
    for tiers in (engine.tier_cache.key_tiers, engine.tier_cache.latent_tiers):
        def spy(tokens: int, _new=tiers._new) -> object:
            made.append(tokens)
            return _new(tokens)
        monkeypatch.setattr(tiers, "_new", spy)
        resume = tiers.resume

        def watch(seq_id, states, num_tokens, _tiers=tiers, _resume=resume) -> None:
            _resume(seq_id, states, num_tokens)
            for (sid, _), t in _tiers.tiers.items():
                if sid == seq_id:
                    held.add(id(t.host.buf) if hasattr(t.host, "buf") else id(t.host))
        monkeypatch.setattr(tiers, "resume", watch)
    _, cached = _turn(engine, prompt + answer + _ids(20, 5), "long")
    assert cached > 0 and made and set(made) == {0}
    assert held == parked_host
