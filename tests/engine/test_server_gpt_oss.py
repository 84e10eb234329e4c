"""gpt-oss through the engine host: a tiny gpt_oss model whose weights are rewired so that greedy
decoding writes a fixed harmony answer (an analysis message, then ``<|return|>``), served by
``python -m hearth.engine.server``: the analysis channel comes back as ``reasoning_content``, whole
and streamed, and no harmony marker reaches the client."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.engine.text.harmony import parse_harmony
from hearth.engine.text.tokenizer import Tokenizer
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


def _rewire(src, dst, script: list[int]):
    """No attention or expert output (the residual stream stays the current token's embedding), and
    an lm_head whose row for each scripted token points at its predecessor's normalised embedding."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = {name: t for file in files for name, t in load_file(str(file)).items()}
    embed, norm = tensors["model.embed_tokens.weight"], tensors["model.norm.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    head = torch.zeros_like(tensors["lm_head.weight"])
    for current, following in zip(script, script[1:]):
        head[following] = normed[current] / normed[current].norm()
    tensors["lm_head.weight"] = head
    for name in tensors:
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            tensors[name] = torch.zeros_like(tensors[name])
    for file in files:
        keep = {n: t for n, t in tensors.items() if n in load_file(str(file))}
        save_file(keep, str(file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_gpt_oss")
    tokenizer = Tokenizer.from_pretrained(tiny_models["gpt_oss"], "gpt_oss")
    model = _rewire(tiny_models["gpt_oss"], root / "tiny-gpt-oss", _script(tokenizer))
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
