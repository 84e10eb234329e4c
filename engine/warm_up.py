"""The engine's warm-up: synthetic requests run before the first user request.

The first request an engine serves pays one-time costs no later one does: Triton compiles (or loads
from its cache) the prefill and decode kernels, each decode batch bucket's CUDA graph is captured
(hearth.engine.cuda_graphs, or its pieces: hearth.engine.piecewise), the caching allocator grows its
pools, cuBLAS initialises and picks its algorithms. On the H200 that was ~1.4 s on the follow-up turn
of a 64K-token chat sent the moment a restarted engine host was ready, and 4-8 s on a first request
after start. ``Engine.warm_up`` pays them at start-up instead, by running the requests planned here
through the engine's ordinary scheduler and step loop, so whatever the configuration composes
(overlapped decode, the runahead scheduler, tiers, offloaded experts, MLI) runs as it will for users.

The rounds (``warm_up_rounds``), each run to its end before the next:

1. one prompt of a few cache pages and an odd remainder: a prefill (in chunks if it is longer than
   ``max_num_batched_tokens``), then decode steps at batch 1;
2. that prompt extended by about a page (where the context has room): its full pages come from the
   prefix cache and the rest is a prefill chunk attending to cached context, the path of a chat's next
   turn; then batch-1 decode;
3. one prompt each of an eighth, a quarter, half and a whole prefill chunk (``Limits.chunk_tokens``) and an odd
   remainder (where the context has room; 259 / 515 / 1,027 / 2,051 tokens at the defaults), one after another:
   the prefill kernels at each size class (GEMMs, the fused MoE's larger tiles, sparse attention over a context
   longer than the indexer's top-k), which a user's first long prompt would otherwise compile (on the H200 with
   an empty Triton cache, 2026-12-04: about 7 s with every expert on the GPU; with experts in RAM, where this
   round was not run then, the first 2K-token prompt took 5.2 s against 0.42 s for the next);
4. for each larger decode batch bucket up to ``max_num_seqs``, that many short prompts decoded
   together, so every bucket's decode graph is captured before a user's request needs it.

After the rounds, an engine with a runahead decoder captures its expert micro-step at every pair bucket
(``RunaheadDecoder.warm_up``): the rounds decode with sync steps (auto's gate has measured nothing yet), so
the decoder's own graph, one per bucket of (request, expert) pairs, would otherwise be recorded (and the
fused MoE kernel compiled at its tile sizes) in the first runahead rounds a user's requests run.

Each request is greedy, ignores EOS and answers ``ANSWER_TOKENS`` tokens: its first from the prefill,
then a synchronous decode step and overlapped ones (``EngineConfig.overlap_decode``). With experts in RAM
the rounds copy no expert (``ExpertCache.dry_copies``): every fetch, stream and expert kernel runs as for a
user, on whatever the cache's slots hold, so round 3's prompts (which route to every expert of every layer)
cost compute only, not the seconds of a large model's experts streamed over the link. What the engine does
so that none of it shows afterwards is ``Engine.warm_up``'s doc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hearth.engine.cuda_graphs import batch_buckets
from hearth.engine.text.tokenizer import Tokenizer

ANSWER_TOKENS = 4  # the prefill's token, one synchronous decode step and two overlapped ones
CONVERSATION = "hearth.warm-up"  # tags the warm-up's cache pages, which it forgets at the end
_TEXT = "Hearth warms its engine up: kernels compile and decode graphs are recorded before anyone asks."
_FULL_PAGES = 2  # the first prompt's whole pages (the second prompt finds them in the prefix cache)
_REMAINDER = 3  # and the odd tokens after them
_EXTENSION = 2  # the second prompt adds a page and this many tokens to the first
_SHORT = 5  # tokens of each prompt in the batch rounds
# Round 3's prompts: an eighth, a quarter, half and all of a prefill chunk (and _REMAINDER): the kernels' tile
# choices change with a step's tokens (the fused MoE's 16 / 32 / 64-row tiles at 16 / 32 / 64 tokens an expert:
# 512 / 1,024 / 2,048 tokens at DeepSeek's 8 of 256 experts; sparse MLA's split plan by rows).
_CHUNK_PARTS = (8, 4, 2, 1)


@dataclass(frozen=True)
class Limits:
    """What bounds the warm-up's prompts: the engine's page size, context, cache and batch."""

    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_seqs: int
    chunk_tokens: int = 0  # prompt tokens a step reads: round 3 warms an eighth of it up to all of it; 0: no round 3


def warm_up_rounds(token_ids: Sequence[int], limits: Limits) -> list[list[list[int]]]:
    """The warm-up's rounds of prompts (the module doc), made of ``token_ids`` (any non-empty run of
    the model's token ids, cycled as needed), each prompt short enough to be served with its answer."""
    if not token_ids:
        raise ValueError("the warm-up needs at least one token id")
    size = limits.block_size
    # The longest prompt that leaves room for its answer (in the context and in the cache's pages).
    room = max(1, min(limits.max_model_len, limits.num_blocks * size) - ANSWER_TOKENS - 1)
    first = min(_FULL_PAGES * size + _REMAINDER, max(1, room // 2))
    second = min(first + size + _EXTENSION, room)
    long_prompt = _cycled(token_ids, max(first, second), offset=0)
    rounds = [[long_prompt[:first]]]
    if second > first:  # (else the context is too short to extend a prompt at all)
        rounds.append([long_prompt])
    if limits.chunk_tokens:  # (each read whole: the engine drops the warm-up's cached pages after round 2)
        lengths = sorted({min(limits.chunk_tokens // part + _REMAINDER, room) for part in _CHUNK_PARTS})
        rounds += [[_cycled(token_ids, length, offset=2)] for length in lengths if length > second]
    short = min(_SHORT, room)
    for batch in batch_buckets(limits.max_num_seqs):
        if batch > 1:  # (batch 1 decoded in the rounds before)
            rounds.append([_cycled(token_ids, short, offset=1 + i) for i in range(batch)])
    return rounds


def _cycled(token_ids: Sequence[int], length: int, offset: int) -> list[int]:
    """``length`` ids of ``token_ids`` read in a loop from ``offset`` (prompts of a round differ)."""
    return [token_ids[(offset + i) % len(token_ids)] for i in range(length)]


def warm_up_token_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """The ids the warm-up's prompts are made of: the tokenizer's ids of a plain sentence (real tokens,
    which the detokenizer knows) that the model's vocabulary holds, or id 0 if none does."""
    return [t for t in tokenizer.encode(_TEXT, add_special_tokens=False) if 0 <= t < vocab_size] or [0]
