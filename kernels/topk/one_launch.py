"""Exact row-wise top-k of decode rows in one launch after the indexer: the indexer's histogram, one
streaming pass per row split, and an exact finish by the row's last program.

Why one launch. The radix select (`radix.py`) costs a fixed ~21-23 µs per decode step on the H200 at
every length from 8K to 128K: six launches (a memset, four histogram passes, a gather), each paying
its launch and tail, not bandwidth. Here the decode indexer already adds the first histogram of each
row to the workspace while it writes the logits (`FUSE_HIST` with `FINE_HIST`), so one more launch can
finish the selection: grid (rows, splits), at most two programs of 8 warps per SM in all (`_programs_per_row`).
At four rows or fewer the histogram and select launches use programmatic dependent launch (`PDL_MAX_ROWS`).

1. Every program of a row picks the cutoff bin from the row's histogram (256 bins, a few hundred
   cycles, the same answer in every program) and streams its slice of the row once: the indices of
   keys above the cutoff bin go straight to the output (they are all in the top-k) through a per-row
   atomic counter; the cutoff bin's (key, index) pairs are compacted into a per-row scratch (CAP
   entries) through another, and, when the bin is a quarter binade (below), each survivor adds one
   to a second 256-bin histogram of its next 8 key bits (scattered atomics: only survivors pay).
   Each program also folds its survivors' min and max key into the row's header.
2. The program that arrives last on the row's arrival counter (acquire/release; the stores made before
   each arrival are visible to it, as in `sampled.py`) finishes the row, then zeroes its histograms and
   counters, so the workspace is initialised once at allocation and never again (no memset launch):
   - all of the cutoff bin is taken, or all its survivors are equal (e.g. a ReLU row whose k-th
     largest is a 0 shared by thousands of entries): copy the first compacted ones (PATH_TAKE);
   - the second histogram names the sub-bin holding the k-th largest: one pass over the compacted
     survivors writes those above the sub-bin and moves the sub-bin's few (CAP2 at most; ~S / 256 for
     smooth scores) into a second scratch, where each one's exact rank is counted against the others
     (ties by position), no histogram pass at all (PATH_SECOND);
   - otherwise (the cutoff bin is a clamped edge bin, or the sub-bin holds more than CAP2): four
     8-bit radix passes over the compacted survivors, one program, exact (PATH_SCRATCH);
   - the survivors overflowed the scratch: the same radix passes over the row itself, filtered to the
     cutoff bin; always exact, only slower (hundreds of µs at 128K; PATH_ROW).
   The path word in the header records the case of each row (tests and the bench read it).

The first digit (`fine_bin`) is not the radix select's top byte (sign and 7 exponent bits, a bin spans two
binades: at 128K and k = 2048 a Gaussian row leaves up to ~28% of the row in the cutoff bin) but the key's
sign, exponent and two mantissa bits clamped to a 32-binade window around 1 (like the top byte of an fp16):
quarter-binade bins for |x| in [1.5 * 2^-16, 1.75 * 2^15), and per sign a bin for the zero alone, one for the
tiny magnitudes (with the window's lowest quarter binade) and one for the large (infinities included). The
same histogram cost (256 bins), ~1-2% of a Gaussian 128K row in the cutoff bin. The map is monotone in the
key, so every bin is a key range and the selection stays exact for any scores; scores far outside the window
only crowd the edge bins (slower paths, same result).

Output contract as `radix.topk_indices`: the indices of k largest entries, unsorted, ties at the k-th
value broken arbitrarily; rows with L <= k give 0..L-1 then -1. No host sync; CUDA-graph capturable
(grid from shapes only, lengths read on the device) with a workspace held across calls.

Workspace per row (int32): the first histogram [NBINS] (filled by the indexer or `fine_hist_launch`),
the second [NBINS], the header [n_gt, n_surv, arrived, key_min, key_max, path], then CAP survivor keys,
CAP survivor indices, CAP2 sub-bin keys, CAP2 sub-bin indices, then the cooperative path's digit table
(`cooperative.py`): TABLE_WAYS keys of each second digit [NBINS, TABLE_WAYS], then their indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, float_order_key, pdl_wait, require, sm_count, use_pdl
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS, checked_output, radix_digit
from hearth.kernels.topk.single_pass import pick_bin

HIST2 = NBINS  # offset of the second histogram
HEADER = 2 * NBINS
N_GT, N_SURV, ARRIVED, KEY_MIN, KEY_MAX, PATH = range(6)
# the header's 128-byte line, then three lines for the cooperative select's barrier counters (`cooperative.py`:
# programs spinning on a counter are kept off the line the others' atomics go to); survivors start on their own line
COUNTER_LINES = HEADER + 32
SCRATCH = COUNTER_LINES + 3 * 32
PATH_TAKE, PATH_SECOND, PATH_SCRATCH, PATH_ROW, PATH_FULL = 1, 2, 3, 4, 5
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
# fine_bin's window: quarter-binade index q = (exponent field << 2) | top 2 mantissa bits; q in
# (FINE_LO, FINE_LO + 127) get their own bin, q = 508 is [1, 1.25)
FINE_LO = 444
SCRATCH_PER_K = 4  # default survivor capacity, in multiples of k
CAPACITY2 = 512  # sub-bin entries ranked pairwise by the finish
RANK_BLOCK = 16  # sub-bin keys compared per step of the pairwise rank
TABLE_WAYS = 32  # keys of a second digit the cooperative path's digit table holds (`cooperative.py`)
# Survivors the row's finish loads at once with its header and second histogram (`_finish_row`; the rest, if
# any, a block at a time after). H200, 2026-12-04, one run each (bench_decode_topk.py --finish-blocks, decode
# indexer + top-k / top-k alone on the indexer's logits, us): 1024 against 16 (the old chain of loads) B1 x 128K
# 19.7 / 10.8 against 19.8 / 11.6, B8 x 32K 26.9 / 11.8 against 27.8 / 12.7, B64 x 128K 460.2 / 95.3 against
# 460.5 / 96.3; 4096 (every survivor of a 128K randn row in one block) lost to 16 in its own run on the indexer
# + top-k (B1 x 128K 22.8 against 21.4, B8 x 32K 30.3 against 27.4, B64 x 32K 144.6 against 135.6).
FINISH_BLOCK = 1024
# Registers a thread of the select may use (ptxas .maxnreg): 128 lets two programs of 8 warps share an SM (a
# finish block of 4096 took the kernel to 182 without it: one program an SM).
SELECT_MAXNREG = 128
# How a selection program streams its slice (`_scan_slice`). H200, 2026-12-03 (bench_one_launch.py --scans 0 1 2,
# histogram + select, randn rows of 128K, default programs and warps): SCAN 1 15.3 / 30.0 / 150.1 us at 1 / 8 /
# 64 rows, against SCAN 0 15.7 / 31.7 / 167.8 and SCAN 2 15.7 / 31.1 / 158.5; blocks of 4096 keys lost everywhere.
SCAN = 1
# Whether `fine_hist_launch` loads each next block early: within 1-5% either way on the same run, so off.
HIST_PREFETCH = False
# The first histogram from one key of every HIST_SAMPLE (`sample_position`) of rows at least SAMPLE_MIN_PER_K * k
# long (1: every key).
# tl.histogram's 256 bins cost ~80 instructions a key (8 ballots and 8 bins a lane of AND / popc), which
# bounds the histogram launch at many long rows (64 x 128K: 42 us, the keys' bytes need ~7); a sample picks a
# band of bins around the k-th largest instead of one bin, and the select counts exactly (`_band`).
# H200, 2026-12-03 (eleventh session; bench_one_launch.py --samples 1 2 4 8 --sigmas 6 4 3 and bench_dsa.py
# --hist-sigmas 6 4 3), histogram + select of randn rows of 128K, exact / 1 in 8 at 4 sigmas, us: 1 row 16.9 / 16.7,
# 8 rows 31.3 / 27.9, 64 rows 154.3 / 125.9; on the decode indexer's logits (top-k alone) 1 x 128K 13.0 / 14.9,
# 8 x 128K 29.2 / 28.6, 64 x 128K 150.0 / 124.2. A row's histogram is cheap and its finish is the tail at few rows,
# so the top-level calls (`default_sample`) sample only from SAMPLE_MIN_WORK (row, key) pairs in all.
HIST_SAMPLE = 8
SAMPLE_MIN_PER_K = 32
SAMPLE_MIN_WORK = 1 << 20
# The band's half-width in sampled keys: SAMPLE_SIGMAS standard deviations of the sample's count above the
# k-th largest (about sqrt(k / sample)) plus SAMPLE_SLACK. 6, 4 and 3 timed alike within 3% but for 64 x 128K
# randn rows (129.6 / 125.9 / 121.3 us); below 4 a row's band misses (PATH_FULL: the row again, ~1 ms) often
# enough to show at 64 rows a step.
SAMPLE_SIGMAS = 4
SAMPLE_SLACK = 8
# Programmatic dependent launch (`hearth.kernels._utils.PDL`: the histogram and the select start while the kernel
# before them drains) for this many rows or fewer. H200, 2026-12-04 (bench_decode_topk.py, on / off, us): the decode
# indexer + top-k at batch 1 x 8K / 32K / 128K 14.3 / 18.2 / 20.4 against 14.6 / 18.0 / 21.7; at 64 rows slower
# (top-k alone at 64 x 128K 123.0 against 109.7: selection programs that start early take whatever SM slots are
# free, and the SMs end up unevenly loaded), at 8 rows within +-1.5 us either way.
PDL_MAX_ROWS = 4
# the same numbers for the kernels (Triton reads module globals only when they are tl.constexpr)
_HIST2, _HEADER, _SCRATCH, _FINE_LO = (tl.constexpr(v) for v in (HIST2, HEADER, SCRATCH, FINE_LO))
_N_GT, _N_SURV, _ARRIVED, _KEY_MIN, _KEY_MAX, _PATH = (tl.constexpr(v) for v in range(6))
_PATH_TAKE, _PATH_SECOND, _PATH_SCRATCH, _PATH_ROW, _PATH_FULL = (tl.constexpr(v) for v in (1, 2, 3, 4, 5))
_SAMPLE_SLACK = tl.constexpr(SAMPLE_SLACK)
_INT_MIN, _INT_MAX = tl.constexpr(INT_MIN), tl.constexpr(INT_MAX)


@triton.jit
def fine_bin(b_key):
    """First digit (0..255) of an order key, monotone in the key: the sign, exponent and two mantissa
    bits (u, a signed quarter-binade index) with the magnitude clamped to a 32-binade window. Bins 1..125
    and 130..254 hold one quarter binade each (their keys share their top 11 bits); 127 and 128 hold only
    -0 and +0 (a ReLU row's thousands of zeros then make a bin of equal keys, taken whole, even beside a
    few tiny positives); 126 and 129 the window's lowest quarter binade with the tiny magnitudes below it;
    0 and 255 the large magnitudes (-inf and +inf included)."""
    u = b_key >> 21
    mag = tl.minimum(tl.maximum(tl.where(u >= 0, u, -1 - u) - _FINE_LO, 1), 127)
    mag = tl.where((b_key == 0) | (b_key == -1), 0, mag)  # the order keys of +0 and -0
    return tl.where(u >= 0, 128 + mag, 127 - mag)


@triton.jit
def _shares_prefix(i_bin):
    """Whether the keys of bin i_bin share their top 11 bits (one quarter binade, not an edge bin)."""
    mag = tl.where(i_bin >= 128, i_bin - 128, 127 - i_bin)
    return (mag > 1) & (mag < 127)


@triton.jit
def _second_digit(b_key):
    """The 8 key bits after the 11 that a quarter-binade bin shares."""
    return (b_key >> 13) & 0xFF


@triton.jit
def sample_position(o_j, SAMPLE: tl.constexpr, LOG2_SAMPLE: tl.constexpr):
    """Row position of sample o_j: one key of each run of SAMPLE, at an offset from a multiplicative hash of
    o_j (not always the run's first: rows with a period of SAMPLE, such as a table's separators every 8 tokens,
    would bias a strided sample)."""
    if SAMPLE == 1:  # every key (no hash: its shift would be by 32, undefined for int32)
        pos = o_j
    else:
        h = o_j * -1640531535  # 0x9E3779B1 as int32, wrapping
        pos = o_j * SAMPLE + ((h >> (32 - LOG2_SAMPLE)) & (SAMPLE - 1))
    return pos


@triton.jit
def _sampled_row(n_len, K, SAMPLE: tl.constexpr, SAMPLE_MIN: tl.constexpr):
    """Whether the row's first histogram counts every SAMPLE-th key (long rows) rather than every key."""
    return (SAMPLE > 1) & (n_len >= SAMPLE_MIN * K)


