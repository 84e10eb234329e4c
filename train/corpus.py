"""The demo model's training corpus: Python's documentation as plain English, a tokenizer, token ids.

    python -m train.corpus --docs DIR/_sources --out .corpus [--vocab 4096]

``DIR/_sources`` is the reStructuredText of the Python documentation as Debian's ``python3.11-doc``
ships it (``scripts/fetch_corpus.sh`` extracts it). The reST is reduced to prose: code blocks,
doctests, tables, index and toctree directives are dropped, roles and inline markup become their
text, paragraphs are re-flowed onto one line each. The folder written holds:

- ``corpus.txt``: the plain text, one section per record, records separated by a form feed;
- ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE trained on it with DeepSeek-V3.2's
  special tokens at their ids (``<｜begin▁of▁sentence｜>`` 0, ``<｜end▁of▁sentence｜>`` 1, ...);
- ``tokens.npy``: uint16 ids of the whole stream. Each section is ``BOS text EOS``; every
  ``CHAT_EVERY``-th section with a title is instead written as a one-turn chat in the V3.2 prompt
  format (``BOS <｜User｜>title<｜Assistant｜></think>text EOS``) so the model also answers after a
  chat prompt.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)
CHAT_EVERY = 8
RECORD_SEP = "\f"
# Whole files that are lists, indexes or legal text rather than prose.
SKIP_FILES = ("whatsnew/changelog", "license", "copyright", "contents", "bugs", "about", "glossary")
# Directives whose indented body is prose worth keeping; every other directive's body is dropped.
KEEP_BODY = frozenset({
    "note", "warning", "important", "tip", "caution", "attention", "seealso", "versionadded",
    "versionchanged", "deprecated", "deprecated-removed", "impl-detail", "function", "method", "class",
    "attribute", "data", "exception", "decorator", "decoratormethod", "classmethod", "staticmethod",
    "describe", "option", "envvar", "module", "opcode", "cmdoption", "abstractmethod", "coroutinefunction",
    "coroutinemethod", "availability", "admonition", "topic", "sidebar", "rubric", "only", "glossary",
    "c:function", "c:type", "c:macro", "c:member", "c:var", "c:struct", "audit-event",
})
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`:._])\1{2,}\s*$")
_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`__?")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_TITLE_REF = re.compile(r"`([^`]+)`")
_SUBST = re.compile(r"\|(\w[\w -]*)\|")


def _role_text(match: re.Match[str]) -> str:
    text = match.group(1)
    labelled = re.match(r"^(.*?)\s*<[^>]*>$", text, re.S)
    if labelled and labelled.group(1):
        return labelled.group(1)
    text = text.lstrip("!~")
    return text.rsplit(".", 1)[-1] if match.group(0).startswith(":") and "~" in match.group(0) else text


def inline_text(line: str) -> str:
    """Inline reST markup -> its visible text (roles, links, literals, emphasis, substitutions)."""
    line = _ROLE.sub(_role_text, line)
    line = _LINK.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = _LITERAL.sub(r"\1", line)
    line = _EMPH.sub(r"\1", line)
    line = _TITLE_REF.sub(r"\1", line)
    line = _SUBST.sub(r"\1", line)
    return line.replace("\\", "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _paragraphs(lines: list[str]) -> Iterator[list[str]]:
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield block
            block = []
    if block:
        yield block


def rst_to_sections(src: str) -> list[tuple[str, str]]:
    """(title, prose) per section of one reST document; prose paragraphs are one line each."""
    lines = src.expandtabs(4).splitlines()
    kept: list[str] = []
    i = 0
    drop_indent: int | None = None  # drop lines indented deeper than this (a dropped block's body)
    literal_next = False
    while i < len(lines):
        line = lines[i]
        i += 1
        if drop_indent is not None:
            if not line.strip() or _indent(line) > drop_indent:
                continue
            drop_indent = None
        if literal_next and line.strip():
            literal_next = False
            drop_indent = _indent(kept[-1]) if kept else 0
            if _indent(line) > drop_indent:
                continue
            drop_indent = None
        directive = _DIRECTIVE.match(line)
        if directive:
            indent, name, argument = len(directive.group(1)), directive.group(2), directive.group(3)
            if name in KEEP_BODY:
                if argument and name not in ("only", "availability", "audit-event", "versionadded",
                                             "versionchanged", "deprecated", "deprecated-removed"):
                    kept.append(" " * indent + argument)
                    kept.append("")
                while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > indent:
                    i += 1  # directive options
            else:
                drop_indent = indent
            continue
        stripped = line.strip()
        if stripped.startswith(".."):  # comments and link targets, with their indented bodies
            drop_indent = _indent(line)
            continue
        if stripped.startswith((">>>", "+--", "+==")) or re.match(r"^=+\s+=+", stripped):
            while i < len(lines) and lines[i].strip():  # doctests and tables: skip the paragraph
                i += 1
            continue
        if stripped.endswith("::"):
            literal_next = True
            line = line.rstrip()[:-2].rstrip()
            if line.strip():
                line += ":"
        kept.append(line)
    return _sections(kept)


def _sections(lines: list[str]) -> list[tuple[str, str]]:
    sections: list[tuple[str, list[str]]] = [("", [])]
    for n, line in enumerate(lines):
        nxt = lines[n + 1] if n + 1 < len(lines) else ""
        if _UNDERLINE.match(line.strip()) and line.strip():
            continue  # over/underlines of titles
        if line.strip() and _UNDERLINE.match(nxt.strip()) and len(nxt.strip()) >= len(line.strip()) - 2:
            sections.append((inline_text(line.strip()), []))
            continue
        sections[-1][1].append(line)
    out = []
    for title, body in sections:
        paras = [" ".join(inline_text(x.strip()) for x in p) for p in _paragraphs(body)]
        paras = [re.sub(r"\s+", " ", p).strip() for p in paras]
        paras = [p for p in paras if len(p) > 2 and sum(c.isalpha() for c in p) > 0.5 * len(p)]
        if paras:
            out.append((title, "\n\n".join(paras)))
    return out


def read_docs(root: Path) -> list[tuple[str, str]]:
    """All sections of all ``*.rst.txt`` files under ``root``, in sorted file order."""
    sections = []
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix().removesuffix(".rst.txt")
        if rel in SKIP_FILES or rel.startswith("includes/"):
            continue
        sections.extend(rst_to_sections(path.read_text(encoding="utf-8", errors="replace")))
    return sections


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the DeepSeek-V3.2 special tokens at ids 0..5."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:  # every id the embedding has must decode
        tokenizer.add_special_tokens([f"<｜reserved_{i}｜>" for i in range(missing)])
    for i, token in enumerate(SPECIALS):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} did not get id {i}")
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json: no chat template (Hearth's V3.2 encoder builds chat prompts)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
            "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": 131072}


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def records(sections: list[tuple[str, str]]) -> list[str]:
    """Training records with their special tokens: plain sections and every CHAT_EVERY-th as a chat turn."""
    out = []
    for n, (title, text) in enumerate(sections):
        if title and n % CHAT_EVERY == 0:
            out.append(f"{BOS}{USER}{title}{ASSISTANT}{END_THINK}{text}{EOS}")
        else:
            out.append(f"{BOS}{title + chr(10) + chr(10) if title else ''}{text}{EOS}")
    return out


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All records tokenised and concatenated: uint16 [num_tokens]."""
    ids = [np.asarray(enc.ids, dtype=np.uint16) for enc in tokenizer.encode_batch(texts)]
    return np.concatenate(ids)


def build(docs: Path, out: Path, vocab_size: int = 4096) -> dict:
    """Write corpus.txt, the tokenizer and tokens.npy into ``out``; returns a summary."""
    sections = read_docs(docs)
    if not sections:
        raise SystemExit(f"no *.rst.txt sections under {docs}")
    out.mkdir(parents=True, exist_ok=True)
    plain = [f"{title}\n\n{text}" if title else text for title, text in sections]
    (out / "corpus.txt").write_text(RECORD_SEP.join(plain), encoding="utf-8")
    tokenizer = train_tokenizer(plain, vocab_size)
    write_tokenizer(tokenizer, out)
    tokens = encode_stream(tokenizer, records(sections))
    np.save(out / "tokens.npy", tokens)
    summary = {"sections": len(sections), "chars": sum(len(p) for p in plain), "tokens": int(tokens.size),
               "vocab_size": vocab_size}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, required=True, help="the _sources folder of the Python docs")
    parser.add_argument("--out", type=Path, default=Path(".corpus"))
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.docs, args.out, args.vocab)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
