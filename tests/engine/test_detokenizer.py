"""Streaming detokenization (no split multi-byte characters) and stop strings across deltas."""

from __future__ import annotations

import pytest

from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopChecker
from hearth.engine.text.tokenizer import Tokenizer

TEXTS = (
    "plain ascii text, nothing special",
    "café crème brûlée, naïve Ångström, ñandú",
    "日本語のテキスト、中文字符和한국어",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 done",
    "mixed: tea ☕ at 5€, Grüße aus Köln 🏔️!",
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny_v32")
    write_tiny_tokenizer(path, "deepseek_v32", 320)
    return Tokenizer.from_pretrained(path, "deepseek_v32")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert detok.flush() == ""


def test_the_tiny_vocab_really_splits_characters(tok: Tokenizer):
    # Guards the test above: some single tokens of these texts decode to a broken character.
    ids = [i for text in TEXTS[1:] for i in tok.encode(text)]
    assert sum(REPLACEMENT in tok.decode([i]) for i in ids) > 10


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_and_special_tokens(tok: Tokenizer, text: str):
    prompt = tok.encode_chat([{"role": "user", "content": "Say something ✨"}], thinking=True)
    ids = [*tok.encode(text), tok.token_to_id("</think>"), *tok.encode(" ok 👍"), 1]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text + " ok 👍"
    assert not any(REPLACEMENT in d for d in deltas)
    raw = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    raw_text = "".join(_stream(raw, ids))
    assert raw_text == text + "</think> ok 👍<｜end▁of▁sentence｜>"


def test_invalid_bytes_are_not_stuck(tok: Tokenizer):
    # The continuation byte of "é" alone can never complete a character.
    lone = tok.encode("é")[-1]
    assert tok.decode([lone]) == REPLACEMENT
    detok = IncrementalDetokenizer(tok)
    ids = [lone, *tok.encode("ab")]
    out = "".join(_stream(detok, ids))
    assert out == tok.decode(ids) == REPLACEMENT + "ab"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(lone) == ""
    assert detok.flush() == REPLACEMENT and detok.text == REPLACEMENT
    many = IncrementalDetokenizer(tok)
    assert "".join(_stream(many, [lone] * 10)) + many.flush() == REPLACEMENT * 10


# --------------------------------------------------------------------------- stop strings


def _feed_all(stop: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    checker = StopChecker(stop)
    outs, hit = [], False
    for delta in deltas:
        out, hit = checker.feed(delta)
        outs.append(out)
        if hit:
            break
    tail = checker.flush()
    return "".join(outs) + tail, hit, outs


def test_no_stop_strings_pass_through():
    checker = StopChecker([])
    assert checker.feed("abc") == ("abc", False)
    assert checker.flush() == ""


def test_stop_split_across_deltas():
    text, hit, outs = _feed_all(["STOP"], ["hello S", "T", "O", "P and more"])
    assert (text, hit) == ("hello ", True)
    assert outs[0] == "hello "  # "S" held back as a possible start of "STOP"
    assert outs[1:] == ["", "", ""]


def test_held_prefix_is_released_when_it_diverges():
    checker = StopChecker(["STOP"])
    assert checker.feed("a ST") == ("a ", False)
    assert checker.feed("ay") == ("STay", False)
    assert checker.feed("S") == ("", False)
    assert checker.flush() == "S"


def test_stop_at_the_very_start():
    assert _feed_all(["<end>"], ["<end>tail"])[:2] == ("", True)
    assert _feed_all(["<end>"], ["<", "e", "nd>", "x"])[:2] == ("", True)


def test_feed_after_stop_returns_nothing():
    checker = StopChecker(["x"])
    assert checker.feed("axb") == ("a", True)
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""
    assert checker.matched == "x"


@pytest.mark.parametrize(
    ("stops", "text", "expected"),
    [
        (["abcd", "bc"], "xxabcdyy", "xxa"),  # "bc" completes before "abcd"
        (["aab", "ab"], "zaab!", "z"),  # same end: the earlier start wins
        (["ana"], "bananas", "b"),  # self-overlapping stop string
        (["\n\n", "\nUser:"], "one\ntwo\nUser: hi", "one\ntwo"),
        (["never"], "nothing to see, nev", "nothing to see, nev"),
        (["日本", "本語"], "私は日本語", "私は"),
    ],
)
def test_overlapping_candidates_are_split_independent(stops: list[str], text: str, expected: str):
    whole = _feed_all(stops, [text])[0]
    chars = _feed_all(stops, list(text))[0]
    assert whole == chars == expected
    for cut in range(len(text) + 1):
        assert _feed_all(stops, [text[:cut], text[cut:]])[0] == expected


def test_detokenizer_and_stop_checker_together(tok: Tokenizer):
    text = "Grüße 😀 from the kitchen. ### END ### ignored"
    detok, checker = IncrementalDetokenizer(tok), StopChecker(["### END"])
    shown = []
    for token_id in tok.encode(text):
        out, hit = checker.feed(detok.push(token_id))
        shown.append(out)
        if hit:
            break
    assert "".join(shown) == "Grüße 😀 from the kitchen. "
