"""The Engine facade: continuous batching, prefix reuse across turns, preemption, abort, stop
conditions, seeds and request validation, on the tiny DeepSeek-V3.2 model."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, RequestError, SamplingParams, TokenDelta
from tests.engine.conftest import TEST_DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["deepseek_v32"])


def _engine(model_dir: str, **options) -> Engine:
    options = {"device": TEST_DEVICE, "dtype": "float32", "block_size": 16, **options}
    return Engine.load(model_dir, EngineConfig(**options))


def _run_all(engine: Engine) -> dict[str, Finished]:
    done: dict[str, Finished] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return done
        for event in engine.step():
            if isinstance(event, Finished):
                done[event.request_id] = event
    raise AssertionError("engine did not finish")


def _tokens(engine: Engine, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    return [t for e in engine.generate(prompt_token_ids=prompt, sampling=sampling) if isinstance(e, TokenDelta)
            for t in e.token_ids]


def _prompt(i: int, n: int = 30) -> list[int]:
    return [(7 * i + 13 * j) % 480 + 10 for j in range(n)]


@pytest.mark.slow
def test_concurrent_requests_equal_solo_runs(model_dir):
    engine = _engine(model_dir, max_num_batched_tokens=40)  # forces chunked prefill beside decodes
    solo = [_tokens(engine, _prompt(i, 20 + 7 * i)) for i in range(4)]
    ids = [engine.add_request(prompt_token_ids=_prompt(i, 20 + 7 * i), sampling=GREEDY) for i in range(4)]
    deltas: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                deltas[event.request_id].extend(event.token_ids)
    assert [deltas[i] for i in ids] == solo


@pytest.mark.slow
def test_prefix_of_earlier_turn_is_reused_and_output_unchanged(model_dir):
    engine = _engine(model_dir)
    first = _prompt(1, 40)
    answer = _tokens(engine, first)
    second = first + answer + _prompt(2, 9)
    events = list(engine.generate(prompt_token_ids=second, sampling=GREEDY))
    finished = events[-1]
    assert finished.stats.cached_prompt_tokens >= 48  # whole 16-token pages of the earlier turn
    fresh = _engine(model_dir)
    assert [t for e in events[:-1] for t in e.token_ids] == _tokens(fresh, second)


def test_preemption_when_cache_runs_out_keeps_outputs_exact(model_dir):
    roomy = _engine(model_dir)
    expected = [_tokens(roomy, _prompt(i, 30)) for i in range(3)]
    tight = _engine(model_dir, num_cache_blocks=7, max_num_seqs=3)  # 112 slots for 3 x 54 tokens
    ids = [tight.add_request(prompt_token_ids=_prompt(i, 30), sampling=GREEDY) for i in range(3)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    while tight.has_unfinished():
        for event in tight.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].extend(event.token_ids)
            else:
                finished[event.request_id] = event
    # A preempted request recomputes; tokens it already streamed are not streamed again.
    assert [tokens[i] for i in ids] == expected
    assert all(finished[i].reason == "length" for i in ids)
    assert tight.blocks.num_free_blocks == 7


def test_answer_longer_than_the_cache_ends_with_length_not_a_preemption_loop(model_dir):
    """4 pages of 16 tokens and a 40-token prompt: the answer stops where the cache is full (64
    tokens), with the tokens a roomy cache gives up to there; before, the request preempted itself
    and recomputed forever."""
    sampling = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    expected = _tokens(_engine(model_dir), _prompt(0, 40), sampling)
    tight = _engine(model_dir, num_cache_blocks=4)
    rid = tight.add_request(prompt_token_ids=_prompt(0, 40), sampling=sampling)
    finished = _run_all(tight)[rid]
    assert finished.reason == "length" and finished.stats.completion_tokens == 64 - 40
    assert _tokens(tight, _prompt(0, 40), sampling) == expected[: 64 - 40]
    assert tight.blocks.num_free_blocks == 4


def test_abort_frees_everything(model_dir):
    engine = _engine(model_dir)
    rid = engine.add_request(prompt_token_ids=_prompt(3), sampling=SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    events = engine.step()
    assert any(isinstance(e, Finished) and e.reason == "abort" and e.request_id == rid for e in events)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_max_tokens_and_eos_and_stop_token(model_dir):
    engine = _engine(model_dir)
    out = list(engine.generate(prompt_token_ids=_prompt(4), sampling=SamplingParams(temperature=0, max_tokens=5,
                                                                                   ignore_eos=True)))
    assert out[-1].reason == "length" and out[-1].stats.completion_tokens == 5
    greedy = _tokens(engine, _prompt(4))
    stop_at = greedy[3]
    out = list(engine.generate(prompt_token_ids=_prompt(4),
                               sampling=SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_at,))))
    assert out[-1].reason == "stop"
    assert out[-1].stats.completion_tokens == greedy.index(stop_at) + 1


def test_stop_string_cuts_text(model_dir):
    engine = _engine(model_dir)
    full = list(engine.generate(prompt_token_ids=_prompt(5), sampling=GREEDY))[-1].text
    assert len(full) > 6
    stop = full[3:6]
    result = list(engine.generate(prompt_token_ids=_prompt(5), sampling=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,))))
    final = result[-1]
    assert final.reason == "stop"
    assert final.text == full[:full.index(stop)]
    assert "".join(e.text for e in result[:-1]) == final.text


def test_seeded_sampling_is_reproducible_and_temperature_matters(model_dir):
    engine = _engine(model_dir)
    hot = SamplingParams(temperature=1.5, seed=11, max_tokens=20, ignore_eos=True)
    a, b = _tokens(engine, _prompt(6), hot), _tokens(engine, _prompt(6), hot)
    assert a == b
    assert _tokens(engine, _prompt(6), SamplingParams(temperature=1.5, seed=12, max_tokens=20, ignore_eos=True)) != a
    assert _tokens(engine, _prompt(6), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) != a


def test_chat_messages_and_streamed_text(model_dir):
    engine = _engine(model_dir)
    events = list(engine.generate(messages=[{"role": "user", "content": "Hello"}],
                                  sampling=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    assert "".join(e.text for e in events[:-1]) == events[-1].text
    expected_prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    assert events[-1].stats.prompt_tokens == len(expected_prompt)
    assert events[-1].stats.time_to_first_token_s is not None


def test_prompt_longer_than_context_is_refused(model_dir):
    engine = _engine(model_dir, max_model_len=64)
    with pytest.raises(RequestError, match="context holds 64"):
        engine.add_request(prompt_token_ids=list(range(10, 80)))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request(prompt_token_ids=[1, 2, 10_000])
    with pytest.raises(RequestError):
        SamplingParams(max_tokens=-1)
    # a request that reaches the context limit finishes with "length"
    out = list(engine.generate(prompt_token_ids=list(range(10, 60)),
                               sampling=SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)))
    assert out[-1].reason == "length" and out[-1].stats.completion_tokens == 14


def test_request_policy_fills_what_the_user_left_out(model_dir):
    """Given options win, the model's generation_config fills temperature / top_p / top_k, max_tokens
    defaults to (and is capped at) the rest of the context, and bad values are refused once, here."""
    engine = _engine(model_dir, max_model_len=64)
    engine.generation_defaults = {"temperature": 0.6, "top_p": 0.95}
    params = engine.sampling_params({"temperature": 0.0, "top_p": None, "max_tokens": None, "seed": 3}, 20)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.0, 0.95, 44, 3)
    assert engine.sampling_params({"max_tokens": 500}, 60).max_tokens == 4
    assert engine.sampling_params({"max_tokens": 2}, 10).max_tokens == 2
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request(prompt_token_ids=[5, 6, 7], sampling={"top_p": 0.0})
    with pytest.raises(RequestError, match="context holds 64"):
        engine.add_request(prompt_token_ids=list(range(10, 74)), sampling={"max_tokens": 1})
    out = list(engine.generate(prompt_token_ids=list(range(10, 62)), sampling={"temperature": 0, "ignore_eos": True}))
    assert out[-1].reason == "length" and out[-1].stats.completion_tokens == 12
    assert not engine.has_unfinished()


def test_generation_defaults_come_from_the_checkpoint(tmp_path):
    from hearth.engine.engine import generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": "x"}')
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert generation_defaults(tmp_path) == {}


def test_gpu_out_of_memory_fails_the_step_not_the_engine(model_dir, monkeypatch):
    """An OOM in a forward step finishes that step's requests with a clear error; pages are freed and
    the engine keeps serving."""
    engine = _engine(model_dir)
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky_run(inputs, all_logits=False, **options):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(inputs, all_logits, **options)

    monkeypatch.setattr(engine.runner, "run", flaky_run)
    done = _run_all_after_adding(engine, [_prompt(7), _prompt(8)])
    assert {f.reason for f in done.values()} == {"error"}
    assert all("ran out of memory" in f.error for f in done.values())
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(_tokens(engine, _prompt(9))) == GREEDY.max_tokens  # still works


def _run_all_after_adding(engine: Engine, prompts) -> dict[str, Finished]:
    for p in prompts:
        engine.add_request(prompt_token_ids=p, sampling=GREEDY)
    return _run_all(engine)
