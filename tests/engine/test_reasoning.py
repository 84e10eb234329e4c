"""The ``<think>`` reasoning parser: whole answers and streams cut at every point split the same way,
whether the prompt left the model inside the block or not; and the marker scanner both parsers share."""

from __future__ import annotations

import pytest

from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.harmony import HarmonyParser
from hearth.engine.text.markers import Marker, MarkerScanner, ReasoningParser
from hearth.engine.text.reasoning import ThinkParser, prompt_opens_reasoning, reasoning_parser_for, split_reasoning
from hearth.engine.text.tokenizer import Tokenizer

# The prompt ended with "<think>" (DeepSeek-V3.2 thinking mode): the answer opens with reasoning.
OPENED = "\nThe user greets; a <b>brief</b> reply < 10 words.\n</think>\n\nHello <there>!"
# The model opens the block itself (GLM-4.5 / Qwen3 with thinking on).
SELF_OPENED = "\n<think>The user greets; a <b>brief</b> reply < 10 words.\n</think>\n\nHello <there>!"
REASONING, CONTENT = "The user greets; a <b>brief</b> reply < 10 words.\n", "Hello <there>!"


def _streamed(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    reasoning, content = [], []
    for start, stop in zip([0, *cuts], [*cuts, len(text)]):
        piece = parser.feed(text[start:stop])
        reasoning.append(piece.reasoning)
        content.append(piece.content)
    tail = parser.finish()
    return "".join(reasoning) + tail.reasoning, "".join(content) + tail.content


@pytest.mark.parametrize(("text", "in_reasoning"), [(OPENED, True), (SELF_OPENED, False)])
def test_every_cut_point_gives_the_whole_answers_split(text, in_reasoning):
    whole = split_reasoning(ThinkParser(in_reasoning), text)
    assert (whole.reasoning, whole.content) == (REASONING, CONTENT)
    for cut in range(1, len(text)):
        assert _streamed(ThinkParser(in_reasoning), text, [cut]) == (REASONING, CONTENT), cut
    for a in range(1, len(text)):
        for b in range(a + 1, len(text)):
            assert _streamed(ThinkParser(in_reasoning), text, [a, b]) == (REASONING, CONTENT), (a, b)


def test_one_character_at_a_time():
    assert _streamed(ThinkParser(True), OPENED, list(range(1, len(OPENED)))) == (REASONING, CONTENT)


def test_reasoning_streams_before_the_block_closes():
    parser = ThinkParser(in_reasoning=True)
    assert parser.feed("Let me see</th").reasoning == "Let me see"  # "</th" may be the marker: held back
    assert parser.feed("ink>Yes").content == "Yes"


def test_thinking_off_is_all_answer():
    """The prompt closed an empty block (or had none): markers the model quotes later stay text."""
    text = "Use <think> and </think> tags."
    assert split_reasoning(ThinkParser(False), "I will. " + text).content == "I will. " + text
    split = split_reasoning(ThinkParser(False), "<think>why</think>" + text)
    assert (split.reasoning, split.content) == ("why", text)  # only the first block is reasoning


def test_leading_whitespace_of_an_answer_without_a_block_is_kept():
    for cut in range(1, 4):
        assert _streamed(ThinkParser(False), "\n  hi", [cut]) == ("", "\n  hi")
    assert split_reasoning(ThinkParser(False), " \n").content == " \n"


def test_each_family_gets_its_parser():
    assert isinstance(reasoning_parser_for("gpt_oss", "")(), HarmonyParser)
    opened = reasoning_parser_for("deepseek_v32", "<｜Assistant｜><think>")
    assert split_reasoning(opened(), "a</think>b").reasoning == "a"
    assert split_reasoning(reasoning_parser_for("glm4_moe", "<|assistant|>")(), "a</think>b").content == "a</think>b"
    assert reasoning_parser_for("mixtral", "<think>") is None


def test_unclosed_block_is_all_reasoning_and_a_cut_marker_is_text():
    split = split_reasoning(ThinkParser(True), "still thinking </thi")
    assert (split.reasoning, split.content) == ("still thinking </thi", "")


@pytest.mark.parametrize(("tail", "opened"), [("<｜Assistant｜><think>", True), ("<｜Assistant｜></think>", False),
                                              ("<|assistant|>\n<think></think>", False), ("<think>\n", True),
                                              ("<|assistant|>", False)])
def test_prompt_tail_says_whether_the_block_is_open(tail, opened):
    assert prompt_opens_reasoning(tail) is opened


def test_scanner_prefers_the_earliest_then_the_longest_marker():
    scanner = MarkerScanner(("<a>", "<ab>"))
    assert scanner.feed("x<ab>y<a") == ["x", Marker("<ab>"), "y"]
    assert scanner.feed(">") == [Marker("<a>")]
    assert scanner.feed("<q") == ["<q"]


def test_special_think_markers_survive_decoding(tmp_path):
    """The tiny DeepSeek-V3.2 tokenizer marks <think> special: skipping specials keeps it (and drops EOS)."""
    write_tiny_tokenizer(tmp_path, "deepseek_v32", 512)
    tokenizer = Tokenizer.from_pretrained(tmp_path, "deepseek_v32")
    ids = [tokenizer.token_to_id("<think>"), *tokenizer.encode("hi"), tokenizer.token_to_id("</think>"),
           *tokenizer.encode("yo"), tokenizer.eos_token_ids[0]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hi</think>yo"
