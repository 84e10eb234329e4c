"""Short-row top-k (hearth.kernels.topk.short_row, the row in registers) against torch: the selection
is torch's stable descending sort cut at k (`topk_ref`) index for index, so ties go to the lower
index and the output is sorted; its scores are torch.topk's."""

import pytest
import torch
import triton
import triton.language as tl

from hearth.kernels.topk import topk_indices_short
from hearth.kernels.topk.radix import PASSES, RADIX_BITS
from hearth.kernels.topk.reference import check_topk, topk_ref
from hearth.kernels.topk.short_row import short_row_hist_select, short_row_narrow_select, short_row_select

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


@triton.jit
def _select_in_order_kernel(x_ptr, len_ptr, out_ptr, stride, K, N_P2: tl.constexpr, HOW: tl.constexpr,
                            BITS: tl.constexpr, NPASS: tl.constexpr):
    """Row r's short_row_select (HOW 1: short_row_narrow_select, 2: short_row_hist_select), its entries
    listed in index order (as the tiered coarse step does)."""
    i_r = tl.program_id(0)
    o_t = tl.arange(0, N_P2)
    m_t = o_t < tl.load(len_ptr + i_r)
    b_x = tl.load(x_ptr + i_r * stride + o_t, mask=m_t, other=0.0)
    if HOW == 2:
        m_best = short_row_hist_select(b_x, m_t, K, BITS, NPASS)
    elif HOW == 1:
        m_best = short_row_narrow_select(b_x, m_t, K)
    else:
        m_best = short_row_select(b_x, m_t, K)
    tl.store(out_ptr + i_r * stride + tl.cumsum(m_best.to(tl.int32), 0) - 1, o_t, mask=m_best)


@pytest.mark.parametrize("how", ["select", "narrow", "hist"])
@pytest.mark.parametrize("n,k", SIZES)
def test_select_in_registers_picks_the_sorted_selection_in_index_order(n, k, how, device):
    """short_row_select (bisection, no sort network), short_row_narrow_select (bisection of the row's
    key range, stopping at an exact count) and short_row_hist_select (radix histograms) pick the same
    set as the sorted top-k, ties to the lower index, every valid entry when fewer than k; listed in
    index order. Rows 6 and 7 span the whole key range (+-inf and finite values; only negative)."""
    s = torch.randn(8, n, device=device) * 10
    s[1] = torch.randint(0, 4, (n,), device=device).float()  # ties across the cut
    s[2] = torch.where(torch.rand(n, device=device) < 0.5, 0.0, -0.0)  # signed zeros tie
    s[3, ::3] = float("-inf")
    s[4] = float("inf")  # all tied at the top of the key range
    s[5] = -torch.finfo(torch.float32).max  # all tied near its bottom
    s[6, ::5], s[6, 1::7] = float("inf"), float("-inf")
    s[7] = -s[7].abs() - 1e-30
    lengths = torch.tensor([n, max(n - 2, 0), n, n // 2 + 1, min(k, n), n, n, n], dtype=torch.int32, device=device)
    out = torch.full((8, n), -1, dtype=torch.int32, device=device)
    _select_in_order_kernel[(8,)](s, lengths, out, n, k, N_P2=triton.next_power_of_2(n),
                                 HOW=("select", "narrow", "hist").index(how), BITS=RADIX_BITS, NPASS=PASSES)
    want = topk_ref(s, lengths, k).cpu()
    for r in range(8):
        picked = sorted(i for i in want[r].tolist() if i >= 0)
        assert out[r, : len(picked)].cpu().tolist() == picked and (out[r, len(picked):] == -1).all()
