"""Device-planned residency (hearth.kernels.tiered): over random candidate sequences every named id
reads its own host row from the slot the plan gives it, ring ids map to id % ring, a step's slots
are distinct, rows a step hits stay (no re-fetch), and only misses are copied. Under the CPU
interpreter the "host" pool is an ordinary CPU tensor; on the GPU it is pinned and read in place."""

from __future__ import annotations

import pytest
import torch

from hearth.kernels.tiered import ResidencyPlan, gather_misses, plan_residency, residency
from hearth.kernels.tiered.residency import GATHER_PROGRAMS


def _host_pool(n: int, width: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(n * width, dtype=torch.int32).view(n, width) % 9973
    return rows.pin_memory() if device.type == "cuda" else rows


# (the last: more misses than GATHER_PROGRAMS, so each gather program copies several rows)
@pytest.mark.parametrize("ring,slots,cand,width", [(4, 8, 8, 24), (16, 40, 32, 7), (1, 33, 33, 2112),
                                                   (2, 300, 300, 5)])
@pytest.mark.parametrize("chunk", [None, 4])  # 4: the free slots are found over many rounds of the plan
def test_random_steps_read_the_right_rows(device, ring, slots, cand, width, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(residency, "SLOT_CHUNK", chunk)
    g = torch.Generator().manual_seed(slots)
    capacity = 700  # >= the last step's ring_start + ring
    host = _host_pool(capacity, width, device)
    dev = torch.full((ring + slots, width), -1, dtype=torch.int32, device=device)
    plan = ResidencyPlan.new(capacity, slots, cand, ring, device)
    previous: set[int] = set()
    cached: dict[int, int] = {}  # id -> slot, as the plan must keep it
    most = 0  # the most misses of a step
    for step in range(12):
        ring_start = 650 + step
        n = cand if step == 0 else int(torch.randint(1, cand + 1, (1,), generator=g))  # (0: all misses)
        # half of the previous step's ids again (reuse), the rest fresh; a few ring ids
        keep = list(previous)[: n // 2]
        written = ring_start + ring  # ids past the ring's end are not written yet
        fresh = [i for i in torch.randperm(written, generator=g).tolist() if i not in keep][: n - len(keep)]
        ids = keep + fresh
        padded = torch.tensor(ids + [-1] * (cand - n), dtype=torch.int32, device=device)
        slot = plan_residency(plan, padded, torch.tensor([ring_start], dtype=torch.int32, device=device))
        gather_misses(plan, host, dev)
        got = slot.cpu().tolist()
        assert got[n:] == [-1] * (cand - n)
        assert len(set(got[:n])) == n, "two ids share a slot in one step"
        cold = [i for i in ids if i < ring_start]
        hits = [i for i in cold if i in cached]
        assert int(plan.n_miss) == len(cold) - len(hits)
        most = max(most, int(plan.n_miss))
        for i, s in zip(ids, got[:n]):
            if i >= ring_start:
                assert s == i % ring
                continue
            assert ring <= s < ring + slots
            if i in cached:
                assert s == cached[i], "a row the step hits moved"
            assert torch.equal(dev[s].cpu(), host[i].cpu()), f"slot {s} does not hold row {i}"
        owners = plan.owner.cpu().tolist()
        cached = {i: ring + s for s, i in enumerate(owners) if i >= 0}
        previous = set(cold)
    assert cand <= GATHER_PROGRAMS or most > GATHER_PROGRAMS


def test_bad_arguments_are_refused(device):
    with pytest.raises(ValueError, match="slots"):
        ResidencyPlan.new(10, 4, 8, 1, device)
    plan = ResidencyPlan.new(10, 8, 8, 1, device)
    with pytest.raises(ValueError, match="candidates"):
        plan_residency(plan, torch.zeros(4, dtype=torch.int32, device=device),
                       torch.zeros(1, dtype=torch.int32, device=device))
