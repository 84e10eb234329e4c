"""Tiny trained tokenizers for test and demo checkpoints.

``write_tiny_tokenizer`` trains a byte-level BPE (``tokenizers`` library) on a few paragraphs of
original prose kept in this module and writes a Hugging Face-style tokenizer folder with the special
tokens and chat format of one model family:

- ``deepseek_v32``: ``<｜begin▁of▁sentence｜>`` = 0, ``<｜end▁of▁sentence｜>`` = 1, ``<｜User｜>``,
  ``<｜Assistant｜>``, ``<think>``, ``</think>``; no Jinja template (the V3.2 encoder is used).
- ``deepseek_v3`` / ``deepseek_v2``: BOS/EOS, ``<｜User｜>``, ``<｜Assistant｜>`` and a DeepSeek-V3-style
  template.
- ``glm_moe_dsa``: ``<|endoftext|>``, ``[gMASK]``, ``<sop>``, ``<|system|>``, ``<|user|>``,
  ``<|assistant|>``, ``<|observation|>``, ``<think>``, ``</think>`` and a GLM-style template.
- ``glm4_moe``: the same specials; ``<think>``, ``</think>`` and GLM-4.5's tool tokens
  (``<tool_call>``, ``<arg_key>``, ``<arg_value>``, ``<tool_response>``...) as added tokens that are
  not special (decoded text keeps them); and a template in the shape GLM-4.5 ships: content given
  as a string or as text parts, ``/nothink`` and an empty ``<think></think>`` when thinking is off,
  the reasoning of assistant turns after the last user turn kept, tool calls as ``<arg_key>`` /
  ``<arg_value>`` pairs, tool results under one ``<|observation|>``.
- ``gpt_oss``: the harmony markers (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
  ``<|return|>``, ``<|call|>``...) and a harmony template: reasoning goes to the ``analysis`` channel,
  the answer to ``final``; generation ends at ``<|return|>`` or ``<|call|>``.

The vocabulary is always **exactly** ``vocab_size`` ids (specials + 256 byte tokens + merges): when
the text runs out of merges the rest is filled with reserved special tokens, so every id a model with
that embedding size can emit decodes. Same inputs give byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_BYTE_ALPHABET = 256

CORPUS = """\
The kettle on the hearth began to sing a little before dawn, and the house woke around it. Mira
pulled on her wool socks, counted the cups on the shelf, and decided that four would be enough for
the morning. Her brother was still asleep upstairs; the dog was not. He sat by the door with the
patience of an animal who knows that sooner or later every door opens.

Outside, the frost had drawn ferns on the window glass. The garden looked smaller in winter, as if
the snow had folded it up and put it away for later. A row of cabbages stood in the white like a
line of old men waiting for a bus. Beyond the fence the river ran dark and quick, and the mill
wheel turned with a slow wooden groan that the whole valley had stopped hearing years ago.

When the tea was ready she carried a cup to the table and opened the notebook where she wrote down
the weather. Monday: clear, cold, wind from the north. Tuesday: grey, a little rain after noon.
Wednesday: snow, about two inches, soft and dry. She liked the small discipline of it. Numbers made
the days feel less alike, and the notebook had become a kind of calendar that only she could read.

Her grandfather had kept the same kind of book for forty years. He used to say that a person who
watches the sky every morning learns more than the names of clouds. You learn that nothing stays,
he said, and that nothing is ever completely new either. The same storms come back, wearing
different coats. Mira had thought that was a sad idea when she was small. Now she found it calming.

By seven the light had turned from blue to pale gold, and the first cart came down the lane with
milk and bread and the newspaper folded under a sack of flour. The driver waved without stopping.
The dog barked twice, to show that he had noticed, and then lay down again with a sigh. Mira took
the bread inside, cut two thick slices, and set them near the fire to warm.

Later there would be work: wood to split, a fence post to mend, letters to answer, a long list of
small repairs that never seemed to grow shorter. But for the moment there was only the tea, the
bread, the ticking clock, and the quiet question of what the day would bring. She wrote one more
line in the notebook before she closed it. Thursday: bright and very still. A good day to begin.

In the afternoon her brother came down at last, rubbing his eyes and asking whether anyone had seen
his gloves. Nobody had. They searched the coats by the door, the basket of hats, the pockets of the
old jacket that hung there for no reason anyone could remember. In the end the dog had them, of
course, curled under his chin like a treasure. Questions, answers, small mysteries solved before
supper: that was how most days went, and it was enough. Numbers like 12, 365 and 2048 appeared in
her sums; symbols such as +, -, =, ?, !, (, ), [, ], {, } and quotes "like these" did too.

