"""The sandboxed Jinja chat-template renderer, and chat prompts of every tiny model family."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearth.engine.api import HearthError
from hearth.engine.chat_template import render_chat_template
from hearth.engine.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hi"}]


def test_basic_variables():
    source = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m.content }}{% endfor %}"
    source += "{% if add_generation_prompt %}<gen>{% endif %}{{ eos_token }}"
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render_chat_template(source, USER, special_tokens=tokens) == "<s><user>hi<gen></s>"
    out = render_chat_template(source, USER, add_generation_prompt=False, special_tokens=tokens)
    assert out == "<s><user>hi</s>"


def test_raise_exception_becomes_hearth_error():
    source = "{% if messages[0]['role'] != 'system' %}"
    source += "{{ raise_exception('System first, please!') }}{% endif %}"
    with pytest.raises(HearthError, match="System first, please!"):
        render_chat_template(source, USER)


def test_tojson_keeps_non_ascii_and_takes_options():
    source = "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}"
    tools = [{"name": "météo"}]
    out = render_chat_template(source, [{"role": "user", "content": "日本 é"}], tools=tools)
    assert out == '{"role": "user", "content": "日本 é"}|[\n  {\n    "name": "météo"\n  }\n]'


def test_tools_default_to_none_and_extra_variables_pass_through():
    source = "{{ tools is none }} {{ thinking }} {{ bos_token }}"
    out = render_chat_template(source, USER, special_tokens={"bos_token": "B"}, thinking=True)
    assert out == "True True B"


def test_strftime_now_and_loopcontrols():
    source = "{{ strftime_now('%Y') | length }}"
    source += "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}"
    source += "{% endif %}{{ i }}{% endfor %}"
    assert render_chat_template(source, USER) == "402"


def test_trim_and_lstrip_blocks():
    source = "A\n  {% if true %}\nB\n  {% endif %}\nC"
    assert render_chat_template(source, USER) == "A\nB\nC"


def test_generation_tag_renders_its_body():
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat_template(source, USER) == "[hi]"


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{% if %}", "syntax error"),
        ("{{ messages.__class__.__mro__ }}", "chat template failed"),
        ("{{ messages.append(1) }}", "chat template failed"),
        ("{{ 1 / 0 }}", "chat template failed"),
        ("{{ undefined_thing.attr }}", "chat template failed"),
    ],
)
def test_template_errors_are_hearth_errors(source: str, match: str):
    with pytest.raises(HearthError, match=match):
        render_chat_template(source, USER)


# --------------------------------------------------------------------------- tiny families

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour 🎨"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]
EXPECTED = {
    "deepseek_v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Name a colour 🎨<｜Assistant｜>Blue."
    "<｜end▁of▁sentence｜><｜User｜>Another?<｜Assistant｜>",
    "deepseek_v2": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Name a colour 🎨<｜Assistant｜>Blue."
    "<｜end▁of▁sentence｜><｜User｜>Another?<｜Assistant｜>",
    "glm_moe_dsa": "[gMASK]<sop><|system|>\nBe brief.<|user|>\nName a colour 🎨<|assistant|>\nBlue."
    "<|user|>\nAnother?<|assistant|>\n<think></think>",
    "deepseek_v32": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Name a colour 🎨<｜Assistant｜></think>Blue."
    "<｜end▁of▁sentence｜><｜User｜>Another?<｜Assistant｜></think>",
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family_chat_prompt(tmp_path: Path, family: str):
    write_tiny_tokenizer(tmp_path, family, 400)
    tok = Tokenizer.from_pretrained(tmp_path, family)
    assert tok.has_chat_format
    text = tok.apply_chat_template(CONVERSATION, enable_thinking=False)
    assert text == EXPECTED[family]
    ids = tok.encode_chat(CONVERSATION, thinking=False)
    assert tok.decode(ids) == text
    specials = [
        t
        for t in ("<｜User｜>", "<｜Assistant｜>", "<|user|>", "<|assistant|>", "[gMASK]")
        if tok.token_to_id(t) is not None
    ]
    for special in specials:
        assert ids.count(tok.token_to_id(special)) == text.count(special) > 0


def test_tiny_v3_template_rejects_tool_role(tmp_path: Path):
    write_tiny_tokenizer(tmp_path, "deepseek_v3", 320)
    tok = Tokenizer.from_pretrained(tmp_path, "deepseek_v3")
    with pytest.raises(HearthError, match="Only system, user and assistant"):
        tok.encode_chat([{"role": "tool", "content": "42"}])


def test_glm_thinking_switch(tmp_path: Path):
    write_tiny_tokenizer(tmp_path, "glm_moe_dsa", 320)
    tok = Tokenizer.from_pretrained(tmp_path, "glm_moe_dsa")
    assert tok.decode(tok.encode_chat(USER, thinking=True)).endswith("<|assistant|>")
    assert tok.decode(tok.encode_chat(USER, thinking=False)).endswith("<|assistant|>\n<think></think>")
