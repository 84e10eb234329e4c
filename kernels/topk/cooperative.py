"""Exact top-k of a few decode rows in one cooperative launch: the first histogram, the select and the finish
in one kernel whose programs wait for each other at two grid barriers, each program holding its slice of the
row in registers from its first load to its last store.

Why. At batch 1 the one-launch path (`one_launch.py`) is two kernels after the decode indexer, the histogram
and the select, and the select's tail is the row's last program finishing alone: on the H200 (2026-12-04,
b1 x 128K) the histogram took ~2.7 us and the select ~8, half of it that finish, a chain of round trips to L2
(header and second histogram, then the survivors, then the sub-bin). Here every program does its share of
each step, and only the sub-bin's few keys (~S / 256 of the S survivors) are ranked by one program:

1. Load the slice (one block of at most `MAX_BLOCK` keys a program) beside the row's length; add its
   `fine_bin` histogram to the row's (scattered atomics); barrier.
2. Read the row's histogram; the bin holding the k-th largest is the band (exact: one bin). Keys above it go
   to the output, the band's (key, index) pairs are counted and ranked (one packed atomic reserves both
   ranges, as `one_launch._reserve`) and written to the scratch in band order; their second digit goes to the
   row's second histogram, whose atomic returns each key's arrival in its digit, and the key to the digit table
   at that arrival (the first `TABLE_WAYS` of each digit); barrier.
3. Every program reads the same header and second histogram, takes the same path and places its own keys
   with no further atomic:
   - all of the band is needed, or its keys are all equal: its band keys whose rank in the band is below the
     number still needed (PATH_TAKE);
   - the second histogram names the sub-bin holding the k-th largest and it holds at most CAP2 keys
     (PATH_SECOND): a key of a digit above the sub-bin goes after the keys of the digits above its own, at its
     arrival; so does a key of a sub-bin needed whole. A sub-bin to rank is ranked by program 0 from the digit
     table (at most `TABLE_WAYS` keys) or else, from the second scratch where each program wrote its keys of it
     by arrival, by the last program to arrive;
   - otherwise (an edge bin, a crowded sub-bin, more survivors than CAP): the last to arrive runs `one_launch`'s
     single-program finish on the band in the scratch.
   A program arrives once it has read the row's counts (and written the second scratch where the last ranks
   from it), before its output stores; the last to arrive leaves the workspace clean (histograms, counters), so
   one allocation serves every call, shared with `one_launch` (same layout; the barrier counters are header
   words that path never touches, the digit table lies past its scratch and is never read unwritten).
   H200, 2026-12-04 (fourteenth session): the b1 x 128K top-k 9.0 us, the one-launch path 10.7 in the same run;
   the earlier step 3 (packed atomics for the keys above the sub-bin, the last program ranking it) ran 10.8
   against the one-launch path's 12.2 in the thirteenth session's run.

Co-residency. A program spins at a barrier until every program of its row has arrived, so every program of
the launch must be resident at once. The plan (`cooperative_plan`) asks for at most two programs of 8 warps
per SM in all (128 registers a thread, `maxnreg`; the GPU test checks the build), the kernel lets no later
kernel launch early (a dependent launch's programs could take the slots a late program of this one needs),
and the path is never taken under the CPU interpreter, which runs programs one after another
(`use_cooperative`). Programs launched early behind the indexer (PDL) wait in `griddepcontrol.wait` before any
barrier, and the indexer's programs never wait on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from hearth.kernels._utils import check_tensor, float_order_key, is_interpreter, require, sm_count
from hearth.kernels.topk.one_launch import (
    COUNTER_LINES,
    HEADER,
    HIST2,
    KEY_MAX,
    KEY_MIN,
    N_GT,
    N_SURV,
    PATH,
    PATH_SECOND,
    PATH_TAKE,
    RANK_BLOCK,
    SCRATCH,
    SELECT_MAXNREG,
    TABLE_WAYS,
    OneLaunchPlan,
    _band_bits,
    _band_digit,
    _finish_row,
    _position,
    _reserve,
    _split_block,
    _stamp,
    _unpack,
    check_page_map,
    check_workspace,
    clean_row,
    fine_bin,
    new_one_launch_workspace,
    one_launch_plan,
    pdl_for_rows,
    rank_sub_bin,
    write_every_entry,
)
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS, checked_output
from hearth.kernels.topk.single_pass import pick_bin

# Whether `indexer_decode_topk`'s "auto" takes this path where `use_cooperative` allows it.
COOPERATIVE = True
# The cooperative path's counters, from the header: the first word of each of its three counter lines
# (`one_launch.COUNTER_LINES`): the histogram barrier's, the split barrier's and the finish's arrivals.
# H200, 2026-12-04 (thirteenth session): with all of them on the header's line and 256 programs a row, a b1 x 128K
# row passed its first barrier 3.6 us and its second 6.4 us after its start (1 x 32K, 128 programs: 2.3 / 4.4).
ARRIVED_HIST, ARRIVED_SPLIT, ARRIVED_DONE = (COUNTER_LINES - HEADER + 32 * i for i in range(3))
# Keys a program holds (one block); rows wider than two programs a SM of this many take `one_launch`.
MAX_BLOCK = 2048
MIN_BLOCK = 256  # one key a thread at 8 warps
# Whether a row's keys are spread over its programs by its length rather than the table's width (`SPREAD` in the
# kernel). The engine's decode tables are `max_model_len` wide: on the H200 (2026-12-04, `bench_decode_topk.py
# --table-tokens 163840`) this top-k alone took 10.0-10.9 us at 1-2 rows of 8K-128K in 160K tables, where tables
# as wide as the context gave 6.4-9.1 (2,048-key blocks, a few programs holding an 8K row). The slice's load then
# waits for the length (a round trip), which costs more than it saves: timed with `--coop-spread` (2026-12-04,
# 160K tables) the indexer and this top-k took 18.2 / 18.3 / 22.6 us at b1 x 8K / 32K / 128K against 14.9 / 18.0 /
# 22.1, and 28.8 against 28.4 at 2 x 128K, so off.
SPREAD = False
# Programs a row at most: a barrier's cost grows with its arrivals (H200, 2026-12-04: 256 programs a b1 x 128K row
# took the top-k alone to 14.0 us against the one-launch path's 12.4; 128 a row of 32K: 8.0 against 9.2).
MAX_PROGRAMS = 128
MAX_ROWS = 4  # rows a launch takes: where the launches and the finish's tail, not the keys, are the cost
NUM_WARPS = 8
# Whether the barriers poll with acquire loads (`_barrier`), a round trip less a barrier. H200, 2026-12-04
# (`K2C_ARGS="--coop-polls acquire hist" bash scripts/gpu_verify.sh k2c`): 0.0-0.3 us under the volatile polls and
# one acquire atomic at 1-4 rows of 8K-128K, within a run's noise, so off.
POLL_ACQUIRE = False
# Whether the first barrier is the histogram itself (polled until its counts sum to the row's length), saving the
# arrival atomic and the histogram's read after the barrier. Same run: 0.3 us faster at 1 x 8K (32 programs), slower
# from 32K on (9.7 against 9.2 us at 1 x 128K: every program re-reads the 256 counts until they sum up), so off.
POLL_HIST = False
_HIST2, _HEADER, _SCRATCH = (tl.constexpr(v) for v in (HIST2, HEADER, SCRATCH))
_N_GT, _N_SURV, _KEY_MIN, _KEY_MAX, _PATH = (tl.constexpr(v) for v in (N_GT, N_SURV, KEY_MIN, KEY_MAX, PATH))
_ARRIVED_HIST, _ARRIVED_SPLIT, _ARRIVED_DONE = (tl.constexpr(v) for v in (ARRIVED_HIST, ARRIVED_SPLIT, ARRIVED_DONE))
_PATH_TAKE, _PATH_SECOND = tl.constexpr(PATH_TAKE), tl.constexpr(PATH_SECOND)
_MIN_BLOCK = tl.constexpr(MIN_BLOCK)


@triton.jit
def _load_acquire(p):
    """The int32 at p, loaded with acquire semantics at GPU scope (what other programs wrote before their release
    of it is visible to this thread's later loads)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _barrier(p_count, n, POLL_ACQUIRE: tl.constexpr):
    """Grid barrier of a row's n programs on the counter p_count: arrive (release: every thread's stores and
    atomics before it), then poll with loads only (no read-modify-write traffic on the line the others arrive
    on) until all have: with POLL_ACQUIRE each thread's polls are acquire loads, so its poll that sees n
    acquires what the others wrote (the last to arrive acquires by its arrival); else volatile loads, then one
    acquire atomic (a round trip more)."""
    tl.debug_barrier()
    seen = tl.atomic_add(p_count, 1, sem="acq_rel") + 1
    while seen < n:
        if POLL_ACQUIRE:
            seen = _load_acquire(p_count)
        else:
            seen = tl.load(p_count, volatile=True)
    if not POLL_ACQUIRE:
        tl.atomic_add(p_count, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def cooperative_select(
    p_x,
    p_out,
    p_ws,
    map_ptr,
    p_trace,
    b_x,
    o_t,
    n_len,
    i_s,
    width,
    K,
    CAP: tl.constexpr,
    CAP2: tl.constexpr,
    MAP_PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    POLL_ACQUIRE: tl.constexpr,
    POLL_HIST: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    TRACE: tl.constexpr,
):
    """Steps 1-3 of the module's doc for one program of a row: b_x its slice's scores (positions o_t, the row's
    from p_x, which the single-program finish re-reads), n_len the row's length (at most its width). Each program
    of the row holds `width` keys (at most BLOCK, the first `width` of b_x and o_t; positions i_s * width on)."""
    p_hdr = p_ws + _HEADER
    p_keys = p_ws + _SCRATCH  # the band in band order: keys, then indices
    p_table = p_keys + 2 * CAP + 2 * CAP2  # the digit table: [NBINS, WAYS] keys, then their indices
    o_b = tl.arange(0, NBINS)
    if n_len <= K:
        if i_s == 0:
            write_every_entry(p_out, n_len, K, map_ptr, MAP_PAGE, BLOCK)
    elif i_s * width < n_len:
        n_prog = (n_len + width - 1) // width  # the programs that hold keys of the row
        m_t = (tl.arange(0, BLOCK) < width) & (o_t < n_len)
        b_key = float_order_key(b_x)
        # 1. the row's first histogram (misses counted in bin 0, then taken out)
        b_hist = tl.histogram(tl.where(m_t, fine_bin(b_key), 0), NBINS)
        b_hist -= tl.where(o_b == 0, tl.sum((~m_t).to(tl.int32), 0), 0)
        tl.atomic_add(p_ws + o_b, b_hist, mask=b_hist > 0, sem="relaxed")
        if POLL_HIST:
            # the histogram is the barrier: every count only grows and they sum to the row's length once every
            # program's have landed, so the read that sums to it is the whole histogram (no other data is needed
            # from the other programs before the split)
            b_hist = tl.load(p_ws + o_b, volatile=True)
            while tl.sum(b_hist, 0) < n_len:
                b_hist = tl.load(p_ws + o_b, volatile=True)
        else:
            _barrier(p_hdr + _ARRIVED_HIST, n_prog, POLL_ACQUIRE)
            b_hist = tl.load(p_ws + o_b, cache_modifier=".cg")
        # 2. the band (the one bin of the k-th largest) and this slice's split around it
        lo, _ = pick_bin(b_hist, K, NBINS)
        _stamp(p_trace, 1, TRACE)
        bits = _band_bits(lo, lo)
        b_bin, m_gt, m_eq, b_pack, n_pack = _split_block(b_key, m_t, lo, lo)
        r_gt, r_eq = _unpack(tl.cumsum(b_pack, 0) - b_pack)
        # Two atomics in flight at once (neither under a branch, whose result would wait for it): each band key's
        # second digit and its arrival among the row's keys of that digit (the old count), its slot among the
        # digit's in step 3, which then needs no atomic; and the slices of the output and the band this slice takes
        b_d = _band_digit(b_key, b_bin, lo, bits)
        m_d = tl.where(bits >= 0, m_eq, False)  # no digit where the band's keys share none
        r_d = tl.atomic_add(p_ws + _HIST2 + b_d, 1, mask=m_d, sem="relaxed")
        n_gt, n_eq = _unpack(n_pack)
        o_gt, o_eq = _reserve(p_hdr, n_gt, n_eq)
        b_pos = _position(o_t, m_t, map_ptr, MAP_PAGE)
        tl.store(p_out + o_gt + r_gt, b_pos, mask=m_gt & (o_gt + r_gt < K))
        o_band = o_eq + r_eq  # each band key's slot in the row's band order
        # the band in band order (the single-program finish's input) and in the digit table (the ranked sub-bin's)
        tl.store(p_keys + o_band, b_key, mask=m_eq & (o_band < CAP))
        tl.store(p_keys + CAP + o_band, b_pos, mask=m_eq & (o_band < CAP))
        m_tab = m_d & (r_d < WAYS)
        tl.store(p_table + b_d * WAYS + r_d, b_key, mask=m_tab)
        tl.store(p_table + NBINS * WAYS + b_d * WAYS + r_d, b_pos, mask=m_tab)
        k_min = tl.min(tl.where(m_eq, b_key, 2147483647), 0)
        k_max = tl.max(tl.where(m_eq, b_key, -2147483648), 0)
        if k_min <= k_max:
            tl.atomic_min(p_hdr + _KEY_MIN, k_min, sem="relaxed")
            tl.atomic_max(p_hdr + _KEY_MAX, k_max, sem="relaxed")
        _stamp(p_trace, 2, TRACE)
        _barrier(p_hdr + _ARRIVED_SPLIT, n_prog, POLL_ACQUIRE)
        _stamp(p_trace, 3, TRACE)
        # 3. the same header and second histogram in every program, so the same path
        b_hist2 = tl.load(p_ws + _HIST2 + o_b, cache_modifier=".cg")
        n_above_band = tl.load(p_hdr + _N_GT, cache_modifier=".cg")
        n_surv = tl.load(p_hdr + _N_SURV, cache_modifier=".cg")
        k_min = tl.load(p_hdr + _KEY_MIN, cache_modifier=".cg")
        k_max = tl.load(p_hdr + _KEY_MAX, cache_modifier=".cg")
        k_rem = K - n_above_band
        i_sub, k_rem2 = pick_bin(b_hist2, k_rem, NBINS)
        n_sub = tl.sum(tl.where(o_b == i_sub, b_hist2, 0), 0)
        take = (n_surv == k_rem) | (k_min == k_max)
        second = (~take) & (bits >= 0) & (n_sub <= CAP2)
        ranked = second & (n_sub > k_rem2)  # the sub-bin is ranked: by program 0 from the table, or by the last
        p_keys2 = p_keys + 2 * CAP
        p_idx2 = p_keys2 + CAP2
        # A program arrives once it has read the row's counts (the last then cleans them) and, where the last
        # ranks the sub-bin from the second scratch, written its keys of the sub-bin there; its other stores
        # follow, so the arrival's release waits on none of them.
        m_in = m_eq & (b_d == i_sub)
        m_scratch2 = tl.where(ranked & (n_sub > WAYS), m_in, False)
        tl.store(p_keys2 + r_d, b_key, mask=m_scratch2)
        tl.store(p_idx2 + r_d, b_pos, mask=m_scratch2)
        tl.debug_barrier()
        n_before = tl.atomic_add(p_hdr + _ARRIVED_DONE, 1, sem="acq_rel")
        _stamp(p_trace, 7, TRACE)
        if take:
            tl.store(p_out + n_above_band + o_band, b_pos, mask=m_eq & (o_band < k_rem))
        elif second:
            # a key of a digit above the sub-bin: after the keys of the digits above its own, at its arrival
            b_above = tl.sum(b_hist2, 0) - tl.cumsum(b_hist2, 0)
            m_above = m_eq & (b_d > i_sub)
            o_above = tl.gather(b_above, tl.where(m_above, b_d, 0), 0)
            tl.store(p_out + K - k_rem + o_above + r_d, b_pos, mask=m_above)
            if not ranked:  # the whole sub-bin is needed
                tl.store(p_out + K - k_rem2 + r_d, b_pos, mask=m_in)
        if ranked & (n_sub <= WAYS) & (i_s == 0):  # the whole sub-bin is in the table since step 2
            rank_sub_bin(p_out, p_table + i_sub * WAYS, p_table + NBINS * WAYS + i_sub * WAYS, n_sub, k_rem2, K,
                         WAYS, WAYS, ".cg")
        if n_before == n_prog - 1:  # the last to arrive: every other program is past its last read
            tl.debug_barrier()
            if take:
                clean_row(p_ws, _PATH_TAKE, NBINS)
            elif second:
                if ranked & (n_sub > WAYS):
                    rank_sub_bin(p_out, p_keys2, p_idx2, n_sub, k_rem2, K, CAP2, RANK_BLOCK, ".cg")
                clean_row(p_ws, _PATH_SECOND, NBINS)
            else:
                _finish_row(
                    p_x, n_len, p_out, p_ws, lo, lo, K, map_ptr, p_trace,
                    CAP, CAP2, MAP_PAGE, 1024, FBLOCK, RANK_BLOCK, NBINS, BITS, PASSES, TRACE,
                )  # fmt: skip
            tl.store(p_hdr + _ARRIVED_HIST, 0)
            tl.store(p_hdr + _ARRIVED_SPLIT, 0)
            tl.store(p_hdr + _ARRIVED_DONE, 0)
        if TRACE:
            tl.debug_barrier()
        _stamp(p_trace, 4, TRACE)


@triton.jit
def _cooperative_topk_kernel(
    x_ptr,
    len_ptr,
    out_ptr,
    ws_ptr,
    map_ptr,
    trace_ptr,
    stride_x,
    stride_out,
    stride_ws,
    N,
    K,
    CAP: tl.constexpr,
    CAP2: tl.constexpr,
    MAP_PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    POLL_ACQUIRE: tl.constexpr,
    POLL_HIST: tl.constexpr,
    SPREAD: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    # TRACE: [start, band, slice done, past the second barrier, done, the single-program finish's sub-bin picked
    # and its path done, arrived after the split]
    p_trace = trace_ptr + (i_r * tl.num_programs(1) + i_s) * 8
    _stamp(p_trace, 0, TRACE)
    if PDL:
        gdc_wait()  # the scores and lengths come from the kernel before (no early launch of the next one)
    p_x = x_ptr + i_r.to(tl.int64) * stride_x
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    p_ws = ws_ptr + i_r.to(tl.int64) * stride_ws
    if SPREAD:
        # the row's keys spread over its programs by its length (a short context in a wide table would leave a few
        # programs holding whole blocks), whole MIN_BLOCK pieces a program: the slice waits for the length
        n_len = tl.minimum(tl.load(len_ptr + i_r), N)  # (a length past the row: the row; no barrier waits for more)
        width = tl.cdiv(tl.cdiv(n_len, tl.num_programs(1)), _MIN_BLOCK) * _MIN_BLOCK
        width = tl.maximum(tl.minimum(width, BLOCK), _MIN_BLOCK)
        o_t = i_s * width + tl.arange(0, BLOCK)
        b_x = tl.load(p_x + o_t, mask=(tl.arange(0, BLOCK) < width) & (o_t < n_len), other=0.0)
    else:
        width = BLOCK
        o_t = i_s * BLOCK + tl.arange(0, BLOCK)
        # the slice in flight beside the length (masked by the row's width, then by its length)
        b_x = tl.load(p_x + o_t, mask=o_t < N, other=0.0)
        n_len = tl.minimum(tl.load(len_ptr + i_r), N)
    cooperative_select(
        p_x, p_out, p_ws, map_ptr, p_trace, b_x, o_t, n_len, i_s, width, K,
        CAP, CAP2, MAP_PAGE, BLOCK, FBLOCK, RANK_BLOCK, WAYS, POLL_ACQUIRE, POLL_HIST, NBINS, BITS, PASSES, TRACE,
    )  # fmt: skip


def use_cooperative(n_rows: int, n_cols: int, device: torch.device) -> bool:
    """Whether rows this few and this wide take the cooperative launch: on a CUDA device (never the CPU
    interpreter: its programs run one after another, so a barrier would wait forever), at most `MAX_ROWS` rows,
    and a slice of at most `MAX_BLOCK` keys a program with two programs an SM."""
    if device.type != "cuda" or is_interpreter() or n_rows > MAX_ROWS:
        return False
    return cooperative_block(n_rows, n_cols, device) is not None


def cooperative_block(n_rows: int, n_cols: int, device: torch.device, sms: int | None = None) -> int | None:
    """Keys a program holds: the power of two (at least `MIN_BLOCK`) that spreads each row over at most two
    programs an SM in all and at most `MAX_PROGRAMS`; None where that would exceed `MAX_BLOCK`."""
    per_row = max(1, min(MAX_PROGRAMS, 2 * (sms or sm_count(device, 4)) // max(n_rows, 1)))
    block = max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(max(n_cols, 1), per_row)))
    return block if block <= MAX_BLOCK else None


def cooperative_topk_launch(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    plan: OneLaunchPlan,
    *,
    block: int | None = None,
    page_map: tuple[torch.Tensor, int] | None = None,
    trace: torch.Tensor | None = None,
):
    """The whole top-k of validated scores / lengths / out in one launch, the workspace clean (as
    `one_launch` leaves it; its first histogram must not have been added). block: keys a program holds (default
    `cooperative_block`, where `use_cooperative` allows); a block as wide as the rows (one program a row) waits
    for no other program, so it runs anywhere, the CPU interpreter included (its tests). page_map and trace as
    `one_launch.one_launch_topk_launch` (trace: [rows, programs, 8]). Returns the compiled kernel (its
    registers and shared memory decide how many programs an SM holds)."""
    n_rows, n_cols = scores.shape
    check_workspace(workspace, n_rows, plan, scores.device)
    check_page_map(page_map, n_rows, n_cols, scores.device)
    if block is None:
        block = cooperative_block(n_rows, n_cols, scores.device) if use_cooperative(n_rows, n_cols, scores.device) \
            else None
        require(block is not None, f"{n_rows} rows of {n_cols} do not fit one resident cooperative launch here")
    require(block >= 16 and block & (block - 1) == 0, f"block must be a power of two >= 16, got {block}")
    grid = (n_rows, triton.cdiv(max(n_cols, 1), block))
    resident = scores.device.type == "cuda" and not is_interpreter() and n_rows * grid[1] <= 2 * sm_count(
        scores.device, 4)
    require(grid[1] == 1 or resident, f"{grid[1]} programs a row must all be resident at once (one a row here)")
    if trace is not None:
        check_tensor("trace", trace, dtypes=(torch.int64,), shape=(*grid, 8), device=scores.device)
    pdl = pdl_for_rows(n_rows, scores.device)
    return _cooperative_topk_kernel[grid](
        scores, lengths, out, workspace, out if page_map is None else page_map[0],
        trace if trace is not None else out, scores.stride(0), out.stride(0), workspace.stride(0), n_cols, plan.k,
        CAP=plan.capacity, CAP2=plan.capacity2, MAP_PAGE=0 if page_map is None else page_map[1], BLOCK=block,
        FBLOCK=plan.finish_block, RANK_BLOCK=RANK_BLOCK, WAYS=TABLE_WAYS, POLL_ACQUIRE=POLL_ACQUIRE,
        POLL_HIST=POLL_HIST, SPREAD=SPREAD and block >= MIN_BLOCK, NBINS=NBINS, BITS=RADIX_BITS, PASSES=PASSES,
        PDL=pdl, TRACE=trace is not None,
        num_warps=NUM_WARPS, maxnreg=SELECT_MAXNREG, launch_pdl=pdl,
    )  # fmt: skip


def topk_indices_cooperative(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    capacity: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Exact top-k indices per row, unsorted, in one cooperative launch; the contract of
    `hearth.kernels.topk.topk_indices` (ties broken arbitrarily; rows with L <= k give 0..L-1 then -1).
    Only where `use_cooperative` holds. workspace / capacity: as `one_launch.topk_indices_one_launch`'s
    (a clean workspace kept across calls; capacity: band survivors the single-program fallback keeps);
    block: `cooperative_topk_launch`'s."""
    out = checked_output(scores, lengths, k, out)
    plan = one_launch_plan(k, capacity=capacity)
    if out.shape[0] == 0:
        return out
    if workspace is None:
        workspace = new_one_launch_workspace(out.shape[0], plan, scores.device)
    cooperative_topk_launch(scores, lengths, out, workspace, plan, block=block)
    return out
