"""Short-row top-k (hearth.kernels.topk.short_row, the row in registers) against torch: the selection
is torch's stable descending sort cut at k (`topk_ref`) index for index, so ties go to the lower
index and the output is sorted; its scores are torch.topk's."""

import pytest
import torch

from hearth.kernels.topk import topk_indices_short
from hearth.kernels.topk.reference import check_topk, topk_ref

SIZES = [(1, 1), (3, 5), (63, 17), (257, 256), (1000, 3), (2049, 256), (4095, 511), (4096, 512)]


@pytest.mark.parametrize("n,k", SIZES)
def test_short_rows_equal_torch(n, k, device):
    s = torch.randn(5, n, device=device) * 10
    s[1] = torch.randint(0, 4, (n,), device=device).float()  # ties across the cut
    s[2] = torch.where(torch.rand(n, device=device) < 0.5, 0.0, -0.0)  # signed zeros tie, as in torch
    s[3, ::3] = float("-inf")
    lengths = torch.tensor([n, max(n - 2, 0), n, n // 2 + 1, min(k, n)], dtype=torch.int32, device=device)
    got = topk_indices_short(s, lengths, k)
    check_topk(got, s, lengths, k)
    assert torch.equal(got.cpu(), topk_ref(s, lengths, k).cpu())
    for r in range(5):
        valid = s[r, : int(lengths[r])]
        want = valid.topk(min(k, valid.numel())).values
        assert torch.equal(s[r, got[r, : want.numel()].long()], want)


def test_short_rows_refuse_long_rows(device):
    s = torch.zeros(1, 4097, device=device)
    with pytest.raises(ValueError, match="4096"):
        topk_indices_short(s, torch.tensor([4097], dtype=torch.int32, device=device), 8)
