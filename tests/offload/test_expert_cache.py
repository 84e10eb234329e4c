"""ExpertCache on the CPU: LRU / decayed-LFU eviction, refcount protection, duplicate merge, stats."""

import pytest
import torch

from hearth.offload.expert_cache import CacheFullError, ExpertCache, LFUPolicy
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.fetch_plan import MISSING, RESIDENT

LAYERS = [0, 1]


@pytest.fixture
def store() -> ExpertStore:
    s = ExpertStore(ExpertLayout(32, 16, torch.bfloat16), LAYERS, 8)
    for layer in LAYERS:  # distinct bytes per (layer, expert)
        buf = s.layer_buffer(layer)
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    return s


def _use(cache: ExpertCache, layer: int, experts: list[int]) -> None:
    cache.release(cache.acquire(layer, experts))


def test_slots_hold_the_store_bytes(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    lease = cache.acquire(1, [4, 6])
    assert lease.ready == [True, True]
    for e, s in zip(lease.experts, lease.slots):
        assert torch.equal(cache.buffer[s], store.expert(1, e))
    assert torch.equal(cache.weights.w13[lease.slots[0]].view(torch.uint8), store.weights(1).w13[4].view(torch.uint8))


def test_lru_evicts_least_recently_used(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3, policy="lru")
    for e in (0, 1, 2, 0):
        _use(cache, 0, [e])
    _use(cache, 0, [3])
    assert cache.resident(0) == [0, 2, 3]


def test_lfu_evicts_least_frequent_and_decays():
    policy = LFUPolicy(decay=0.9)
    for key in [(0, 0)] * 3 + [(0, 1), (0, 2), (0, 2)]:
        policy.advance()
        policy.touch(key)
    assert policy.victims(1, lambda k: True) == [(0, 1)]
    for _ in range(10):  # old counts decay: 0 -> 0.69, 2 -> 0.66, 1 -> 1.28
        policy.advance()
    policy.touch((0, 1))
    assert policy.victims(2, lambda k: True) == [(0, 2), (0, 0)]


def test_lfu_cache(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3, policy="lfu")
    for experts in ([0], [0], [1], [2], [2], [0]):
        _use(cache, 1, experts)
    _use(cache, 1, [5])
    assert cache.resident(1) == [0, 2, 5]


def test_referenced_expert_is_never_evicted(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    held = cache.acquire(0, [0])  # least recently used, but referenced
    for e in (1, 2, 3, 4):
        _use(cache, 0, [e])
        assert 0 in cache.resident(0)
    assert cache.refcount(0, 0) == 1
    cache.release(held)
    assert cache.refcount(0, 0) == 0
    _use(cache, 0, [5])
    assert 0 not in cache.resident(0)


def test_full_cache_of_referenced_experts_raises(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    held = cache.acquire(0, [0, 1])
    with pytest.raises(CacheFullError, match=r"needs 2 more experts but its pool of 3 slots has 1 free and 0 "
                                             r"evictable \(2 hold experts in use\)"):
        cache.acquire(0, [1, 2, 3])
    assert cache.refcount(0, 1) == 1  # the failed call took no references
    cache.release(held)
    assert len(cache.acquire(0, [1, 2, 3]).slots) == 3


def test_duplicates_merged_and_stats(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=4)
    lease = cache.acquire(0, [2, 2, 5, 2])
    assert lease.experts == [2, 5]
    second = cache.acquire(0, [5])  # held twice: one copy, two references
    assert second.slots == [lease.slots[1]] and cache.refcount(0, 5) == 2
    cache.release(lease)
    cache.release(second)
    _use(cache, 0, [1, 3, 4])  # 1 and 3 fill the pool, 4 evicts 2 (LRU)
    st = cache.stats()
    layer0 = st["layers"][0]
    assert (layer0["requests"], layer0["hits"], layer0["misses"], layer0["evictions"]) == (6, 1, 5, 1)
    assert layer0["bytes_fetched"] == 5 * store.layout.record_bytes
    assert layer0["hit_rate"] == pytest.approx(1 / 6)
    assert st["layers"][1]["requests"] == 0 and st["total"]["misses"] == 5
    cache.reset_stats()
    assert cache.stats()["total"]["requests"] == 0


def test_global_pool_is_shared_across_layers(store):
    cache = ExpertCache(store, "cpu", num_slots=3)
    _use(cache, 0, [0, 1])
    _use(cache, 1, [0, 1])  # layer 1 takes the free slot and evicts layer 0's LRU expert
    assert cache.resident(0) == [1] and cache.resident(1) == [0, 1]
    assert cache.capacity(0) == cache.capacity(1) == 3


def test_bad_sizes(store):
    with pytest.raises(ValueError, match="exactly one"):
        ExpertCache(store, "cpu")
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertCache(store, "cpu", num_slots=0)



def test_refused_acquire_counts_no_hits(store):
    """A CacheFullError must leave the counters as they were (the runahead decoder retries)."""
    cache = ExpertCache(store, "cpu", slots_per_layer=2)
    layer = store.layers[0]
    held = cache.acquire(layer, [0, 1])
    before = cache.stats()["total"]
    with pytest.raises(CacheFullError):
        cache.acquire(layer, [0, 2])
    after = cache.stats()["total"]
    assert after["hits"] == before["hits"] and after["requests"] == before["requests"]
    assert cache.refcount(layer, 0) == 1
    cache.release(held)


def test_lookup_states_and_host_computed_count(store):
    from hearth.offload.fetch_plan import MISSING, RESIDENT

    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    lease = cache.acquire(0, [2, 5])
    assert lease.expert_events == [None, None]  # CPU copies are synchronous
    lease.wait_for([0, 1])  # no-op without events
    assert cache.lookup(0, [5, 1, 2]) == [RESIDENT, MISSING, RESIDENT]
    assert cache.lookup(1, [5]) == [MISSING]
    cache.release(lease)
    cache.count_cpu_computed(1, 3)
    st = cache.stats()
    assert st["layers"][1]["cpu_computed"] == 3 and st["total"]["cpu_computed"] == 3
    assert st["layers"][1]["requests"] == 0  # host-computed experts are not cache requests


def test_one_wait_per_stream_for_released_slots():
    """Before copying into slots, the copy stream waits for their release events: only the newest of
    each stream (a stream's events complete in order)."""
    from hearth.offload.expert_cache import newest_per_stream

    released = [(3, 7, "s7-3"), None, (5, 7, "s7-5"), (4, 9, "s9-4"), (1, 7, "s7-1"), (4, 9, "s9-4")]
    assert newest_per_stream(released) == ["s7-5", "s9-4"]
    assert newest_per_stream([None, None]) == []


def test_fetch_copies_the_right_rows_in_a_global_pool(store):
    """Copies go through per-slot and per-expert views made once: evictions and refills across layers
    still put each expert's own bytes in its slot."""
    cache = ExpertCache(store, "cpu", num_slots=3)
    for layer, experts in ((0, [1, 2]), (1, [2, 7]), (0, [2, 5, 6]), (1, [7])):
        lease = cache.acquire(layer, experts)
        for e, s in zip(lease.experts, lease.slots):
            assert torch.equal(cache.buffer[s], store.expert(layer, e))
        cache.release(lease)


def test_available_counts_slots_not_held(store):
    """Free slots and slots of unreferenced experts can be taken; held ones cannot, in either kind of pool."""
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    assert cache.available(0) == 3
    held = cache.acquire(0, [0, 1])
    _use(cache, 0, [2])
    assert cache.available(0) == 1 and cache.available(1) == 3
    again = cache.acquire(0, [1])  # a second reference to a held slot takes no new room
    assert cache.available(0) == 1
    cache.release(held)
    assert cache.available(0) == 2
    cache.release(again)
    assert cache.available(0) == 3
    shared = ExpertCache(store, "cpu", num_slots=4)
    lease = shared.acquire(0, [0, 1])
    assert shared.available(0) == shared.available(1) == 2
    shared.release(lease)
    assert shared.available(1) == 4


def test_copy_seconds_is_zero_on_a_host_cache(store):
    """Nothing crosses a link on a host-memory cache: the busy time auto's runahead gate reads stays 0."""
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    _use(cache, 0, [1, 2, 3])
    assert cache.copies == 3
    assert cache.copy_seconds() == 0.0


def test_dry_copies_bookkeep_every_fetch_copy_nothing_and_forget_them(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    _use(cache, 0, [5])  # a real expert, held in a slot before
    real_slot = cache._slot_of[(0, 5)]
    before = cache.buffer.clone()
    with cache.dry_copies():
        lease = cache.acquire(0, [1, 2, 5])  # two dry fetches beside the resident expert
        assert lease.ready == [True, True, True] and sorted(lease.slots) == sorted(set(lease.slots))
        assert cache.lookup(0, [1, 2, 5]) == [RESIDENT] * 3
        cache.release(lease)
        with pytest.raises(CacheFullError):  # a pool's room is bookkept as for real fetches
            cache.acquire(1, [0, 1, 2, 3])
        _use(cache, 1, [7])
        assert cache.copies == 1  # (the real fetch before)
    assert torch.equal(cache.buffer, before)  # not a byte copied
    # the dry experts are forgotten (free slots again), the real one stays where it was
    assert cache.resident(0) == [5] and cache.resident(1) == []
    assert cache._slot_of[(0, 5)] == real_slot and cache.available(0) == 3
    assert cache.lookup(0, [1, 2]) == [MISSING, MISSING]
    # fetched for real afterwards, they hold the store's bytes
    lease = cache.acquire(0, [1, 2])
    for expert, slot in zip(lease.experts, lease.slots):
        assert torch.equal(cache.buffer[slot], store.expert(0, expert))
    assert cache.copies == 3


def test_dry_copies_refuse_a_held_dry_expert_and_nesting_and_keep_the_bodys_error(store):
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    with pytest.raises(RuntimeError, match="dry_copies does not nest"), cache.dry_copies(), cache.dry_copies():
        pass
    with pytest.raises(RuntimeError, match=r"leases still hold experts copied dry: \[\(0, 4\)\]"), cache.dry_copies():
        held = cache.acquire(0, [4])
    assert cache.resident(0) == [4]  # still held: left as it is
    cache.release(held)
    with pytest.raises(ValueError, match="the body's"), cache.dry_copies():
        _use(cache, 1, [3])
        raise ValueError("the body's")
    assert cache.resident(1) == []
