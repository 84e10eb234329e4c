"""A tiny GLM-4.5-shaped model (``glm4_moe``) served by ``python -m hearth.engine.server`` with its
routed experts offloaded behind a small expert cache: the official ``openai`` client gets the same
greedy answer the in-process engine (all experts resident) writes, and the chat template's thinking
switch reaches the prompt the way it does for the other families (thinking off unless asked)."""

from __future__ import annotations

import httpx
import pytest

from hearth.engine import Engine, EngineConfig, SamplingParams, TokenDelta
from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.test_server_support import ServerProcess, start_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about hearths."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("glm") / "tiny-glm45", "glm4_moe", seed=6)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    running = start_server(model, tmp_path_factory.mktemp("run"), max_model_len=256,
                           extra=("--offload", "always", "--expert-cache-slots", "3"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _resident_answer(model, max_tokens: int, **chat_options) -> tuple[str, int]:
    engine = Engine.load(str(model), EngineConfig(device="cpu", dtype="float32", max_model_len=256))
    events = list(engine.generate(messages=MESSAGES, sampling=SamplingParams(temperature=0, max_tokens=max_tokens),
                                  **chat_options))
    text = "".join(e.text for e in events if isinstance(e, TokenDelta))
    return text, len(engine.encode(MESSAGES, **chat_options))


def test_chat_completion_matches_the_resident_engine(client, server, model):
    text, prompt_tokens = _resident_answer(model, 12)
    result = client.chat.completions.create(model="tiny-glm45", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert choice.message.content == text and choice.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 12)
    stats = httpx.get(f"{server.base_url}/hearth/stats", timeout=5).json()
    assert stats["expert_cache_misses"] > 0  # the experts really are behind the cache


def test_thinking_switch_reaches_the_template(client, model):
    """Off by default: the template appends /nothink and an empty think block; asked for, neither."""
    text, prompt_tokens = _resident_answer(model, 6, enable_thinking=True)
    result = client.chat.completions.create(model="tiny-glm45", messages=MESSAGES, max_tokens=6, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert result.choices[0].message.content == text
    assert result.usage.prompt_tokens == prompt_tokens
    default = client.chat.completions.create(model="tiny-glm45", messages=MESSAGES, max_tokens=1, temperature=0)
    assert default.usage.prompt_tokens > prompt_tokens


def test_tools_reach_the_glm_template(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    plain = client.chat.completions.create(model="tiny-glm45", messages=MESSAGES, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model="tiny-glm45", messages=MESSAGES, max_tokens=1, temperature=0,
                                                tools=[tool])
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