That evening the wind turned west and brought the smell of rain. They sat by the fire and played
cards, badly, while the clock argued with the kettle about what time it was. Her brother told the
story of the winter the river froze so hard that the baker drove his cart across it, and Mira
pretended, as she always did, that she had never heard it before. The fire settled into red coals.
One by one the lamps went out, and the old house creaked and sighed and held them all until morning.
"""

_DSV3_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages if message['role'] == 'system' -%}
{%- set ns.system = ns.system + message['content'] -%}
{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}
{{- '<｜User｜>' + message['content'] -}}
{%- elif message['role'] == 'assistant' -%}
{{- '<｜Assistant｜>' + (message['content'] or '') + eos_token -}}
{%- elif message['role'] != 'system' -%}
{{- raise_exception('Only system, user and assistant messages are supported.') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<｜Assistant｜>' -}}
{%- endif -%}
"""

_GLM_TEMPLATE = """\
[gMASK]<sop>
{%- for message in messages -%}
{%- set role = 'observation' if message['role'] == 'tool' else message['role'] -%}
{%- if role not in ['system', 'user', 'assistant', 'observation'] -%}
{{- raise_exception('Unknown message role: ' + role) -}}
{%- endif -%}
{{- '<|' + role + '|>\\n' + (message['content'] or '') -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' -}}
{%- if enable_thinking is defined and not enable_thinking -%}
{{- '\\n<think></think>' -}}
{%- endif -%}
{%- endif -%}
"""

# The harmony format: every message is <|start|>{role}[<|channel|>{channel}]<|message|>{text}<|end|>.
# Reasoning of assistant turns after the last user message is kept (the analysis channel), earlier
# reasoning is dropped, as the gpt-oss release does.
_HARMONY_TEMPLATE = """\
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}
{{- '<|start|>system<|message|>Reasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final.'
    + ' Channel must be included for every message.<|end|>' -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages if message['role'] == 'user' -%}
{%- set ns.last_user = loop.index0 -%}
{%- endfor -%}
{%- set ns.seen_users = 0 -%}
{%- for message in messages -%}
{%- if message['role'] in ['system', 'developer'] -%}
{{- '<|start|>developer<|message|># Instructions\n\n' + message['content'] + '<|end|>' -}}
{%- elif message['role'] == 'user' -%}
{%- set ns.seen_users = ns.seen_users + 1 -%}
{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' -}}
{%- elif message['role'] == 'assistant' -%}
{%- set reasoning = message.get('reasoning_content') or message.get('thinking') -%}
{%- if reasoning and ns.seen_users > ns.last_user -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}
{%- endif -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + (message['content'] or '') + '<|end|>' -}}
{%- else -%}
{{- raise_exception('Unknown message role: ' + message['role']) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start|>assistant' -}}
{%- endif -%}
"""


_GLM45_TEMPLATE = """\
[gMASK]<sop>
{%- if tools -%}
{{- '<|system|>\\n# Tools\\n\\nFunctions you may call, one JSON signature per line:\\n<tools>\\n' -}}
{%- for tool in tools -%}
{{- (tool.function if tool.function is defined else tool) | tojson(ensure_ascii=False) + '\\n' -}}
{%- endfor -%}
{{- '</tools>\\n\\nWrite each call as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>'
    '...</tool_call>.' -}}
{%- endif -%}
{%- macro text_of(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- elif part is string -%}{{- part -}}{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}
{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- set no_thinking = enable_thinking is defined and not enable_thinking -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set text = text_of(m.content) -%}
{%- if m.role == 'system' -%}
{{- '<|system|>\\n' + text -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>\\n' + text -}}
{{- '/nothink' if no_thinking and not text.endswith('/nothink') else '' -}}
{%- elif m.role == 'assistant' -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
{%- set text = text.split('</think>')[-1] -%}
{%- endif -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > ns.last_user and reasoning.strip() -%}
{{- '\\n<think>' + reasoning.strip() + '</think>' -}}
{%- else -%}
{{- '\\n<think></think>' -}}
{%- endif -%}
{%- if text.strip() -%}{{- '\\n' + text.strip() -}}{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>' + call.name -}}
{%- if call.arguments is mapping -%}
{%- for key, value in call.arguments.items() -%}
{{- '\\n<arg_key>' + key + '</arg_key>\\n<arg_value>' -}}
{{- value if value is string else value | tojson(ensure_ascii=False) -}}
{{- '</arg_value>' -}}
{%- endfor -%}
{%- elif call.arguments -%}
{{- '\\n' + call.arguments -}}
{%- endif -%}
{{- '\\n</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' -}}
{%- else -%}
{{- raise_exception('Unknown message role: ' + m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' + ('\\n<think></think>' if no_thinking else '') -}}
{%- endif -%}
"""


