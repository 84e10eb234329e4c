"""Host-side plan of one routed-experts call: in which order the needed experts are served, how the
fetched ones are grouped for compute-as-they-arrive, and how a call that needs more experts than
the pool holds is split into rounds. Pure functions on ints: no tensors, no CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RESIDENT, IN_FLIGHT, MISSING = 0, 1, 2  # an expert's state in the cache before the call
MIN_GROUP_BYTES = 16 << 20  # below this one group's copy is too short to hide a compute launch
MAX_GROUPS = 32  # per round: each group costs one fused-kernel call


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
