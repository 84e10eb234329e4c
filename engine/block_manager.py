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

Lower tiers. With a ``SpillTier`` (``hearth.engine.prefix_store.PageTier``: host RAM, then disk) a
cached block is spilled there when its memory is taken for new content, and a prompt's prefix match
continues there after the device's blocks end: those pages are restored into free blocks at
``allocate`` instead of being recomputed. Spills and restores happen only in ``allocate`` /
``append``, between steps (the tier's copies are ordered before the next forward step).

Conversations. ``allocate`` may name the request's conversation; its registered blocks carry that
tag (into the lower tiers too), and ``drop_conversation`` forgets the conversation's blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BlockManager", "PageHashes", "SpillTier", "common_pages", "hash_block"]

_RECENT_PROMPTS = 16  # prompts whose page hashes PageHashes keeps (~0.5 MB each at 64K tokens)


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained content hash of a full block: stable across processes, 128 bits."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


class PageHashes:
    """Chained hashes of a prompt's full pages (``hash_block``'s values), remembering the last few
    prompts by their first page: a follow-up turn of a chat shares the previous turn's pages, whose
    hashes are reused (after one list comparison in C) instead of recomputed. New pages go to bytes
    together, and each costs one hash of a slice of them."""

    def __init__(self, block_size: int, capacity: int = _RECENT_PROMPTS) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._recent: OrderedDict[tuple[int, ...], tuple[list[int], list[int]]] = OrderedDict()  # first page ->

    def __call__(self, token_ids: Sequence[int], count: int) -> list[int]:
        """The hashes of the first ``count`` full pages of ``token_ids``."""
        if count <= 0:
            return []
        size = self.block_size
        tokens = list(token_ids[:count * size])
        key = tuple(tokens[:size])
        known, known_hashes = self._recent.get(key, ([], []))
        same = common_pages(known, tokens, size)
        hashes = known_hashes[:same]
        parent = hashes[-1] if hashes else None
        values = array("q", tokens[same * size:])
        data = memoryview(values).cast("B")
        page = size * values.itemsize
        for index in range(count - same):
            digest = hashlib.blake2b(digest_size=16)
            digest.update(b"root" if parent is None else parent.to_bytes(16, "little"))
            digest.update(data[index * page:(index + 1) * page])
            parent = int.from_bytes(digest.digest(), "little")
            hashes.append(parent)
        self._recent[key] = (tokens, hashes)
        self._recent.move_to_end(key)
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        return list(hashes)


_SCAN_PAGES = 64  # pages compared at a time by common_pages before it bisects inside a run that differs


def common_pages(a: list[int], b: list[int], size: int) -> int:
    """How many leading whole pages of ``size`` tokens ``a`` and ``b`` share. Runs of ``_SCAN_PAGES``
    pages are compared in order and only the first run that differs is bisected, so the cost is about
    one pass over the shared prefix (a bisection over a 64K-token prompt copied and compared long
    slices ten times: milliseconds per parked chat, on a follow-up's path)."""
    limit = min(len(a), len(b)) // size
    run = _SCAN_PAGES * size
    first = 0  # pages known to match
    while first < limit:
        stop = min(first * size + run, limit * size)
        if a[first * size:stop] != b[first * size:stop]:
            break
        first = stop // size
    else:
        return limit
    lo, hi = first, min(first + _SCAN_PAGES, limit) - 1  # the run differs somewhere: bisect the page count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[first * size:mid * size] == b[first * size:mid * size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SpillTier(Protocol):
    """Where evicted cached blocks go and come back from (see the module doc)."""

    def __contains__(self, block_hash: int) -> bool: ...

    def spill(self, pages: list[tuple[int, int, frozenset[str]]]) -> None:
        """Keep the content of the blocks ``(block id, hash, conversations)`` before they are reused."""

    def restore(self, pages: list[tuple[int, int]]) -> list[frozenset[str]]:
        """Fill the blocks ``(hash, block id)`` in order, stopping at the first it cannot; returns the
        conversations of each block filled."""


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    conversations: set[str] = field(default_factory=set)  # of the requests that used it (while registered)


@dataclass
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the computed full blocks
    conversation: str | None = None
    prompt_hashes: list[int] = field(default_factory=list)  # of the prompt's full pages, known at allocate


class BlockManager:
    """Hands out cache blocks to requests (``seq_id``) and reclaims them.

    Questions and actions come in pairs: ask ``can_allocate`` / ``can_append`` first; the actions
    raise ``RuntimeError`` when the caller skipped the question and blocks ran out, and on other
    misuse (allocating a live ``seq_id`` twice, appending to an unknown one).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: SpillTier | None = None) -> None:
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
        self.tier = tier if enable_prefix_caching else None
        self._spills: list[tuple[int, int, frozenset[str]]] = []  # evicted, not yet handed to the tier
        self.page_hashes = PageHashes(block_size)
        self.hit_tokens = 0  # prompt tokens served from cached blocks, device and lower tiers
        self.restored_tokens = 0  # of those, from the lower tiers

    # ---- questions -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request could take: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def table_view(self, seq_id: str) -> Sequence[int]:
        """The request's block table itself, not a copy (a step's inputs, read at once): it only
        grows while the request lives, and a request allocated again gets a new one."""
        return self._seq(seq_id).block_table

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seq(seq_id).token_ids)

    def can_allocate(self, token_ids: Sequence[int], max_cached: int | None = None) -> bool:
        """Whether ``allocate`` would find enough blocks for this prompt right now."""
        hits, _, _ = self._prefix_hits(token_ids, max_cached)
        return self._fits(len(token_ids), hits)

    def _fits(self, num_tokens: int, hits: list[tuple[int, int]]) -> bool:
        num_new = self._blocks_for(num_tokens) - len(hits)
        num_hits_unused = sum(1 for _, block_id in hits if self._blocks[block_id].ref_count == 0)
        return num_new <= self.num_free_blocks - num_hits_unused

    def can_append(self, seq_id: str, num_new_tokens: int = 1) -> bool:
        return self._blocks_to_grow(self._seq(seq_id), num_new_tokens) <= self.num_free_blocks

    def can_append_each(self, seq_ids: Sequence[str]) -> bool:
        """Whether every one of ``seq_ids`` can grow by one token at the same time."""
        needed = sum(self._blocks_to_grow(self._seq(seq_id), 1) for seq_id in seq_ids)
        return needed <= self.num_free_blocks

    # ---- actions ---------------------------------------------------------------------------

    def allocate(self, seq_id: str, token_ids: Sequence[int], conversation: str | None = None,
                 max_cached: int | None = None) -> int:
        """Give a new request blocks for its prompt; returns the number of leading prompt tokens
        whose cache was reused (whole blocks only, always < len(token_ids), at most ``max_cached``),
        from the device or restored from the lower tier. ``conversation`` tags the blocks the request
        uses. ``max_cached``: the request's state outside the pages (tiered keys, parked between
        turns) covers only that many tokens, so more reused pages would be useless."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        hits, lower, hashes = self._prefix_hits(token_ids, max_cached)
        if not self._fits(len(token_ids), hits):
            raise RuntimeError(f"out of cache blocks for {seq_id!r} (call can_allocate first)")
        for _, block_id in hits:
            self._take_cached(block_id)
        new_blocks = [self._take_free() for _ in range(self._blocks_for(len(token_ids)) - len(hits))]
        seq = _Sequence(list(token_ids), [block_id for _, block_id in hits] + new_blocks,
                        [block_hash for block_hash, _ in hits], conversation, hashes)
        self._seqs[seq_id] = seq
        self._flush_spills()  # before restoring: the blocks restored into may be the ones evicted
        restored = self._restore(seq, list(zip(lower, new_blocks)))
        for block_id in seq.block_table[:len(seq.block_hashes)]:
            self._tag(self._blocks[block_id], conversation)
        self.hit_tokens += len(seq.block_hashes) * self.block_size
        self.restored_tokens += restored * self.block_size
        return len(seq.block_hashes) * self.block_size

    def drop_conversation(self, conversation: str) -> int:
        """Forget the cached blocks of ``conversation`` (those other conversations used too only
        lose its tag); returns how many blocks were forgotten. Requests using them keep running."""
        dropped = 0
        for block_id in list(self._cached.values()):
            block = self._blocks[block_id]
            if conversation not in block.conversations:
                continue
            block.conversations.discard(conversation)
            if not block.conversations:
                self._unregister(block)
                dropped += 1
        return dropped

    def cached_blocks(self) -> list[tuple[int, int, frozenset[str]]]:
        """``(block id, hash, conversations)`` of every registered block (to save them all)."""
        return [(block_id, block_hash, frozenset(self._blocks[block_id].conversations))
                for block_hash, block_id in self._cached.items()]

    def conversations(self) -> set[str]:
        """The conversations with registered blocks on the device."""
        return {c for block_id in self._cached.values() for c in self._blocks[block_id].conversations}

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
        self._flush_spills()

    def set_token(self, seq_id: str, position: int, token_id: int) -> None:
        """Give the token at ``position`` its value: it was appended as a placeholder because the
        step that sampled it had not been read back yet (overlapped decode). Its block must not be
        registered yet: callers mark tokens computed only once their values are set."""
        seq = self._seq(seq_id)
        if position // self.block_size < len(seq.block_hashes):
            raise RuntimeError(f"token {position} of {seq_id!r} is in a registered block")
        seq.token_ids[position] = token_id

    def mark_computed(self, seq_id: str, num_computed_tokens: int) -> None:
        """Register for reuse every full block within the first ``num_computed_tokens`` tokens,
        which the caller guarantees are in the cache for every layer."""
        seq = self._seq(seq_id)
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            if index < len(seq.prompt_hashes):
                block_hash = seq.prompt_hashes[index]
            else:
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                start = index * self.block_size
                block_hash = hash_block(parent, seq.token_ids[start : start + self.block_size])
            seq.block_hashes.append(block_hash)
            self._register(seq.block_table[index], block_hash, seq.conversation)

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

    def _prefix_hits(self, token_ids: Sequence[int],
                     max_cached: int | None = None) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """(hash, block id) of the device's cached blocks that serve the prompt's leading full
        blocks, then the hashes of the blocks after them that the lower tier holds, leaving at
        least the prompt's last token to compute (and at most ``max_cached`` tokens served); and
        the hashes of all those full blocks."""
        hits: list[tuple[int, int]] = []
        lower: list[int] = []
        if not self.enable_prefix_caching:
            return hits, lower, []
        count = (len(token_ids) - 1) // self.block_size
        if max_cached is not None:
            count = min(count, max_cached // self.block_size)
        hashes = self.page_hashes(token_ids, count)
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is not None and not lower:
                hits.append((block_hash, block_id))
            elif block_id is None and self.tier is not None and block_hash in self.tier:
                lower.append(block_hash)
            else:
                break  # (a device block after lower-tier ones ends the match: restores stay a contiguous run)
        return hits, lower, hashes

    def _restore(self, seq: _Sequence, pages: list[tuple[int, int]]) -> int:
        """Fill ``seq``'s new blocks from the lower tier where its prefix continues there; returns
        how many were filled (the rest are computed like any new block)."""
        if not pages or self.tier is None:
            return 0
        tags = self.tier.restore(pages)
        for (block_hash, block_id), conversations in zip(pages, tags):
            seq.block_hashes.append(block_hash)
            self._register(block_id, block_hash, None)
            self._blocks[block_id].conversations |= conversations
        return len(tags)

    def _flush_spills(self) -> None:
        spills, self._spills = self._spills, []
        if spills and self.tier is not None:
            self.tier.spill(spills)

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
            if self.tier is not None:
                self._spills.append((block_id, block.hash, frozenset(block.conversations)))
            del self._cached[block.hash]
            block.hash = None
            block.conversations.clear()
        else:
            raise RuntimeError("out of cache blocks")
        self._blocks[block_id].ref_count = 1
        return block_id

    def _register(self, block_id: int, block_hash: int, conversation: str | None) -> None:
        block = self._blocks[block_id]
        if block.hash is not None or block_hash in self._cached:
            self._tag(self._blocks[self._cached.get(block_hash, block_id)], conversation)
            return  # already registered, or the same content is cached in another block
        block.hash = block_hash
        self._cached[block_hash] = block_id
        self._tag(block, conversation)

    @staticmethod
    def _tag(block: _Block, conversation: str | None) -> None:
        if conversation is not None and block.hash is not None:
            block.conversations.add(conversation)

    def _unregister(self, block: _Block) -> None:
        """Forget a cached block's content: unused, it becomes free; in use, free once released."""
        assert block.hash is not None
        del self._cached[block.hash]
        block.hash = None
        block.conversations.clear()
        if block.ref_count == 0:
            del self._evictable[block.block_id]
            self._free.append(block.block_id)
