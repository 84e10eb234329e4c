"""Exact row-wise top-k for decode rows in one launch: one program per row, cutoff + compaction.

The multi-CTA radix select (`radix.py`) pays six launches and four full passes over every row. Decode
rows are few, so here one program owns a whole row and keeps its histograms and counters in registers:

1. one streaming pass builds the 256-bin histogram of the top digit of the order key (the signed top
   byte: the sign and 7 of the 8 exponent bits, so a bin spans two binades) and picks the cutoff bin
   that holds the k-th largest key;
2. a second pass writes the indices of keys above the cutoff bin straight to the output (they are
   all in the top-k) and compacts the cutoff bin's (key, index) pairs into a per-row scratch buffer;
3. the three remaining 8-bit digits are resolved on the compacted survivors only, then the survivors
   above the exact threshold and as many equal to it as are still needed are appended (any ties win).

When the cutoff bin holds more survivors than the scratch buffer (e.g. a ReLU row whose k-th largest
is 0 with thousands of zeros), step 3 runs over the row itself, filtered to the cutoff bin, so the
result is always exact; it only costs more passes. Output is unsorted, like `radix.topk_indices`;
rows with length L <= k return 0..L-1 then -1. No workspace zeroing and no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import float_order_key, require
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS, checked_output, radix_digit

SCRATCH_PER_K = 4  # default survivor capacity, in multiples of k


@triton.jit
def pick_bin(b_hist, k_rem, NBINS: tl.constexpr):
    """Bin holding the k_rem-th largest element of a register histogram; returns (bin, rank left in it)."""
    o_b = tl.arange(0, NBINS)
    b_ge = tl.sum(b_hist, 0) - tl.cumsum(b_hist, 0) + b_hist  # elements in bins >= b
    i_sel = tl.sum((b_ge >= k_rem).to(tl.int32), 0) - 1
    n_gt = tl.sum(tl.where(o_b > i_sel, b_hist, 0), 0)
    return i_sel, k_rem - n_gt


@triton.jit
def _keys(p_src, p_x, o_t, m_t, FROM_ROW: tl.constexpr):
    """Order keys at positions o_t of the source: the fp32 row itself or the compacted scratch keys."""
    if FROM_ROW:
        b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
    else:
        b_key = tl.load(p_src + o_t, mask=m_t, other=0)
    return b_key


@triton.jit
def _finish(
    p_x,
    p_keys,
    p_idx,
    p_out,
    n_src,
    prefix,
    k_rem,
    n_done,
    K,
    FROM_ROW: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Select the k_rem largest keys among the source's keys whose top digit equals prefix and append
    their indices to out[n_done:K]. The source is the scratch buffer (n_src survivors, all in the
    cutoff bin) or, after an overflow, the row itself (n_src = row length, filtered by the prefix)."""
    o_b = tl.arange(0, NBINS)
    for p in tl.static_range(1, PASSES):
        b_hist = tl.zeros([NBINS], dtype=tl.int32)
        n_skip = 0
        for i0 in range(0, n_src, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < n_src
            b_key = _keys(p_keys, p_x, o_t, m_t, FROM_ROW)
            m_hit = m_t & ((b_key >> (32 - BITS * p)) == prefix)
            # misses go to bin 0 and are subtracted once at the end (no masked histogram in older Triton)
            b_hist += tl.histogram(tl.where(m_hit, radix_digit(b_key, p, NBINS, BITS), 0), NBINS)
            n_skip += tl.sum((~m_hit).to(tl.int32), 0)
        b_hist -= tl.where(o_b == 0, n_skip, 0)
        i_sel, k_rem = pick_bin(b_hist, k_rem, NBINS)
        prefix = prefix * NBINS + i_sel
    # prefix is now the full threshold key; K - k_rem keys in total lie above it
    n_gt = n_done
    n_eq = 0
    n_above = K - k_rem
    for i0 in range(0, n_src, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n_src
        b_key = _keys(p_keys, p_x, o_t, m_t, FROM_ROW)
        if FROM_ROW:
            b_idx = o_t
        else:
            b_idx = tl.load(p_idx + o_t, mask=m_t, other=0)
        m_gt = m_t & (b_key > prefix) & ((b_key >> (32 - BITS)) == (prefix >> (32 - BITS)))
        m_eq = m_t & (b_key == prefix)
        c_gt = tl.cumsum(m_gt.to(tl.int32), 0)
        tl.store(p_out + n_gt + c_gt - 1, b_idx, mask=m_gt)
        n_gt += tl.sum(m_gt.to(tl.int32), 0)
        o_rank = n_eq + tl.cumsum(m_eq.to(tl.int32), 0) - 1
        tl.store(p_out + n_above + o_rank, b_idx, mask=m_eq & (o_rank < k_rem))
        n_eq += tl.sum(m_eq.to(tl.int32), 0)


@triton.jit
def select_row(
    p_x,
    n_len,
    p_out,
    p_keys,
    p_idx,
    K,
    CAP,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the indices of the K largest of the row's n_len > K keys to p_out[0:K], with the CAP-entry
    scratch buffers p_keys / p_idx (also the sampled kernel's exact fallback for a row)."""
    o_b = tl.arange(0, NBINS)
    # 1. histogram of the top digit over the whole row
    b_hist = tl.zeros([NBINS], dtype=tl.int32)
    n_pad = 0
    for i0 in range(0, n_len, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n_len
        b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
        b_hist += tl.histogram(tl.where(m_t, radix_digit(b_key, 0, NBINS, BITS), 0), NBINS)
        n_pad += tl.sum((~m_t).to(tl.int32), 0)
    b_hist -= tl.where(o_b == 0, n_pad, 0)
    i_cut, k_rem = pick_bin(b_hist, K, NBINS)
    n_surv = tl.sum(tl.where(o_b == i_cut, b_hist, 0), 0)
    prefix = i_cut - NBINS // 2  # the cutoff bin as a signed top byte
    n_room = tl.where(n_surv <= CAP, CAP, 0)  # on overflow nothing is compacted
    # 2. keys above the cutoff bin go straight to the output; the cutoff bin is compacted
    n_gt = 0
    n_kept = 0
    for i0 in range(0, n_len, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n_len
        b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
        b_top = b_key >> (32 - BITS)
        m_gt = m_t & (b_top > prefix)
        tl.store(p_out + n_gt + tl.cumsum(m_gt.to(tl.int32), 0) - 1, o_t, mask=m_gt)
        n_gt += tl.sum(m_gt.to(tl.int32), 0)
        m_eq = m_t & (b_top == prefix)
        o_dst = n_kept + tl.cumsum(m_eq.to(tl.int32), 0) - 1
        tl.store(p_keys + o_dst, b_key, mask=m_eq & (o_dst < n_room))
        tl.store(p_idx + o_dst, o_t, mask=m_eq & (o_dst < n_room))
        n_kept += tl.sum(m_eq.to(tl.int32), 0)
    # 3. exact finish inside the cutoff bin
    if n_surv <= CAP:
        _finish(p_x, p_keys, p_idx, p_out, n_surv, prefix, k_rem, n_gt, K, False, NBINS, BITS, PASSES, BLOCK)
    else:
        _finish(p_x, p_keys, p_idx, p_out, n_len, prefix, k_rem, n_gt, K, True, NBINS, BITS, PASSES, BLOCK)


@triton.jit
def _topk_single_pass_kernel(
    x_ptr,
    len_ptr,
    out_ptr,
    scratch_ptr,
    stride_x,
    stride_out,
    stride_scratch,
    K,
    CAP,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_r = tl.program_id(0)
    n_len = tl.load(len_ptr + i_r)
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    if n_len <= K:
        # every valid entry is selected: out[t] = t for t < L, -1 up to k
        for i0 in range(0, K, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            tl.store(p_out + o_t, tl.where(o_t < n_len, o_t, -1), mask=o_t < K)
    else:
        p_keys = scratch_ptr + i_r.to(tl.int64) * stride_scratch
        select_row(
            x_ptr + i_r.to(tl.int64) * stride_x, n_len, p_out, p_keys, p_keys + CAP, K, CAP, NBINS, BITS, PASSES, BLOCK
        )


def new_scratch(n_rows: int, k: int, device: torch.device, capacity: int | None = None) -> torch.Tensor:
    """Uninitialised int32 survivor buffer [n_rows, 2 * capacity] (keys, then indices) for
    `single_pass_topk_launch`; capacity defaults to SCRATCH_PER_K * k."""
    cap = SCRATCH_PER_K * k if capacity is None else capacity
    require(cap >= 1, f"scratch capacity must be >= 1, got {cap}")
    return torch.empty(n_rows, 2 * cap, dtype=torch.int32, device=device)


def single_pass_topk_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    scratch: torch.Tensor,
    block: int = 2048,
    num_warps: int = 16,
) -> None:
    """Launch the single-pass kernel on already validated buffers (see `topk_indices_single_pass`);
    the survivor capacity is scratch.shape[1] // 2."""
    n_rows = scores.shape[0]
    _topk_single_pass_kernel[(n_rows,)](
        scores,
        lengths,
        out,
        scratch,
        scores.stride(0),
        out.stride(0),
        scratch.stride(0),
        k,
        scratch.shape[1] // 2,
        NBINS=NBINS,
        BITS=RADIX_BITS,
        PASSES=PASSES,
        BLOCK=block,
        num_warps=num_warps,
    )


def topk_indices_single_pass(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """Exact top-k indices per row, unsorted, one program per row (for few, long rows: decode).

    Same contract as `hearth.kernels.topk.topk_indices` (fp32 scores [R, N] with unit last stride,
    int32 lengths [R], 1 <= k <= 65536, optional int32 out [R, k]; ties broken arbitrarily; rows with
    L <= k give 0..L-1 then -1). capacity: survivors kept per row before the exact-but-slower
    fallback over the whole row (default 4 * k)."""
    out = checked_output(scores, lengths, k, out)
    if out.shape[0] == 0:
        return out
    scratch = new_scratch(out.shape[0], k, scores.device, capacity)
    single_pass_topk_launch(scores, lengths, k, out, scratch)
    return out
