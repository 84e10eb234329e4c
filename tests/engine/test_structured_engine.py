"""Structured output through the Engine on the tiny random DeepSeek-V3.2: answers parse and conform
(greedy and seeded sampling, sync and runahead schedulers, beside unconstrained requests), end with
"stop" as soon as the JSON is whole, never fly in overlapped decode, and leave a thinking model's
reasoning free; strings held to a pattern or format match it."""

from __future__ import annotations

import json
import re

import pytest

from hearth.engine import Engine, EngineConfig, Finished, RequestError, SamplingParams, TokenDelta
from hearth.engine.structured.grammar import Grammar
from hearth.engine.text.reasoning import ThinkParser, split_reasoning
from tests.engine.conftest import TEST_DEVICE
from tests.engine.schema_check import problems

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 6},
                                                  "near": {"type": "boolean"}}, "required": ["town"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "pet", "home"],
}
PROMPT = [(7 * j) % 480 + 10 for j in range(24)]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["deepseek_v32"])


def _engine(model_dir: str, **options) -> Engine:
    return Engine.load(model_dir, EngineConfig(**{"device": TEST_DEVICE, "dtype": "float32", "block_size": 16,
                                                  **options}))


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], Finished]]:
    ids = [engine.add_request(prompt_token_ids=prompt, sampling=params) for prompt, params in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, Finished] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id] += event.token_ids
            else:
                done[event.request_id] = event
    return [(tokens[i], done[i]) for i in ids]


def _conforming(finished: Finished, schema=SCHEMA) -> None:
    assert finished.reason == "stop", finished
    value = json.loads(finished.text)
    assert problems(value, schema) == [], finished.text
    assert finished.text == finished.text.rstrip()  # nothing after the value


SAMPLED = SamplingParams(temperature=1.0, seed=11, max_tokens=400, json_schema=SCHEMA)


@pytest.fixture(scope="module")
def greedy(model_dir) -> SamplingParams:
    """Greedy, whitespace tokens all but banned: the random model's greedy choice is often a space, and
    its answers would be mostly (bounded) whitespace."""
    engine = _engine(model_dir)
    vocabulary = engine.tokenizer.token_index(engine.model_config.vocab_size).vocabulary
    spaces = {i: -100.0 for i, data in enumerate(vocabulary.grammar) if data is not None and not data.strip()}
    assert spaces
    return SamplingParams(temperature=0, max_tokens=400, json_schema=SCHEMA, logit_bias=spaces)


@pytest.fixture(scope="module")
def sync_answers(model_dir, greedy):
    return _run(_engine(model_dir), [(PROMPT, greedy), (PROMPT[:17], SAMPLED)])


def test_greedy_and_seeded_answers_parse_and_conform(sync_answers):
    for tokens, finished in sync_answers:
        _conforming(finished)
        assert finished.stats.completion_tokens == len(tokens)


def test_runahead_scheduler_gives_the_same_answers(model_dir, greedy, sync_answers):
    engine = _engine(model_dir, scheduler="runahead")
    engine.runahead_gate = None
    assert engine.decoder is not None
    answers = _run(engine, [(PROMPT, greedy), (PROMPT[:17], SAMPLED)])
    assert [t for t, _ in answers] == [t for t, _ in sync_answers]


def test_constrained_requests_never_fly_and_leave_the_others_unchanged(model_dir, greedy, sync_answers):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = _engine(model_dir)
    (plain_tokens, _), = _run(alone, [(PROMPT[:20], plain)])
    assert alone.decode_steps["overlapped"] > 0  # (so the zero below means something)
    other = {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}
    engine = _engine(model_dir)
    (tokens, _), (json_tokens, finished), (_, other_finished) = _run(engine, [
        (PROMPT[:20], plain), (PROMPT, greedy),
        (PROMPT[:9], SamplingParams(temperature=0, max_tokens=100, json_schema=other, logit_bias=greedy.logit_bias))])
    assert tokens == plain_tokens
    assert json_tokens == sync_answers[0][0] and len(json_tokens) > len(tokens)  # it ran through every step
    _conforming(finished)
    _conforming(other_finished, other)
    assert engine.decode_steps["overlapped"] == 0


def test_length_cuts_the_json_and_bad_schemas_are_refused(model_dir):
    engine = _engine(model_dir)
    (tokens, finished), = _run(engine, [(PROMPT, SamplingParams(temperature=0, max_tokens=3, json_schema=SCHEMA))])
    assert finished.reason == "length" and len(tokens) == 3
    grammar = Grammar.from_schema(SCHEMA)
    assert grammar.advance_bytes(grammar.initial, finished.text.encode()) is not None  # a prefix of an answer
    with pytest.raises(RequestError) as err:
        engine.add_request(prompt_token_ids=PROMPT, sampling=SamplingParams(json_schema={"not": {}}))
    assert err.value.param == "response_format" and "'not'" in str(err.value)
    assert not engine.has_unfinished()


def test_thinking_is_free_and_the_answer_after_it_is_json(model_dir, greedy):
    engine = _engine(model_dir)
    messages = [{"role": "user", "content": "Who lives by the river?"}]
    end = engine.tokenizer.token_to_id("</think>")
    free = list(engine.generate(messages, sampling=SamplingParams(temperature=0, max_tokens=8, json_schema=SCHEMA),
                                thinking=True))[-1]
    grammar = Grammar.from_schema(SCHEMA)
    assert grammar.advance_bytes(grammar.initial, free.text.encode()) is None  # (not held to the schema)
    # +100 on </think> makes it the first token (the prompt ends inside <think>); after it the mask bans it
    bias = {**dict(greedy.logit_bias), end: 100.0}
    forced = list(engine.generate(messages, sampling=SamplingParams(temperature=0, max_tokens=400, json_schema=SCHEMA,
                                                                    logit_bias=bias), thinking=True))[-1]
    assert forced.reason == "stop" and forced.text.startswith("</think>")
    split = split_reasoning(ThinkParser(in_reasoning=True), forced.text)
    assert split.reasoning == "" and problems(json.loads(split.content), SCHEMA) == []


PATTERNED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": r"^[A-Z]{3}-\d{4}$"},
    "mail": {"type": "string", "format": "email", "maxLength": 24},
    "note": {"type": "string", "pattern": "o[kK]", "maxLength": 10}},
    "required": ["code", "mail", "note"]}


def test_patterned_strings_match_and_backreferences_are_refused(model_dir, greedy):
    engine = _engine(model_dir)
    answers = _run(engine, [
        (PROMPT, SamplingParams(temperature=0, max_tokens=300, json_schema=PATTERNED, logit_bias=greedy.logit_bias)),
        (PROMPT[:13], SamplingParams(temperature=1.0, seed=3, max_tokens=300, json_schema=PATTERNED))])
    for _, finished in answers:
        _conforming(finished, PATTERNED)
        value = json.loads(finished.text)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", value["code"]), value
        assert re.fullmatch(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", value["mail"]), value
        assert re.search("o[kK]", value["note"]) and len(value["note"]) <= 10, value
    for pattern, named in ((r"^(a)\1$", "backreference"), ("a(?=b)", "lookahead")):
        with pytest.raises(RequestError) as err:
            engine.add_request(prompt_token_ids=PROMPT, sampling=SamplingParams(
                json_schema={"type": "string", "pattern": pattern}))
        assert err.value.param == "response_format" and "'pattern'" in str(err.value) and named in str(err.value)
    assert not engine.has_unfinished()