@dataclass(frozen=True)
class _Family:
    specials: tuple[str, ...]
    bos: str | None
    eos: tuple[str, ...]  # the first is tokenizer_config's eos_token
    pad: str
    template: str | None
    reserved: str  # pattern for filler tokens, with {i}
    # Added tokens that are not special: decoded text keeps them, as the real tokenizers do for
    # GLM-4.5's reasoning and tool-call markers (so answers show them and tool calls can be parsed).
    visible: tuple[str, ...] = ()


_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DS_V3 = _Family(
    specials=(_DS_BOS, _DS_EOS, "<｜User｜>", "<｜Assistant｜>"),
    bos=_DS_BOS,
    eos=(_DS_EOS,),
    pad=_DS_EOS,
    template=_DSV3_TEMPLATE,
    reserved="<｜reserved_{i}｜>",
)
_FAMILIES: dict[str, _Family] = {
    "deepseek_v32": _Family(
        specials=(_DS_BOS, _DS_EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        bos=_DS_BOS,
        eos=(_DS_EOS,),
        pad=_DS_EOS,
        template=None,
        reserved="<｜reserved_{i}｜>",
    ),
    "deepseek_v3": _DS_V3,
    "deepseek_v2": _DS_V3,
    "glm_moe_dsa": _Family(
        specials=(
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<think>",
            "</think>",
        ),
        bos=None,
        eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
        pad="<|endoftext|>",
        template=_GLM_TEMPLATE,
        reserved="<|reserved_{i}|>",
    ),
    "glm4_moe": _Family(
        specials=(
            "<|endoftext|>",
            "[MASK]",
            "[gMASK]",
            "[sMASK]",
            "<sop>",
            "<eop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
        ),
        bos=None,
        eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
        pad="<|endoftext|>",
        template=_GLM45_TEMPLATE,
        reserved="<|reserved_{i}|>",
        visible=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    "gpt_oss": _Family(
        specials=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>"),
        bos="<|startoftext|>",
        eos=("<|return|>", "<|endoftext|>", "<|call|>"),
        pad="<|endoftext|>",
        template=_HARMONY_TEMPLATE,
        reserved="<|reserved_{i}|>",
    ),
}


def _train(family: _Family, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(family.visible),
        min_frequency=1,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    tokenizer.add_tokens(list(family.visible))
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens([family.reserved.format(i=i) for i in range(missing)])
    return tokenizer


def _synthetic(family: _Family, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly vocab_size ids whose merges build lowercase words (a, b, .., aa,
    ab, .., aaa, ..): every id decodes to visible text, so a random model at a release's vocabulary
    size streams real characters (benchmarks). No training: the vocabulary is constructed. The
    family's specials and visible added tokens (GLM-4.5's reasoning and tool markers) come last."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    merges: list[tuple[str, str]] = []
    need = vocab_size - len(vocab) - len(family.specials) - len(family.visible)
    letters = "abcdefghijklmnopqrstuvwxyz"
    frontier = list(letters)
    while len(merges) < need:
        grown = []
        for prefix in frontier:
            for c in letters:
                if len(merges) == need:
                    break
                vocab[prefix + c] = len(vocab)
                merges.append((prefix, c))
                grown.append(prefix + c)
        frontier = grown
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(family.specials))
    tokenizer.add_tokens(list(family.visible))
    return tokenizer


def _tokenizer_config(family: _Family) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos,
        "eos_token": family.eos[0],
        "pad_token": family.pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }


def write_tiny_tokenizer(out_dir: Path, model_type: str, vocab_size: int, synthetic: bool = False) -> dict:
    """Train (with ``synthetic``: construct, see :func:`_synthetic`) and write ``tokenizer.json``,
    ``tokenizer_config.json`` (and ``chat_template.jinja`` where the family has one) into ``out_dir``;
    the vocabulary has exactly ``vocab_size`` ids.

    Returns ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` for config.json /
    generation_config.json (``eos_token_id`` is a list for GLM; ``bos_token_id`` is None for GLM,
    which has no BOS token).
    """
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"no tiny tokenizer for model_type {model_type!r}; known: {sorted(_FAMILIES)}")
    minimum = _BYTE_ALPHABET + len(family.specials) + len(family.visible)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} for {model_type} (256 bytes + specials)")
    tokenizer = _synthetic(family, vocab_size) if synthetic else _train(family, vocab_size)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("tiny tokenizer vocabulary does not have the requested size")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = json.dumps(_tokenizer_config(family), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    if family.template is not None:
        (out_dir / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    eos_ids = [tokenizer.token_to_id(t) for t in family.eos]
    return {
        "bos_token_id": None if family.bos is None else tokenizer.token_to_id(family.bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": tokenizer.token_to_id(family.pad),
    }
