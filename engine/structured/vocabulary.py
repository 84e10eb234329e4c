"""Each token's bytes, as the answer's text holds them: what the grammar reads when a token is chosen.

Three kinds of vocabularies (told apart by tokenizer.json's decoder):

- byte-level BPE (GPT-2, DeepSeek, Qwen, gpt-oss...): every character of a vocabulary entry stands for
  one byte through GPT-2's byte-to-character table (``Ġ`` is a space); an entry may end in the middle
  of a UTF-8 character.
- SentencePiece-style (Llama 2, Mistral...): ``▁`` is a space and ``<0xNN>`` entries are single bytes
  (byte fallback).
- anything else: the id decoded alone, when that gives whole characters.

Added tokens (specials such as EOS, ``<think>``, chat markers, and added non-special text) never write
into a structured answer (``grammar`` is None for them); ``text`` still has their content, which the
reasoning gates look for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Vocabulary:
    """grammar[i]: the bytes token i writes into an answer (None: it never may); text[i]: the bytes it
    writes into the output text, added and special tokens included."""

    grammar: list[bytes | None]
    text: list[bytes]


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves and
    the other 68 (controls, space, DEL, NBSP, soft hyphen...) for U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return table


def _decoder_kinds(state: Any) -> list[dict[str, Any]]:
    if not isinstance(state, dict):
        return []
    if state.get("type") == "Sequence":
        return [d for member in state.get("decoders", []) for d in _decoder_kinds(member)]
    return [state]


def read_vocabulary(backend: RustTokenizer) -> Vocabulary:
    """The ``Vocabulary`` of a ``tokenizers`` tokenizer (a second or so for 150K entries)."""
    vocab = backend.get_vocab(with_added_tokens=False)
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    size = max([*vocab.values(), *added, -1]) + 1
    decoder = backend.decoder
    kinds = _decoder_kinds(json.loads(decoder.__getstate__())) if decoder is not None else []
    types = {k.get("type") for k in kinds}
    grammar: list[bytes | None] = [None] * size
    if "ByteLevel" in types:
        table = byte_level_table()
        for entry, i in vocab.items():
            if all(c in table for c in entry):
                grammar[i] = bytes(table[c] for c in entry)
    elif "Metaspace" in types or any(k.get("type") == "Replace" for k in kinds):
        space = next((k.get("replacement", "\u2581") for k in kinds if k.get("type") == "Metaspace"), "\u2581")
        byte_fallback = "ByteFallback" in types
        for entry, i in vocab.items():
            match = _BYTE_FALLBACK.fullmatch(entry) if byte_fallback else None
            grammar[i] = bytes((int(match.group(1), 16),)) if match else entry.replace(space, " ").encode()
    else:
        for i in vocab.values():
            text = backend.decode([i], skip_special_tokens=False)
            grammar[i] = text.encode() if "\ufffd" not in text else None
    text = [b if b is not None else b"" for b in grammar]
    for i, content in added.items():
        grammar[i] = None
        text[i] = content.encode()
    return Vocabulary(grammar, text)
