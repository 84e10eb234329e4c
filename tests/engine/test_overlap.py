"""Overlapped decode (``EngineConfig.overlap_decode``) on the CPU: the same tokens, texts and finish
reasons as the synchronous loop for requests that join and leave at different steps, finish one step
before the others (EOS, stop token, stop string, max_tokens, the context limit) or are aborted while
a step is in flight; penalties fall back to synchronous steps; no cache page leaks. Also the
vectorised staging of CUDA-graph inputs (``DecodeInputs``), which runs on any device."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from hearth.engine.cuda_graphs import DecodeInputs
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.conftest import TEST_DEVICE

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["deepseek_v32"])


def _prompt(i: int, n: int = 24) -> list[int]:
    return [(11 * i + 17 * j) % 480 + 10 for j in range(n)]


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished: tuple | None = None  # (reason, text, completion tokens)


@dataclass
class Run:
    outcomes: list[Outcome]
    overlapped: int  # decode steps launched from device-resident tokens
    engine: Engine


def _engine(model_dir: str, overlap: bool, **options) -> Engine:
    options = {"device": TEST_DEVICE, "dtype": "float32", "block_size": 16, "overlap_decode": overlap, **options}
    return Engine.load(model_dir, EngineConfig(**options))


def _count_overlapped(engine: Engine) -> dict[str, int]:
    counts = {"overlapped": 0}
    real = engine.runner.run

    def run(inputs, all_logits=False, use_graphs=True, input_ids=None):
        counts["overlapped"] += input_ids is not None
        return real(inputs, all_logits, use_graphs, input_ids)

    engine.runner.run = run
    return counts


def _collect(engine: Engine, events, ids: dict[str, int], outcomes: list[Outcome]) -> None:
    for event in events:
        outcome = outcomes[ids[event.request_id]]
        assert outcome.finished is None, "an event after the request finished"
        if isinstance(event, TokenDelta):
            outcome.tokens.extend(event.token_ids)
            outcome.text += event.text
        else:
            outcome.finished = (event.reason, event.text, event.stats.completion_tokens)


def _scenario(model_dir: str, overlap: bool, plan: list[tuple[int, list[int], SamplingParams]],
              **options) -> Run:
    """Add request k of ``plan`` (arrival step, prompt, sampling) before step ``arrival``; step until
    every request finished; check that every cache page is free again."""
    engine = _engine(model_dir, overlap, **options)
    counts = _count_overlapped(engine)
    free_at_start = engine.blocks.num_free_blocks
    ids: dict[str, int] = {}
    outcomes = [Outcome() for _ in plan]
    last_arrival = max(at for at, _, _ in plan)
    for step in range(10_000):
        for k, (at, prompt, sampling) in enumerate(plan):
            if at == step:
                ids[engine.add_request(prompt_token_ids=prompt, sampling=sampling)] = k
        if step > last_arrival and not engine.has_unfinished():
            break
        _collect(engine, engine.step(), ids, outcomes)
    assert all(o.finished is not None for o in outcomes)
    assert engine.blocks.num_free_blocks == free_at_start
    assert engine.stats().generated_tokens == sum(len(o.tokens) for o in outcomes)  # dropped rows uncounted
    return Run(outcomes, counts["overlapped"], engine)


def _same_both_ways(model_dir: str, plan, **options) -> Run:
    sync = _scenario(model_dir, False, plan, **options)
    overlapped = _scenario(model_dir, True, plan, **options)
    assert sync.overlapped == 0
    assert overlapped.outcomes == sync.outcomes
    for outcome in sync.outcomes:
        assert outcome.finished[2] == len(outcome.tokens) and outcome.finished[1] == outcome.text
    return overlapped


def test_joining_and_leaving_requests_give_the_same_tokens(model_dir):
    plan = [
        (0, _prompt(1), GREEDY),
        (0, _prompt(2, 30), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)),
        (3, _prompt(3, 18), SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=9, max_tokens=9,
                                           ignore_eos=True)),
        (7, _prompt(4, 40), GREEDY),  # its prompt arrives while the others decode
        (9, _prompt(5), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),  # done at its prefill
    ]
    run = _same_both_ways(model_dir, plan, max_num_batched_tokens=32)  # chunked prefill beside decodes
    assert run.overlapped > 10
    assert [len(o.tokens) for o in run.outcomes] == [12, 16, 9, 12, 1]


def test_finishing_one_step_before_the_others(model_dir, monkeypatch):
    """EOS, a stop token and a stop string end a request while its next step is already running."""
    free_run = _scenario(model_dir, False, [(0, _prompt(6), GREEDY), (0, _prompt(7), GREEDY)]).outcomes
    tokens, text = free_run[0].tokens, free_run[1].text
    eos = free_run[1].tokens[5]
    monkeypatch.setattr(Tokenizer, "eos_token_ids", property(lambda self: (eos,)))
    companion = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plan = [
        (0, _prompt(6), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(tokens[3],))),
        (0, _prompt(7), SamplingParams(temperature=0, max_tokens=12)),  # stops at its EOS
        (0, _prompt(7), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=(text[4:7],))),
        (0, _prompt(8), companion),
    ]
    run = _same_both_ways(model_dir, plan)
    assert run.overlapped > 5
    stop_token, at_eos, stop_string, other = run.outcomes
    assert stop_token.finished[0] == "stop" and stop_token.tokens == tokens[:tokens.index(tokens[3]) + 1]
    assert at_eos.finished[0] == "stop" and at_eos.tokens[-1] == eos and len(at_eos.tokens) <= 6
    assert stop_string.finished[0] == "stop" and stop_string.text == text[:text.index(text[4:7])]
    assert other.finished[0] == "length" and len(other.tokens) == 14


def test_max_tokens_and_the_context_limit(model_dir):
    plan = [
        (0, list(range(10, 60)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)),  # context 64
        (0, _prompt(9), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        (2, _prompt(10), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
    ]
    run = _same_both_ways(model_dir, plan, max_model_len=64)
    assert [o.finished[0] for o in run.outcomes] == ["length"] * 3
    assert [len(o.tokens) for o in run.outcomes] == [14, 3, 7]


def test_abort_while_a_step_is_in_flight(model_dir):
    reference = _scenario(model_dir, False, [(0, _prompt(11), GREEDY), (0, _prompt(12), GREEDY)]).outcomes
    engine = _engine(model_dir, True)
    counts = _count_overlapped(engine)
    a = engine.add_request(prompt_token_ids=_prompt(11), sampling=GREEDY)
    b = engine.add_request(prompt_token_ids=_prompt(12), sampling=GREEDY)
    ids, outcomes = {a: 0, b: 1}, [Outcome(), Outcome()]
    while counts["overlapped"] < 3:
        _collect(engine, engine.step(), ids, outcomes)
    assert engine._flight is not None  # a launched step whose tokens are not read yet
    engine.abort(a)
    while engine.has_unfinished():
        _collect(engine, engine.step(), ids, outcomes)
    aborted, other = outcomes
    assert aborted.finished == ("abort", aborted.text, len(aborted.tokens))
    assert aborted.tokens == reference[0].tokens[:len(aborted.tokens)] and 0 < len(aborted.tokens) < 12
    assert other == reference[1]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.stats().generated_tokens == len(aborted.tokens) + len(other.tokens)


def test_abort_of_every_request_in_flight_leaves_nothing_behind(model_dir):
    engine = _engine(model_dir, True)
    counts = _count_overlapped(engine)
    rid = engine.add_request(prompt_token_ids=_prompt(13), sampling=GREEDY)
    while counts["overlapped"] < 2:
        engine.step()
    engine.abort(rid)
    events = engine.step()
    assert [type(e) for e in events] == [Finished] and events[0].reason == "abort"
    assert not engine.has_unfinished() and engine._flight is None
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_penalties_run_synchronously_and_match(model_dir):
    penalised = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
                 SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, presence_penalty=0.5,
                                frequency_penalty=0.7)]
    only = _same_both_ways(model_dir, [(0, _prompt(14), penalised[0]), (0, _prompt(15), penalised[1])])
    assert only.overlapped == 0  # every step has a request that reads its token history
    # beside a plain request: synchronous while a penalised one runs, overlapped after it ends
    mixed = _same_both_ways(model_dir, [(0, _prompt(14), penalised[0]), (0, _prompt(16), GREEDY),
                                        (0, _prompt(17), SamplingParams(temperature=0, max_tokens=18,
                                                                        ignore_eos=True))])
    assert 0 < mixed.overlapped <= 18 - 10


def test_out_of_memory_in_an_overlapped_step(model_dir):
    """An OOM launching the next step delivers the tokens already sampled, then fails the requests."""
    engine = _engine(model_dir, True)
    real = engine.runner.run

    def run(inputs, all_logits=False, use_graphs=True, input_ids=None):
        if input_ids is not None:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(inputs, all_logits, use_graphs, input_ids)

    engine.runner.run = run
    rid = engine.add_request(prompt_token_ids=_prompt(18), sampling=GREEDY)
    outcomes = [Outcome()]
    while engine.has_unfinished():
        _collect(engine, engine.step(), {rid: 0}, outcomes)
    assert outcomes[0].finished[0] == "error" and len(outcomes[0].tokens) == 2
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _expected_rows(tables, positions, b, block_size, scratch):
    rows = []
    for i in range(b):
        if i < len(positions):
            table, pos = tables[i], positions[i]
            rows.append((pos, table[pos // block_size] * block_size + pos % block_size, pos + 1, list(table)))
        else:
            rows.append((0, scratch * block_size, 1, [scratch]))
    return rows


def test_decode_inputs_upload_only_what_changed_and_match_a_full_rebuild():
    bs, scratch = 4, 99
    inputs = DecodeInputs(max_batch=8, max_blocks=6, block_size=bs, scratch_block=scratch,
                          device=torch.device("cpu"))
    a, b, c = [3, 7], [5], [11, 12, 13]
    steps = [  # (pages appended to tables in place first, as the block manager does; tables; ...)
        ([], [a, b], [6, 2], [10, 20], 2),
        ([], [a, b, c], [7, 3, 9], [11, 21, 31], 4),  # c joins: padded to a bucket of four
        ([(a, 8), (b, 6)], [a, b, c], [8, 4, 10], [12, 22, 32], 4),  # a and b grow a page
        ([], [b, c], [5, 11], [23, 33], 2),  # a leaves: rows shift
        ([], [[5, 40], a], [5, 9], [24, 13], 2),  # b preempted and allocated again (a new list); a back
        ([], [[1]], [0], torch.tensor([77]), 1),  # ids from the device; a table shorter than the row's
    ]
    for grow, tables, positions, ids, size in steps:
        for table, page in grow:
            table.append(page)
        inputs.stage(tables, positions, ids, size)
        want_ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        assert inputs.ids[:size].tolist() == want_ids + [0] * (size - len(want_ids))
        for i, (pos, slot, length, table) in enumerate(_expected_rows(tables, positions, size, bs, scratch)):
            assert (inputs.positions[i].item(), inputs.slots[i].item(), inputs.lens[i].item()) == (pos, slot, length)
            assert inputs.tables[i, :len(table)].tolist() == table
        assert int(inputs.tables.max()) <= scratch  # every entry a valid page


def test_decode_inputs_send_no_table_entries_in_steady_decoding(monkeypatch):
    inputs = DecodeInputs(max_batch=4, max_blocks=8, block_size=4, scratch_block=50, device=torch.device("cpu"))
    tables = [[1, 2], [3, 4, 5]]
    inputs.stage(tables, [5, 9], [1, 2], 2)
    sent = []
    real = inputs._table_changes
    monkeypatch.setattr(inputs, "_table_changes", lambda t, b: sent.append(real(t, b)) or sent[-1])
    inputs.stage(tables, [6, 10], [3, 4], 2)
    tables[0].append(6)
    inputs.stage(tables, [8, 11], [5, 6], 2)
    assert sent == [([], [], []), ([0], [2], [6])]


def test_token_slice_equals_slicing_the_whole_sequence():
    from hearth.engine.scheduler import Sequence

    seq = Sequence("r", [1, 2, 3, 4], GREEDY, output_ids=[5, 6, 7])
    for start in range(8):
        for stop in range(start, 9):
            assert seq.token_slice(start, stop) == seq.token_ids[start:stop]


def test_page_growth_stays_overlapped_and_steps_are_counted_by_kind(model_dir):
    """Requests crossing into new 16-token pages mid-answer keep decoding overlapped (a free page is
    taken for the token in flight); only the first decode step after the prompts is synchronous."""
    engine = _engine(model_dir, True)
    counts = _count_overlapped(engine)
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=_prompt(20 + i, 20), sampling=sampling) for i in range(4)]
    pages_at_start = None
    while engine.has_unfinished():
        engine.step()
        if pages_at_start is None and all(len(engine.blocks.block_table(i)) for i in ids):
            pages_at_start = {i: len(engine.blocks.block_table(i)) for i in ids}
    steps = engine.decode_steps
    assert pages_at_start is not None and all(n == 2 for n in pages_at_start.values())  # 20 + 40 tokens: 4 pages
    assert steps["overlapped"] == counts["overlapped"] >= 35
    assert steps["sync_no_free_page"] == 0 and steps["sync_previous_step_not_in_flight"] == 1
    assert steps["sync_every_token_is_last"] == 1  # the last flight lands with nothing left to launch
    stats = engine.stats().extra
    assert stats["decode_steps_overlapped"] == steps["overlapped"]
    assert stats["decode_steps"] == steps["overlapped"] + 1  # the step timer saw every decode step
    assert stats["decode_gaps"] == stats["decode_steps"] - 1 and stats["decode_step_ms_sum"] > 0
    # the steps that read the four prompts (at most one each) count apart, with their wall time
    assert 1 <= stats["prompt_steps"] <= 4 and stats["prompt_step_ms_sum"] > 0


def test_a_joining_prompt_makes_the_next_step_synchronous_and_says_why(model_dir):
    engine = _engine(model_dir, True, max_num_seqs=2)
    counts = _count_overlapped(engine)
    engine.add_request(prompt_token_ids=_prompt(30), sampling=GREEDY)
    while counts["overlapped"] < 2:
        engine.step()
    engine.add_request(prompt_token_ids=_prompt(31), sampling=GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.decode_steps["sync_prompt_may_join"] == 1


def test_the_launched_callback_runs_before_the_step_lands(model_dir):
    """``Engine.step(launched=...)`` is called once per step that ran the model, after the launch and
    before the landed tokens are delivered (the host hands the last step's events over then)."""
    engine = _engine(model_dir, True)
    counts = _count_overlapped(engine)
    rid = engine.add_request(prompt_token_ids=_prompt(32), sampling=GREEDY)
    seen: list[tuple[int, int]] = []  # (overlapped steps launched, tokens of the request so far) per call
    while engine.has_unfinished():
        engine.step(launched=lambda: seen.append((counts["overlapped"], len(engine._requests[rid].seq.output_ids))))
    # every step that ran the model: the prompt's, the first decode step, the overlapped ones
    assert len(seen) == 2 + counts["overlapped"]
    # in an overlapped step the callback comes after the launch and before its flight's token lands
    overlapped = [(n, tokens) for n, tokens in seen if n > 0]
    assert overlapped and all(tokens == n for n, tokens in overlapped)
