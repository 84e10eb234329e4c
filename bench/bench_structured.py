"""Structured output's host cost: building a vocabulary's mask index, and the allowed-token mask of
representative grammar states, the first time (computed) and again (cached).

    python bench/bench_structured.py MODEL_OR_TOKENIZER_FOLDER [--width N]

The folder needs a tokenizer.json (a checkpoint folder does). Every mask is checked against the
grammar on a sample of tokens. The figures are wall times on this machine's CPU (one thread): what a
JSON request adds to the engine's step, once per new state and then per token.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from hearth.engine.structured.grammar import Grammar
from hearth.engine.structured.masks import TokenIndex  # noqa: F401  (imports torch before the timing)
from hearth.engine.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "code": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "code", "age", "score", "tags", "kind"],
}
# (label, text read from the start): one state of each kind the mask index handles differently
PREFIXES = [
    ("before the value", ""),
    ("object: first key", '{"'),
    ("string body (free)", '{"name": "Ada Love'),
    ("string body (maxLength)", '{"name": "x", "code": "AB'),
    ("after a backslash", '{"name": "a\\'),
    ("integer with bounds", '{"name": "x", "code": "y", "age": 4'),
    ("number", '{"name": "x", "code": "y", "age": 4, "score": -1.2'),
    ("array: next item", '{"name": "x", "code": "y", "age": 4, "score": 1, "tags": ["a", '),
    ("enum value", '{"name": "x", "code": "y", "age": 4, "score": 1, "tags": [], "kind": '),
]


def _check(index, grammar: Grammar, state, mask, samples: int = 2000) -> None:
    vocabulary = index.vocabulary.grammar
    rng = random.Random(0)
    for token_id in rng.sample(range(index.width), min(samples, index.width)):
        data = vocabulary[token_id] if token_id < len(vocabulary) else None
        expected = bool(data) and grammar.advance_bytes(state, data) is not None
        assert bool(mask[token_id]) == expected, (token_id, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--width", type=int, default=None, help="logits width (default: the vocabulary size)")
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_pretrained(args.folder, model_type="bench")
    width = args.width or tokenizer.vocab_size
    start = time.perf_counter()
    index = tokenizer.token_index(width)
    build = time.perf_counter() - start
    counts = index.counts()
    print(f"vocabulary {tokenizer.vocab_size} tokens, logits width {width}: index built in {build * 1e3:.0f} ms "
          f"({counts['plain']} plain string pieces, {counts['walked_in_strings']} walked inside strings, "
          f"{counts['digits']} digit runs)")
    grammar = Grammar.from_schema(SCHEMA)
    print(f"{'state':<26} {'allowed':>8} {'first ms':>9} {'cached us':>10}")
    for label, text in PREFIXES:
        state = grammar.advance_bytes(grammar.initial, text.encode())
        assert state is not None, label
        start = time.perf_counter()
        mask = index.mask(grammar, state)
        first = time.perf_counter() - start
        repeats = 200
        start = time.perf_counter()
        for _ in range(repeats):
            index.mask(grammar, state)
        cached = (time.perf_counter() - start) / repeats
        _check(index, grammar, state, mask)
        print(f"{label:<26} {int(mask.sum()):>8} {first * 1e3:>9.1f} {cached * 1e6:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
