"""Exact row-wise top-k by multi-CTA radix select (no sort).

Each fp32 score maps to an int32 key with the same order (`float_order_key`). The k-th largest key
is found digit by digit, four 8-bit digits, most significant first: one histogram launch per digit,
each row split into segments whose programs add their local histogram into the row's workspace with
atomics; every program re-derives the digits chosen so far from the finished histograms (256 bins,
cheap), so no host sync and no extra "scan" launch is needed. A last launch writes the indices of
keys above the threshold and as many keys equal to it as are still needed (any ties win), through
per-row atomic counters. Output is unsorted; rows with length L <= k return 0..L-1 then -1.

Workspace per row (int32, zeroed before use): 4 histograms of NBINS, then 2 counters.
NOTE: 8-bit digits because `tl.histogram`'s cost grows with the bin count (a 2048-bin version measured
about 10x slower per pass on the H200).
The decode indexer can add the first histogram itself (`first_pass_done=True`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, float_order_key, require

RADIX_BITS = 8
NBINS = 1 << RADIX_BITS
PASSES = 32 // RADIX_BITS
WS_STRIDE = PASSES * NBINS + 32  # histograms + counters (padded)
CNT_OFFSET = PASSES * NBINS
MAX_K = 1 << 16


@triton.jit
def _pick_bin(p_hist, k_rem, NBINS: tl.constexpr):
    """Bin holding the k_rem-th largest of the histogram's elements; returns (bin, rank left in it)."""
    o_b = tl.arange(0, NBINS)
    b_h = tl.load(p_hist + o_b)
    b_ge = tl.sum(b_h, 0) - tl.cumsum(b_h, 0) + b_h  # elements in bins >= b
    i_sel = tl.sum((b_ge >= k_rem).to(tl.int32), 0) - 1
    n_gt = tl.sum(tl.where(o_b > i_sel, b_h, 0), 0)
    return i_sel, k_rem - n_gt


@triton.jit
def _threshold(p_ws, K, DONE: tl.constexpr, NBINS: tl.constexpr, BITS: tl.constexpr):
    """Signed key prefix fixed by the first DONE digits (the top digit is the signed top byte) and
    the number of elements still to take inside it."""
    k_rem = K
    prefix = 0
    for p in tl.static_range(DONE):
        i_sel, k_rem = _pick_bin(p_ws + p * NBINS, k_rem, NBINS)
        if p == 0:
            prefix = i_sel - NBINS // 2
        else:
            prefix = prefix * NBINS + i_sel
    return prefix, k_rem


