"""The host-side plan of a routed-experts call: serving order, compute groups, streaming rounds."""

import pytest
import torch

from hearth.offload.fetch_plan import (
    ACQUIRE,
    COMPUTE,
    HALVES,
    IN_FLIGHT,
    MAX_GROUPS,
    MISSING,
    RELEASE,
    RESIDENT,
    RING,
    Group,
    StreamPlan,
    group_sizes,
    plan_stream,
    round_groups,
    serving_order,
    slot_reuse,
    sort_pairs,
    split_rounds,
)

MB = 1 << 20


def test_serving_order_resident_then_in_flight_then_missing_by_pairs():
    counts = [1, 5, 2, 2, 7, 1]
    states = [MISSING, MISSING, RESIDENT, IN_FLIGHT, RESIDENT, MISSING]
    assert serving_order(counts, states) == [2, 4, 3, 1, 0, 5]  # ties (0, 5) keep their order
    with pytest.raises(ValueError):
        serving_order([1], [])


@pytest.mark.parametrize(
    ("num", "record", "want"),
    [
        (6, 45 * MB, [1] * 6),  # DeepSeek-V3 FP8 expert: one per group
        (0, 45 * MB, []),
        (10, 5 * MB, [4, 3, 3]),  # 4 x 5 MB reach 16 MiB: 3 groups, larger first
        (100, 45 * MB, [4] * 4 + [3] * 28),  # at most 32 groups
        (3, 1, [3]),
    ],
)
def test_group_sizes(num, record, want):
    sizes = group_sizes(num, record)
    assert sizes == want and sum(sizes) == num
    assert sizes == sorted(sizes, reverse=True)


def test_split_rounds():
    assert split_rounds(40, 64) == [40]
    assert split_rounds(0, 64) == []
    assert split_rounds(256, 64) == [32] * 8
    assert split_rounds(12, 5) == [2] * 6
    assert split_rounds(3, 1) == [1, 1, 1]
    with pytest.raises(ValueError):
        split_rounds(3, 0)


def test_round_groups_resident_first_then_each_fetch():
    states = [RESIDENT, RESIDENT, IN_FLIGHT, MISSING, MISSING]
    assert round_groups(states, 45 * MB) == [Group(0, 2, False), Group(2, 3, True), Group(3, 4, True),
                                             Group(4, 5, True)]
    assert round_groups(states, 45 * MB, overlap=False) == [Group(0, 5, True)]
    assert round_groups([RESIDENT] * 3, 45 * MB, overlap=False) == [Group(0, 3, False)]
    assert round_groups([MISSING] * 4, 1 * MB) == [Group(0, 4, True)]
    assert round_groups([], 1) == []


def test_round_groups_late_resident_joins_a_waiting_group():
    groups = round_groups([MISSING, RESIDENT, MISSING], 45 * MB)
    assert groups == [Group(0, 1, True), Group(1, 2, True), Group(2, 3, True)]


def test_sort_pairs_is_the_stable_argsort_by_serving_position():
    g = torch.Generator().manual_seed(0)
    for num_pairs in (1, 8, 64, 200):
        ids = torch.randint(0, 16, (num_pairs,), generator=g)
        needed = sorted(set(ids.tolist()))
        order = [needed[i] for i in torch.randperm(len(needed), generator=g).tolist()]
        position = torch.full((16,), len(order), dtype=torch.long)
        position[torch.tensor(order)] = torch.arange(len(order))
        want = torch.argsort(position[ids], stable=True).tolist()
        assert sort_pairs(ids.tolist(), order) == want
    assert sort_pairs([], []) == []


