"""gpt-oss's harmony format: the tiny model's template renders it, and the parser splits generated
text into reasoning (analysis channel) and answer however the stream cuts it."""

from __future__ import annotations

import pytest

from hearth.engine.text.harmony import HarmonyParser, parse_harmony
from hearth.engine.text.tokenizer import Tokenizer

ANSWER = ("<|channel|>analysis<|message|>The user greets; answer < briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello <|there, friend|>!<|return|>")
REASONING, CONTENT = "The user greets; answer < briefly.", "Hello <|there, friend|>!"


def _streamed(text: str, cuts: list[int]) -> tuple[str, str]:
    parser, reasoning, content = HarmonyParser(), [], []
    for start, stop in zip([0, *cuts], [*cuts, len(text)]):
        piece = parser.feed(text[start:stop])
        reasoning.append(piece.reasoning)
        content.append(piece.content)
    tail = parser.finish()
    return "".join(reasoning) + tail.reasoning, "".join(content) + tail.content


def test_whole_answer_splits_into_reasoning_and_content():
    split = parse_harmony(ANSWER)
    assert (split.reasoning, split.content) == (REASONING, CONTENT)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11])
def test_any_stream_cut_gives_the_same_split(step):
    assert _streamed(ANSWER, list(range(step, len(ANSWER), step))) == (REASONING, CONTENT)


def test_every_single_cut_point():
    for cut in range(1, len(ANSWER)):
        assert _streamed(ANSWER, [cut]) == (REASONING, CONTENT), cut


def test_text_is_released_as_soon_as_no_marker_can_start():
    parser = HarmonyParser()
    parser.feed("<|channel|>final<|message|>")
    assert parser.feed("ab<").content == "ab"  # "<" may start a marker: held back
    assert parser.feed("x").content == "<x"


def test_tool_call_header_and_commentary():
    text = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>")
    split = parse_harmony(text)
    assert split.reasoning == "" and split.content == '{"city": "Oslo"}'


def test_unfinished_marker_at_the_end_is_kept_as_text():
    split = parse_harmony("<|channel|>final<|message|>ends with <|mess")
    assert split.content == "ends with <|mess"


def test_answer_without_analysis_is_all_content():
    assert parse_harmony("<|channel|>final<|message|>Just this.").content == "Just this."


def test_tiny_template_renders_harmony(tiny_models):
    tok = Tokenizer.from_pretrained(tiny_models["gpt_oss"], "gpt_oss")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "old thoughts"},
                {"role": "user", "content": "Again"},
                {"role": "assistant", "content": "Hi again.", "reasoning_content": "new thoughts"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text.startswith("<|start|>system<|message|>Reasoning: medium")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in text
    assert "<|start|>user<|message|>Hi<|end|>" in text
    assert "old thoughts" not in text  # reasoning before the last user turn is dropped
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>new thoughts<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>Hi again.<|end|>")
    prompt = tok.apply_chat_template(messages[:2], reasoning_effort="high")
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")
    ids = tok.encode(prompt)
    assert tok.token_to_id("<|start|>") in ids and tok.token_to_id("<|message|>") in ids


def test_generation_stops_at_return_and_call(tiny_models):
    tok = Tokenizer.from_pretrained(tiny_models["gpt_oss"], "gpt_oss")
    stops = {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")}
    assert stops <= set(tok.eos_token_ids)
    assert tok.token_to_id("<|end|>") not in tok.eos_token_ids  # the final channel follows the analysis
