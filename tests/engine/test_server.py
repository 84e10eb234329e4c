"""The engine host end to end: the official ``openai`` client against ``python -m
hearth.engine.server`` serving a tiny random DeepSeek-V3.2 on 127.0.0.1 (one server per module,
started with an API key), plus raw HTTP for malformed requests. OpenAI's conventions clients rely
on: null for "not given", the legacy completions' 16-token default, ``context_length_exceeded``,
``logit_bias``, errors naming their field; vLLM's ``continue_final_message``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hearth.engine.structured.grammar import Grammar
from hearth.engine.testing.tiny import write_tiny_model
from hearth.engine.text.tokenizer import Tokenizer
from tests.engine.test_server_support import ServerProcess, start_server, wait_until

openai = pytest.importorskip("openai")

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
MESSAGES = [{"role": "user", "content": "Tell me about hearths."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("server") / "tiny-v32", "deepseek_v32", seed=3)


@pytest.fixture(scope="module")
def server(model_path):
    running = start_server(model_path, model_path.parent / "run", api_key=API_KEY, max_model_len=MAX_MODEL_LEN)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_text(client) -> str:
    """The greedy answer to MESSAGES in 24 tokens (the reference for other tests)."""
    result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24, temperature=0)
    return result.choices[0].message.content


def _stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/hearth/stats", headers=server.headers, timeout=5).json()


def test_models_lists_the_folder_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny-v32"]


def test_chat_max_tokens_gives_length_and_usage(client):
    result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=7, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7


def test_max_completion_tokens_is_honoured(client):
    result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_completion_tokens=3,
                                            temperature=0)
    assert result.usage.completion_tokens == 3


def test_streaming_matches_non_streaming_and_reports_usage(client, greedy_text):
    stream = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == greedy_text
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_stop_strings_end_the_answer_before_the_stop(client, greedy_text):
    start = next(i for i in range(4, len(greedy_text) - 2) if greedy_text[i:i + 2].isalpha())
    stop = greedy_text[start:start + 2]
    expected = greedy_text[:greedy_text.index(stop)]
    for given in (stop, [stop, "never-appears"]):
        result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24,
                                                temperature=0, stop=given)
        assert result.choices[0].message.content == expected
        assert result.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample() -> str:
        return client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              top_p=0.9, seed=42).choices[0].message.content
    assert sample() == sample()


def test_completions_with_text_and_token_ids(client):
    text = client.completions.create(model="tiny-v32", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5
    ids = client.completions.create(model="tiny-v32", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 4
    streamed = client.completions.create(model="tiny-v32", prompt="Once upon a time", max_tokens=5, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_four_concurrent_requests_match_the_single_result(client, greedy_text):
    def ask(_: int) -> str:
        result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24, temperature=0)
        return result.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert answers == [greedy_text] * 4


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "model_not_found" and "tiny-v32" in err.value.message


@pytest.mark.parametrize(("change", "param"), [({"max_tokens": -5}, "max_tokens"), ({"n": 2}, "n")])
def test_impossible_parameters_are_400(client, change, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-v32", messages=MESSAGES, **change)
    assert err.value.param == param


@pytest.mark.parametrize(("change", "param", "message"), [
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1]"), ({"temperature": -1}, "temperature", "temperature must"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must"), ({"stop": [""]}, "stop", "stop strings"),
    ({"extra_body": {"logit_bias": {"5": 101}}}, "logit_bias", "logit_bias values"),
    ({"logit_bias": {"512": 1}}, "logit_bias", "token id 512, outside the vocabulary (0..511)"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token id -1, outside the vocabulary"),
    ({"logit_bias": {"the": 1}}, "logit_bias", "keys must be token ids"),
])
def test_out_of_range_sampling_is_400_naming_the_field(client, change, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=2, **change)
    assert err.value.param == param and err.value.type == "invalid_request_error"
    assert message in err.value.body["message"]


def test_prompt_longer_than_the_context_is_context_length_exceeded(server, client):
    long = [{"role": "user", "content": "hearth fire " * 400}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-v32", messages=long, max_tokens=2)
    assert (err.value.type, err.value.param, err.value.code) == ("invalid_request_error", "messages",
                                                                 "context_length_exceeded")
    opening = f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, the prompt has "
    assert err.value.body["message"].startswith(opening)
    assert f"the context holds {MAX_MODEL_LEN}" in err.value.body["message"]
    # Refused before tokenising (from a bound on its length), after it, and as token ids.
    for prompt, has in (("hearth " * 100_000, "at least "), ("hearth fire " * 400, "1"),
                        (list(range(3, 3 + MAX_MODEL_LEN)), "512 tokens")):
        response = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=30,
                              json={"model": "tiny-v32", "prompt": prompt, "max_tokens": 2})
        error = response.json()["error"]
        assert response.status_code == 400 and error["message"].startswith(opening + has)
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prompt",
                                                                  "context_length_exceeded")


def test_null_is_the_default_for_every_optional_field(server, greedy_text):
    nulls = dict.fromkeys(["n", "stream", "stream_options", "ignore_eos", "reasoning_format", "stop", "seed", "top_p",
                           "top_k", "min_p", "logit_bias", "response_format", "logprobs", "tools", "tool_choice",
                           "presence_penalty", "max_completion_tokens", "chat_template_kwargs", "hearth",
                           "add_generation_prompt", "continue_final_message", "stop_token_ids", "user"])
    body = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **nulls}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == greedy_text
    body = {"model": "tiny-v32", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "echo": None, "n": None,
            "suffix": None, "logprobs": None, "stream": None, "ignore_eos": None}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, response.text


@pytest.mark.parametrize(("raw", "param"), [
    (b'"temperature": Infinity', "temperature"), (b'"top_p": NaN', "top_p"),
    (b'"presence_penalty": -Infinity', "presence_penalty"), (b'"logit_bias": {"5": Infinity}', "logit_bias.5"),
    (b'"max_tokens": Infinity', "max_tokens"),
])
def test_non_finite_numbers_are_400(server, raw, param):
    body = b'{"model": "tiny-v32", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, ' + raw + b"}"
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=body, timeout=10,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_completions_default_to_16_tokens(client):
    text = client.completions.create(model="tiny-v32", prompt="Once upon a time", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 16 and text.choices[0].finish_reason == "length"


def test_top_k_minus_one_is_off(client, greedy_text):
    result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24, temperature=0,
                                            extra_body={"top_k": -1})
    assert result.choices[0].message.content == greedy_text


def _no_whitespace(model_path) -> dict[str, int]:
    """logit_bias that all but bans whitespace tokens (the random model's greedy choice is often a space,
    which would fill its JSON answers with bounded runs of them)."""
    tokenizer = Tokenizer.from_pretrained(model_path)
    return {str(i): -100 for i in range(tokenizer.vocab_size) if not tokenizer.decode([i]).strip()
            and tokenizer.decode([i])}


def test_response_format_json_schema_and_json_object_are_held(client, greedy_text, model_path):
    result = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=24, temperature=0,
                                            response_format={"type": "text"})
    assert result.choices[0].message.content == greedy_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rooms": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "cosy": {"type": "boolean"}},
              "required": ["city", "rooms", "cosy"], "additionalProperties": False}
    house = {"name": "house", "schema": schema, "strict": True}
    ask = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
           "logit_bias": _no_whitespace(model_path), "response_format": {"type": "json_schema", "json_schema": house}}
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert list(value) == ["city", "rooms", "cosy"] and isinstance(value["city"], str) and len(value["city"]) <= 10
    assert type(value["rooms"]) is int and 1 <= value["rooms"] <= 9 and type(value["cosy"]) is bool
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # json_object: any object (the random model's strings run long: 30 tokens of one, held to the grammar)
    anything = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=30, temperature=1.0,
                                              seed=4, response_format={"type": "json_object"})
    grammar = Grammar.from_schema({"type": "object"})
    text = anything.choices[0].message.content
    assert text.lstrip().startswith("{") and grammar.advance_bytes(grammar.initial, text.encode()) is not None


def test_schemas_that_cannot_be_enforced_are_400(client):
    for schema, named in (({"type": "string", "pattern": "^(a)\\1$"}, "backreference"),
                          ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}},
                           "'multipleOf'")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=2, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert err.value.param == "response_format" and named in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert err.value.param == "response_format.json_schema"


def test_logit_bias_forces_a_token_greedy_sampled_and_streamed(client, model_path):
    (the,) = Tokenizer.from_pretrained(model_path).encode(" the")
    ask = {"model": "tiny-v32", "max_tokens": 6, "extra_body": {"ignore_eos": True}, "logit_bias": {str(the): 100}}
    greedy = client.completions.create(prompt=[5, 6, 7, 8], temperature=0, **ask)
    sampled = client.completions.create(prompt=[5, 6, 7, 8], temperature=1.0, seed=7, **ask)
    streamed = client.chat.completions.create(messages=MESSAGES, temperature=0, stream=True, **ask)
    assert greedy.choices[0].text == sampled.choices[0].text == " the" * 6
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " the" * 6
    unbiased = client.completions.create(prompt=[5, 6, 7, 8], temperature=0, **{**ask, "logit_bias": None})
    assert unbiased.choices[0].text != " the" * 6


def test_continue_final_message_continues_the_assistant_s_text(client, model_path):
    started = [*MESSAGES, {"role": "assistant", "content": "Hearths are"}]
    options = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True,
               "reasoning_format": "raw"}
    chat = client.chat.completions.create(model="tiny-v32", messages=started, max_tokens=8, temperature=0,
                                          extra_body=options)
    # DeepSeek-V3.2's prompt, ending inside the assistant's turn (no end of sentence after its text).
    ids = Tokenizer.from_pretrained(model_path).encode(
        "<｜begin▁of▁sentence｜><｜User｜>Tell me about hearths.<｜Assistant｜></think>Hearths are")
    text = client.completions.create(model="tiny-v32", prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == text.choices[0].text


@pytest.mark.parametrize(("messages", "options", "param"), [
    (MESSAGES, {"add_generation_prompt": False}, "add_generation_prompt"),  # V3.2 cannot leave it out
    (MESSAGES, {"continue_final_message": True}, "continue_final_message"),  # nothing to continue
    ([*MESSAGES, {"role": "assistant", "content": "So"}], {"continue_final_message": True,
                                                          "add_generation_prompt": True}, "continue_final_message"),
])
def test_generation_prompt_options_the_prompt_cannot_follow_are_400(client, messages, options, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-v32", messages=messages, max_tokens=2, extra_body=options)
    assert err.value.param == param


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "tiny-v32"}',
                                  b'{"model": "tiny-v32", "messages": [], "max_tokens": 2}'])
def test_malformed_bodies_get_openai_style_400(server, body):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=body, timeout=10,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"]


def test_unknown_route_is_a_json_404(server):
    response = httpx.get(f"{server.base_url}/v1/nothing-here", headers=server.headers, timeout=5)
    assert response.status_code == 404 and "message" in response.json()["error"]


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": API_KEY}, {"Authorization": f"Bearer {API_KEY}x"}):
        response = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=5)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    for scheme in ("bearer", "BEARER", "bEaReR"):  # RFC 7235: the scheme is case-insensitive
        response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200, scheme
    no_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()


def test_client_disconnect_aborts_the_request(server, client):
    before = _stats(server)["requests_aborted"]
    stream = client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=480, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    stream.close()
    stats = wait_until(lambda: (s := _stats(server))["requests_aborted"] > before and s["running"] == 0 and s,
                       timeout=10, what="the aborted request to leave the engine")
    assert stats["waiting"] == 0
    assert stats["cache_blocks_free"] == stats["cache_blocks_total"]


def test_client_disconnect_aborts_a_non_streaming_request(server):
    before = _stats(server)["requests_aborted"]
    body = {"model": "tiny-v32", "messages": MESSAGES, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=0.3)
    stats = wait_until(lambda: (s := _stats(server))["requests_aborted"] > before and s["running"] == 0 and s,
                       timeout=10, what="the server to notice the disconnect")
    assert stats["cache_blocks_free"] == stats["cache_blocks_total"]


def test_stats_report_engine_and_memory(server):
    stats = _stats(server)
    assert stats["model"] == "tiny-v32" and stats["state"] == "ready"
    assert stats["max_model_len"] == MAX_MODEL_LEN and stats["generated_tokens"] > 0
    assert stats["memory"]["process_rss_bytes"] > 0
    assert {"running", "waiting", "decode_tokens_per_s", "cache_blocks_free"} <= set(stats)


def test_unload_and_load(server, client, model_path, tmp_path):
    base, headers = server.base_url, server.headers
    bad = httpx.post(f"{base}/hearth/load", json={"model": str(tmp_path / "missing")}, headers=headers, timeout=30)
    assert bad.status_code == 403 and bad.json()["error"]["code"] == "model_not_allowed"
    assert httpx.get(f"{base}/health", headers=headers).json()["status"] == "ready"  # the model was kept

    path = str(model_path)
    assert httpx.post(f"{base}/hearth/unload", json={}, headers=headers, timeout=30).json() == {"unloaded": "tiny-v32"}
    assert client.models.list().data == []
    with pytest.raises(openai.InternalServerError) as err:  # 503: nothing to run on
        client.chat.completions.create(model="tiny-v32", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 503 and err.value.type == "server_error"

    loaded = httpx.post(f"{base}/hearth/load", json={"model": path, "served_name": "again"}, headers=headers,
                        timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert json.loads(loaded.text)["model"] == "again"
    result = client.chat.completions.create(model="again", messages=MESSAGES, max_tokens=2)
    assert result.usage.completion_tokens == 2


def test_the_server_logged_no_tracebacks(server):
    # Runs last in this module: every request above was answered without an unexpected error.
    assert "Traceback" not in server.log(), server.log()
