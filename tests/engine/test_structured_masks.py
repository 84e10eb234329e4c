"""Allowed-token masks (hearth.engine.structured.masks / vocabulary / matcher / gates): each mask equals
a brute-force reading of every token from the state, on a trained byte-level vocabulary and on a
hand-made one full of awkward tokens (UTF-8 cut mid-character, escapes cut mid-way, digits, quotes with
structure); tokens' bytes for byte-level and SentencePiece-style vocabularies; special tokens and EOS;
where reasoning ends for <think> and harmony models."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from hearth.engine.api import SamplingParams
from hearth.engine.structured.gates import AnswerGate, HarmonyGate, ThinkGate, answer_gate
from hearth.engine.structured.grammar import Grammar
from hearth.engine.structured.masks import TokenIndex
from hearth.engine.structured.matcher import DONE, GOES_ON, REFUSED, JsonAnswer, StructuredOutputs
from hearth.engine.structured.vocabulary import Vocabulary, byte_level_table, read_vocabulary
from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.test_structured_grammar import PERSON, RANDOM_SCHEMAS

VOCAB = 1200
EXTRA_IDS = 16  # logits wider than the vocabulary, as model embeddings often are


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, "deepseek_v32", VOCAB)
    return Tokenizer.from_pretrained(folder, "deepseek_v32")


def _brute(grammar: Grammar, state, vocabulary: list[bytes | None], width: int) -> set[int]:
    return {i for i, data in enumerate(vocabulary[:width]) if data and grammar.advance_bytes(state, data) is not None}


def _states(grammar: Grammar, rng: random.Random, walks: int = 4):
    """States along random texts of the grammar (every prefix of each)."""
    from tests.engine.test_structured_grammar import _random_text

    for _ in range(walks):
        text = _random_text(grammar, rng, budget=rng.randint(5, 40))
        state = grammar.initial
        for byte in text:
            yield state
            state = grammar.advance(state, byte)


def _check_masks(index: TokenIndex, schemas, seed: int) -> int:
    rng = random.Random(seed)
    checked = 0
    for schema in schemas:
        grammar = Grammar.from_schema(schema)
        for state in list(_states(grammar, rng))[::3]:
            mask = index.mask(grammar, state)
            assert mask.shape == (index.width,) and mask.dtype == torch.bool
            got = set(mask.nonzero().flatten().tolist())
            assert got == _brute(grammar, state, index.vocabulary.grammar, index.width), state
            checked += 1
    return checked


def test_masks_equal_brute_force_on_a_trained_byte_level_vocabulary(tokenizer):
    index = tokenizer.token_index(VOCAB + EXTRA_IDS)
    assert _check_masks(index, RANDOM_SCHEMAS, seed=1) > 100


# Tokens that straddle every boundary the grammar has.
_AWKWARD = [
    b'"', b'",', b'":', b'"}', b'"]', b'{"', b'["', b'{', b'}', b'[', b']', b',', b':', b', "', b'":"', b'"},',
    b'\\', b'\\n', b'\\u', b'\\u00', b'e9', b'e9"', b'\\ud83d', b'\\ude00', b'\\"', b'\\\\', b'"\\',
    b'\xc3', b'\xa9', "é".encode(), "é\"".encode(), b'\xf0\x9f', b'\x98\x80', b'\x98\x80"', "😀".encode(),
    b'\xe2\x82', b'\xac', b'\xed\xa0\x80', b'\xc0\x80',
    b'0', b'1', b'12', b'007', b'123456', b'1.5', b'.5', b'e+', b'E-3', b'-', b'-1', b'99999999999',
    b' ', b'  ', b'\n', b'\n  ', b'\n\n\n', b'\t', b' "', b' {', b'\n}', b' ]',
    b'true', b'tr', b'ue', b'null', b'nul', b'false', b' true', b'name', b'age', b'"name', b'"age":',
    b'a', b'ab', b'abc', b'hello world', b'\x01', b'\x7f', b'', b'x"y', b'a, b',
]


def test_masks_equal_brute_force_on_awkward_tokens():
    singles = [bytes((b,)) for b in range(256)]
    grammar_bytes: list[bytes | None] = [*singles, *_AWKWARD, None, None]  # two specials
    vocabulary = Vocabulary(grammar_bytes, [b or b"<special>" for b in grammar_bytes])
    index = TokenIndex(vocabulary, len(grammar_bytes) + EXTRA_IDS)
    schemas = [*RANDOM_SCHEMAS, {"type": "string", "maxLength": 4}, {"type": "array", "items": {"type": "number"}},
               {"type": "object", "properties": {"name": {"type": "string", "minLength": 2}}, "required": ["name"],
                "additionalProperties": {"type": "integer"}}]
    assert _check_masks(index, schemas, seed=2) > 100
    empty = len(singles) + _AWKWARD.index(b"")
    grammar = Grammar.from_schema({"type": "string"})
    assert not index.mask(grammar, grammar.advance(grammar.initial, 0x22))[empty]  # never allowed


def test_cached_masks_are_shared_and_unchanged(tokenizer):
    index = tokenizer.token_index(VOCAB)
    grammar = Grammar.from_schema(PERSON)
    state = grammar.advance_bytes(grammar.initial, b'{"name": "Ad')
    first = index.mask(grammar, state)
    assert index.mask(grammar, state) is first


def test_byte_level_bytes_rebuild_the_decoded_text(tokenizer):
    vocabulary = tokenizer.token_index(VOCAB).vocabulary
    special = {i for i in range(VOCAB) if vocabulary.grammar[i] is None}
    assert {tokenizer.token_to_id(t) for t in ("<think>", "</think>")} <= special
    assert set(tokenizer.eos_token_ids) <= special
    rng = random.Random(3)
    ordinary = [i for i in range(VOCAB) if i not in special]
    for _ in range(50):
        ids = rng.sample(ordinary, 12)
        text = b"".join(vocabulary.grammar[i] for i in ids).decode("utf-8", errors="replace")
        assert text == tokenizer.decode(ids)
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256)) and table["Ġ"] == 0x20 and table["Ċ"] == 0x0A


def test_sentencepiece_style_vocabulary_reads_spaces_and_byte_fallback():
    entries = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "▁a", "a", "b", "ab", "▁{", '"']
    vocab = {entry: i for i, entry in enumerate(entries)}
    backend = RustTokenizer(models.BPE(vocab, [("a", "b")], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    vocabulary = read_vocabulary(backend)
    assert vocabulary.grammar[vocab["<0x0A>"]] == b"\n" and vocabulary.grammar[vocab["<0xC3>"]] == b"\xc3"
    assert vocabulary.grammar[vocab["▁a"]] == b" a" and vocabulary.grammar[vocab["ab"]] == b"ab"
    assert vocabulary.grammar[vocab["</s>"]] is None and vocabulary.text[vocab["</s>"]] == b"</s>"
    ids = [vocab["a"], vocab["▁a"], vocab["<0xC3>"], vocab["<0xA9>"], vocab["▁{"]]
    assert b"".join(vocabulary.grammar[i] for i in ids).decode() == backend.decode(ids) == "a aé {"


def _answer(tokenizer: Tokenizer, schema, gate: AnswerGate | None = None, **params) -> JsonAnswer:
    outputs = StructuredOutputs(tokenizer, VOCAB, "test")
    answer = outputs.answer(json.dumps(schema), SamplingParams(**params), [5, 6])
    if gate is not None:
        answer.gate = gate
    return answer


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_special_tokens_never_and_eos_only_once_complete(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    answer = _answer(tokenizer, {"type": "integer"})
    mask = answer.mask()
    specials = [i for i in range(VOCAB) if answer.index.vocabulary.grammar[i] is None]
    assert not mask[specials].any()
    assert answer.accept(_ids(tokenizer, "1")[0]) == GOES_ON
    mask = answer.mask()  # "1" is a whole integer that may go on: EOS is allowed beside the digits
    assert mask[eos] and not mask[[i for i in specials if i != eos]].any()
    assert not _answer(tokenizer, {"type": "integer"}, ignore_eos=True).mask()[eos]
    stop = _answer(tokenizer, {"type": "integer"}, stop_token_ids=(3,))
    stop.accept(_ids(tokenizer, "1")[0])
    assert stop.mask()[3]


def test_a_closed_value_is_done_and_a_refused_token_is_reported(tokenizer):
    answer = _answer(tokenizer, {"type": "array", "maxItems": 0})
    outcomes = [answer.accept(i) for i in _ids(tokenizer, "[]")]
    assert outcomes[-1] == DONE and set(outcomes[:-1]) <= {GOES_ON}
    other = _answer(tokenizer, {"type": "array"})
    assert other.accept(_ids(tokenizer, "x")[0]) == REFUSED
    assert _answer(tokenizer, {"type": "array"}).accept(tokenizer.eos_token_ids[0]) == REFUSED


def test_think_gate_leaves_the_reasoning_free(tokenizer):
    end = tokenizer.token_to_id("</think>")
    answer = _answer(tokenizer, PERSON, ThinkGate(in_reasoning=True, opener=None))
    assert answer.mask() is None
    for token in _ids(tokenizer, "Mira thinks {not json"):
        assert answer.accept(token) == GOES_ON and answer.mask() is None
    assert answer.accept(end) == GOES_ON
    mask = answer.mask()
    assert mask is not None and not mask[_ids(tokenizer, "Mira")[0]]
    # a marker spelled in pieces opens it too, and what follows it in the token is the answer's
    spelled = ThinkGate(in_reasoning=True, opener=None)
    assert spelled.feed(b"ok </th") is None and not spelled.open
    assert spelled.feed(b"ink>\n{") == b"\n{" and spelled.open


def test_think_gate_may_open_a_block_first(tokenizer):
    start = tokenizer.token_to_id("<think>")
    answer = _answer(tokenizer, PERSON, ThinkGate(in_reasoning=False, opener=start))
    assert answer.mask()[start]
    assert answer.accept(start) == GOES_ON and answer.mask() is None
    direct = _answer(tokenizer, PERSON, ThinkGate(in_reasoning=False, opener=start))
    assert direct.accept(_ids(tokenizer, "{")[0]) == GOES_ON
    assert not direct.mask()[start]  # only as the first token


def test_harmony_gate_opens_at_the_final_message():
    gate = HarmonyGate()
    for text in (b"<|channel|>", b"analysis", b"<|message|>", b"let me think {", b"<|end|>", b"<|start|>",
                 b"assistant", b"<|channel|>", b"commentary", b"<|message|>", b"a preamble", b"<|end|>",
                 b"<|start|>", b"assistant<|channel|>final <|constrain|>", b"json"):
        assert gate.feed(text) is None and not gate.open
    assert gate.feed(b"<|message|>{") == b"{" and gate.open


@pytest.mark.parametrize("model_type, tail, kind, open_, opener", [
    ("deepseek_v32", "<｜Assistant｜><think>", ThinkGate, False, None),  # thinking mode: the prompt opens the block
    ("deepseek_v32", "<｜Assistant｜></think>", AnswerGate, True, None),  # chat mode: the block is closed
    ("deepseek_v32", "<｜Assistant｜>", AnswerGate, True, None),  # a raw prompt: DeepSeek never opens one itself
    ("glm4_moe", "<|assistant|>", ThinkGate, True, 7),  # thinking on: the model may write <think> first
    ("glm4_moe", "<|assistant|>\n<think></think>", AnswerGate, True, None),  # thinking off
    ("gpt_oss", "<|start|>assistant", HarmonyGate, False, None),
    ("llama", "<think>", AnswerGate, True, None),  # no reasoning format
])
def test_answer_gate_follows_the_model_and_prompt(model_type, tail, kind, open_, opener):
    gate = answer_gate(model_type, tail, think_start_id=7)
    assert (type(gate), gate.open, gate.opener) == (kind, open_, opener)


def test_bad_schemas_are_request_errors_naming_response_format(tokenizer):
    from hearth.engine.api import RequestError

    outputs = StructuredOutputs(tokenizer, VOCAB, "test")
    for text in ('{"type": "string", "pattern": "(?<=a)b"}', "{not json", '{"type": 5}'):
        with pytest.raises(RequestError) as err:
            outputs.grammar(text)
        assert err.value.param == "response_format"
    assert "'pattern'" in str(pytest.raises(RequestError, outputs.grammar, '{"pattern": "\\\\p{L}"}').value)
