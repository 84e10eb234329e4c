"""fit_messages: which turns are dropped when a conversation outgrows the context (a counter that
charges one token per character plus two per message stands in for the engine's tokenizer)."""

from __future__ import annotations

import pytest

from hearth.app.client.context_window import ContextFullError, answer_reserve, estimate_tokens, fit_messages


def count(messages) -> int:
    return sum(len(m["content"]) + 2 for m in messages)


def chat(*contents: str, system: str | None = "sys") -> list[dict[str, str]]:
    roles = ("user", "assistant")
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


def test_a_chat_that_fits_is_sent_whole():
    messages = chat("aaaa", "bbbb", "cccc")
    fit = fit_messages(messages, count, context_length=100, reserve=10, policy="truncate")
    assert fit.messages == messages and fit.dropped == 0 and fit.prompt_tokens == count(messages)


def test_truncate_drops_the_fewest_oldest_turns_and_keeps_the_system_prompt():
    messages = chat("a" * 20, "b" * 20, "c" * 20, "d" * 20, "e" * 20)  # 5 + 5 * 22 = 115 tokens
    fit = fit_messages(messages, count, context_length=90, reserve=10, policy="truncate")  # budget 80
    assert fit.dropped == 2  # dropping one turn (user + answer) leaves 5 + 3 * 22 = 71 tokens
    assert fit.messages[0] == {"role": "system", "content": "sys"}
    assert fit.messages[1]["role"] == "user" and fit.prompt_tokens == 71
    assert fit.messages[1:] == messages[1 + fit.dropped:]


def test_what_is_sent_always_starts_at_a_user_message():
    messages = chat("a" * 10, "b" * 50, "c" * 10, system=None)  # dropping only "a" would start at an answer
    fit = fit_messages(messages, count, context_length=30, reserve=5, policy="truncate")
    assert fit.dropped == 2 and fit.messages == [{"role": "user", "content": "c" * 10}]


def test_stop_refuses_with_the_numbers():
    messages = chat("a" * 50, "b" * 50, "c" * 50)
    with pytest.raises(ContextFullError, match=r"outgrown the model's context: it is 161 tokens.*holds 100"):
        fit_messages(messages, count, context_length=100, reserve=10, policy="stop")


def test_a_last_message_too_long_for_any_context_says_so():
    messages = chat("a" * 10, "b" * 10, "c" * 200)
    with pytest.raises(ContextFullError, match="Your message is too long"):
        fit_messages(messages, count, context_length=100, reserve=10, policy="truncate")


def test_reserve_and_estimate():
    assert answer_reserve(2048, 40) == 40 and answer_reserve(2048, 4000) == 512 and answer_reserve(2048, None) == 512
    assert estimate_tokens([{"role": "user", "content": "x" * 40}]) == 10 + 4
