"""The sandboxed Jinja chat-template renderer, chat prompts of every tiny model family, content given
as text parts, and prompts that continue the last message (vLLM's ``continue_final_message``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearth.engine.api import HearthError, RequestError
from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer
from hearth.engine.text.chat_template import render_chat_template
from hearth.engine.text.tokenizer import Tokenizer

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
    "glm4_moe": "[gMASK]<sop><|system|>\nBe brief.<|user|>\nName a colour 🎨/nothink<|assistant|>\n<think></think>"
    "\nBlue.<|user|>\nAnother?/nothink<|assistant|>\n<think></think>",
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


def test_glm45_template_reasoning_tools_and_parts(tmp_path: Path):
    """GLM-4.5's format: content as text parts, the reasoning of turns after the last user turn kept
    (earlier ones emptied), calls as arg_key / arg_value pairs, a run of tool results under one
    <|observation|>, and thinking on when asked (no /nothink, open generation prompt)."""
    write_tiny_tokenizer(tmp_path, "glm4_moe", 400)
    tok = Tokenizer.from_pretrained(tmp_path, "glm4_moe")
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo", "days": 2}}}
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "<think>need the tool</think>", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "cold"},
    ]
    text = tok.apply_chat_template(conversation, enable_thinking=True)
    assert text == ("[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\nHello.<|user|>\nWeather in Oslo?"
                    "<|assistant|>\n<think>need the tool</think>\n<tool_call>weather\n<arg_key>city</arg_key>"
                    "\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
                    "<|observation|>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\ncold\n"
                    "</tool_response><|assistant|>")
    ids = tok.encode_chat(conversation, thinking=True)
    for special in ("<|observation|>", "<tool_call>", "<arg_key>", "<think>"):
        assert ids.count(tok.token_to_id(special)) == text.count(special) > 0
    with pytest.raises(HearthError, match="Unknown message role"):
        tok.encode_chat([{"role": "critic", "content": "x"}])


# --------------------------------------------------------------------------- content parts, continuing

# String operations on content, as Qwen3's template does them ("'list object' has no attribute
# 'startswith'" when content came as a list of parts).
STRING_OPS_TEMPLATE = """\
{%- if messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0].content.strip() + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages if message.role != 'system' -%}
{%- if message.role == 'user' and message.content.startswith('<tool_response>') -%}
{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def test_text_parts_reach_templates_as_one_string():
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_parts = [{"role": "system", "content": _parts("Be brief.")}, {"role": "user", "content": _parts("hi")}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(STRING_OPS_TEMPLATE, as_strings) == expected
    assert render_chat_template(STRING_OPS_TEMPLATE, as_parts) == expected
    several = [{"role": "user", "content": _parts("one", "two")}]
    assert render_chat_template(STRING_OPS_TEMPLATE, several, add_generation_prompt=False) == \
        "<|im_start|>user\none\ntwo<|im_end|>\n"  # joined with newlines, as vLLM joins them


def _tokenizer(tmp_path: Path, family: str) -> Tokenizer:
    write_tiny_tokenizer(tmp_path, family, 400)
    return Tokenizer.from_pretrained(tmp_path, family)


def test_continue_final_message_ends_the_prompt_inside_the_last_message(tmp_path: Path):
    tok = _tokenizer(tmp_path, "glm_moe_dsa")
    started = [*USER, {"role": "assistant", "content": "Blue and "}]
    assert tok.chat_prompt(started, continue_final_message=True) == "[gMASK]<sop><|user|>\nhi<|assistant|>\nBlue and "
    assert tok.chat_prompt(USER, add_generation_prompt=False) == "[gMASK]<sop><|user|>\nhi"
    parts = [*USER, {"role": "assistant", "content": _parts("Blue", "and")}]
    assert tok.chat_prompt(parts, continue_final_message=True).endswith("<|assistant|>\nBlue\nand")


def test_continue_final_message_with_a_template_that_strips_the_text(tmp_path: Path):
    tok = _tokenizer(tmp_path, "glm_moe_dsa")
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
    started = [*USER, {"role": "assistant", "content": "  Blue and  "}]
    assert tok.chat_prompt(started, continue_final_message=True) == "<user>hi</user><assistant>Blue and"
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}"
    with pytest.raises(RequestError, match="does not keep the last message's text") as err:
        tok.chat_prompt(started, continue_final_message=True)
    assert err.value.param == "continue_final_message"


def test_deepseek_v32_continues_the_final_message_and_keeps_its_assistant_prefix(tmp_path: Path):
    tok = _tokenizer(tmp_path, "deepseek_v32")
    started = [*USER, {"role": "assistant", "content": "Blue and "}]
    assert tok.chat_prompt(started, continue_final_message=True) == \
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>Blue and "
    whole = [*USER, {"role": "assistant", "content": "Blue."}]
    assert tok.chat_prompt(whole, add_generation_prompt=False).endswith("</think>Blue.<｜end▁of▁sentence｜>")
    with pytest.raises(RequestError, match="add_generation_prompt=false works only after an assistant") as err:
        tok.chat_prompt(USER, add_generation_prompt=False)
    assert err.value.param == "add_generation_prompt"


@pytest.mark.parametrize("messages", [USER, [*USER, {"role": "assistant", "content": " "}],
                                      [*USER, {"role": "assistant", "content": None}]])
def test_continue_final_message_needs_assistant_text_last(tmp_path: Path, messages):
    tok = _tokenizer(tmp_path, "glm_moe_dsa")
    with pytest.raises(RequestError, match="continue_final_message needs") as err:
        tok.chat_prompt(messages, continue_final_message=True)
    assert err.value.param == "continue_final_message"
