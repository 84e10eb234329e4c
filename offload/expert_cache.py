"""Device cache of routed experts: fixed-size slots per layer (or one global pool), a residency map
(layer, expert) -> slot, reference counts so an expert in use is never evicted, LRU or decayed-LFU
eviction, and copies from the host store on a dedicated CUDA stream ordered by events.

A slot holds an expert as the store does: an MXFP4 store's (gpt-oss) slots hold MXFP4 records, which
the fused MoE kernel reads directly, so the link moves 4.25 bits a weight and a slot is 3.76x smaller
than a bf16 one (3.76x more experts fit in the same GPU memory).

On a CPU device the copies are synchronous and the bookkeeping is the same, so the logic is tested
without a GPU. ``acquire`` merges duplicate requests: an expert already in flight is not copied twice.
Every copy records its own event, so a caller can compute with each expert as soon as it lands.

Under :meth:`ExpertCache.dry_copies` (the engine's warm-up) the bookkeeping, the copy stream's events and
so every caller's path run as they would, but no byte is copied: a slot keeps what it held, and every
expert assigned a slot meanwhile is forgotten at the end, so no later lookup finds one.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hearth.offload.expert_store import ExpertStore, ExpertWeights
from hearth.offload.fetch_plan import IN_FLIGHT, MISSING, RESIDENT
from hearth.offload.stats import LayerCacheStats, summarize

Key = tuple[int, int]  # (layer, expert)


class CacheFullError(RuntimeError):
    """More experts must be fetched than the pool has free or evictable (unreferenced) slots."""


class EvictionPolicy(ABC):
    """Orders the resident experts of one pool for eviction."""

    def advance(self) -> None:  # noqa: B027 - optional hook: one tick per acquire call
        """Called once per acquire call (a clock for policies that age their counts)."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """Record a use of ``key`` (inserting it if new)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget ``key`` (it was evicted)."""

    @abstractmethod
    def victims(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        """Up to ``n`` evictable keys, best victim first."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        out: list[Key] = []
        for key in self._order:
            if len(out) == n:
                break
            if evictable(key):
                out.append(key)
        return out


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, counts decayed by ``decay`` per acquire call; ties go LRU."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._now = 0
        self._score: dict[Key, tuple[float, int]] = {}  # key -> (count at last use, tick of last use)

    def advance(self) -> None:
        self._now += 1

    def _current(self, key: Key) -> float:
        count, last = self._score[key]
        return count * self.decay ** (self._now - last)

    def touch(self, key: Key) -> None:
        count = self._current(key) if key in self._score else 0.0
        self._score[key] = (count + 1.0, self._now)

    def remove(self, key: Key) -> None:
        self._score.pop(key, None)

    def victims(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        keys = [k for k in self._score if evictable(k)]
        keys.sort(key=lambda k: (self._current(k), self._score[k][1]))
        return keys[:n]


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


@dataclass
class ExpertLease:
    """Experts of one layer held for a computation. ``slots[i]`` holds ``experts[i]``; it is valid now
    when ``ready[i]``, otherwise after ``expert_events[i]`` (:meth:`wait_for`) or :meth:`wait` (all).
    Give it back with ``ExpertCache.release``."""

    layer: int
    experts: list[int]
    slots: list[int]
    ready: list[bool]
    events: list = field(default_factory=list)  # torch.cuda.Event: all done = every slot filled (empty on CPU)
    expert_events: list = field(default_factory=list)  # per expert: its copy's event, None when ready

    def wait(self) -> None:
        """Make the current stream wait until every fetched slot of this lease is filled."""
        for event in self.events:
            torch.cuda.current_stream().wait_event(event)

    def wait_for(self, indices: Sequence[int]) -> None:
        """Make the current stream wait until the slots of ``experts[i]``, i in ``indices``, are filled."""
        seen: set[int] = set()
        for i in indices:
            event = self.expert_events[i] if self.expert_events else None
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                torch.cuda.current_stream().wait_event(event)


def newest_per_stream(released: Iterable[tuple[int, int, Any] | None]) -> list:
    """The events to wait for so that every one of ``released`` (release number, stream handle, event;
    or None) has completed: the newest of each stream.

    NOTE: the events of one stream complete in the order they were recorded, so the newest release
    event of a stream covers its older ones: one wait per stream instead of one per slot. Streams come
    from PyTorch's pool and are never destroyed, so a handle names one stream for the whole run.
    """
    newest: dict[int, tuple[int, Any]] = {}
    for item in released:
        if item is not None:
            number, handle, event = item
            if handle not in newest or newest[handle][0] < number:
                newest[handle] = (number, event)
    return [event for _, event in newest.values()]


@dataclass
class _Pool:
    size: int
    free: list[int]
    policy: EvictionPolicy
    held: int = 0  # slots referenced by at least one lease


class ExpertCache:
    """Slots for ``store``'s experts on ``device``: ``slots_per_layer`` each, or ``num_slots`` shared."""

    def __init__(
        self, store: ExpertStore, device: torch.device | str, *, slots_per_layer: int | None = None,
        num_slots: int | None = None, policy: str | Callable[[], EvictionPolicy] = "lru",
    ) -> None:
        if (slots_per_layer is None) == (num_slots is None):
            raise ValueError("give exactly one of slots_per_layer (per-layer pools) or num_slots (one pool)")
        make_policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.store = store
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        sizes = [slots_per_layer] * len(store.layers) if slots_per_layer else [num_slots]
        if min(sizes) < 1:
            raise ValueError(f"an expert cache pool needs at least one slot, got {min(sizes)}")
        self._pools, start = [], 0
        for size in sizes:
            self._pools.append(_Pool(size, list(range(start + size - 1, start - 1, -1)), make_policy()))
            start += size
        self._per_layer = slots_per_layer is not None
        self._pool_of = {layer: self._pools[i if self._per_layer else 0] for i, layer in enumerate(store.layers)}
        self.num_slots = start
        self.buffer = torch.empty((start, store.record_bytes), dtype=torch.uint8, device=self.device)
        self.weights: ExpertWeights = store.record_weights(self.buffer)  # w13, w2, scales, biases of the slots
        # NOTE: one view per slot and per stored expert, made once: indexing a tensor costs microseconds
        # of Python per copy, on the path to the first copy of a call.
        self._slot_rows = self.buffer.unbind(0)
        self._expert_rows: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> its store rows, on first fetch
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * start
        self._refs = [0] * start
        self._ready: list = [None] * start  # copy-done event of a slot still in flight
        # (release number, stream handle, event recorded after the last computation that read the slot)
        self._released: list = [None] * start
        self._num_released = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._stats = {layer: LayerCacheStats() for layer in store.layers}
        self.copies = 0  # experts copied into slots since the cache was built (never reset: callers compare)
        self._copy_events: list = []  # (layer, start event, end event), resolved by _resolve_copies
        self._copy_ms_total = 0.0  # copy-stream busy time of the resolved copies, never reset (copy_seconds)
        self._dry: set[int] | None = None  # under dry_copies: the slots assigned an expert without its bytes

    def _pool(self, layer: int) -> _Pool:
        return self._pool_of[layer]

    def capacity(self, layer: int) -> int:
        """Slots of ``layer``'s pool: the most experts one lease of it can hold."""
        return self._pool(layer).size

    def available(self, layer: int) -> int:
        """Slots of ``layer``'s pool a lease could take now: free, or holding an expert nobody
        references. Experts already held by other leases can be acquired on top of these."""
        pool = self._pool(layer)
        return pool.size - pool.held

    def resident(self, layer: int) -> list[int]:
        return sorted(e for (l, e) in self._slot_of if l == layer)

    def lookup(self, layer: int, experts: Sequence[int]) -> list[int]:
        """State of each expert now: ``RESIDENT`` (ready), ``IN_FLIGHT`` (copy queued) or ``MISSING``."""
        out = []
        for expert in experts:
            slot = self._slot_of.get((layer, expert))
            if slot is None:
                out.append(MISSING)
                continue
            event = self._ready[slot]
            if event is not None and event.query():
                self._ready[slot] = event = None
            out.append(RESIDENT if event is None else IN_FLIGHT)
        return out

    def count_cpu_computed(self, layer: int, num_experts: int) -> None:
        """Record experts of ``layer`` that a caller computed on the host instead of fetching."""
        self._stats[layer].cpu_computed += num_experts

    def refcount(self, layer: int, expert: int) -> int:
        slot = self._slot_of.get((layer, expert))
        return 0 if slot is None else self._refs[slot]

    def acquire(self, layer: int, experts: Sequence[int]) -> ExpertLease:
        """Reference ``experts`` of ``layer`` (duplicates merged); start copies for the missing ones."""
        experts = list(dict.fromkeys(experts))
        pool, stats = self._pool_of[layer], self._stats[layer]
        pool.policy.advance()
        lease = ExpertLease(layer, experts, [-1] * len(experts), [False] * len(experts),
                            expert_events=[None] * len(experts))
        counted = (stats.hits, stats.merged)  # a refused acquire must not count as hits
        missing: list[int] = []
        slot_of = self._slot_of
        for i, expert in enumerate(experts):
            slot = slot_of.get((layer, expert))
            if slot is None:
                missing.append(i)
                continue
            self._hold(lease, i, slot, stats, pool)
        if missing:
            try:
                free = self._take_slots(pool, layer, len(missing))
            except CacheFullError:
                self.release(lease, record=False)
                stats.hits, stats.merged = counted
                raise
            self._fetch(lease, [(i, s) for i, s in zip(missing, free)], stats)
        # NOTE: the experts of one call are used together. Touching them in expert order, not in the
        # caller's order (resident before in flight before missing), keeps the eviction order, and so
        # the bytes fetched, independent of which copies had landed when the call was planned.
        for expert in sorted(experts):
            pool.policy.touch((layer, expert))
        stats.requests += len(experts)
        return lease

    def _hold(self, lease: ExpertLease, i: int, slot: int, stats: LayerCacheStats, pool: _Pool) -> None:
        event = self._ready[slot]
        if event is not None and event.query():
            self._ready[slot] = event = None
        if event is None:
            stats.hits += 1
            lease.ready[i] = True
        else:
            stats.merged += 1
            lease.expert_events[i] = event
            if event not in lease.events:
                lease.events.append(event)
        lease.slots[i] = slot
        pool.held += self._refs[slot] == 0
        self._refs[slot] += 1

    def _take_slots(self, pool: _Pool, layer: int, n: int) -> list[int]:
        need = n - len(pool.free)
        victims = pool.policy.victims(need, lambda k: self._refs[self._slot_of[k]] == 0) if need > 0 else []
        if need > len(victims):
            raise CacheFullError(
                f"expert cache: layer {layer} needs {n} more experts but its pool of {pool.size} slots has "
                f"{len(pool.free)} free and {len(victims)} evictable ({pool.held} hold experts in use); release "
                f"leases first or give the cache more slots")
        for key in victims:
            slot = self._slot_of.pop(key)
            self._key_of[slot] = None
            pool.policy.remove(key)
            pool.free.append(slot)
            self._stats[key[0]].evictions += 1
        return [pool.free.pop() for _ in range(n)]

    def _fetch(self, lease: ExpertLease, todo: list[tuple[int, int]], stats: LayerCacheStats) -> None:
        """Copy host -> slot for (lease index, slot) pairs in the given order; on CUDA on the copy
        stream, after the slots' last readers (their release events), one event per copy. Each copy is
        queued before its bookkeeping, so the link starts as early as it can."""
        layer, pool = lease.layer, self._pool_of[lease.layer]
        src, dst = self._expert_rows.get(layer), self._slot_rows
        if src is None:
            src = self._expert_rows[layer] = self.store.layer_buffer(layer).unbind(0)
        stats.misses += len(todo)
        dry = self._dry is not None
        if dry:
            self._dry.update(slot for _, slot in todo)
        else:
            self.copies += len(todo)
            stats.bytes_fetched += len(todo) * self.store.record_bytes
        if not self.is_cuda:
            for i, slot in todo:
                if not dry:
                    dst[slot].copy_(src[lease.experts[i]])
                lease.ready[i] = True
                self._assign(lease, i, slot, pool)
            return
        stream = self.copy_stream
        waits = newest_per_stream(self._released[slot] for _, slot in todo)
        with torch.cuda.stream(stream):
            for event in waits:
                stream.wait_event(event)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for i, slot in todo:
                if not dry:
                    dst[slot].copy_(src[lease.experts[i]], non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
                self._ready[slot] = lease.expert_events[i] = landed
                self._assign(lease, i, slot, pool)
            end.record(stream)
        lease.events.append(end)
        self._copy_events.append((layer, start, end))

    def _assign(self, lease: ExpertLease, i: int, slot: int, pool: _Pool) -> None:
        """Slot ``slot`` now holds ``lease.experts[i]``, referenced once by ``lease``."""
        key = (lease.layer, lease.experts[i])
        self._slot_of[key] = slot
        self._key_of[slot] = key
        pool.held += self._refs[slot] == 0
        self._refs[slot] += 1
        lease.slots[i] = slot

    def release(self, lease: ExpertLease, record: bool = True) -> None:
        """Drop the lease's references; on CUDA, later copies into its slots wait for the work queued
        so far on the current stream (which may still be reading them)."""
        released = None
        if self.is_cuda and record:
            event, current = torch.cuda.Event(), torch.cuda.current_stream(self.device)
            event.record(current)
            self._num_released += 1
            released = (self._num_released, current.cuda_stream, event)
        pool = self._pool_of[lease.layer]
        for slot in lease.slots:
            if slot < 0:
                continue
            self._refs[slot] -= 1
            pool.held -= self._refs[slot] == 0
            if released is not None:
                self._released[slot] = released
        lease.slots = [-1] * len(lease.slots)

    @contextlib.contextmanager
    def dry_copies(self) -> Iterator[None]:
        """Within: every fetch is bookkept, ordered and timed as usual but copies nothing (the module doc).
        On leaving, each expert given a slot within is forgotten (its slot free again); every lease on one
        must have been released by then (a RuntimeError names those still held, which stay as they are).
        What the engine's warm-up runs under: its prompts take every path a user's would, the kernels of
        the expert computations included, without moving the experts they route to over the link."""
        if self._dry is not None:
            raise RuntimeError("dry_copies does not nest")
        self._dry = set()
        try:
            yield
        finally:
            dry, self._dry = self._dry, None
            held = [self._key_of[slot] for slot in sorted(dry) if self._refs[slot]]
            for slot in dry:
                key = self._key_of[slot]
                if key is None or self._refs[slot]:
                    continue
                del self._slot_of[key]
                self._key_of[slot] = None
                self._ready[slot] = None
                pool = self._pool_of[key[0]]
                pool.policy.remove(key)
                pool.free.append(slot)
        if held:  # (not where the body raised: that error is the one to see)
            raise RuntimeError(f"dry_copies: leases still hold experts copied dry: {held[:8]}")

    def stats(self) -> dict:
        """{'layers': {layer: counters}, 'total': counters}; waits for copies still in flight."""
        self._resolve_copies(wait=True)
        return {"layers": {l: s.as_dict() for l, s in self._stats.items()}, "total": summarize(self._stats)}

    def copy_seconds(self) -> float:
        """Copy-stream busy time so far, in seconds, of the copies that have landed (never waits: copies
        still in flight count once they land). Only grows, also across :meth:`reset_stats`; 0 on a
        host-memory cache, where nothing crosses a link. Auto's runahead gate reads it (``link_gate``)."""
        self._resolve_copies(wait=False)
        return self._copy_ms_total / 1e3

    def _resolve_copies(self, wait: bool) -> None:
        """Add the timed copies' busy time to the counters: all of them (``wait``: waiting for those in
        flight) or those that have landed."""
        done = 0
        for layer, start, end in self._copy_events:
            if wait:
                end.synchronize()
            elif not end.query():
                break  # one copy stream: later copies land later
            ms = start.elapsed_time(end)
            self._stats[layer].copy_ms += ms
            self._copy_ms_total += ms
            done += 1
        del self._copy_events[:done]

    def reset_stats(self) -> None:
        self.stats()
        self._stats = {layer: LayerCacheStats() for layer in self.store.layers}
