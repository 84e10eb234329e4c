"""Radix-select top-k vs a sort-based reference; any tie order is accepted (`check_topk`)."""

import pytest
import torch

from hearth.kernels.topk import topk_indices
from hearth.kernels.topk.reference import check_topk, topk_ref
from tests.kernels.conftest import requires_cuda

POISON = 0x5A5A5A5A


def _run(scores, lengths, k):
    out = torch.full((scores.shape[0], k), POISON, dtype=torch.int32, device=scores.device)
    idx = topk_indices(scores, lengths, k, out=out)
    assert idx.data_ptr() == out.data_ptr()
    check_topk(idx, scores, lengths, k)
    return idx


@pytest.mark.parametrize("n,k", [(1, 4), (63, 16), (2049, 64), (2049, 2048), (100, 2048), (5000, 300)])
def test_topk_random_rows(n, k, device):
    lengths = torch.tensor([n, max(n - 1, 0), n // 2, min(k, n), min(k + 1, n), 0], dtype=torch.int32)
    scores = torch.randn(6, n, device=device) * 10
    _run(scores, lengths.to(device), k)


def test_topk_ties_and_infinities(device):
    n, k = 3000, 100
    s = torch.randn(8, n, device=device)
    s[0] = torch.randint(0, 5, (n,), device=device).float()  # heavy ties across the threshold
    s[1] = 1.0  # all equal
    s[2] = float("-inf")  # -inf row longer than k: any k indices are valid
    s[3, ::2] = float("-inf")  # half -inf
    s[4] = -s[4].abs()  # all negative
    s[5] = torch.where(torch.rand(n, device=device) < 0.5, 0.0, -0.0)  # signed zeros tie
    s[6, :50] = float("inf")
    s[7] = torch.randn(n, device=device).half().float() * 1e-30  # tiny values, close keys
    lengths = torch.tensor([n, n, n, 2 * k + 1, n - 7, n, 77, n], dtype=torch.int32, device=device)
    _run(s, lengths, k)


def test_topk_strided_rows(device):
    base = torch.randn(4, 700, device=device)
    scores = base[:, :600]  # row stride 700
    _run(scores, torch.tensor([600, 599, 1, 300], dtype=torch.int32, device=device), 128)


def test_reference_is_a_valid_topk():
    s = torch.randint(0, 3, (5, 200)).float()
    s[2] = float("-inf")
    lengths = torch.tensor([200, 10, 150, 0, 64], dtype=torch.int32)
    check_topk(topk_ref(s, lengths, 64), s, lengths, 64)


def test_check_rejects_a_wrong_set():
    s = torch.arange(10.0)[None]
    lengths = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(AssertionError):
        check_topk(torch.tensor([[9, 8, 6]], dtype=torch.int32), s, lengths, 3)


def test_layout_errors(device):
    s = torch.randn(2, 10, device=device)
    lengths = torch.tensor([10, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(s.double(), lengths, 4)
    with pytest.raises(ValueError, match="lengths"):
        topk_indices(s, lengths.long(), 4)
    with pytest.raises(ValueError, match="k must"):
        topk_indices(s, lengths, 0)
    with pytest.raises(ValueError, match="unit last stride"):
        topk_indices(s.t(), torch.tensor([2] * 10, dtype=torch.int32, device=device), 1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,n", [(64, 131072), (1, 1 << 20), (4096, 8192)])
def test_topk_real_shapes_gpu(rows, n):
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    lengths[0] = n
    idx = _run(s, lengths, 2048)
    # cross-check a few rows against torch.topk's value set
    for r in range(min(rows, 4)):
        want = torch.topk(s[r, : lengths[r]], 2048).values.sort().values
        assert torch.equal(s[r, idx[r].long()].sort().values, want)
