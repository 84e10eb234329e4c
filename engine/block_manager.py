"""Page allocation for the paged KV caches, with reference counting and prefix caching.

A request's cache lives in fixed-size blocks of ``block_size`` tokens; its block table lists them in
order. The latent cache and the indexer-key cache are indexed by the same block table, so one
``BlockManager`` serves both. This module is pure bookkeeping: it never touches tensors.

Prefix caching. A full block is known by a chained hash of (parent block's hash, its token ids), so
a block's hash names the whole prefix up to and including it, and equal token runs at different
prefixes get different hashes. A later prompt that starts with the same full blocks reuses them
(``allocate`` returns how many prompt tokens were served from cache). Reused blocks are shared
between live requests and reference counted; a block whose last user frees it keeps its hash and
content and stays reusable, on an LRU list, until its memory is needed for a new block.

NOTE: a block is registered for reuse only once its keys are known to be in the cache. A caller
appends a token after the step that computed everything before it (through every layer), so
``append`` first registers the full blocks that lie wholly before the new tokens. A block whose last
token was sampled but never fed back (the request ended right after sampling it) is never
registered. Callers that know more (a finished prefill chunk) may call ``mark_computed`` earlier.
Registering at allocation instead would let a second request read keys not yet written, since
prompts are prefilled in chunks and the runahead scheduler moves requests through layers unevenly.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BlockManager", "hash_block"]


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained content hash of a full block: stable across processes, 128 bits."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache


@dataclass
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the computed full blocks


class BlockManager:
    """Hands out cache blocks to requests (``seq_id``) and reclaims them.

    Questions and actions come in pairs: ask ``can_allocate`` / ``can_append`` first; the actions
    raise ``RuntimeError`` when the caller skipped the question and blocks ran out, and on other
    misuse (allocating a live ``seq_id`` twice, appending to an unknown one).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unused, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unused but cached; oldest first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._seqs: dict[str, _Sequence] = {}

    # ---- questions -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request could take: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seq(seq_id).token_ids)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether ``allocate`` would find enough blocks for this prompt right now."""
        hits = self._prefix_hits(token_ids)
        num_new = self._blocks_for(len(token_ids)) - len(hits)
        num_hits_unused = sum(1 for _, block_id in hits if self._blocks[block_id].ref_count == 0)
        return num_new <= self.num_free_blocks - num_hits_unused

    def can_append(self, seq_id: str, num_new_tokens: int = 1) -> bool:
        return self._blocks_to_grow(self._seq(seq_id), num_new_tokens) <= self.num_free_blocks

    # ---- actions ---------------------------------------------------------------------------

    def allocate(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Give a new request blocks for its prompt; returns the number of leading prompt tokens
        whose cache was reused (whole blocks only, always < len(token_ids))."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        if not self.can_allocate(token_ids):
            raise RuntimeError(f"out of cache blocks for {seq_id!r} (call can_allocate first)")
        hits = self._prefix_hits(token_ids)
        for _, block_id in hits:
            self._take_cached(block_id)
        new_blocks = [self._take_free() for _ in range(self._blocks_for(len(token_ids)) - len(hits))]
        block_table = [block_id for _, block_id in hits] + new_blocks
        seq = _Sequence(list(token_ids), block_table, [block_hash for block_hash, _ in hits])
        self._seqs[seq_id] = seq
        return len(hits) * self.block_size

    def append(self, seq_id: str, new_token_ids: Sequence[int]) -> None:
        """Add tokens to a running request (normally the one it just sampled), growing its block
        table as blocks fill. Everything already in the sequence counts as computed."""
        seq = self._seq(seq_id)
        num_grow = self._blocks_to_grow(seq, len(new_token_ids))
        if num_grow > self.num_free_blocks:
            raise RuntimeError(f"out of cache blocks for {seq_id!r} (call can_append first)")
        self.mark_computed(seq_id, len(seq.token_ids))
        seq.token_ids.extend(new_token_ids)
        seq.block_table.extend(self._take_free() for _ in range(num_grow))

    def mark_computed(self, seq_id: str, num_computed_tokens: int) -> None:
        """Register for reuse every full block within the first ``num_computed_tokens`` tokens,
        which the caller guarantees are in the cache for every layer."""
        seq = self._seq(seq_id)
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            start = index * self.block_size
            block_hash = hash_block(parent, seq.token_ids[start : start + self.block_size])
            seq.block_hashes.append(block_hash)
            self._register(seq.block_table[index], block_hash)

    def free(self, seq_id: str) -> None:
        """Release a request's blocks (no-op for an unknown or already freed ``seq_id``)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Tail blocks first, so LRU eviction drops the ends of prefixes before their beginnings.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    # ---- internals -------------------------------------------------------------------------

    def _seq(self, seq_id: str) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise RuntimeError(f"unknown sequence {seq_id!r}")
        return seq

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_to_grow(self, seq: _Sequence, num_new_tokens: int) -> int:
        return self._blocks_for(len(seq.token_ids) + num_new_tokens) - len(seq.block_table)

    def _prefix_hits(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(hash, block id) of the cached blocks that serve the prompt's leading full blocks,
        leaving at least its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[tuple[int, int]] = []
        parent: int | None = None
        for index in range((len(token_ids) - 1) // self.block_size):
            start = index * self.block_size
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append((parent, block_id))
        return hits

    def _take_cached(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        """An unused block for new content: a never-cached one first, else the least recently
        freed cached one (its hash is forgotten)."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self._blocks[block_id]
            assert block.hash is not None, "evictable blocks are always hashed"
            del self._cached[block.hash]
            block.hash = None
        else:
            raise RuntimeError("out of cache blocks")
        self._blocks[block_id].ref_count = 1
        return block_id

    def _register(self, block_id: int, block_hash: int) -> None:
        block = self._blocks[block_id]
        if block.hash is not None or block_hash in self._cached:
            return  # already registered, or the same content is cached in another block
        block.hash = block_hash
        self._cached[block_hash] = block_id
