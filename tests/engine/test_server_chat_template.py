"""The engine host serving a model whose Jinja chat template does string operations on the content,
as Qwen3's does (``python -m hearth.engine.server`` on 127.0.0.1, the official ``openai`` client):
content sent as text parts reaches the template as a string, and vLLM's ``add_generation_prompt`` /
``continue_final_message`` shape the prompt, counted alike by ``/hearth/tokenize``."""

from __future__ import annotations

import httpx
import pytest

from hearth.engine.testing.tiny import write_tiny_model
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.test_chat_template import STRING_OPS_TEMPLATE
from tests.engine.test_server_support import ServerProcess, start_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about hearths."}]
# STRING_OPS_TEMPLATE's rendering of MESSAGES, without the generation prompt.
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me about hearths.<|im_end|>\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("jinja") / "tiny-jinja", "deepseek_v3", seed=5)
    (path / "chat_template.jinja").write_text(STRING_OPS_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    running = start_server(model, tmp_path_factory.mktemp("run"), max_model_len=256)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_pretrained(model)


def _answer(client, messages, **extra_body):
    return client.chat.completions.create(model="tiny-jinja", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "reasoning_format": "raw", **extra_body})


def test_text_parts_reach_the_template_as_strings(client, tokenizer):
    as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    parts, strings = _answer(client, as_parts), _answer(client, MESSAGES)
    assert parts.usage.prompt_tokens == strings.usage.prompt_tokens
    assert parts.usage.prompt_tokens == len(tokenizer.encode(RENDERED + "<|im_start|>assistant\n"))
    assert parts.choices[0].message.content == strings.choices[0].message.content


def test_add_generation_prompt_false_ends_after_the_last_turn(client, tokenizer):
    assert _answer(client, MESSAGES, add_generation_prompt=False).usage.prompt_tokens == \
        len(tokenizer.encode(RENDERED))


def test_continue_final_message_continues_the_assistant_s_text(server, client, tokenizer):
    started = [*MESSAGES, {"role": "assistant", "content": "Hearths are"}]
    chat = _answer(client, started, continue_final_message=True)
    ids = tokenizer.encode(RENDERED + "<|im_start|>assistant\nHearths are")  # no <|im_end|> after the text
    text = client.completions.create(model="tiny-jinja", prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == text.choices[0].text
    counted = httpx.post(f"{server.base_url}/hearth/tokenize", timeout=30,
                         json={"model": "tiny-jinja", "messages": started, "continue_final_message": True})
    assert counted.json()["prompt_tokens"] == len(ids)