def test_plan_stream_halves_and_ring():
    """One round when the experts fit; halves: rounds of half the pool, two leased, per-expert groups;
    ring: rounds of 1/depth of the pool, depth leased, one group each. The 256-of-64 prefill case."""
    assert plan_stream(40, 64, RING) == StreamPlan((40,), 1, MAX_GROUPS)
    assert plan_stream(0, 64, HALVES) == StreamPlan((), 1, MAX_GROUPS)
    assert plan_stream(256, 64, HALVES) == StreamPlan((32,) * 8, 2, MAX_GROUPS)
    assert plan_stream(256, 64, RING) == StreamPlan((8,) * 32, 8, 1)
    assert plan_stream(250, 64, RING, depth=4) == StreamPlan((16,) * 15 + (10,), 4, 1)
    assert plan_stream(12, 5, RING) == StreamPlan((1,) * 12, 5, 1)  # fewer slots than depth: one by one
    assert plan_stream(3, 1, HALVES).ahead == plan_stream(3, 1, RING).ahead == 1
    with pytest.raises(ValueError):
        plan_stream(3, 2, "deep")
    with pytest.raises(ValueError):
        plan_stream(3, 2, RING, depth=0)


def test_plan_steps_queue_each_copy_right_after_the_compute_it_reuses():
    plan = StreamPlan((2, 2, 2, 1), ahead=2, max_groups=1)
    assert plan.steps() == [(ACQUIRE, 0), (ACQUIRE, 1), (COMPUTE, 0), (RELEASE, 0), (ACQUIRE, 2),
                            (COMPUTE, 1), (RELEASE, 1), (ACQUIRE, 3), (COMPUTE, 2), (RELEASE, 2),
                            (COMPUTE, 3), (RELEASE, 3)]


def _check_copies_wait_only_for_slot_reuse(plan: StreamPlan, capacity: int) -> None:
    """A round's copies are queued as soon as slots are free for them: the first ``ahead`` rounds up
    front into fresh slots, each later one right after the release of the newest round whose slots it
    takes, at least ``ahead`` rounds back. So the copy stream waits only for slot reuse (never for a
    later round's compute), and while round r computes the copies of the next ``ahead - 1`` are queued."""
    waits = slot_reuse(plan, capacity)
    steps = plan.steps()
    first_compute = steps.index((COMPUTE, 0)) if plan.rounds else 0
    for r in range(len(plan.rounds)):
        i = steps.index((ACQUIRE, r))
        if r < plan.ahead:
            assert waits[r] == [] and i < first_compute, (plan, r, waits[r])
        else:
            assert waits[r] and max(waits[r]) <= r - plan.ahead, (plan, r, waits[r])
            assert steps[i - 1] == (RELEASE, max(waits[r])), (plan, r, steps[i - 1])
        before_compute = steps[:steps.index((COMPUTE, r))]
        leased_ahead = {q for s, q in before_compute if s == ACQUIRE} - {q for s, q in before_compute if s == RELEASE}
        assert leased_ahead == set(range(r, min(r + plan.ahead, len(plan.rounds)))), (plan, r)


@pytest.mark.parametrize("streaming", [HALVES, RING])
@pytest.mark.parametrize(("num", "capacity"), [(256, 64), (250, 64), (12, 5), (7, 3), (3, 1), (9, 2)])
def test_stream_plans_copy_only_into_released_slots(streaming, num, capacity):
    plan = plan_stream(num, capacity, streaming)
    assert sum(plan.rounds) == num
    _check_copies_wait_only_for_slot_reuse(plan, capacity)


def test_slot_reuse_catches_plans_that_overfill_or_wait_on_the_wrong_compute():
    with pytest.raises(ValueError, match="needs 4 slots"):
        slot_reuse(StreamPlan((4, 4, 4), ahead=2, max_groups=1), capacity=6)
    # Rounds smaller than the room leave fresh slots to the third round: not the ring of ``ahead``.
    loose = StreamPlan((2, 2, 2, 2), ahead=2, max_groups=1)  # round 2 could have been copied up front
    assert slot_reuse(loose, capacity=6) == [[], [], [], [0]]
    with pytest.raises(AssertionError):
        _check_copies_wait_only_for_slot_reuse(loose, capacity=6)
