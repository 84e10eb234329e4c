"""Tests for hearth.engine.block_manager: block arithmetic, growth, freeing, prefix caching
(reuse across turns, sharing, LRU eviction) and a random stress test that checks every invariant
after each operation against a simulated cache whose slots hold the tokens written into them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hearth.engine.block_manager import BlockManager, common_pages, hash_block

BS = 4  # block size used throughout


def _served(bm: BlockManager, seq_id: str, tokens: list[int], answer: list[int]) -> None:
    """Run a request: allocate its prompt, append its answer token by token."""
    bm.allocate(seq_id, tokens)
    for token in answer:
        bm.append(seq_id, [token])


# ---- arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocation_at_block_boundaries(num_tokens, num_blocks):
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert bm.allocate("a", list(range(num_tokens))) == 0
    assert len(bm.block_table("a")) == num_blocks
    assert len(set(bm.block_table("a"))) == num_blocks
    assert bm.num_tokens("a") == num_tokens
    assert bm.num_free_blocks == 10 - num_blocks
    assert (bm.num_blocks, bm.block_size) == (10, BS)


def test_append_grows_the_table_when_a_block_fills():
    bm = BlockManager(num_blocks=10, block_size=BS)
    bm.allocate("a", [1, 2, 3])
    first = bm.block_table("a")
    bm.append("a", [4])  # fills block 0
    assert bm.block_table("a") == first and bm.num_tokens("a") == 4
    bm.append("a", [5])  # needs block 1
    assert len(bm.block_table("a")) == 2 and bm.block_table("a")[0] == first[0]
    bm.append("a", [6, 7, 8, 9, 10])  # 10 tokens -> 3 blocks
    assert len(bm.block_table("a")) == 3 and bm.num_tokens("a") == 10
    assert bm.num_free_blocks == 7


def test_can_append_counts_blocks_needed():
    bm = BlockManager(num_blocks=2, block_size=BS)
    bm.allocate("a", [1, 2, 3])
    assert bm.can_append("a", 5)  # 8 tokens fit in two blocks
    assert not bm.can_append("a", 6)
    bm.allocate("b", [1])
    assert bm.can_append("a", 1) and not bm.can_append("a", 2)


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(num_blocks=8, block_size=BS)
    _served(bm, "a", list(range(6)), [7, 8, 9])
    bm.allocate("b", [1, 2])
    bm.free("a")
    assert bm.num_free_blocks == 7
    bm.free("a")
    bm.free("never-seen")
    assert bm.num_free_blocks == 7
    bm.free("b")
    assert bm.num_free_blocks == 8
    with pytest.raises(RuntimeError):
        bm.block_table("a")


# ---- prefix caching ----------------------------------------------------------------------------


def test_prefix_reuse_across_turns():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt, answer = list(range(100, 110)), [7, 8, 9, 10, 11]  # 10 + 5 tokens
    _served(bm, "turn1", prompt, answer)
    table1 = bm.block_table("turn1")
    bm.free("turn1")
    # The last answer token was sampled but never computed: blocks 0-2 (tokens 0-11) are reusable.
    turn2 = prompt + answer + [20, 21, 22]
    assert bm.allocate("turn2", turn2) == 12
    assert bm.block_table("turn2")[:3] == table1[:3]
    assert len(bm.block_table("turn2")) == 5
    assert bm.num_tokens("turn2") == 18


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))
    _served(bm, "a", prompt, [50])
    bm.free("a")
    assert bm.allocate("same", prompt) == 4  # 8 cached tokens, but the 8th must be computed
    assert bm.allocate("longer", prompt + [60]) == 8


def test_blocks_register_only_once_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))
    bm.allocate("a", prompt)  # prefill not run yet: nothing may be reused
    assert bm.allocate("b", prompt + [1]) == 0
    bm.mark_computed("a", 12)
    assert bm.allocate("c", prompt + [1]) == 12
    assert bm.block_table("c")[:3] == bm.block_table("a")


def test_equal_blocks_at_different_prefixes_do_not_collide():
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    bm = BlockManager(num_blocks=16, block_size=BS)
    _served(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8], [9])
    assert bm.allocate("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert bm.allocate("c", [5, 6, 7, 8, 0]) == 0
    assert bm.allocate("d", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_shared_blocks_stay_while_another_request_holds_them():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(8))
    _served(bm, "a", prompt, [100])  # 9 tokens, 3 blocks, blocks 0-1 registered
    assert bm.allocate("b", prompt + [200]) == 8
    shared = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == shared
    assert bm.num_free_blocks == 2  # 3 for a + 1 new for b
    bm.free("a")
    assert bm.num_free_blocks == 3  # only a's private tail block came back
    bm.allocate("c", list(range(500, 512)))  # takes every free block
    assert bm.num_free_blocks == 0
    assert not set(bm.block_table("c")) & set(shared)
    assert bm.block_table("b")[:2] == shared
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 6


def test_cached_blocks_are_evicted_only_when_needed_in_lru_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = [1] * 8, [2] * 8
    _served(bm, "a", a, [0])  # 3 blocks, 2 cached
    _served(bm, "b", b, [0])
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    assert bm.allocate("x", [9, 9]) == 0  # a never-cached block is free: nothing evicted
    assert bm.allocate("probe-a", a + [3]) == 8 and bm.allocate("probe-b", b + [3]) == 8
    bm.free("probe-b")
    bm.free("probe-a")  # a's blocks are now more recently used than b's
    bm.free("x")
    assert bm.allocate("y", list(range(20, 41))) == 0  # 6 blocks: 4 never-cached + b's 2 cached
    bm.free("y")
    assert bm.allocate("probe-a2", a + [3]) == 8
    assert bm.allocate("probe-b2", b + [3]) == 0


def test_eviction_takes_a_prefix_tail_first():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = [1] * 8
    _served(bm, "a", a, [0])  # blocks a0, a1 cached, a2 plain
    bm.free("a")
    bm.allocate("y", [7] * 13)  # 4 blocks: the 3 plain ones, then one cached one
    bm.free("y")
    assert bm.allocate("probe-head", a[:4] + [3]) == 4  # a0 survived
    assert bm.allocate("probe-both", a + [3]) == 4  # a1, the tail, was evicted


def test_can_allocate_accounts_for_reusable_prefix_blocks():
    bm = BlockManager(num_blocks=5, block_size=BS)
    prompt = list(range(8))
    _served(bm, "a", prompt, [9])  # 3 blocks held, 2 free
    assert bm.can_allocate(prompt + [1, 2, 3, 4])  # 3 blocks, 2 shared with live "a"
    assert not bm.can_allocate(list(range(50, 62)))  # 3 new blocks
    bm.free("a")
    # Now a's cached blocks count as free too, but reusing them takes them out of the free pool.
    assert bm.num_free_blocks == 5
    assert not bm.can_allocate(prompt + list(range(20, 33)))  # 6 blocks: 2 reused, 4 new > 5 - 2
    assert bm.can_allocate(prompt + list(range(20, 32)))  # 5 blocks: 2 reused, 3 new <= 5 - 2
    assert bm.allocate("b", prompt + list(range(20, 32))) == 8
    assert bm.num_free_blocks == 0


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    _served(bm, "a", list(range(8)), [1, 2])
    bm.free("a")
    assert bm.allocate("b", list(range(8)) + [1]) == 0


# ---- misuse ------------------------------------------------------------------------------------


def test_misuse_raises_clear_errors():
    bm = BlockManager(num_blocks=2, block_size=BS)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(RuntimeError, match="already allocated"):
        bm.allocate("a", [1])
    with pytest.raises(RuntimeError, match="unknown sequence"):
        bm.append("nope", [1])
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        bm.allocate("big", list(range(5)))
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        bm.append("a", list(range(6)))
    assert bm.num_tokens("a") == 3 and bm.num_free_blocks == 1  # failed actions changed nothing
    with pytest.raises(ValueError):
        bm.allocate("empty", [])
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=BS)


# ---- random stress -----------------------------------------------------------------------------


class _Simulation:
    """Drives a BlockManager with random operations and a model of what each cache slot holds."""

    def __init__(self, seed: int, enable_prefix_caching: bool) -> None:
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=enable_prefix_caching)
        self.tokens: dict[str, list[int]] = {}  # live sequences
        self.computed: dict[str, int] = {}  # tokens whose keys are in the cache
        self.slots: dict[int, list[int | None]] = {b: [None] * BS for b in range(24)}
        self.history: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
        self.next_id = 0
        self.num_hits = 0

    def _write(self, seq_id: str, start: int, stop: int) -> None:
        table = self.bm.block_table(seq_id)
        holders = Counter(b for s in self.tokens for b in self.bm.block_table(s))
        for pos in range(start, stop):
            block = table[pos // BS]
            assert holders[block] == 1, "a shared block must never be written"
            self.slots[block][pos % BS] = self.tokens[seq_id][pos]

    def _new_prompt(self) -> list[int]:
        base = self.rng.choice(self.history)
        keep = self.rng.randint(0, len(base))
        return base[:keep] + [self.rng.randint(0, 2) for _ in range(self.rng.randint(1, 9))]

    def allocate(self) -> None:
        prompt, seq_id = self._new_prompt(), f"s{self.next_id}"
        self.next_id += 1
        if not self.bm.can_allocate(prompt):
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq_id, prompt)
            return
        cached = self.bm.allocate(seq_id, prompt)
        assert cached % BS == 0 and 0 <= cached < len(prompt)
        self.num_hits += cached > 0
        table = self.bm.block_table(seq_id)
        assert [self.slots[table[p // BS]][p % BS] for p in range(cached)] == prompt[:cached]
        self.tokens[seq_id], self.computed[seq_id] = prompt, cached

    def append(self) -> None:
        seq_id = self.rng.choice(sorted(self.tokens))
        new = [self.rng.randint(0, 2) for _ in range(self.rng.choice([1, 1, 1, 3]))]
        if not self.bm.can_append(seq_id, len(new)):
            with pytest.raises(RuntimeError):
                self.bm.append(seq_id, new)
            return
        self._write(seq_id, self.computed[seq_id], len(self.tokens[seq_id]))  # the step before ran
        self.computed[seq_id] = len(self.tokens[seq_id])
        self.bm.append(seq_id, new)
        self.tokens[seq_id] = self.tokens[seq_id] + new

    def free(self) -> None:
        seq_id = self.rng.choice(sorted(self.tokens))
        self.history.append(self.tokens.pop(seq_id))
        del self.computed[seq_id]
        self.bm.free(seq_id)
        self.bm.free(seq_id)

    def step(self) -> None:
        roll = self.rng.random()
        if not self.tokens or roll < 0.3:
            self.allocate()
        elif roll < 0.8:
            self.append()
        else:
            self.free()

    def check(self) -> None:
        bm = self.bm
        holders: Counter[int] = Counter()
        for seq_id, tokens in self.tokens.items():
            table = bm.block_table(seq_id)
            assert bm.num_tokens(seq_id) == len(tokens)
            assert len(table) == -(-len(tokens) // BS) and len(set(table)) == len(table)
            holders.update(table)
        free, evictable = set(bm._free), set(bm._evictable)
        assert len(free) == len(bm._free) and not free & evictable
        assert not (free | evictable) & set(holders), "a block is both free and in use"
        assert len(holders) + len(free) + len(evictable) == bm.num_blocks
        assert bm.num_free_blocks == bm.num_blocks - len(holders)
        assert all(bm._blocks[b].ref_count == holders[b] for b in range(bm.num_blocks))
        assert all(bm._blocks[b].hash is not None for b in evictable)
        assert all(bm._blocks[b].hash is None for b in free)
        assert all(bm._blocks[b].hash == h for h, b in bm._cached.items())
        assert len(bm._cached) == sum(block.hash is not None for block in bm._blocks)
        self._check_sharing(holders)

    def _check_sharing(self, holders: Counter[int]) -> None:
        """Requests sharing a block hold it at the same index, after identical token prefixes."""
        for block in (b for b, n in holders.items() if n > 1):
            prefixes = set()
            for seq_id, tokens in self.tokens.items():
                table = self.bm.block_table(seq_id)
                if block in table:
                    end = (table.index(block) + 1) * BS
                    prefixes.add(tuple(tokens[:end]))
            assert len(prefixes) == 1


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_every_invariant(seed, enable_prefix_caching):
    sim = _Simulation(seed, enable_prefix_caching)
    for _ in range(3000):
        sim.step()
        sim.check()
    if enable_prefix_caching:
        assert sim.num_hits > 50, "the stress test should exercise prefix reuse"
    else:
        assert sim.num_hits == 0
    for seq_id in list(sim.tokens):
        sim.bm.free(seq_id)
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_placeholder_token_gets_its_value_before_its_block_is_registered():
    """Overlapped decode appends a token before its value is known and sets it when it lands."""
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1, 2, 3])
    view = bm.table_view("a")
    assert bm.can_append_each(["a"])
    bm.append("a", [-1])  # fills the first block
    bm.set_token("a", 3, 9)
    bm.append("a", [-1])  # registers the first block: its tokens are all known now
    assert view == bm.block_table("a") and len(view) == 2  # the view grew with the table
    bm.allocate("b", [1, 2, 3, 9, 5])
    assert bm.hit_tokens == 4  # the block holds 9, not the placeholder
    with pytest.raises(RuntimeError, match="registered"):
        bm.set_token("a", 2, 7)
    assert bm.num_free_blocks == 1 and bm.can_append_each(["a", "b"])  # room in their second blocks
    bm.append("a", [6, 7, 8])
    bm.append("b", [6, 7, 8])
    assert bm.can_append("a") and bm.can_append("b")
    assert not bm.can_append_each(["a", "b"])  # both need a new block and one is free


def test_common_pages_equals_a_page_by_page_comparison():
    """common_pages (runs of pages compared in order, the first differing run bisected) counts the
    leading whole pages two token lists share, as a page-by-page walk does: lists of any length, a
    difference anywhere (the first token, inside or at the edge of a scanned run, past the end)."""
    def walk(a: list[int], b: list[int], size: int) -> int:
        n = 0
        while (n + 1) * size <= min(len(a), len(b)) and a[n * size:(n + 1) * size] == b[n * size:(n + 1) * size]:
            n += 1
        return n

    rng = random.Random(3)
    for _ in range(400):
        size = rng.choice([1, 3, 16, 64])
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 6000))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 300))]
        assert common_pages(a, b, size) == walk(a, b, size) == common_pages(b, a, size)
    a = list(range(64 * 64 * 3))
    for at in (0, 63, 64, 64 * 64 - 1, 64 * 64, 64 * 64 * 2 + 5):  # around the edges of the scanned runs
        b = a[:at] + [-1] + a[at + 1:]
        assert common_pages(a, b, 64) == at // 64
    assert common_pages(a, a + [1], 64) == len(a) // 64
