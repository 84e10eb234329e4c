"""Exact row-wise top-k of short rows (<= MAX_SHORT_N entries), one program per row, in registers.

A program loads its whole row once and keeps its k largest entries with Triton's bitonic top-k
(`tl.topk`), no histogram passes and no scratch memory: for a row of a few thousand entries (the
candidate pages of tiered keys: ~2K page scores, k 256) the passes of the radix or single-pass
selects cost more than the row.

Each entry becomes one distinct int64 sort key: the score's order key (`float_order_key`, with -0
made +0 so that signed zeros tie as they do in torch) in the high 32 bits and N_P2 - 1 - index in
the low 32 bits. The selection is therefore torch's stable descending sort cut at k
(`reference.topk_ref`), index for index: ties go to the lower index, and the output is sorted by
score (descending, ties by index); rows with length L <= k give their L entries in that order, then
-1. NaN is not supported.

`short_row_select` picks the same entries without the bitonic network (which costs O(N log^2 N)
compare-exchanges of int64 keys across warps): it bisects the k-th largest order key with 32 counts
of the row and returns a mask, which a caller lists in index order with one cumsum (the tiered coarse
step's candidate pages); `short_row_narrow_select` bisects only the row's own key range and stops at
the first midpoint exactly k entries reach; `short_row_hist_select` finds the same cut with 4 radix
histograms (8-bit digits) of the row in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import float_order_key, require
from hearth.kernels.topk.radix import checked_output
from hearth.kernels.topk.sampled import select_prefix

MAX_SHORT_N = 4096  # row entries one program holds (the sort keys of a row live in registers)


@triton.jit
def short_row_topk(b_x, m_t, N_P2: tl.constexpr, K_P2: tl.constexpr):
    """Indices [K_P2] int32 of the K_P2 largest of the row b_x [N_P2] fp32 where m_t holds (valid
    entries only), best first, ties by lower index; ranks past the valid count are meaningless."""
    o_t = tl.arange(0, N_P2)
    b_x = tl.where(b_x == 0.0, 0.0, b_x)  # -0 == +0
    b_key = (float_order_key(b_x).to(tl.int64) << 32) | (N_P2 - 1 - o_t).to(tl.int64)
    b_key = tl.where(m_t, b_key, tl.full([N_P2], -(2**63), dtype=tl.int64))
    b_top = tl.topk(b_key, K_P2)
    return (N_P2 - 1 - (b_top & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _mask_at_cut(b_key, m_t, cut, k):
    """The k valid entries whose order keys b_key are the largest, given the k-th largest key cut:
    every key above it, then keys equal to it lowest index first."""
    m_above = m_t & (b_key > cut)
    m_tie = m_t & (b_key == cut)
    room = k - tl.sum(m_above.to(tl.int32), 0)
    return m_above | (m_tie & (tl.cumsum(m_tie.to(tl.int32), 0) <= room))


@triton.jit
def short_row_select(b_x, m_t, k):
    """Mask [N] of the k largest valid entries of the row b_x [N] fp32 (valid where m_t holds): the
    same set as `short_row_topk` (torch's stable descending sort cut at k, ties to the lower index;
    every valid entry when fewer than k), as a mask, so a caller lists them in index order with one
    cumsum and no sort. The k-th largest order key is found by bisection over the int32 key range
    (32 counts of the row in registers, no bitonic network); entries equal to it are taken lowest
    index first."""
    b_key = float_order_key(tl.where(b_x == 0.0, 0.0, b_x))  # -0 == +0
    lo = tl.full([], -(2**31), dtype=tl.int64)  # the largest key t with count(key >= t) >= k so far
    hi = tl.full([], 2**31 - 1, dtype=tl.int64)
    for _ in tl.static_range(32):
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((m_t & (b_key >= mid.to(tl.int32))).to(tl.int32), 0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return _mask_at_cut(b_key, m_t, lo.to(tl.int32), k)


@triton.jit
def short_row_narrow_select(b_x, m_t, k):
    """`short_row_select`'s mask (the same entries) in fewer counts: the bisection starts from the
    row's own key range [min, max] (two reductions) instead of the whole int32 range, and stops at
    the first midpoint that exactly k entries reach (then no entry ties at the cut). Each count is
    a reduction across the program's warps, which is most of a step's cost: a row of ~2K page scores
    whose keys span ~2^26 needs ~12-16 counts instead of 32. Every valid entry when there are at most k."""
    b_key = float_order_key(tl.where(b_x == 0.0, 0.0, b_x))  # -0 == +0
    # lo: a key that at least k entries reach (the least valid key reaches them all); hi: the greatest
    lo = tl.min(tl.where(m_t, b_key, 2**31 - 1), 0).to(tl.int64)
    hi = tl.max(tl.where(m_t, b_key, -(2**31)), 0).to(tl.int64)
    done = (tl.sum(m_t.to(tl.int32), 0) <= k).to(tl.int32)  # at most k valid entries: take them all
    while (lo < hi) & (done == 0):
        mid = (lo + hi + 1) >> 1
        reach = tl.sum((m_t & (b_key >= mid.to(tl.int32))).to(tl.int32), 0)
        lo = tl.where(reach >= k, mid, lo)
        hi = tl.where(reach >= k, hi, mid - 1)
        done = (reach == k).to(tl.int32)
    return _mask_at_cut(b_key, m_t, lo.to(tl.int32), k)


@triton.jit
def short_row_hist_select(b_x, m_t, k, BITS: tl.constexpr, PASSES: tl.constexpr):
    """`short_row_select`'s mask (the same entries), its cut found by PASSES radix histograms of the
    row in registers (`tl.histogram` of BITS-bit digits, most significant first, among the entries
    that share the digits found so far) instead of 32 bisection counts: 4 histograms of 256 bins for
    8-bit digits (`sampled.select_prefix`). Every valid entry when there are at most k."""
    b_key = float_order_key(tl.where(b_x == 0.0, 0.0, b_x))  # -0 == +0
    prefix, k_rem = select_prefix(b_key, m_t, k, BITS, PASSES)
    # prefix is the k-th largest key; k_rem entries equal to it are taken, lowest index first
    m_above = m_t & (b_key > prefix)
    m_tie = m_t & (b_key == prefix)
    m_best = m_above | (m_tie & (tl.cumsum(m_tie.to(tl.int32), 0) <= k_rem))
    return tl.where(tl.sum(m_t.to(tl.int32), 0) <= k, m_t, m_best)


@triton.jit
def _topk_short_kernel(
    x_ptr,
    len_ptr,
    out_ptr,
    stride_x,
    stride_out,
    K,
    N_P2: tl.constexpr,
    K_P2: tl.constexpr,
):
    i_r = tl.program_id(0)
    n_len = tl.load(len_ptr + i_r)
    o_t = tl.arange(0, N_P2)
    m_t = o_t < n_len
    b_x = tl.load(x_ptr + i_r.to(tl.int64) * stride_x + o_t, mask=m_t, other=0.0)
    b_idx = short_row_topk(b_x, m_t, N_P2, K_P2)
    o_k = tl.arange(0, K_P2)
    tl.store(out_ptr + i_r.to(tl.int64) * stride_out + o_k, tl.where(o_k < n_len, b_idx, -1), mask=o_k < K)


def short_row_sizes(n_cols: int, k: int) -> tuple[int, int]:
    """(N_P2, K_P2) of `short_row_topk` for rows of n_cols entries and top-k k."""
    k_p2 = triton.next_power_of_2(k)
    return max(triton.next_power_of_2(max(n_cols, 1)), k_p2), k_p2


def short_row_warps(n_p2: int) -> int:
    return 4 if n_p2 <= 1024 else 8


def topk_indices_short(
    scores: torch.Tensor, lengths: torch.Tensor, k: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact top-k indices of rows of at most MAX_SHORT_N entries, sorted (see the module doc).

    Same arguments as `hearth.kernels.topk.topk_indices` (fp32 scores [R, N] with unit last stride,
    int32 lengths [R], optional int32 out [R, k]) with N <= 4096 and k <= 4096; the result equals
    `reference.topk_ref`."""
    out = checked_output(scores, lengths, k, out)
    require(scores.shape[1] <= MAX_SHORT_N, f"rows must have at most {MAX_SHORT_N} entries, got {scores.shape[1]}")
    require(k <= MAX_SHORT_N, f"k must be at most {MAX_SHORT_N} for short rows, got {k}")
    if out.shape[0] == 0:
        return out
    n_p2, k_p2 = short_row_sizes(scores.shape[1], k)
    _topk_short_kernel[(out.shape[0],)](
        scores, lengths, out, scores.stride(0), out.stride(0), k, N_P2=n_p2, K_P2=k_p2, num_warps=short_row_warps(n_p2)
    )
    return out
