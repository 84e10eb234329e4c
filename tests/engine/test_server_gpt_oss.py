"""gpt-oss through the engine host: a tiny gpt_oss model whose weights are rewired so that greedy
decoding writes a fixed harmony answer (an analysis message, then ``<|return|>``), served by
``python -m hearth.engine.server``: the analysis channel comes back as ``reasoning_content``, whole
and streamed, and no harmony marker reaches the client."""

from __future__ import annotations

import pytest

from hearth.engine.text.harmony import parse_harmony
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.scripted_model import rewire
from tests.engine.test_server_support import start_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Tell me about hearths."}]
THOUGHT = " the kettle sang"
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")


def _script(tokenizer: Tokenizer) -> list[int]:
    """The greedy answer: after the prompt's last token, ``<|channel|>analysis<|message|>`` + THOUGHT
    + ``<|return|>`` (every token but the last appears once, so "next token" is a function)."""
    last = tokenizer.encode_chat(MESSAGES)[-1]
    special = tokenizer.token_to_id
    return [last, special("<|channel|>"), *tokenizer.encode("analysis"), special("<|message|>"),
            *tokenizer.encode(THOUGHT), special("<|return|>")]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_gpt_oss")
    tokenizer = Tokenizer.from_pretrained(tiny_models["gpt_oss"], "gpt_oss")
    model = rewire(tiny_models["gpt_oss"], root / "tiny-gpt-oss", _script(tokenizer))
    running = start_server(model, root / "run", api_key="k", max_model_len=256)
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="k", max_retries=0, timeout=60) as client:
        yield client, tokenizer
    running.stop()


def test_chat_answer_carries_the_analysis_as_reasoning(served):
    client, tokenizer = served
    whole = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, max_tokens=40, temperature=0)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop"  # <|return|> ended it
    assert message.reasoning_content == THOUGHT
    assert message.content == ""
    raw = client.completions.create(model="tiny-gpt-oss", prompt=tokenizer.encode_chat(MESSAGES), max_tokens=40,
                                    temperature=0).choices[0].text
    assert raw.startswith("<|channel|>analysis<|message|>")  # the markers are there to be parsed
    assert parse_harmony(raw).reasoning == THOUGHT


def test_streamed_chat_splits_the_same_way(served):
    client, _ = served
    chunks = list(client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, max_tokens=40,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (THOUGHT, "")
    assert not any(m in reasoning + content for m in MARKERS)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_reasoning_format_keeps_the_channels_in_the_content(served):
    client, _ = served
    raw = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, max_tokens=40, temperature=0,
                                         extra_body={"reasoning_format": "raw"}).choices[0].message
    assert raw.content.startswith("<|channel|>analysis<|message|>") and THOUGHT in raw.content
    assert getattr(raw, "reasoning_content", None) is None