@triton.jit
def radix_digit(b_key, PASS: tl.constexpr, NBINS: tl.constexpr, BITS: tl.constexpr):
    """Bin of each key in pass PASS (top digit first; the top digit's sign bit is flipped so that
    negative keys sort first)."""
    SHIFT: tl.constexpr = 32 - BITS * (PASS + 1)
    b_d = (b_key >> SHIFT) & (NBINS - 1)
    if PASS == 0:
        b_d = b_d ^ (NBINS // 2)
    return b_d


@triton.jit
def _topk_hist_kernel(
    x_ptr,
    len_ptr,
    ws_ptr,
    stride_x,
    K,
    SEG,
    PASS: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    WS_STRIDE: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    n_len = tl.load(len_ptr + i_r)
    if n_len > K:
        p_ws = ws_ptr + i_r.to(tl.int64) * WS_STRIDE
        prefix, k_rem = _threshold(p_ws, K, PASS, NBINS, BITS)
        o_b = tl.arange(0, NBINS)
        b_hist = tl.zeros([NBINS], dtype=tl.int32)
        n_skip = 0
        i_start = i_s * SEG
        i_end = tl.minimum(i_start + SEG, n_len)
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < i_end
            b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            b_d = radix_digit(b_key, PASS, NBINS, BITS)
            if PASS == 0:
                m_hit = m_t
            else:
                m_hit = m_t & ((b_key >> (32 - BITS * PASS)) == prefix)
            # misses go to bin 0 and are subtracted once at the end (no masked histogram in older Triton)
            b_hist += tl.histogram(tl.where(m_hit, b_d, 0), NBINS)
            n_skip += tl.sum((~m_hit).to(tl.int32), 0)
        b_hist -= tl.where(o_b == 0, n_skip, 0)
        tl.atomic_add(p_ws + PASS * NBINS + o_b, b_hist, mask=b_hist > 0)


@triton.jit
def _through_pages(map_ptr, o_t, m_t, MAP_PAGE: tl.constexpr):
    """Indices o_t as they are, or (MAP_PAGE > 0) read through a page table: entry t of the row lies
    on page map[t // MAP_PAGE], at offset t % MAP_PAGE."""
    if MAP_PAGE > 0:
        b_page = tl.load(map_ptr + o_t // MAP_PAGE, mask=m_t, other=0)
        o_t = b_page * MAP_PAGE + o_t % MAP_PAGE
    return o_t


@triton.jit
def _topk_gather_kernel(
    x_ptr,
    len_ptr,
    ws_ptr,
    out_ptr,
    map_ptr,
    stride_x,
    stride_out,
    K,
    SEG,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
    WS_STRIDE: tl.constexpr,
    CNT_OFFSET: tl.constexpr,
    MAP_PAGE: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    n_len = tl.load(len_ptr + i_r)
    i_start = i_s * SEG
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    if n_len <= K:
        # every valid entry is selected: out[t] = t for t < L, -1 up to k
        i_end = tl.minimum(i_start + SEG, K)
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < n_len
            tl.store(p_out + o_t, tl.where(m_t, _through_pages(map_ptr, o_t, m_t, MAP_PAGE), -1), mask=o_t < i_end)
    else:
        p_ws = ws_ptr + i_r.to(tl.int64) * WS_STRIDE
        b_thr, k_rem = _threshold(p_ws, K, PASSES, NBINS, BITS)
        n_above = K - k_rem
        i_end = tl.minimum(i_start + SEG, n_len)
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < i_end
            b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            m_gt = m_t & (b_key > b_thr)
            m_eq = m_t & (b_key == b_thr)
            o_v = _through_pages(map_ptr, o_t, m_gt | m_eq, MAP_PAGE)
            n_gt = tl.sum(m_gt.to(tl.int32), 0)
            if n_gt > 0:
                i_base = tl.atomic_add(p_ws + CNT_OFFSET, n_gt)
                o_dst = i_base + tl.cumsum(m_gt.to(tl.int32), 0) - 1
                tl.store(p_out + o_dst, o_v, mask=m_gt)
            n_eq = tl.sum(m_eq.to(tl.int32), 0)
            if n_eq > 0:
                i_base = tl.atomic_add(p_ws + CNT_OFFSET + 1, n_eq)
                o_rank = i_base + tl.cumsum(m_eq.to(tl.int32), 0) - 1
                tl.store(p_out + n_above + o_rank, o_v, mask=m_eq & (o_rank < k_rem))


def _segments(n_rows: int, n_cols: int, block: int, target_programs: int = 1024) -> int:
    """Segment length (a multiple of block) so that rows x segments gives about target_programs."""
    n_seg = max(1, min(triton.cdiv(n_cols, block), triton.cdiv(target_programs, max(n_rows, 1))))
    return triton.cdiv(triton.cdiv(max(n_cols, 1), n_seg), block) * block


def radix_topk_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    workspace: torch.Tensor,
    first_pass_done: bool = False,
    block: int = 1024,
    page_map: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Launch the radix passes on already validated buffers (see `topk_indices`). page_map (table,
    page_size): write each selected index t as table[t // page_size] * page_size + t % page_size
    (a one-row table, int32: logical positions of a paged row back to token positions)."""
    n_rows, n_cols = scores.shape
    require(page_map is None or n_rows == 1, "page_map maps the indices of one row")
    seg = _segments(n_rows, n_cols, block)
    grid = (n_rows, triton.cdiv(max(n_cols, 1), seg))
    for p in range(1 if first_pass_done else 0, PASSES):
        _topk_hist_kernel[grid](
            scores,
            lengths,
            workspace,
            scores.stride(0),
            k,
            seg,
            PASS=p,
            NBINS=NBINS,
            BITS=RADIX_BITS,
            BLOCK=block,
            WS_STRIDE=WS_STRIDE,
            num_warps=8,
        )
    grid_g = (n_rows, triton.cdiv(max(n_cols, k), seg))
    _topk_gather_kernel[grid_g](
        scores,
        lengths,
        workspace,
        out,
        out if page_map is None else page_map[0],
        scores.stride(0),
        out.stride(0),
        k,
        seg,
        NBINS=NBINS,
        BITS=RADIX_BITS,
        PASSES=PASSES,
        BLOCK=block,
        WS_STRIDE=WS_STRIDE,
        CNT_OFFSET=CNT_OFFSET,
        MAP_PAGE=0 if page_map is None else page_map[1],
        num_warps=8,
    )


def new_workspace(n_rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 workspace [n_rows, WS_STRIDE] for `radix_topk_launch`."""
    return torch.zeros(n_rows, WS_STRIDE, dtype=torch.int32, device=device)


def checked_output(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None) -> torch.Tensor:
    """Check a top-k launcher's arguments (ValueError naming the bad one); returns ``out``, allocated
    as int32 [R, k] when None."""
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=2, contiguous=False)
    require(scores.stride(1) == 1, f"scores must have unit last stride, got strides {scores.stride()}")
    check_tensor("lengths", lengths, dtypes=(torch.int32,), shape=(scores.shape[0],), device=scores.device)
    require(1 <= k <= MAX_K, f"k must be in [1, {MAX_K}], got {k}")
    if out is None:
        out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    check_tensor("out", out, dtypes=(torch.int32,), shape=(scores.shape[0], k), device=scores.device)
    return out


def topk_indices(
    scores: torch.Tensor, lengths: torch.Tensor, k: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact top-k indices per row, unsorted, by radix select.

    Args:
        scores: [R, N] fp32, unit last stride (row stride may be larger; entries past a row's length
            are never read). NaN is not supported.
        lengths: [R] int32, valid entries per row, 0 <= lengths[r] <= N (not checked: no host sync).
        k: 1 <= k <= 65536.
        out: optional preallocated int32 [R, k] output.
    Returns:
        int32 [R, k]: for rows with L > k, the indices of k largest entries among [0, L) in no particular
        order (ties broken arbitrarily); for rows with L <= k, 0..L-1 followed by -1.
    """
    out = checked_output(scores, lengths, k, out)
    if out.shape[0] == 0:
        return out
    ws = new_workspace(out.shape[0], scores.device)
    radix_topk_launch(scores, lengths, k, out, ws)
    return out