@triton.jit
def _band(b_hist, K, n_len, SAMPLE: tl.constexpr, SAMPLE_MIN: tl.constexpr, SIGMAS: tl.constexpr, NBINS: tl.constexpr):
    """Bins [lo, hi] that hold the row's k-th largest key: with an exact histogram the one bin that does; with a
    sampled one the bins from the (k_s + m)-th to the (k_s - m)-th largest sampled key, k_s = k / SAMPLE and m
    SIGMAS standard deviations of the sample's count plus a slack. Keys above hi are in the top-k, keys
    below lo are not; the select counts how many lie above and inside, and the finish checks the band."""
    if _sampled_row(n_len, K, SAMPLE, SAMPLE_MIN):
        k_s = (K + SAMPLE - 1) // SAMPLE
        m = (tl.sqrt(k_s.to(tl.float32)) * SIGMAS).to(tl.int32) + _SAMPLE_SLACK
        hi, _ = pick_bin(b_hist, tl.maximum(k_s - m, 1), NBINS)
        lo, _ = pick_bin(b_hist, k_s + m, NBINS)
        hi = tl.maximum(hi, 0)
        lo = tl.maximum(lo, 0)
    else:
        lo, _ = pick_bin(b_hist, K, NBINS)
        hi = lo
    return lo, hi


