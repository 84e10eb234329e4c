"""``<think>`` models through the engine host: tiny DeepSeek-V3.2 and GLM-4.5 models rewired so that
greedy decoding writes fixed reasoning, ``</think>`` and an answer, served by ``python -m
hearth.engine.server``. The reasoning comes back as ``reasoning_content`` (whole and streamed) whether
the prompt opened the block (V3.2's thinking mode ends the prompt with ``<think>``) or the model did
(GLM-4.5); thinking off gives the answer alone; ``reasoning_format: "raw"`` returns the text as
written; tool calls are parsed from the answer part."""

from __future__ import annotations

import json

import pytest

from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.scripted_model import rewire
from tests.engine.test_server_support import start_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Tell me about hearths."}]
THOUGHT = " the kettle sang"
ANSWER = " Mira smiled."
THINKING = {"chat_template_kwargs": {"thinking": True, "enable_thinking": True}}
CALL = "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def _dsv32_script(tokenizer: Tokenizer) -> list[int]:
    """The prompt (thinking) ends in <think>; after it: THOUGHT, </think>, ANSWER, EOS. A prompt with
    thinking off ends in </think>, so the same model then writes ANSWER alone."""
    think_start, think_end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert tokenizer.encode_chat(MESSAGES, thinking=True)[-1] == think_start
    return [think_start, *tokenizer.encode(THOUGHT), think_end, *tokenizer.encode(ANSWER), tokenizer.eos_token_ids[0]]


def _glm_script(tokenizer: Tokenizer) -> list[int]:
    """Thinking on leaves the prompt at <|assistant|>: the model writes <think>THOUGHT</think>, then
    a GLM tool call as its answer, then <|user|> (a stop token)."""
    last = tokenizer.encode_chat(MESSAGES, thinking=True)[-1]
    return [last, *tokenizer.encode("<think>" + THOUGHT + "</think>" + CALL), tokenizer.token_to_id("<|user|>")]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm4_moe"])
def served(request, tiny_models, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"server_reasoning_{family}")
    tokenizer = Tokenizer.from_pretrained(tiny_models[family], family)
    script = _dsv32_script(tokenizer) if family == "deepseek_v32" else _glm_script(tokenizer)
    model = rewire(tiny_models[family], root / "tiny", script)
    running = start_server(model, root / "run", max_model_len=256)
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client, family
    running.stop()


def _answer(family: str) -> str:
    return ANSWER if family == "deepseek_v32" else CALL


def _streamed(client, **kwargs) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                                 stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_reasoning_is_split_from_the_answer(served):
    client, family = served
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                           extra_body=THINKING)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop"
    assert (message.reasoning_content, message.content) == (THOUGHT.strip(), _answer(family).strip())


def test_streamed_reasoning_comes_first_and_splits_the_same_way(served):
    client, family = served
    reasoning, content, chunks = _streamed(client, extra_body=THINKING)
    assert (reasoning, content) == (THOUGHT.strip(), _answer(family).strip())
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
             for c in chunks if c.choices and (c.choices[0].delta.content or
                                               getattr(c.choices[0].delta, "reasoning_content", None))]
    assert kinds == sorted(kinds, reverse=True)  # every reasoning chunk before the first answer chunk
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_format_returns_the_text_as_written(served):
    client, family = served
    message = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                             extra_body={**THINKING, "reasoning_format": "raw"}).choices[0].message
    opened = "" if family == "deepseek_v32" else "<think>"  # V3.2's prompt held the <think>
    assert message.content == f"{opened}{THOUGHT}</think>{_answer(family)}"
    assert getattr(message, "reasoning_content", None) is None


def test_an_unknown_reasoning_format_is_a_clear_400(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError, match="reasoning_format"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       extra_body={"reasoning_format": "hidden"})


@pytest.mark.parametrize("served", ["deepseek_v32"], indirect=True)  # GLM's script starts from thinking on
def test_thinking_off_gives_the_answer_alone(served):
    client, _ = served
    message = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                             temperature=0).choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None  # as written


@pytest.mark.parametrize("served", ["glm4_moe"], indirect=True)  # its scripted answer is a tool call
def test_tool_calls_are_parsed_from_the_answer_part(served):
    client, _ = served
    for stream in (False, True):
        kwargs = {"extra_body": THINKING, "tools": [TOOL]}
        if stream:
            reasoning, content, chunks = _streamed(client, **kwargs)
            calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                                    **kwargs).choices[0]
            reasoning, content = choice.message.reasoning_content, choice.message.content
            calls, reason = choice.message.tool_calls, choice.finish_reason
        assert reasoning == THOUGHT.strip() and not content and reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
