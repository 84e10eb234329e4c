"""Host-side plan of one routed-experts call: in which order the needed experts are served, how the
fetched ones are grouped for compute-as-they-arrive, and how a call that needs more experts than
the pool holds is split into rounds and in which order the host issues their copies and compute
(:class:`StreamPlan`). Pure functions on ints: no tensors, no CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RESIDENT, IN_FLIGHT, MISSING = 0, 1, 2  # an expert's state in the cache before the call
MIN_GROUP_BYTES = 16 << 20  # below this one group's copy is too short to hide a compute launch
MAX_GROUPS = 32  # per round: each group costs one fused-kernel call
HALVES, RING = "halves", "ring"  # how a call larger than the pool streams (StreamPlan)
STREAMING = (HALVES, RING)
RING_DEPTH = 8  # rounds a RING plan splits the pool into
ACQUIRE, COMPUTE, RELEASE = "acquire", "compute", "release"  # the host steps of a StreamPlan


def serving_order(counts: Sequence[int], states: Sequence[int]) -> list[int]:
    """Indices of ``counts`` (pairs routed to each needed expert) in the order to serve them.

    Resident experts first (they compute while the copies run), then those already in flight (their
    copies were queued earlier), then the missing ones by decreasing pair count, so the expert whose
    compute is left after the last copy lands is the cheapest one. Ties keep the given order.
    """
    if len(counts) != len(states):
        raise ValueError(f"{len(counts)} counts for {len(states)} states")
    return sorted(range(len(counts)), key=lambda i: (states[i], -counts[i] if states[i] == MISSING else 0))


def sort_pairs(ids: Sequence[int], order: Sequence[int]) -> list[int]:
    """Indices of the (token, k) pairs whose experts are ``ids`` (the flattened [T*K] routing), grouped
    by their expert's position in ``order`` (the serving order), the pairs of one expert in their given
    order: the stable sort by serving position that ``torch.argsort(position[ids], stable=True)`` gives.
    Every id must be in ``order``.
    """
    by_expert: dict[int, list[int]] = {e: [] for e in order}
    for pair, expert in enumerate(ids):
        by_expert[expert].append(pair)
    return [pair for e in order for pair in by_expert[e]]


def group_sizes(num_fetched: int, record_bytes: int, min_group_bytes: int = MIN_GROUP_BYTES,
                max_groups: int = MAX_GROUPS) -> list[int]:
    """Sizes of the consecutive groups the ``num_fetched`` copies are split into; the compute of a
    group starts when its last copy lands.

    One expert per group when an expert's copy is at least ``min_group_bytes`` (DeepSeek-V3: 45 MB,
    0.8 ms at 55 GB/s, far longer than a kernel launch); smaller experts are grouped up to that many
    bytes, and never more than ``max_groups`` groups. Larger groups come first: the last one, whose
    compute is the tail of the call, is the smallest.
    """
    if num_fetched <= 0:
        return []
    per_group = max(1, -(-min_group_bytes // max(1, record_bytes)))
    num_groups = max(1, min(max_groups, -(-num_fetched // per_group)))
    base, extra = divmod(num_fetched, num_groups)
    return [base + 1] * extra + [base] * (num_groups - extra)


def split_rounds(num_experts: int, capacity: int) -> list[int]:
    """Sizes of the rounds ``num_experts`` experts stream through a pool of ``capacity`` slots.

    All at once when they fit; otherwise rounds of half the pool, so round i+1 is copied into one
    half while round i computes from the other.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if num_experts <= capacity:
        return [num_experts] if num_experts else []
    size = max(1, capacity // 2)
    return [min(size, num_experts - start) for start in range(0, num_experts, size)]


@dataclass(frozen=True)
class Group:
    """Consecutive experts ``[start, stop)`` of a round (in serving order) computed by one kernel call,
    after the copy of expert ``stop - 1`` lands when ``wait``."""

    start: int
    stop: int
    wait: bool


def round_groups(states: Sequence[int], record_bytes: int, overlap: bool = True,
                 min_group_bytes: int = MIN_GROUP_BYTES, max_groups: int = MAX_GROUPS) -> list[Group]:
    """The compute groups of one round whose experts, in serving order, are in ``states`` (at acquire).

    The leading resident experts form one group that needs no wait; in-flight and fetched ones follow in groups
    of :func:`group_sizes`. Without ``overlap`` everything is one group after every copy.
    """
    n = len(states)
    if n == 0:
        return []
    if not overlap:
        return [Group(0, n, wait=any(s != RESIDENT for s in states))]
    num_ready = 0
    while num_ready < n and states[num_ready] == RESIDENT:
        num_ready += 1
    # NOTE: a resident expert after the first non-resident one (evicted and re-fetched between plan
    # and acquire, or ordered so by the caller) joins a waiting group: correct, only later than possible.
    groups = [Group(0, num_ready, wait=False)] if num_ready else []
    start = num_ready
    for size in group_sizes(n - num_ready, record_bytes, min_group_bytes, max_groups):
        groups.append(Group(start, start + size, wait=True))
        start += size
    return groups


@dataclass(frozen=True)
class StreamPlan:
    """How a call's device experts (in serving order) go through a pool: consecutive rounds of
    ``rounds[i]`` experts, ``ahead`` rounds leased (their copies queued) at once, the fetched experts
    of a round computed in at most ``max_groups`` fused-kernel calls (resident ones at its head in one
    more, :func:`round_groups`)."""

    rounds: tuple[int, ...]
    ahead: int
    max_groups: int

    def steps(self) -> list[tuple[str, int]]:
        """The host's issue order, (ACQUIRE | COMPUTE | RELEASE, round).

        The first ``ahead`` rounds are acquired up front; then each round is computed, released, and
        the round ``ahead`` later acquired at once: its copies reuse the released round's slots, so
        they wait on that compute and on nothing else, and no other compute is queued before them.
        """
        n = len(self.rounds)
        out = [(ACQUIRE, r) for r in range(min(self.ahead, n))]
        for r in range(n):
            out += [(COMPUTE, r), (RELEASE, r)]
            if r + self.ahead < n:
                out.append((ACQUIRE, r + self.ahead))
        return out


def plan_stream(num_experts: int, capacity: int, streaming: str = HALVES, depth: int = RING_DEPTH) -> StreamPlan:
    """The :class:`StreamPlan` of ``num_experts`` device experts through ``capacity`` free slots.

    All in one round when they fit. Otherwise ``HALVES``: rounds of half the pool, the next one copied
    while the current one computes in up to MAX_GROUPS groups (one per expert for DeepSeek-V3: the host
    queues about 50 ops and 3 kernels per group). ``RING``: rounds of 1/``depth`` of the pool, ``depth``
    of them leased at once, each computed in one call after its copies: the host issues a round's
    work in one launch, and the copies of the next ``depth - 1`` rounds are queued while it computes.
    """
    if streaming not in STREAMING:
        raise ValueError(f"streaming must be one of {STREAMING}, got {streaming!r}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if num_experts <= capacity:
        return StreamPlan(tuple(split_rounds(num_experts, max(1, capacity))), 1, MAX_GROUPS)
    if streaming == HALVES:  # (a room of 3 holds three rounds of one)
        rounds = split_rounds(num_experts, capacity)
        return StreamPlan(tuple(rounds), capacity // rounds[0], MAX_GROUPS)
    size = max(1, capacity // depth)
    rounds = [min(size, num_experts - start) for start in range(0, num_experts, size)]
    return StreamPlan(tuple(rounds), capacity // size, 1)


def slot_reuse(plan: StreamPlan, capacity: int) -> list[list[int]]:
    """For each round of ``plan`` run through a pool of ``capacity`` empty slots: the rounds whose
    compute its copies wait for, i.e. that last read the slots it takes (empty: fresh slots).

    A model of :class:`~hearth.offload.expert_cache.ExpertCache` for a call that misses every expert:
    a round takes free slots first, then those released longest ago (LRU over unheld slots); a copy
    waits for the release of the slot it overwrites. Raises ValueError when an acquire finds fewer
    unheld slots than its round needs (the plan would hit a full cache).
    """
    free = list(range(capacity))  # never used: no wait
    released: list[tuple[int, int]] = []  # (slot, round that released it), oldest first
    held: dict[int, list[int]] = {}
    waits: list[list[int]] = [[] for _ in plan.rounds]
    for step, r in plan.steps():
        if step == ACQUIRE:
            need = plan.rounds[r]
            if need > len(free) + len(released):
                raise ValueError(f"round {r} needs {need} slots, {len(free) + len(released)} are not held")
            fresh, free = free[:need], free[need:]
            reused, released = released[:need - len(fresh)], released[need - len(fresh):]
            held[r] = fresh + [slot for slot, _ in reused]
            waits[r] = sorted({by for _, by in reused})
        elif step == RELEASE:
            released += [(slot, r) for slot in held.pop(r)]
    return waits
