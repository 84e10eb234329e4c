"""Exact row-wise top-k for decode rows in one launch: several programs per row, a sampled cutoff,
compaction, and an exact finish by the row's last program.

The radix select (`radix.py`) pays six launches and four histogram passes over every row; the
single-pass kernel (`single_pass.py`) is one launch but one SM per row. Here a row is split across the
programs of grid axis 1 (enough to fill the GPU at batch 1), and no program builds a histogram of its
slice (Triton's `tl.histogram` costs grow with the bin count and dominate a streaming pass):

1. every program of a row picks the same cutoff key `tau` from a fixed strided sample of the row
   (SAMPLE keys in CHUNK-wide coalesced pieces; the whole row when it is no longer than SAMPLE):
   the j-th largest sampled key with j about twice the sample's expected share of the top-k (plus
   a slack of 16), resolved to 16 bits by small register histograms and then snapped down to the
   smallest sampled key with that prefix, so `tau` is a key of the row;
2. each program streams its slice once and appends (key, index) of keys > tau to the row's candidate
   buffer (CAP entries) and the indices of keys == tau to a ties buffer (k entries), through per-row
   atomic counters (one atomic per block that has any);
3. the program that arrives last on the row's arrival counter (acquire/release atomics; the buffers
   written before each arrival are visible to it) finishes the row and zeroes the counters for the
   next call, so the workspace is zeroed once at allocation and never again (no memset launch):
   - `n_gt` in [k, CAP]: exact k-th largest of the candidates in registers (8 passes of 4-bit digits:
     16-bin histograms cost about a ninth of 256-bin ones per element), then write them out;
   - `n_gt < k <= n_gt + n_eq` (and n_gt <= CAP): all candidates and the first k - n_gt ties (e.g. ReLU rows whose
     k-th largest is a 0 shared by thousands of entries);
   - otherwise (the sample misjudged the row: adversarial layouts, or fewer than k keys >= tau):
     the single-pass kernel's exact one-program selection over the row (`single_pass.select_row`),
     correct but slow; the `path` word in the workspace records which case each row took.

For rows of i.i.d. scores the fallback needs the sample's count above the true cutoff to be off by
about 8 standard deviations (see `sampled_plan`). Output contract as `radix.topk_indices`: the
indices of k largest entries, unsorted, ties at the k-th value broken arbitrarily; rows with L <= k
give 0..L-1 then -1. No host sync; CUDA-graph capturable with a workspace allocated once per
(rows, plan).

Workspace per row (int32): [n_gt, n_eq, arrived, path], then CAP candidate keys, CAP candidate
indices, k tie indices. path: 1 = candidates, 2 = ties at the sampled cutoff, 3 = fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, float_order_key, require, sm_count
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS, checked_output, radix_digit
from hearth.kernels.topk.single_pass import pick_bin, select_row

MAX_K = 4096  # the finish holds about 4k candidates in registers
HEADER = 4  # n_gt, n_eq, arrived, path
PATH_CANDIDATES, PATH_TIES, PATH_FALLBACK = 1, 2, 3
DIGIT_BITS = 4  # in-register selects: 16-bin histograms
SAMPLE_BITS = 16  # the sampled cutoff's resolution before snapping to a sampled key
SAMPLE_CHUNK = 32  # contiguous sampled keys (one 128-byte line)
SAMPLE_SLACK = 16


@triton.jit
def select_prefix(b_key, m_valid, k, BITS: tl.constexpr, N_PASSES: tl.constexpr):
    """Signed top BITS * N_PASSES bits of the k-th largest valid key (the whole key when that is 32)
    and the rank it still has among the valid keys sharing that prefix; 1 <= k <= valid keys. Radix
    histograms of the keys in registers, most significant digit first (also `short_row_hist_select`)."""
    NB: tl.constexpr = 1 << BITS
    o_b = tl.arange(0, NB)
    k_rem = k
    prefix = 0
    for p in tl.static_range(N_PASSES):
        if p == 0:
            m_hit = m_valid
        else:
            m_hit = m_valid & ((b_key >> (32 - BITS * p)) == prefix)
        # misses go to bin 0 and are subtracted after (no masked histogram in older Triton)
        b_hist = tl.histogram(tl.where(m_hit, radix_digit(b_key, p, NB, BITS), 0), NB)
        b_hist -= tl.where(o_b == 0, tl.sum((~m_hit).to(tl.int32), 0), 0)
        i_sel, k_rem = pick_bin(b_hist, k_rem, NB)
        if p == 0:
            prefix = i_sel - NB // 2
        else:
            prefix = prefix * NB + i_sel
    return prefix, k_rem


@triton.jit
def _sample_cutoff(
    p_x,
    n_len,
    K,
    SAMPLE: tl.constexpr,
    CHUNK: tl.constexpr,
    SLACK: tl.constexpr,
    BITS: tl.constexpr,
    SAMPLE_PASSES: tl.constexpr,
):
    """A key of the row (n_len > K): the smallest sampled key sharing the top BITS * SAMPLE_PASSES bits
    of the j-th largest sampled key, so that >= j sampled keys are >= it. A row that fits in the
    sample is sampled whole with j = K (then >= K row keys are >= it)."""
    o_s = tl.arange(0, SAMPLE)
    whole = n_len <= SAMPLE
    o_chunk = (o_s // CHUNK).to(tl.int64) * n_len // (SAMPLE // CHUNK) + o_s % CHUNK
    o_pos = tl.where(whole, o_s.to(tl.int64), o_chunk)
    m_s = o_pos < n_len
    b_key = float_order_key(tl.load(p_x + o_pos, mask=m_s, other=0.0))
    n_want = tl.where(whole, K, tl.minimum(tl.cdiv(2 * K * SAMPLE, n_len) + SLACK, SAMPLE))
    prefix, _ = select_prefix(b_key, m_s, n_want, BITS, SAMPLE_PASSES)
    # snap down to a sampled key: at least n_want sampled keys are >= it
    SHIFT: tl.constexpr = 32 - BITS * SAMPLE_PASSES
    return tl.min(tl.where(m_s & ((b_key >> SHIFT) >= prefix), b_key, 0x7FFFFFFF), 0)


@triton.jit
def _compact(p_x, p_ws, p_keys, p_idx, p_ties, i_start, i_end, tau, K, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Append (key, index) of the slice's keys > tau to the candidates and indices of keys == tau to
    the ties, counting all of them even past the buffers' ends."""
    for i0 in range(i_start, i_end, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < i_end
        b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
        m_gt = m_t & (b_key > tau)
        n_gt = tl.sum(m_gt.to(tl.int32), 0)
        if n_gt > 0:
            o_dst = tl.atomic_add(p_ws, n_gt, sem="relaxed") + tl.cumsum(m_gt.to(tl.int32), 0) - 1
            tl.store(p_keys + o_dst, b_key, mask=m_gt & (o_dst < CAP))
            tl.store(p_idx + o_dst, o_t, mask=m_gt & (o_dst < CAP))
        m_eq = m_t & (b_key == tau)
        n_eq = tl.sum(m_eq.to(tl.int32), 0)
        if n_eq > 0:
            o_dst = tl.atomic_add(p_ws + 1, n_eq, sem="relaxed") + tl.cumsum(m_eq.to(tl.int32), 0) - 1
            tl.store(p_ties + o_dst, o_t, mask=m_eq & (o_dst < K))


@triton.jit
def _finish_row(
    p_x,
    n_len,
    p_out,
    p_ws,
    p_keys,
    p_idx,
    p_ties,
    K,
    CAP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX_PASSES: tl.constexpr,
):
    """Write the row's top-K from the compacted buffers (or the row itself) and zero its counters."""
    n_gt = tl.load(p_ws, volatile=True)
    n_eq = tl.load(p_ws + 1, volatile=True)
    o_c = tl.arange(0, CAP)
    m_c = o_c < n_gt
    if (n_gt >= K) & (n_gt <= CAP):
        # L1 is not coherent across SMs: other programs wrote these
        b_key = tl.load(p_keys + o_c, mask=m_c, other=0, cache_modifier=".cg")
        b_idx = tl.load(p_idx + o_c, mask=m_c, other=0, cache_modifier=".cg")
        thr, k_rem = select_prefix(b_key, m_c, K, BITS, 32 // BITS)
        m_gt = m_c & (b_key > thr)
        tl.store(p_out + tl.cumsum(m_gt.to(tl.int32), 0) - 1, b_idx, mask=m_gt)
        m_eq = m_c & (b_key == thr)
        o_rank = tl.cumsum(m_eq.to(tl.int32), 0) - 1
        tl.store(p_out + K - k_rem + o_rank, b_idx, mask=m_eq & (o_rank < k_rem))
        tl.store(p_ws + 3, 1)
    elif (n_gt < K) & (n_gt + n_eq >= K) & (n_gt <= CAP):
        b_idx = tl.load(p_idx + o_c, mask=m_c, other=0, cache_modifier=".cg")
        tl.store(p_out + o_c, b_idx, mask=m_c)
        for i0 in range(0, K - n_gt, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < K - n_gt
            b_tie = tl.load(p_ties + o_t, mask=m_t, other=0, cache_modifier=".cg")
            tl.store(p_out + n_gt + o_t, b_tie, mask=m_t)
        tl.store(p_ws + 3, 2)
    else:
        select_row(p_x, n_len, p_out, p_keys, p_idx, K, CAP, NBINS, RADIX_BITS, RADIX_PASSES, BLOCK)
        tl.store(p_ws + 3, 3)
    tl.store(p_ws, 0)
    tl.store(p_ws + 1, 0)
    tl.store(p_ws + 2, 0)


@triton.jit
def _topk_sampled_kernel(
    x_ptr,
    len_ptr,
    out_ptr,
    ws_ptr,
    stride_x,
    stride_out,
    stride_ws,
    K,
    SEG,
    HEADER: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE: tl.constexpr,
    CHUNK: tl.constexpr,
    SLACK: tl.constexpr,
    BITS: tl.constexpr,
    SAMPLE_PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX_PASSES: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    n_len = tl.load(len_ptr + i_r)
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    if n_len <= K:
        if i_s == 0:
            # every valid entry is selected: out[t] = t for t < L, -1 up to k
            for i0 in range(0, K, BLOCK):
                o_t = i0 + tl.arange(0, BLOCK)
                tl.store(p_out + o_t, tl.where(o_t < n_len, o_t, -1), mask=o_t < K)
    else:
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        p_ws = ws_ptr + i_r.to(tl.int64) * stride_ws
        p_keys = p_ws + HEADER
        p_idx = p_keys + CAP
        p_ties = p_idx + CAP
        i_start = i_s * SEG
        if i_start < n_len:
            tau = _sample_cutoff(p_x, n_len, K, SAMPLE, CHUNK, SLACK, BITS, SAMPLE_PASSES)
            _compact(p_x, p_ws, p_keys, p_idx, p_ties, i_start, tl.minimum(i_start + SEG, n_len), tau, K, CAP, BLOCK)
        # every thread's stores are done before the (single-thread) release of the arrival
        tl.debug_barrier()
        n_before = tl.atomic_add(p_ws + 2, 1, sem="acq_rel")
        if n_before == tl.num_programs(1) - 1:
            tl.debug_barrier()
            _finish_row(
                p_x, n_len, p_out, p_ws, p_keys, p_idx, p_ties, K, CAP, BITS, BLOCK, NBINS, RADIX_BITS, RADIX_PASSES
            )


@dataclass(frozen=True)
class SampledPlan:
    """Sizes of the sampled top-k for one shape class (row capacity n_cols, k)."""

    k: int
    sample: int  # sampled keys per row (power of two, a multiple of SAMPLE_CHUNK)
    capacity: int  # candidate buffer entries per row (power of two: held in registers by the finish)

    @property
    def ws_stride(self) -> int:
        """int32 words of workspace per row (padded to 128 bytes)."""
        return triton.cdiv(HEADER + 2 * self.capacity + self.k, 32) * 32


def sampled_plan(n_cols: int, k: int, *, sample: int | None = None, capacity: int | None = None) -> SampledPlan:
    """Sample and candidate capacity for rows of up to n_cols scores.

    The sample expects >= 64 keys above the true cutoff where it can (2048..8192 keys); the cutoff is
    the j-th largest sampled key with j = 2 x that expectation + 16, so about 2k + 16 L / sample keys
    of a row of length L land above it; the capacity holds 1.5x that. For k = 2048 at 128K: 4096
    sampled keys, 64 expected above the true cutoff against j = 144 (fallback when >= 144 are: ~10 sigma),
    ~4.6k expected candidates against 8192 slots (fallback when fewer than 144 sampled keys are above
    the 8192nd largest, 256 expected: ~7 sigma)."""
    require(1 <= k <= MAX_K, f"k must be in [1, {MAX_K}] for the sampled top-k, got {k}")
    n_cols = max(n_cols, 1)
    if sample is None:
        sample = min(max(triton.next_power_of_2(triton.cdiv(64 * n_cols, k)), 2048), 8192)
    require(
        sample >= SAMPLE_CHUNK and sample & (sample - 1) == 0,
        f"sample must be a power of two >= {SAMPLE_CHUNK}, got {sample}",
    )
    if capacity is None:
        surv = 2 * k + SAMPLE_SLACK * triton.cdiv(n_cols, sample)
        capacity = triton.next_power_of_2(triton.cdiv(3 * surv, 2))
    require(capacity >= 1 and capacity & (capacity - 1) == 0, f"capacity must be a power of two, got {capacity}")
    return SampledPlan(k=k, sample=sample, capacity=capacity)


def new_sampled_workspace(n_rows: int, plan: SampledPlan, device: torch.device) -> torch.Tensor:
    """Zeroed int32 workspace [n_rows, plan.ws_stride]; the kernel leaves its counters zeroed, so one
    allocation serves every later call (and CUDA-graph replay) with the same plan."""
    return torch.zeros(n_rows, plan.ws_stride, dtype=torch.int32, device=device)


def _sm_count(device: torch.device) -> int:
    return sm_count(device, 4)


def _programs_per_row(n_rows: int, n_cols: int, block: int, device: torch.device) -> int:
    """About two programs per SM over all rows, at least one block per program."""
    return max(1, min(triton.cdiv(max(n_cols, 1), block), triton.cdiv(2 * _sm_count(device), max(n_rows, 1))))


def sampled_topk_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    plan: SampledPlan,
    *,
    programs: int | None = None,
    block: int = 1024,
    num_warps: int = 16,
) -> None:
    """Launch the sampled top-k on validated scores / lengths / out (see `topk_indices_sampled`);
    programs: per row (default: about two per SM in all)."""
    n_rows, n_cols = scores.shape
    check_tensor("workspace", workspace, dtypes=(torch.int32,), shape=(n_rows, plan.ws_stride), device=scores.device)
    require(out.shape[1] == plan.k, f"out has {out.shape[1]} columns, the plan is for k = {plan.k}")
    if programs is None:
        programs = _programs_per_row(n_rows, n_cols, block, scores.device)
    seg = triton.cdiv(triton.cdiv(max(n_cols, 1), programs), block) * block
    _topk_sampled_kernel[(n_rows, triton.cdiv(max(n_cols, 1), seg))](
        scores,
        lengths,
        out,
        workspace,
        scores.stride(0),
        out.stride(0),
        workspace.stride(0),
        plan.k,
        seg,
        HEADER=HEADER,
        CAP=plan.capacity,
        SAMPLE=plan.sample,
        CHUNK=SAMPLE_CHUNK,
        SLACK=SAMPLE_SLACK,
        BITS=DIGIT_BITS,
        SAMPLE_PASSES=SAMPLE_BITS // DIGIT_BITS,
        BLOCK=block,
        NBINS=NBINS,
        RADIX_BITS=RADIX_BITS,
        RADIX_PASSES=PASSES,
        num_warps=num_warps,
    )


def topk_indices_sampled(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    sample: int | None = None,
    capacity: int | None = None,
    programs: int | None = None,
    block: int = 1024,
) -> torch.Tensor:
    """Exact top-k indices per row, unsorted, several programs per row (decode rows).

    Same contract as `hearth.kernels.topk.topk_indices` (fp32 scores [R, N] with unit last stride,
    int32 lengths [R], optional int32 out [R, k]; ties broken arbitrarily; rows with L <= k give
    0..L-1 then -1) for 1 <= k <= 4096. sample / capacity override `sampled_plan`'s sizes and programs
    the programs per row (tests use them to force every path). Allocates a zeroed workspace per call:
    hold one from `new_sampled_workspace` and call `sampled_topk_launch` to avoid that memset."""
    out = checked_output(scores, lengths, k, out)
    plan = sampled_plan(scores.shape[1], k, sample=sample, capacity=capacity)
    if out.shape[0] == 0:
        return out
    ws = new_sampled_workspace(out.shape[0], plan, scores.device)
    sampled_topk_launch(scores, lengths, out, ws, plan, programs=programs, block=block)
    return out
