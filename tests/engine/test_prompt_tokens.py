"""PromptTokens: a conversation's follow-up prompt tokenises only its new text, and the ids are always
those of tokenising the whole text (tricky boundaries, edits, other tokenizers); PageHashes: reused
page hashes equal hash_block's chain."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hearth.engine.block_manager import PageHashes, hash_block
from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.prompt_tokens import PromptTokens, anchor_ids
from hearth.engine.text.tokenizer import Tokenizer as HearthTokenizer


@pytest.fixture(scope="module")
def v32(tmp_path_factory) -> HearthTokenizer:
    folder = tmp_path_factory.mktemp("v32-tokenizer")
    write_tiny_tokenizer(folder, "deepseek_v32", 512)
    return HearthTokenizer.from_pretrained(folder, "deepseek_v32")


def tricky_backend() -> Tokenizer:
    """Byte-level BPE with added tokens that look across their edges or contain one another."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([
        "<s>",  # an anchor
        "<turn>",  # inside "<turn>!" below: never an anchor
        "<turn>!",
        AddedToken("<strip>", special=True, rstrip=True),  # looks across its right edge
        AddedToken("<left>", special=True, lstrip=True),
        AddedToken("<word>", special=True, single_word=True),
    ])
    backend.add_tokens(["<visible>"])  # not special
    return backend


def test_anchors_are_the_special_tokens_that_match_alone():
    backend = tricky_backend()
    names = {backend.id_to_token(i) for i in anchor_ids(backend)}
    assert names == {"<s>", "<turn>!"}
    backend.enable_truncation(8)
    assert anchor_ids(backend) == frozenset()  # a truncating tokenizer is never cut


def test_a_follow_up_tokenises_only_its_new_turn_and_matches_the_whole_text(v32):
    cache = v32.prompt_tokens()
    first = [{"role": "user", "content": "Tell me about the kettle on the hearth. " * 40}]
    text = v32.chat_prompt(first)
    assert cache.encode(text, "chat") == v32.encode(text)
    assert cache.reused_tokens == 0
    follow = [*first, {"role": "assistant", "content": "It sang before dawn."},
              {"role": "user", "content": "And the mill wheel?"}]
    text2 = v32.chat_prompt(follow)
    whole = v32.encode(text2)
    assert cache.encode(text2, "chat") == whole
    assert cache.reused_tokens > len(v32.encode(text)) - 20  # all but the last turn's few tokens


def test_edits_system_prompts_and_other_conversations_fall_back_exactly(v32):
    cache = v32.prompt_tokens()
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three " * 30},
             {"role": "assistant", "content": "four"}, {"role": "user", "content": "five six"}]
    cache.encode(v32.chat_prompt(turns), "chat")
    edited = [turns[0], {"role": "user", "content": "one two THREE " * 30}, *turns[2:]]  # an earlier message edited
    reused = cache.reused_tokens
    assert cache.encode(v32.chat_prompt(edited), "chat") == v32.encode(v32.chat_prompt(edited))
    assert cache.reused_tokens - reused < 10  # only the system part before the edit
    system = [{"role": "system", "content": "Be thorough."}, *edited[1:]]
    reused = cache.reused_tokens
    assert cache.encode(v32.chat_prompt(system), "chat") == v32.encode(v32.chat_prompt(system))
    assert cache.reused_tokens == reused  # nothing shared after BOS
    other = [{"role": "user", "content": "unrelated"}]
    reused = cache.reused_tokens
    assert cache.encode(v32.chat_prompt(other), "other") == v32.encode(v32.chat_prompt(other))
    assert cache.reused_tokens == reused
    cache.forget("chat")  # a dropped conversation starts over
    assert cache.encode(v32.chat_prompt(system), "chat") == v32.encode(v32.chat_prompt(system))
    assert cache.reused_tokens == reused


def test_another_tokenizer_has_its_own_cache(v32, tmp_path):
    write_tiny_tokenizer(tmp_path, "deepseek_v32", 600, synthetic=True)
    other = HearthTokenizer.from_pretrained(tmp_path, "deepseek_v32")
    text = v32.chat_prompt([{"role": "user", "content": "the same words " * 20}])
    mine, theirs = v32.prompt_tokens(), other.prompt_tokens()
    assert mine.encode(text, "chat") == v32.encode(text)
    assert theirs.encode(text, "chat") == other.encode(text) != v32.encode(text)


