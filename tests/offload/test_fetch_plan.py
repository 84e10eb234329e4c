"""The host-side plan of a routed-experts call: serving order, compute groups, streaming rounds."""

import pytest
import torch

from hearth.offload.fetch_plan import (
    IN_FLIGHT,
    MISSING,
    RESIDENT,
    Group,
    group_sizes,
    round_groups,
    serving_order,
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