@triton.jit
def _band_bits(lo, hi):
    """Bits of a band digit the bin takes (0 for one bin, 1 for two, 2 for up to four), or -1 where the band's
    keys have no common second digit: wider than four bins, or a clamped edge bin in it."""
    width = hi - lo + 1
    bits = tl.where(width == 1, 0, tl.where(width <= 2, 1, tl.where(width <= 4, 2, -1)))
    inner = _shares_prefix(lo) & _shares_prefix(hi) & (lo // 128 == hi // 128)
    return tl.where(inner, bits, -1)


@triton.jit
def _band_digit(b_key, b_bin, lo, bits):
    """Second digit of a key in band [lo, hi] of quarter-binade bins (bits = `_band_bits`): the bin's offset
    in the band in the top bits, then the key's next bits; monotone in the key across the band."""
    return ((b_bin - lo) << (8 - bits)) | (_second_digit(b_key) >> bits)


@triton.jit
def _position(o_t, m_t, p_map, MAP_PAGE: tl.constexpr):
    """Row position o_t as the index the output holds: itself, or with a page map (MAP_PAGE > 0) the
    token position it names through the table's pages, p_map[o_t // MAP_PAGE] * MAP_PAGE + o_t % MAP_PAGE
    (what ``map_through_pages`` does after the select, in the select)."""
    if MAP_PAGE > 0:
        b_page = tl.load(p_map + o_t // MAP_PAGE, mask=m_t, other=0)
        o_t = b_page * MAP_PAGE + o_t % MAP_PAGE
    return o_t


@triton.jit
def write_every_entry(p_out, n_len, K, p_map, MAP_PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """A row no longer than k: every valid entry is selected, out[t] = t (as `_position` maps it) for t < L, then -1
    up to k."""
    for i0 in range(0, K, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_v = o_t < n_len
        tl.store(p_out + o_t, tl.where(m_v, _position(o_t, m_v, p_map, MAP_PAGE), -1), mask=o_t < K)


@triton.jit
def _copy(p_src, p_dst, n):
    """p_dst[0:n] = p_src[0:n] (int32), reading what other programs wrote (bypassing L1)."""
    BLOCK: tl.constexpr = 1024
    for i0 in range(0, n, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n
        tl.store(p_dst + o_t, tl.load(p_src + o_t, mask=m_t, other=0, cache_modifier=".cg"), mask=m_t)


@triton.jit
def _source_keys(p_x, p_keys, o_t, m_t, FROM_ROW: tl.constexpr):
    if FROM_ROW:
        b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
    else:
        b_key = tl.load(p_keys + o_t, mask=m_t, other=0, cache_modifier=".cg")
    return b_key


@triton.jit
def _select_stream(
    p_x,
    p_keys,
    p_idx,
    p_out,
    n_src,
    lo,
    hi,
    k_rem,
    K,
    p_map,
    FROM_ROW: tl.constexpr,
    MAP_PAGE: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the indices of the k_rem largest keys of bins [lo, hi] to p_out[K - k_rem: K]; the source is
    the compacted survivors (n_src of them, all in the bins) or the row (n_src = its length, filtered to
    the bins). Exact radix select on the full key in one program: PASSES histogram passes, then a write
    pass (keys above the threshold first, then as many equal to it as are still needed)."""
    o_b = tl.arange(0, NBINS)
    n_gt = K - k_rem  # output slots before the bin's share
    prefix = 0
    for p in tl.static_range(PASSES):
        b_hist = tl.zeros([NBINS], dtype=tl.int32)
        n_skip = 0
        for i0 in range(0, n_src, BLOCK):
            o_t = i0 + tl.arange(0, BLOCK)
            m_t = o_t < n_src
            b_key = _source_keys(p_x, p_keys, o_t, m_t, FROM_ROW)
            b_bin = fine_bin(b_key)
            m_hit = m_t & (b_bin >= lo) & (b_bin <= hi)
            if p > 0:
                m_hit = m_hit & ((b_key >> (32 - BITS * p)) == prefix)
            # misses go to bin 0 and are subtracted once at the end (no masked histogram in older Triton)
            b_hist += tl.histogram(tl.where(m_hit, radix_digit(b_key, p, NBINS, BITS), 0), NBINS)
            n_skip += tl.sum((~m_hit).to(tl.int32), 0)
        b_hist -= tl.where(o_b == 0, n_skip, 0)
        i_sel, k_rem = pick_bin(b_hist, k_rem, NBINS)
        if p == 0:
            prefix = i_sel - NBINS // 2
        else:
            prefix = prefix * NBINS + i_sel
    # prefix is the exact threshold key; k_rem keys equal to it are still needed
    n_above = K - k_rem
    n_eq = 0
    for i0 in range(0, n_src, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n_src
        b_key = _source_keys(p_x, p_keys, o_t, m_t, FROM_ROW)
        if FROM_ROW:
            b_idx = _position(o_t, m_t, p_map, MAP_PAGE)
        else:
            b_idx = tl.load(p_idx + o_t, mask=m_t, other=0, cache_modifier=".cg")
        b_bin = fine_bin(b_key)
        m_bin = m_t & (b_bin >= lo) & (b_bin <= hi)
        m_gt = m_bin & (b_key > prefix)
        m_eq = m_bin & (b_key == prefix)
        tl.store(p_out + n_gt + tl.cumsum(m_gt.to(tl.int32), 0) - 1, b_idx, mask=m_gt)
        n_gt += tl.sum(m_gt.to(tl.int32), 0)
        o_rank = n_eq + tl.cumsum(m_eq.to(tl.int32), 0) - 1
        tl.store(p_out + n_above + o_rank, b_idx, mask=m_eq & (o_rank < k_rem))
        n_eq += tl.sum(m_eq.to(tl.int32), 0)


@triton.jit
def _second_block(b_key, b_idx, m_t, lo, bits, i_sub, n_w, n_c, p_out, p_keys2, p_idx2):
    """One block of survivors against the sub-bin i_sub: those above it to p_out[n_w:], its own to the second
    scratch at n_c (one scan of packed flags, as `_split_block`); returns the advanced n_w, n_c."""
    b_d = _band_digit(b_key, fine_bin(b_key), lo, bits)
    m_gt = m_t & (b_d > i_sub)
    m_eq = m_t & (b_d == i_sub)
    b_pack = m_gt.to(tl.int32) | (m_eq.to(tl.int32) << 16)
    r_gt, r_eq = _unpack(tl.cumsum(b_pack, 0) - b_pack)
    tl.store(p_out + n_w + r_gt, b_idx, mask=m_gt)
    tl.store(p_keys2 + n_c + r_eq, b_key, mask=m_eq)
    tl.store(p_idx2 + n_c + r_eq, b_idx, mask=m_eq)
    d_gt, d_eq = _unpack(tl.sum(b_pack, 0))
    return n_w + d_gt, n_c + d_eq


@triton.jit
def _finish_second(
    p_out,
    p_keys,
    p_idx,
    p_keys2,
    p_idx2,
    b_key0,
    b_idx0,
    n_surv,
    lo,
    bits,
    i_sub,
    n_sub,
    k_rem,
    k_rem2,
    K,
    CAP2: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
):
    """With the sub-bin i_sub of the band's second digit (`_band_digit`) known (n_sub <= CAP2 survivors,
    k_rem2 of them wanted): write the survivors above it after the band's share, move the sub-bin into the
    second scratch, and place each of its keys by its exact rank among them (ties by position). The first
    FBLOCK survivors come loaded (b_key0, b_idx0: the caller read them beside the header); the second scratch
    is this program's own, so it is read back through L1 after a barrier."""
    n_w, n_c = _second_block(b_key0, b_idx0, tl.arange(0, FBLOCK) < n_surv, lo, bits, i_sub, K - k_rem, 0, p_out,
                             p_keys2, p_idx2)
    for i0 in range(FBLOCK, n_surv, BLOCK):
        o_t = i0 + tl.arange(0, BLOCK)
        m_t = o_t < n_surv
        b_key = tl.load(p_keys + o_t, mask=m_t, other=0, cache_modifier=".cg")
        b_idx = tl.load(p_idx + o_t, mask=m_t, other=0, cache_modifier=".cg")
        n_w, n_c = _second_block(b_key, b_idx, m_t, lo, bits, i_sub, n_w, n_c, p_out, p_keys2, p_idx2)
    tl.debug_barrier()  # the second scratch was written by every thread of this program
    rank_sub_bin(p_out, p_keys2, p_idx2, n_sub, k_rem2, K, CAP2, RANK_BLOCK, "")


@triton.jit
def rank_sub_bin(p_out, p_keys2, p_idx2, n_sub, k_rem2, K, CAP2: tl.constexpr, RANK_BLOCK: tl.constexpr,
                 CACHE: tl.constexpr):
    """Place each of the n_sub (<= CAP2) keys in the second scratch by its exact rank among them (ties by
    slot): the indices of the k_rem2 best to p_out[K - k_rem2: K]. CACHE: the loads' cache modifier ("" where
    this program wrote the scratch, so L1 holds it; ".cg" where other programs did)."""
    # all of the sub-bin's keys and indices and the first RANK_BLOCK keys to compare them with in one round trip
    # (the rank loop's later blocks, rarely needed: ~S / 256 keys share a sub-bin, 9 at 128K randn rows)
    o_i = tl.arange(0, CAP2)
    m_i = o_i < n_sub
    b_key_i = tl.load(p_keys2 + o_i, mask=m_i, other=0, cache_modifier=CACHE)
    b_idx_i = tl.load(p_idx2 + o_i, mask=m_i, other=0, cache_modifier=CACHE)
    o_j = tl.arange(0, RANK_BLOCK)
    b_key_j = tl.load(p_keys2 + o_j, mask=o_j < n_sub, other=0, cache_modifier=CACHE)
    b_rank = tl.zeros([CAP2], dtype=tl.int32)
    for j0 in range(0, n_sub, RANK_BLOCK):
        o_j = j0 + tl.arange(0, RANK_BLOCK)
        if j0 > 0:
            b_key_j = tl.load(p_keys2 + o_j, mask=o_j < n_sub, other=0, cache_modifier=CACHE)
        m_beats = (b_key_j[None, :] > b_key_i[:, None]) | (
            (b_key_j[None, :] == b_key_i[:, None]) & (o_j[None, :] < o_i[:, None])
        )
        b_rank += tl.sum((m_beats & (o_j < n_sub)[None, :]).to(tl.int32), 1)
    tl.store(p_out + K - k_rem2 + b_rank, b_idx_i, mask=m_i & (b_rank < k_rem2))


@triton.jit
def _finish_row(
    p_x,
    n_len,
    p_out,
    p_ws,
    lo,
    hi,
    K,
    p_map,
    p_trace,
    CAP: tl.constexpr,
    CAP2: tl.constexpr,
    MAP_PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    TRACE: tl.constexpr,
):
    """The row's last program: append the band's k_rem best to out[K - k_rem: K] (k_rem = k less the keys
    above the band, counted exactly by the select), then clean the row's workspace for the next call. A band
    from a sampled histogram that missed the k-th largest (k or more keys above it, or fewer than k above and
    in it) is recomputed from the whole row (PATH_FULL; the keys above the band wrote only their first k).
    The header, the second histogram and the first FBLOCK survivors are loaded together, before the header
    says which are needed: one round trip to L2 where there was a chain of them (the finish was ~9 us of a
    b1 x 128K select's ~13 on the H200 timeline, `bench_one_launch.py --trace`; 5.6-5.9 us with the first
    4096 survivors loaded this way)."""
    p_hdr = p_ws + _HEADER
    p_keys = p_ws + _SCRATCH
    p_idx = p_keys + CAP
    o_b = tl.arange(0, NBINS)
    o_f = tl.arange(0, FBLOCK)
    b_hist2 = tl.load(p_ws + _HIST2 + o_b, cache_modifier=".cg")
    b_key0 = tl.load(p_keys + o_f, cache_modifier=".cg")  # the scratch's first FBLOCK, valid or not
    b_idx0 = tl.load(p_idx + o_f, cache_modifier=".cg")
    n_gt = tl.load(p_hdr + _N_GT, volatile=True)
    n_surv = tl.load(p_hdr + _N_SURV, volatile=True)
    k_min = tl.load(p_hdr + _KEY_MIN, volatile=True)
    k_max = tl.load(p_hdr + _KEY_MAX, volatile=True)
    k_rem = K - n_gt
    if (n_gt >= K) | (n_gt + n_surv < K):
        _select_stream(p_x, p_keys, p_idx, p_out, n_len, 0, NBINS - 1, K, K, p_map, True, MAP_PAGE, NBINS, BITS,
                       PASSES, BLOCK)
        path = _PATH_FULL
    elif (n_surv == k_rem) | (k_min == k_max):
        # all of the band, or any k_rem of equal keys: the first ones compacted (CAP >= K >= k_rem)
        _copy(p_idx, p_out + K - k_rem, k_rem)
        path = _PATH_TAKE
    elif n_surv <= CAP:
        bits = _band_bits(lo, hi)
        i_sub, k_rem2 = pick_bin(b_hist2, k_rem, NBINS)
        n_sub = tl.sum(tl.where(o_b == i_sub, b_hist2, 0), 0)
        _stamp(p_trace, 5, TRACE)
        if (bits >= 0) & (n_sub <= CAP2):
            p_keys2 = p_idx + CAP
            _finish_second(
                p_out, p_keys, p_idx, p_keys2, p_keys2 + CAP2, b_key0, b_idx0, n_surv, lo, bits, i_sub, n_sub,
                k_rem, k_rem2, K, CAP2, BLOCK, FBLOCK, RANK_BLOCK,
            )  # fmt: skip
            path = _PATH_SECOND
        else:
            _select_stream(p_x, p_keys, p_idx, p_out, n_surv, lo, hi, k_rem, K, p_map, False, MAP_PAGE, NBINS, BITS,
                           PASSES, BLOCK)
            path = _PATH_SCRATCH
    else:
        _select_stream(p_x, p_keys, p_idx, p_out, n_len, lo, hi, k_rem, K, p_map, True, MAP_PAGE, NBINS, BITS, PASSES,
                       BLOCK)
        path = _PATH_ROW
    _stamp(p_trace, 6, TRACE)
    clean_row(p_ws, path, NBINS)


@triton.jit
def clean_row(p_ws, path, NBINS: tl.constexpr):
    """Leave the row's workspace as a new one (histograms and counters zero, no survivor min / max) with the
    path its finish took in the header."""
    p_hdr = p_ws + _HEADER
    o_b = tl.arange(0, NBINS)
    tl.store(p_ws + o_b, tl.zeros([NBINS], dtype=tl.int32))
    tl.store(p_ws + _HIST2 + o_b, tl.zeros([NBINS], dtype=tl.int32))
    tl.store(p_hdr + _N_GT, 0)
    tl.store(p_hdr + _N_SURV, 0)
    tl.store(p_hdr + _ARRIVED, 0)
    tl.store(p_hdr + _KEY_MIN, _INT_MAX)
    tl.store(p_hdr + _KEY_MAX, _INT_MIN)
    tl.store(p_hdr + _PATH, path)


@triton.jit
def _split_block(b_key, m_t, lo, hi):
    """A block's keys above band [lo, hi] and in it: the key's bin, both masks, both flags packed in one int32
    (above in the low 16 bits, in the band in the high; a block holds fewer than 2^15 keys) and their sum, so
    that one sum counts and one scan places both kinds (a Triton sum or scan over a block is a round through
    shared memory, and a scan ~200 instructions a thread at 1,024 keys and 4 warps)."""
    b_bin = fine_bin(b_key)
    m_gt = m_t & (b_bin > hi)
    m_eq = m_t & (b_bin >= lo) & (b_bin <= hi)
    b_pack = m_gt.to(tl.int32) | (m_eq.to(tl.int32) << 16)
    return b_bin, m_gt, m_eq, b_pack, tl.sum(b_pack, 0)


@triton.jit
def _unpack(n_pack):
    """(above, in band) of a packed count or rank (`_split_block`)."""
    return n_pack & 0xFFFF, n_pack >> 16


@triton.jit
def _keep_block(b_key, b_bin, m_gt, m_eq, b_pack, n_pack, o_t, lo, bits, o_gt, o_eq, v_min, v_max, p_out, p_ws,
                p_map, K, CAP: tl.constexpr, MAP_PAGE: tl.constexpr):
    """Write one block's keys above the band to p_out[o_gt:] (the first K of the row: a sampled band may have
    too many above it) and the band's (key, index) pairs to the scratch at o_eq (their band digits to the
    second histogram where the band has them, bits >= 0), from `_split_block`'s masks and its packed flags
    (n_pack: their sum); returns each lane's running min / max band key (reduced once per slice)."""
    p_keys = p_ws + _SCRATCH
    if n_pack > 0:
        r_gt, r_eq = _unpack(tl.cumsum(b_pack, 0) - b_pack)  # each key's rank among the block's of its kind
        o_dst = o_gt + r_gt
        tl.store(p_out + o_dst, _position(o_t, m_gt, p_map, MAP_PAGE), mask=m_gt & (o_dst < K))
        o_dst = o_eq + r_eq
        tl.store(p_keys + o_dst, b_key, mask=m_eq & (o_dst < CAP))
        tl.store(p_keys + CAP + o_dst, _position(o_t, m_eq, p_map, MAP_PAGE), mask=m_eq & (o_dst < CAP))
        if bits >= 0:
            tl.atomic_add(p_ws + _HIST2 + _band_digit(b_key, b_bin, lo, bits), 1, mask=m_eq, sem="relaxed")
        v_min = tl.where(m_eq, tl.minimum(v_min, b_key), v_min)
        v_max = tl.where(m_eq, tl.maximum(v_max, b_key), v_max)
    return v_min, v_max


@triton.jit
def _reserve(p_hdr, n_gt, n_eq):
    """Reserve n_gt output slots and n_eq scratch slots of the row in one 64-bit atomic on the adjacent
    counters (n_gt the low word, n_eq the high one; neither exceeds 2^31); returns where each range starts."""
    p_pair = p_hdr.to(tl.pointer_type(tl.int64))  # _N_GT, _N_SURV: words 0 and 1 of an 8-byte aligned header
    old = tl.atomic_add(p_pair, n_gt.to(tl.int64) + (n_eq.to(tl.int64) << 32), sem="relaxed")
    return (old & 0xFFFFFFFF).to(tl.int32), (old >> 32).to(tl.int32)


@triton.jit
def _scan_slice(p_x, p_out, p_ws, i_start, i_end, lo, hi, p_map, K, CAP: tl.constexpr, MAP_PAGE: tl.constexpr,
                BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """Stream keys [i_start, i_end) of the row: indices above band [lo, hi] to the output, the band's
    (key, index) pairs to the scratch, their band digits to the second histogram (quarter-binade
    bins only), their min and max key to the header. Indices are output indices (``_position``): every
    later step copies them as they are.

    SCAN 0: one block at a time, each reserving its output and scratch slots with two returning atomics
    (a round trip to L2 before the block's stores, then the next block's load). SCAN 1: the same with the
    next block's keys loaded before this block's (one, packed) atomic. SCAN 2: two passes over the slice,
    the first only counting (independent loads, the next block prefetched), one packed atomic for the whole
    slice, the second writing at running offsets (no atomic but the second histogram's)."""
    tl.static_assert(BLOCK < 32768, "a block's packed counts need fewer than 2^15 keys")
    p_hdr = p_ws + _HEADER
    bits = _band_bits(lo, hi)
    o_b = tl.arange(0, BLOCK)
    v_min = tl.full([BLOCK], _INT_MAX, tl.int32)
    v_max = tl.full([BLOCK], _INT_MIN, tl.int32)
    if SCAN == 0:
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + o_b
            m_t = o_t < i_end
            b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
            b_bin, m_gt, m_eq, b_pack, n_pack = _split_block(b_key, m_t, lo, hi)
            n_gt, n_eq = _unpack(n_pack)
            o_gt = 0
            o_eq = 0
            if n_gt > 0:
                o_gt = tl.atomic_add(p_hdr + _N_GT, n_gt, sem="relaxed")
            if n_eq > 0:
                o_eq = tl.atomic_add(p_hdr + _N_SURV, n_eq, sem="relaxed")
            v_min, v_max = _keep_block(b_key, b_bin, m_gt, m_eq, b_pack, n_pack, o_t, lo, bits, o_gt, o_eq, v_min,
                                       v_max, p_out, p_ws, p_map, K, CAP, MAP_PAGE)
    elif SCAN == 1:
        b_x = tl.load(p_x + i_start + o_b, mask=i_start + o_b < i_end, other=0.0)
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + o_b
            m_t = o_t < i_end
            b_key = float_order_key(b_x)
            b_x = tl.load(p_x + o_t + BLOCK, mask=o_t + BLOCK < i_end, other=0.0)  # in flight over the atomic
            b_bin, m_gt, m_eq, b_pack, n_pack = _split_block(b_key, m_t, lo, hi)
            o_gt = 0
            o_eq = 0
            if n_pack > 0:
                n_gt, n_eq = _unpack(n_pack)
                o_gt, o_eq = _reserve(p_hdr, n_gt, n_eq)
            v_min, v_max = _keep_block(b_key, b_bin, m_gt, m_eq, b_pack, n_pack, o_t, lo, bits, o_gt, o_eq, v_min,
                                       v_max, p_out, p_ws, p_map, K, CAP, MAP_PAGE)
    else:
        n_gt = 0
        n_eq = 0
        b_x = tl.load(p_x + i_start + o_b, mask=i_start + o_b < i_end, other=0.0)
        for i0 in range(i_start, i_end, BLOCK):
            o_t = i0 + o_b
            n_pack = _split_block(float_order_key(b_x), o_t < i_end, lo, hi)[4]
            b_x = tl.load(p_x + o_t + BLOCK, mask=o_t + BLOCK < i_end, other=0.0)
            d_gt, d_eq = _unpack(n_pack)
            n_gt += d_gt
            n_eq += d_eq
        if (n_gt > 0) | (n_eq > 0):
            o_gt, o_eq = _reserve(p_hdr, n_gt, n_eq)
            b_x = tl.load(p_x + i_start + o_b, mask=i_start + o_b < i_end, other=0.0)
            for i0 in range(i_start, i_end, BLOCK):
                o_t = i0 + o_b
                m_t = o_t < i_end
                b_key = float_order_key(b_x)
                b_x = tl.load(p_x + o_t + BLOCK, mask=o_t + BLOCK < i_end, other=0.0)
                b_bin, m_gt, m_eq, b_pack, n_pack = _split_block(b_key, m_t, lo, hi)
                v_min, v_max = _keep_block(b_key, b_bin, m_gt, m_eq, b_pack, n_pack, o_t, lo, bits, o_gt, o_eq,
                                           v_min, v_max, p_out, p_ws, p_map, K, CAP, MAP_PAGE)
                d_gt, d_eq = _unpack(n_pack)
                o_gt += d_gt
                o_eq += d_eq
    k_min = tl.min(v_min, 0)
    k_max = tl.max(v_max, 0)
    if k_min <= k_max:  # this slice had survivors
        tl.atomic_min(p_hdr + _KEY_MIN, k_min, sem="relaxed")
        tl.atomic_max(p_hdr + _KEY_MAX, k_max, sem="relaxed")


@triton.jit
def _stamp(p_trace, slot, TRACE: tl.constexpr):
    """With TRACE: the GPU's global timer (ns) to p_trace[slot] (a benchmark's timeline of the select)."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(p_trace + slot, t)


@triton.jit
def _topk_one_launch_kernel(
    x_ptr,
    len_ptr,
    out_ptr,
    ws_ptr,
    map_ptr,
    trace_ptr,
    stride_x,
    stride_out,
    stride_ws,
    K,
    SEG,
    CAP: tl.constexpr,
    CAP2: tl.constexpr,
    MAP_PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    SCAN: tl.constexpr,
    SAMPLE: tl.constexpr,
    SAMPLE_MIN: tl.constexpr,
    SIGMAS: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    # TRACE: [start, band, slice done, arrived, finished, finish: sub-bin picked, finish: path done]
    p_trace = trace_ptr + (i_r * tl.num_programs(1) + i_s) * 8
    _stamp(p_trace, 0, TRACE)
    pdl_wait(PDL)  # the histogram (and the lengths, from the indexer) come from the kernels before
    n_len = tl.load(len_ptr + i_r)
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    p_ws = ws_ptr + i_r.to(tl.int64) * stride_ws
    o_b = tl.arange(0, NBINS)
    b_hist = tl.load(p_ws + o_b)  # beside the length, not after it (one round trip before the band)
    if n_len <= K:
        if i_s == 0:
            # no other program of the row reads the histogram the indexer added, so this one clears it
            write_every_entry(p_out, n_len, K, map_ptr, MAP_PAGE, BLOCK)
            tl.store(p_ws + o_b, tl.zeros([NBINS], dtype=tl.int32))
    else:
        lo, hi = _band(b_hist, K, n_len, SAMPLE, SAMPLE_MIN, SIGMAS, NBINS)
        _stamp(p_trace, 1, TRACE)
        i_start = i_s * SEG
        if i_start < n_len:
            p_x = x_ptr + i_r.to(tl.int64) * stride_x
            _scan_slice(p_x, p_out, p_ws, i_start, tl.minimum(i_start + SEG, n_len), lo, hi, map_ptr, K, CAP,
                        MAP_PAGE, BLOCK, SCAN)
        # every thread's stores are done before the (single-thread) release of the arrival
        tl.debug_barrier()
        _stamp(p_trace, 2, TRACE)
        n_before = tl.atomic_add(p_ws + _HEADER + _ARRIVED, 1, sem="acq_rel")
        _stamp(p_trace, 3, TRACE)
        if n_before == tl.num_programs(1) - 1:
            tl.debug_barrier()
            _finish_row(
                x_ptr + i_r.to(tl.int64) * stride_x, n_len, p_out, p_ws, lo, hi, K, map_ptr, p_trace,
                CAP, CAP2, MAP_PAGE, BLOCK, FBLOCK, RANK_BLOCK, NBINS, BITS, PASSES, TRACE,
            )  # fmt: skip
            if TRACE:
                tl.debug_barrier()  # the stamp after every thread's part of the finish
            _stamp(p_trace, 4, TRACE)


@triton.jit
def fine_hist_digit(b_key, FINE: tl.constexpr, NBINS: tl.constexpr, BITS: tl.constexpr):
    """The first-histogram digit a fused indexer adds: `fine_bin` (FINE, for this module) or the radix
    select's top byte."""
    if FINE:
        b_d = fine_bin(b_key)
    else:
        b_d = radix_digit(b_key, 0, NBINS, BITS)
    return b_d


@triton.jit
def _fine_hist_kernel(x_ptr, len_ptr, ws_ptr, stride_x, stride_ws, K, SEG, NBINS: tl.constexpr, BLOCK: tl.constexpr,
                      PREFETCH: tl.constexpr, SAMPLE: tl.constexpr, LOG2_SAMPLE: tl.constexpr,
                      SAMPLE_MIN: tl.constexpr, PDL: tl.constexpr):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    pdl_wait(PDL)  # the scores come from the kernel before
    n_len = tl.load(len_ptr + i_r)
    i_start = i_s * SEG
    if (n_len > K) & (i_start < n_len):
        o_b = tl.arange(0, NBINS)
        i_end = tl.minimum(i_start + SEG, n_len)
        p_x = x_ptr + i_r.to(tl.int64) * stride_x
        b_hist = tl.zeros([NBINS], dtype=tl.int32)
        n_skip = 0
        if _sampled_row(n_len, K, SAMPLE, SAMPLE_MIN):
            # one key of every SAMPLE (`sample_position`), BLOCK positions a step (SEG is a multiple of BLOCK, so
            # the row's sample is the same whatever the programs)
            o_j = tl.arange(0, BLOCK // SAMPLE)
            for i0 in range(i_start, i_end, BLOCK):
                o_t = sample_position(i0 // SAMPLE + o_j, SAMPLE, LOG2_SAMPLE)
                m_t = o_t < i_end
                b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
                b_hist += tl.histogram(tl.where(m_t, fine_bin(b_key), 0), NBINS)
                n_skip += tl.sum((~m_t).to(tl.int32), 0)
        else:
            o_k = tl.arange(0, BLOCK)
            if PREFETCH:  # the next block's keys in flight while this one is binned
                b_x = tl.load(p_x + i_start + o_k, mask=i_start + o_k < i_end, other=0.0)
            for i0 in range(i_start, i_end, BLOCK):
                o_t = i0 + o_k
                m_t = o_t < i_end
                if PREFETCH:
                    b_key = float_order_key(b_x)
                    b_x = tl.load(p_x + o_t + BLOCK, mask=o_t + BLOCK < i_end, other=0.0)
                else:
                    b_key = float_order_key(tl.load(p_x + o_t, mask=m_t, other=0.0))
                b_hist += tl.histogram(tl.where(m_t, fine_bin(b_key), 0), NBINS)
                n_skip += tl.sum((~m_t).to(tl.int32), 0)
        b_hist -= tl.where(o_b == 0, n_skip, 0)
        tl.atomic_add(ws_ptr + i_r.to(tl.int64) * stride_ws + o_b, b_hist, mask=b_hist > 0, sem="relaxed")


def pdl_for_rows(n_rows: int, device: torch.device) -> bool:
    """Whether the histogram and select launches for n_rows rows use programmatic dependent launch (and the
    kernel before them lets them start early): `PDL_MAX_ROWS`."""
    return n_rows <= PDL_MAX_ROWS and use_pdl(device)


@dataclass(frozen=True)
class OneLaunchPlan:
    """Sizes of the one-launch top-k for one k."""

    k: int
    capacity: int  # cutoff-bin survivors kept per row (>= k)
    capacity2: int = CAPACITY2  # sub-bin survivors ranked pairwise (power of two)

    @property
    def ws_stride(self) -> int:
        """int32 words of workspace per row (padded to 128 bytes)."""
        return triton.cdiv(self.table + 2 * NBINS * TABLE_WAYS, 32) * 32

    @property
    def table(self) -> int:
        """Offset of the cooperative path's digit table in a row's workspace."""
        return SCRATCH + 2 * self.capacity + 2 * self.capacity2

    @property
    def finish_block(self) -> int:
        """Survivors the finish loads beside the header (a power of two, at most the capacity and FINISH_BLOCK)."""
        return 1 << (min(self.capacity, FINISH_BLOCK).bit_length() - 1)


def one_launch_plan(k: int, *, capacity: int | None = None) -> OneLaunchPlan:
    """Plan for top-k k; capacity: survivors kept per row before the row fallback (default 4 k, at
    least k: the tie path copies k_rem <= k of them)."""
    require(1 <= k <= 1 << 16, f"k must be in [1, 65536], got {k}")
    cap = SCRATCH_PER_K * k if capacity is None else capacity
    require(cap >= k, f"capacity must be >= k ({k}), got {cap}")
    return OneLaunchPlan(k=k, capacity=cap)


def new_one_launch_workspace(n_rows: int, plan: OneLaunchPlan, device: torch.device) -> torch.Tensor:
    """Initialised int32 workspace [n_rows, plan.ws_stride]; every call leaves it as it found it, so one
    allocation serves every later call (and CUDA-graph replay) with the same plan."""
    ws = torch.zeros(n_rows, plan.ws_stride, dtype=torch.int32, device=device)
    ws[:, HEADER + KEY_MIN] = INT_MAX
    ws[:, HEADER + KEY_MAX] = INT_MIN
    return ws


def check_workspace(workspace: torch.Tensor, n_rows: int, plan: OneLaunchPlan, device: torch.device) -> None:
    check_tensor("workspace", workspace, dtypes=(torch.int32,), shape=(n_rows, plan.ws_stride), device=device)


def _programs_per_row(n_rows: int, n_cols: int, block: int, device: torch.device) -> int:
    """Two programs per SM over all rows, rounded down (at least one a row, at most one a block): every SM then
    runs at most two, so none of them finishes last carrying a third. H200, 2026-12-04 (`bench_one_launch.py
    --programs 0 2 3 4 6 8 12 16 --warps 4 8`, 1-in-8 histogram + select, randn rows of 128K): 64 rows 100.6 us
    at 4 a row (256 programs of 8 warps) against 113.5 at the rounded-up 5 (320 programs, 4 warps: 56 SMs held
    three); 8 rows 24.1 at 33 a row (264 programs), every fewer slower."""
    return max(1, min(triton.cdiv(max(n_cols, 1), block), 2 * sm_count(device, 4) // max(n_rows, 1)))


def _hist_block(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Keys per step of the histogram launch: 4096 where a program would scan at least four 1024-key blocks,
    else 1024. H200, 2026-12-03 (bench_one_launch.py --hist-blocks 1024 4096, 8 warps, 128K rows): 64 rows
    42.3 us at 4096 against 60.3 at 1024, 8 rows 6.6 against 8.8; 1 row (one block a program) 2.7 at 1024
    against 4.4."""
    return 4096 if _segment(n_rows, n_cols, 1024, None, device) >= 4 * 1024 else 1024


def _segment(n_rows: int, n_cols: int, block: int, programs: int | None, device: torch.device) -> int:
    if programs is None:
        programs = _programs_per_row(n_rows, n_cols, block, device)
    return triton.cdiv(triton.cdiv(max(n_cols, 1), programs), block) * block


def fine_hist_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    workspace: torch.Tensor,
    *,
    block: int | None = None,
    prefetch: bool = HIST_PREFETCH,
    num_warps: int = 8,
    sample: int = 1,
    sample_min: int = SAMPLE_MIN_PER_K,
) -> None:
    """Add each row's `fine_bin` histogram (rows longer than k) to the workspace: what a fused decode
    indexer does, for scores from elsewhere. block: keys per step (default `_hist_block`); prefetch: load
    each next block while binning this one; sample: count one key of every sample (`sample_position`) in rows
    of at least sample_min * k keys (a power of two, 1 = every key; the select is told the same two numbers)."""
    n_rows, n_cols = scores.shape
    block = block or _hist_block(n_rows, n_cols, scores.device)
    _check_sample(sample, block)
    seg = _segment(n_rows, n_cols, block, None, scores.device)
    _fine_hist_kernel[(n_rows, triton.cdiv(max(n_cols, 1), seg))](
        scores, lengths, workspace, scores.stride(0), workspace.stride(0), k, seg, NBINS=NBINS, BLOCK=block,
        PREFETCH=prefetch, SAMPLE=sample, LOG2_SAMPLE=sample.bit_length() - 1, SAMPLE_MIN=sample_min,
        PDL=pdl_for_rows(n_rows, scores.device), num_warps=num_warps, launch_pdl=pdl_for_rows(n_rows, scores.device),
    )  # fmt: skip


def default_sample(n_rows: int, n_cols: int) -> int:
    """The first histogram's sample for these scores when the caller names none: `HIST_SAMPLE` from
    `SAMPLE_MIN_WORK` (row, key) pairs, else every key (the kernels further count every key of rows shorter
    than `SAMPLE_MIN_PER_K` * k)."""
    return HIST_SAMPLE if n_rows * n_cols >= SAMPLE_MIN_WORK else 1


def _check_sample(sample: int, block: int) -> None:
    require(sample >= 1 and sample & (sample - 1) == 0, f"sample must be a power of two, got {sample}")
    require(sample == 1 or block // sample >= 16, f"a {block}-key block has too few keys for a sample of 1 in {sample}")


def check_page_map(page_map: tuple[torch.Tensor, int] | None, n_rows: int, n_cols: int, device: torch.device) -> None:
    """A select's page_map (table, page): one row's positions through an int32 table of pages covering the row."""
    if page_map is not None:
        table, page = page_map
        require(n_rows == 1, "page_map maps the indices of one row")
        require(page >= 1, f"page must be >= 1, got {page}")
        check_tensor("page_map table", table, dtypes=(torch.int32,), ndim=1, device=device)
        require(table.shape[0] * page >= n_cols, "the page_map table must cover the row")


def one_launch_topk_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    plan: OneLaunchPlan,
    *,
    programs: int | None = None,
    block: int = 1024,
    num_warps: int | None = None,
    page_map: tuple[torch.Tensor, int] | None = None,
    scan: int = SCAN,
    sample: int = 1,
    sample_min: int = SAMPLE_MIN_PER_K,
    sample_sigmas: float = SAMPLE_SIGMAS,
    trace: torch.Tensor | None = None,
) -> None:
    """The selection launch on validated scores / lengths / out whose first histograms are already in the workspace
    (the fused indexer's, or `fine_hist_launch`'s); programs: per row (default `_programs_per_row`: two per SM in
    all, rounded down). page_map (table, page): one row's positions in a table of pages written as the pages' own
    token positions, table[i // page] * page + i % page (``map_through_pages`` fused: one launch fewer). num_warps:
    default 8 (two programs of 8 warps fill an SM's registers at 128 a thread; with programs per row chosen to
    match, 8 warps beat 4 at every row count timed). scan: how a program streams its slice (``_scan_slice``'s SCAN 0
    / 1 / 2). sample / sample_min: what `fine_hist_launch` was given (1: an exact histogram, as the fused
    indexer's); any histogram gives exact results, a misjudged one slowly.
    sample_sigmas: the band's half-width in standard deviations of the sample's count (`_band`). trace: an int64
    [rows, programs per row, 8] tensor that gets each program's global-timer stamps (ns) at its start, once it
    has its band, after its slice, after its arrival and (the row's last program) after the finish (benchmarks;
    GPU only)."""
    n_rows, n_cols = scores.shape
    check_workspace(workspace, n_rows, plan, scores.device)
    require(out.shape[1] == plan.k, f"out has {out.shape[1]} columns, the plan is for k = {plan.k}")
    check_page_map(page_map, n_rows, n_cols, scores.device)
    seg = _segment(n_rows, n_cols, block, programs, scores.device)
    grid = (n_rows, triton.cdiv(max(n_cols, 1), seg))
    if trace is not None:
        require(scores.device.type == "cuda", "trace reads the GPU's global timer")
        check_tensor("trace", trace, dtypes=(torch.int64,), shape=(*grid, 8), device=scores.device)
    _topk_one_launch_kernel[grid](
        scores,
        lengths,
        out,
        workspace,
        out if page_map is None else page_map[0],
        trace if trace is not None else out,
        scores.stride(0),
        out.stride(0),
        workspace.stride(0),
        plan.k,
        seg,
        CAP=plan.capacity,
        CAP2=plan.capacity2,
        MAP_PAGE=0 if page_map is None else page_map[1],
        BLOCK=block,
        FBLOCK=plan.finish_block,
        RANK_BLOCK=RANK_BLOCK,
        NBINS=NBINS,
        BITS=RADIX_BITS,
        PASSES=PASSES,
        SCAN=scan,
        SAMPLE=sample,
        SAMPLE_MIN=sample_min,
        SIGMAS=float(sample_sigmas),
        PDL=pdl_for_rows(n_rows, scores.device),
        TRACE=trace is not None,
        num_warps=num_warps or 8,
        maxnreg=SELECT_MAXNREG,
        launch_pdl=pdl_for_rows(n_rows, scores.device),
    )


def topk_indices_one_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    capacity: int | None = None,
    programs: int | None = None,
    block: int | None = None,
    scan: int = SCAN,
    sample: int | None = None,
    sample_min: int = SAMPLE_MIN_PER_K,
    sample_sigmas: float = SAMPLE_SIGMAS,
) -> torch.Tensor:
    """Exact top-k indices per row, unsorted: the first histogram (`fine_hist_launch`) and the
    one-launch selection, two launches (after the fused indexer only the second runs).

    Same contract as `hearth.kernels.topk.topk_indices` (fp32 scores [R, N] with unit last stride,
    int32 lengths [R], optional int32 out [R, k]; ties broken arbitrarily; rows with L <= k give 0..L-1
    then -1). workspace: from `new_one_launch_workspace(R, one_launch_plan(k, capacity=capacity))`,
    reused across calls (else one is allocated per call); capacity / programs / block: the survivor
    buffer, programs per row and keys per step (default: the histogram's `_hist_block`, 1024 for the select;
    tests use them to force every path); scan: how a program streams its slice (`_scan_slice`); sample /
    sample_min: the first histogram counts one key in every sample of rows of at least sample_min * k keys
    (`fine_hist_launch`; default `default_sample`), and the select's band around the k-th largest is
    sample_sigmas standard deviations of the sample's count wide on either side (`_band`)."""
    out = checked_output(scores, lengths, k, out)
    plan = one_launch_plan(k, capacity=capacity)
    if out.shape[0] == 0:
        return out
    if workspace is None:
        workspace = new_one_launch_workspace(out.shape[0], plan, scores.device)
    check_workspace(workspace, out.shape[0], plan, scores.device)
    sample = default_sample(*scores.shape) if sample is None else sample
    fine_hist_launch(scores, lengths, k, workspace, block=block, sample=sample, sample_min=sample_min)
    one_launch_topk_launch(scores, lengths, out, workspace, plan, programs=programs, block=block or 1024, scan=scan,
                           sample=sample, sample_min=sample_min, sample_sigmas=sample_sigmas)
    return out


@triton.jit
def _map_through_pages_kernel(idx_ptr, map_ptr, out_ptr, n, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    o_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_t = o_t < n
    b_idx = tl.load(idx_ptr + o_t, mask=m_t, other=-1)
    m_v = m_t & (b_idx >= 0)
    b_page = tl.load(map_ptr + b_idx // PAGE, mask=m_v, other=0)
    tl.store(out_ptr + o_t, tl.where(m_v, b_page * PAGE + b_idx % PAGE, -1), mask=m_t)


def map_through_pages(indices: torch.Tensor, pages: torch.Tensor, page: int, out: torch.Tensor) -> torch.Tensor:
    """out[i] = pages[indices[i] // page] * page + indices[i] % page, -1 where indices[i] < 0: the
    one-launch select's positions in a table of pages as the pages' own token positions (what the
    radix select's `page_map` does inside its last pass). One launch; int32 throughout."""
    check_tensor("indices", indices, dtypes=(torch.int32,))
    check_tensor("pages", pages, dtypes=(torch.int32,), device=indices.device)
    check_tensor("out", out, dtypes=(torch.int32,), shape=tuple(indices.shape), device=indices.device)
    require(indices.is_contiguous() and out.is_contiguous() and pages.is_contiguous(), "need contiguous tensors")
    n, block = indices.numel(), 1024
    _map_through_pages_kernel[(triton.cdiv(max(n, 1), block),)](indices, pages, out, n, PAGE=page, BLOCK=block)
    return out