@pytest.mark.parametrize("seed", range(3))
def test_random_edits_at_tricky_boundaries_give_the_whole_texts_ids(seed):
    backend = tricky_backend()
    cache = PromptTokens(backend, lambda text: 0)
    pieces = ["<s>", "<turn>", "<turn>!", "!", "<strip>", "<left>", "<word>", "<visible>", " ", "  ", "ab", "é",
              "\n", "<", ">", "<tu", "rn>", "word", "x"]
    rng = random.Random(seed)
    reused = 0
    for trial in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        conversation = f"c{trial % 5}"
        assert cache.encode(text, conversation) == backend.encode(text, add_special_tokens=False).ids
        for _ in range(4):  # follow-ups: keep a prefix (cut anywhere, even inside a token), add pieces
            text = text[:rng.randint(0, len(text))] + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
            assert cache.encode(text, conversation) == backend.encode(text, add_special_tokens=False).ids, text
        reused = cache.reused_tokens
    assert reused > 0  # the cases did exercise reuse


def test_refuse_sees_a_lower_bound_before_tokenising(v32):
    cache = v32.prompt_tokens()
    text = v32.chat_prompt([{"role": "user", "content": "words " * 50}])
    seen = []
    cache.encode(text, "chat", seen.append)
    assert 0 < seen[0] <= len(v32.encode(text))

    def refuse(fewest: int) -> None:
        raise ValueError(fewest)

    longer = v32.chat_prompt([{"role": "user", "content": "words " * 50}, {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "more " * 40}])
    with pytest.raises(ValueError):
        cache.encode(longer, "chat", refuse)


def _chat(v32: HearthTokenizer, turns: int) -> str:
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: where does the kettle sing? " * 8},
                     {"role": "assistant", "content": f"Answer {i}: on the hearth."}]
    return v32.chat_prompt([*messages, {"role": "user", "content": "And the mill?"}])


def test_a_saved_prompt_is_adopted_by_a_new_cache_and_gives_the_whole_texts_ids(v32):
    assert v32.identity  # a hash of tokenizer.json
    first = v32.prompt_tokens()
    text = _chat(v32, 3)
    first.encode(text, "chat")
    record = first.to_bytes("chat")
    assert record is not None and first.to_bytes("other") is None
    restarted = v32.prompt_tokens()  # a new engine: nothing cached
    assert restarted.adopt("chat", record) and "chat" in restarted
    follow = _chat(v32, 4)
    assert restarted.encode(follow, "chat") == v32.encode(follow)
    assert restarted.reused_tokens > len(v32.encode(text)) // 2  # the saved ids were used


def test_a_corrupt_or_foreign_record_is_refused(v32):
    cache = v32.prompt_tokens()
    text = _chat(v32, 2)
    cache.encode(text, "chat")
    record = cache.to_bytes("chat")
    assert record is not None
    other_tokenizer = PromptTokens(v32._backend, v32.fewest_tokens, identity="another tokenizer.json")
    assert not other_tokenizer.adopt("chat", record)
    size = int.from_bytes(record[:4], "little")
    text_at = len(record) - json.loads(record[4:4 + size])["text_bytes"]
    assert record[text_at:text_at + 1] == b"<"  # the text opens with the BOS anchor
    moved = bytearray(record)
    moved[text_at] = ord("[")  # the anchor's text no longer holds the anchor
    bad = [record[:len(record) // 2], record + b"x", b"", b"\xff" * 40, bytes(moved)]
    fresh = v32.prompt_tokens()
    assert not any(fresh.adopt("chat", data) for data in bad)
    assert "chat" not in fresh
    assert fresh.encode(text, "chat") == v32.encode(text) and fresh.reused_tokens == 0


def test_page_hashes_reuse_a_shared_prefix_and_equal_the_chain():
    rng = random.Random(0)
    tokens = [rng.randrange(100_000) for _ in range(16 * 40 + 5)]

    def chain(ids: list[int], count: int) -> list[int]:
        out, parent = [], None
        for i in range(count):
            parent = hash_block(parent, ids[i * 16:(i + 1) * 16])
            out.append(parent)
        return out

    hashes = PageHashes(16, capacity=2)
    assert hashes(tokens, 40) == chain(tokens, 40)
    longer = tokens + [7] * 30
    assert hashes(longer, 41) == chain(longer, 41)
    edited = list(tokens)
    edited[16 * 25 + 3] += 1  # page 25 differs: 25 pages shared, the rest recomputed
    assert hashes(edited, 40) == chain(edited, 40)
    assert hashes(edited[:100], 6) == chain(edited, 6)  # a shorter prompt of the same chat
    assert hashes(tokens, 0) == []
