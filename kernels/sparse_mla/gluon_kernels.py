"""Sparse MLA in Gluon (Triton 3.6, Hopper sm_90), bf16 latent cache: what `sparse_mla_decode` and
`sparse_mla_prefill` run on an sm_90 GPU where they can (`gluon_unsupported`; `kernel.GLUON_DECODE` /
`GLUON_PREFILL`), the Triton kernel of kernel.py everywhere else (an FP8 cache, heads not in 64s, other GPUs,
the CPU interpreter). An FP8-cache seesaw (below, "seesaw over an FP8 cache") is prepared but kept out of the
dispatch (`FP8 = False`) until it is timed on the GPU; `sparse_mla_decode_gluon` runs it on request.

Same semantics as the Triton kernel and `reference.sparse_mla_ref`: for query row r and head h, s[n] = sm_scale *
q[r, h, :576] . kv[slot(idx[r, n]), :576] over the valid selected positions (0 <= idx <= limit[r]; decode: the
request's context length - 1, prefill: the query's position; slot = table_r[idx // block_size] * block_size +
idx % block_size, table_r the request's block table, one shared table for a prefill chunk), out = softmax(s) @
kv[slot, :512] (bf16, zeros when nothing is valid), lse = natural-log log-sum-exp of s (fp32, -inf when nothing is
valid). One program (CTA) owns one row, 64 heads and one split of the selection; splits are merged by the Triton
combine kernel of kernel.py.

Measured on the H200 (2026-12-04, `python3 bench/bench_gluon_mla.py`, 128 heads, top-k 2048 of a 32K context,
CUDA-graph medians), against the Triton kernel in the same run: decode batch 1 / 8 / 64: 13.4 / 35.4 / 111.7-112.9 us
(323-327 TFLOP/s at 64) against 13.8 / 46.1 / 166.6-166.8 (219); prefill of 4,096 queries: 5.91 ms (396 TFLOP/s)
against 9.81 ms (238). The simple variant: 310 / 340 TFLOP/s.

Why Gluon: the Triton kernel (kernel.py) runs one program of 8 warps per SM and is bound by the serial
QK -> softmax -> PV chain of that program and by the gather that the pipeliner prefetches one tile ahead
(docs/benchmarks.md, "What would remove the fixed part is FlashMLA's structure"). Gluon exposes the pieces
that FlashMLA's Hopper kernels are built from: explicit warpgroup MMAs (`warpgroup_mma`, asynchronous, with
`warpgroup_mma_wait`), shared-memory buffers and mbarriers, cp.async gathers, and warp-specialised
partitions with their own register budgets. Two variants, selected by `variant=`:

"simple": one partition of 8 warps (two warpgroups), like the Triton kernel but written out by hand. The
query (64 heads x 576) is copied once into shared memory; gathered 64-row tiles of the cache go through a
ring of two stages with cp.async (all 256 threads issue them, one commit group per tile, the next tile is
issued before the current one is consumed). QK^T is one async wgmma pair (512 latent + 64 rope columns,
both operands in shared memory); the 64 x 64 score tile is split by columns over the two warpgroups, so the
row max / sum and the P operand of the PV wgmma cross warpgroups (Triton inserts the shared-memory
exchanges). Each warpgroup accumulates 256 of the 512 output columns ([64, 256] fp32: 128 registers a
thread). Shared memory: query 72 KiB + 2 x 72 KiB tiles + the compiler's scratch for P and the row
reductions = 220 KiB of the 227 KiB a CTA may have; 251 registers a thread (256 threads), no spills.

"seesaw" (default): FlashMLA-style warp specialisation, 12 warps (384 threads) in three partitions.
- Producer (the default partition: the kernel's 4 warps, 24 registers): copies the query into shared memory once
  (cp.async, completion signalled on `q_bar` with one no-increment cp.async arrive per thread), then
  gathers 32-row tiles into a ring of NS = 4 stages. For tile t it waits `kv_free[t % NS]` (the stage's
  previous tile released by both consumers), issues the row copies (masked rows are zero-filled and read
  nothing) and arms `kv_ready[t % NS]` with a no-increment cp.async arrive per thread (count 128), so the
  stage completes when every copy has landed and the producer never waits for its own copies. The
  selection -> block table -> slot chain of the next tile is loaded while it waits for a free stage.
- Two consumer warpgroups (two worker partitions, same code, `WG` = 0 / 1, 240 registers). Warpgroup w
  owns 256 of the 512 output columns ([64, 256] fp32 accumulator, 128 registers a thread) and the QK^T +
  softmax of the tiles t = 2p + w of step p; both warpgroups run the PV of both tiles of a step on their
  own columns. One step of warpgroup w:
    1. wait kv_ready of its tile, S = Q K_t^T (two async wgmmas from shared memory, 64 x 32 fp32),
    2. softmax against m_t = max(running max, rowmax S): P_t = exp2(S - m_t), row sums r_t,
    3. publish P_t (bf16, 4 KiB), m_t and r_t in its exchange buffer (`p_ready[w]`; it first waits
       `p_free[w]`, the other warpgroup done reading the previous step's),
    4. rescale its accumulator to m_t and issue O += P_t V_t[:, own columns] (async, P from registers),
    5. wait `p_ready[1 - w]`, read the other tile's P_u, m_u, r_u, release `p_free[1 - w]`,
    6. new max M = max(m_t, m_u): wait for its PV, rescale O by exp2(m_t - M), issue
       O += (P_u * exp2(m_u - M)) V_u[:, own columns], wait, and release both stages (`kv_free`, count 2).
  Unlike FlashMLA, the two warpgroups' softmaxes do not depend on each other: each publishes its P
  against its own running max and the receiver rescales it (one multiply of a 64 x 32 tile in registers),
  so neither warpgroup waits for the other's softmax before its own; they only meet at the exchange
  (step 5), and the own-tile PV (step 4) is in flight meanwhile. While one warpgroup runs its softmax
  the other's wgmmas keep the tensor cores busy. Both warpgroups see the same maxima, so they end
  with the same running max; each divides its half by its own row sum (identical up to rounding
  order), warpgroup 0 writes the lse.
- Stage lifetime: a tile's stage is released at the end of the step that reads it, so with NS = 4 the
  producer fills the next step's two tiles during the current step (one step of latency hiding).
- Shared memory (227 KiB per CTA): query 72 KiB, ring 4 x 36 KiB = 144 KiB, P exchange 2 x 4 KiB,
  row stats 1 KiB, 13 mbarriers: 225.3 KiB (230,752 B), so one CTA per SM.
- Registers (64K per SM): 384 threads start at 168 (ptxas .maxnreg); Triton's warp_specialize gives the
  worker partitions what `REGS_CONSUMER` asks (setmaxnreg.inc) and the default partition what is left of
  3 x 168: consumers 240 (the 128-register accumulator, the 64 x 32 score tile and P, the other
  warpgroup's P, row statistics, and the hoisted wgmma descriptors of the query), producer 24 (one row
  of the 32-row tile per thread). No spills at 240 / 24; at 232 / 40 the consumers spill 36 bytes
  (loop-invariant descriptors reloaded each step), at 224 / 56 76 bytes. Each mbarrier arrive is one
  thread's after a partition barrier (Triton emits bar.sync + thread-0 arrive), so counts are per
  partition: kv_free 2, p_ready / p_free 1; cp.async arrives are per producer thread (128).

"seesaw" over an FP8 cache (`_sparse_mla_seesaw_fp8_kernel`; uint8 [num_blocks, block_size, 656] rows: 512 e4m3
values, 4 fp32 scales for the 4 groups of 128, 64 bf16 rope values, as `reference.quantize_latent_fp8`): the
seesaw's consumers unchanged (their PTX is the bf16 kernel's: `bench/gluon_report.py` compares it), the same
shared memory plus a 1 KiB scale buffer (226.3 KiB), and a producer that dequantises in shared memory, in place
in the stage the consumers read (there is no room for a separate FP8 ring: the bf16 ring and query take 225 KiB):
- Copies: for the two tiles of step p (their stages are released together), wait kv_free, then cp.async each
  row's 512 e4m3 bytes into the upper half of the tile's stage (as [4, 32, 128] bytes: group g at bytes 16K + 4K g
  of the 32 KiB latent stage), its 16 scale bytes into the scale buffer, its 128 rope bytes straight into the rope
  stage (bf16 already); one commit group a tile, masked rows zero-filled. The table lookups of step p + 1 (their
  selection loaded a step earlier) and an L2 prefetch of its rows (cp.async.bulk.prefetch.L2, 656 bytes a row:
  `prefetch`) go out while the copies land.
- Dequantisation of tile t (wait_group, partition barrier): for g = 0..3, load staged group g ([32, 128] bytes, 32
  a thread), scale[:, g], convert e4m3 -> f16 -> f32 (exact), multiply by the fp32 scale (one rounding) and round
  to bf16: exactly `dequantize_latent_fp8`'s values in bf16, so the result is bit for bit the bf16 seesaw's on the
  dequantised cache; store them as latent columns 128g .. 128g + 127 (column blocks 2g, 2g + 1 of the 128-byte
  swizzled stage, bytes 8K g .. 8K g + 8K). Group 2's store covers staged groups 0-1, group 3's staged groups 2-3,
  all loaded by then; a partition barrier between the loads and the store of iterations 2 and 3 orders every
  thread's reads before the stores over them (Triton's barrier analysis, which sees one buffer, puts one between
  every load and store of the stage anyway: 8 a tile). Then fence.proxy.async and one arrive on kv_ready (count
  1: bar.sync + one thread's arrive), so the consumers' waits, phases and kv_free protocol are the bf16 kernel's.
- Registers: the producer holds its loop state and a 32-value chunk a thread; at 24 registers (consumers 240) it
  spills 100 B (48 LDL / STL in its loop), at 40 (consumers 232, the default) ptxas reports 40 B: 14 LDL / STL in
  the consumers (loop-invariant values reloaded each step, as the bf16 seesaw's at 232) and 5 in the producer.
- Work: per tile a producer thread (128 values) issues 11 cp.async, 8 LDS.128 + 4 LDS, 64 F2FP.F16.E4M3.UNPACK_B,
  128 HADD2.F32, 128 FMUL, 64 F2FP.BF16.F32.PACK_AB, 16 STS.128 and 12 partition barriers (SASS): it must fetch
  and dequantise a step's two tiles within one consumer step (~3.5 us at batch 64) where the bf16 producer only
  fetched them. Not yet timed: `bench/bench_gluon_mla.py --fp8` (Triton's FP8 tile path, this variant under
  `SEESAW_FP8` overrides, the bf16 seesaw on the dequantised cache); the GPU tests check it against the reference
  and bit for bit against the bf16 seesaw (tests/kernels/test_sparse_mla_gluon.py), and offline models check the
  in-place dataflow and the mbarrier protocol.

Constraints: bf16 cache [num_blocks, block_size, 576] (or, for the FP8 seesaw, uint8 [.., 656] with fewer than
2^31 rows) with a power-of-two block size, H a multiple of 64, q / indices / block_table with unit last stride.
Any top-k: tails are masked (a partial last tile, and for the seesaw an odd tile count, cost a masked tile's
wgmmas, no memory traffic).

On a Triton without a usable `triton.experimental.gluon` this module still imports (`GLUON_ERROR` says why),
the dispatch keeps the Triton kernel, and `sparse_mla_decode_gluon` raises a RuntimeError. The kernels cannot
run in Triton's CPU interpreter; `bench/gluon_report.py` compiles them offline for sm_90
(`PYTHONPATH=/tmp/t36 python bench/gluon_report.py`, with Triton 3.6 installed there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import is_interpreter, require, sm_count
from hearth.kernels.sparse_mla.kernel import (
    D_LATENT,
    D_QK,
    D_ROPE,
    FP8_TOKEN_BYTES,
    H200_SMS,
    LOG2E,
    _sparse_mla_combine_kernel,
    check_decode,
    launch_plan,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any Triton without a usable gluon (ImportError, AttributeError, ...)
    GLUON_ERROR = f"triton {triton.__version__} has no usable triton.experimental.gluon ({type(exc).__name__}: {exc})"

    class _NoGluon:
        """Stand-in so that the @gluon.jit definitions below still execute (annotations are strings)."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    gluon = _NoGluon()

BLOCK_H = 64  # heads per program: the M of one warpgroup's wgmma
VARIANTS = ("seesaw", "simple")
VARIANT = "seesaw"  # what `sparse_mla_decode` / `sparse_mla_prefill` run where the Gluon kernels can
# launch settings of each variant: tile rows, ring stages, warps of the (default) partition, worker registers
# seesaw: 32-row tiles in 4 stages; 4 warps = the producer (default partition), which gets the registers the two
# consumer warpgroups leave of 3 x 168 (a CTA of 384 threads): 240 each -> 24 for the producer, no spills
SEESAW = {"block_n": 32, "stages": 4, "num_warps": 4, "regs": 240, "proxy_fence": True}
SIMPLE = {"block_n": 64, "stages": 2, "num_warps": 8}
# the seesaw over an FP8 cache (`_sparse_mla_seesaw_fp8_kernel`): the same tiles, ring and consumers; the producer
# dequantises in shared memory and needs more than 24 registers (loop state + a 32-value chunk a thread): consumers
# at 232 leave it 40 (ptxas: 40 B of spills, mostly loop-invariant values the consumers reload each step; at 240 / 24
# the producer spills 100 B instead). prefetch: the next step's rows brought into L2 (cp.async.bulk.prefetch.L2)
# while the current step's copies land. Not yet timed on the GPU (`bench/bench_gluon_mla.py --fp8` compares both)
SEESAW_FP8 = {"block_n": 32, "stages": 4, "num_warps": 4, "regs": 232, "proxy_fence": True, "prefetch": True}
# whether `sparse_mla_decode` / `sparse_mla_prefill` give an FP8 cache to the FP8 seesaw (`gluon_unsupported`); off
# until it is timed on the H200 against the Triton kernel's FP8 tile path (`sparse_mla_decode_gluon` runs it anyway)
FP8 = False
LN2 = 0.6931471805599453
# constexpr globals for the kernels (plain module ints cannot be read inside @jit functions)
_DV = tl.constexpr(D_LATENT)
_DR = tl.constexpr(D_ROPE)
_DQK = tl.constexpr(D_QK)
_BH = tl.constexpr(BLOCK_H)
_LN2 = tl.constexpr(LN2)
_FP8_ROW = tl.constexpr(FP8_TOKEN_BYTES)


# ----------------------------------------------------------------------------------------------------------
# shared helpers (inlined into each partition)
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _program_split(TOPK, CHUNK):
    """This program's row (int32 and int64), head block and split; the split's first selection entry and its
    number of entries."""
    i_r = gl.program_id(0)
    i_h = gl.program_id(1)
    i_s = gl.program_id(2)
    i_start = i_s * CHUNK
    return i_r, i_r.to(gl.int64), i_h, i_s, i_start, gl.minimum(CHUNK, TOPK - i_start)


@gluon.jit
def _output_rows(o_ptr, lse_ptr, i_r64, i_h, i_s, stride_o_r, stride_o_s, stride_o_h, stride_lse_r, stride_lse_s):
    """Where this program's [64, 512] output and its 64 lse values go (row, split, first head)."""
    o_row_ptr = o_ptr + i_r64 * stride_o_r + i_s.to(gl.int64) * stride_o_s + (i_h * _BH).to(gl.int64) * stride_o_h
    return o_row_ptr, lse_ptr + i_r64 * stride_lse_r + i_s.to(gl.int64) * stride_lse_s + i_h * _BH


@gluon.jit
def _load_selection(sel_ptr, n_sel, t, BN: gl.constexpr, layout: gl.constexpr):
    """Logical positions of tile t of the split's selection (`sel_ptr`, `n_sel` entries; -1 past its end),
    in `layout` (a 1-D slice layout)."""
    offs = t * BN + gl.arange(0, BN, layout=layout)
    return gl.load(sel_ptr + offs, mask=offs < n_sel, other=-1)


@gluon.jit
def _selection_to_slots(idx, table_row_ptr, limit, BLOCK_SIZE: gl.constexpr):
    """Physical cache rows (int64) and validity of logical positions `idx` (block table row `table_row_ptr`)."""
    valid = (idx >= 0) & (idx <= limit)
    safe = gl.where(valid, idx, 0).to(gl.uint32)  # non-negative: unsigned division by the power of two is a shift
    page = gl.load(table_row_ptr + safe // BLOCK_SIZE, mask=valid, other=0)
    return page.to(gl.int64) * BLOCK_SIZE + (safe % BLOCK_SIZE).to(gl.int64), valid


@gluon.jit
def _gather_tile(kv_ptr, slot, valid, lat_dst, rope_dst, layout: gl.constexpr):
    """cp.async the rows `slot` of the cache ([BN, 512] latent and [BN, 64] rope) into shared memory;
    invalid rows are zero-filled and read nothing. `slot` / `valid` are in SliceLayout(1, layout)."""
    rows = slot[:, None] * _DQK
    cols = gl.arange(0, _DV, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(lat_dst, kv_ptr + rows + cols[None, :], mask=valid[:, None])
    rcols = _DV + gl.arange(0, _DR, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(rope_dst, kv_ptr + rows + rcols[None, :], mask=valid[:, None])


@gluon.jit
def _copy_query(q_row_ptr, stride_q_h, q_lat, q_rope, layout: gl.constexpr, ROWS: gl.constexpr):
    """cp.async the program's [64, 576] query into shared memory, ROWS heads at a time."""
    cols = gl.arange(0, _DV, layout=gl.SliceLayout(0, layout))
    rcols = _DV + gl.arange(0, _DR, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, _BH, ROWS):
        heads = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        p_row = q_row_ptr + heads[:, None] * stride_q_h
        async_copy.async_copy_global_to_shared(q_lat.slice(r0, ROWS, dim=0), p_row + cols[None, :])
        async_copy.async_copy_global_to_shared(q_rope.slice(r0, ROWS, dim=0), p_row + rcols[None, :])


@gluon.jit
def _store_output(acc, m_run, l_run, o_row_ptr, stride_o_h, lse_row_ptr, COL0: gl.constexpr, WRITE_LSE: gl.constexpr,
                  layout: gl.constexpr):
    """out[:, COL0 : COL0 + N] = acc / l (0 where l == 0); lse = ln(2) * (m + log2 l) (-inf where l == 0)."""
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    l_o = gl.convert_layout(l_run, row_l)
    has = l_o > 0
    out = acc / gl.where(has, l_o, 1.0)[:, None]
    heads = gl.arange(0, _BH, layout=row_l)
    cols = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    p_o = o_row_ptr + heads[:, None] * stride_o_h + cols[None, :]
    gl.store(p_o, out.to(o_row_ptr.dtype.element_ty))
    if WRITE_LSE:
        m_o = gl.convert_layout(m_run, row_l)
        lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_o, 1.0))) * _LN2, float("-inf"))
        gl.store(lse_row_ptr + heads, lse)


# ----------------------------------------------------------------------------------------------------------
# variant "simple": one partition, 8 warps
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _sparse_mla_simple_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    table_ptr,
    ctx_ptr,
    limit_bias,
    o_ptr,
    lse_ptr,
    TOPK,
    CHUNK,
    qk_scale,
    stride_q_r,
    stride_q_h,
    stride_idx_r,
    stride_table_r,
    stride_o_r,
    stride_o_s,
    stride_o_h,
    stride_lse_r,
    stride_lse_s,
    BLOCK_SIZE: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
):
    gl.static_assert(NS == 2, "the simple variant double-buffers")
    i_r, i_r64, i_h, i_s, i_start, n_sel = _program_split(TOPK, CHUNK)
    n_tiles = gl.cdiv(n_sel, BN)
    limit = gl.load(ctx_ptr + i_r) + limit_bias
    sel_ptr = idx_ptr + i_r64 * stride_idx_r + i_start
    table_row_ptr = table_ptr + i_r64 * stride_table_r

    # layouts: 8 warps = two warpgroups side by side along N of every wgmma
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DV], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DR], gl.bfloat16)
    qlat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DV], gl.bfloat16)
    qrope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DR], gl.bfloat16)

    q_lat = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DV], qlat_sl)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DR], qrope_sl)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DV], lat_sl)
    kv_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DR], rope_sl)

    q_row_ptr = q_ptr + i_r64 * stride_q_r + (i_h * _BH).to(gl.int64) * stride_q_h
    _copy_query(q_row_ptr, stride_q_h, q_lat, q_rope, copy_l, 32)
    async_copy.commit_group()
    sel = _load_selection(sel_ptr, n_sel, 0, BN, gl.SliceLayout(1, copy_l))
    slot, valid = _selection_to_slots(sel, table_row_ptr, limit, BLOCK_SIZE)
    _gather_tile(kv_ptr, slot, valid, kv_lat.index(0), kv_rope.index(0), copy_l)
    async_copy.commit_group()

    m_run = gl.full([_BH], float("-inf"), gl.float32, row_s)
    l_run = gl.zeros([_BH], gl.float32, row_s)
    acc = gl.zeros([_BH, _DV], gl.float32, o_l)
    for t in range(n_tiles):
        st = t % NS
        # prefetch tile t + 1 into the other stage (fully masked past the end: zero-fill, no reads)
        sel = _load_selection(sel_ptr, n_sel, t + 1, BN, gl.SliceLayout(1, copy_l))
        slot, valid = _selection_to_slots(sel, table_row_ptr, limit, BLOCK_SIZE)
        _gather_tile(kv_ptr, slot, valid, kv_lat.index(1 - st), kv_rope.index(1 - st), copy_l)
        async_copy.commit_group()
        # the score mask of tile t, loaded while the copies land
        sel_t = _load_selection(sel_ptr, n_sel, t, BN, gl.SliceLayout(0, s_l))
        valid_t = (sel_t >= 0) & (sel_t <= limit)
        async_copy.wait_group(1)  # this thread's copies of tile t (and the query) have landed
        gl.thread_barrier()  # ... and every other thread's
        fence_async_shared()  # generic-proxy writes -> async-proxy (wgmma) reads
        kv_t = kv_lat.index(st)
        s = warpgroup_mma(q_lat, kv_t.permute((1, 0)), gl.zeros([_BH, BN], gl.float32, s_l), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q_rope, kv_rope.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        s = gl.where(valid_t[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_run, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_run - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_run = l_run * alpha + gl.sum(p, axis=1)
        m_run = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_l)
        acc = warpgroup_mma(p_op, kv_t, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
        gl.thread_barrier()  # every warpgroup is done with stage st before the next iteration refills it
    async_copy.wait_group(0)

    o_row_ptr, lse_row_ptr = _output_rows(o_ptr, lse_ptr, i_r64, i_h, i_s, stride_o_r, stride_o_s, stride_o_h,
                                          stride_lse_r, stride_lse_s)
    _store_output(acc, m_run, l_run, o_row_ptr, stride_o_h, lse_row_ptr, 0, True, o_l)


# ----------------------------------------------------------------------------------------------------------
# variant "seesaw": producer warpgroup + two consumer warpgroups
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _seesaw_producer(args, smem, bars, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr):
    q_row_ptr, stride_q_h, kv_ptr, sel_ptr, table_row_ptr, limit, n_sel, n_pairs = args
    q_lat, q_rope, kv_lat, kv_rope, p_smem, m_smem, r_smem = smem
    q_bar, kv_ready, kv_free, p_ready, p_free = bars
    # one warpgroup, one row of the 32-row tile per thread: a warp copies 8 rows x 64 bytes per instruction
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    sel_l: gl.constexpr = gl.SliceLayout(1, copy_l)

    _copy_query(q_row_ptr, stride_q_h, q_lat, q_rope, copy_l, 32)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    # software pipeline: the slots of tile t are ready when its stage frees up; the selection of
    # tile t + 1 is in flight meanwhile
    sel = _load_selection(sel_ptr, n_sel, 0, BN, sel_l)
    slot, valid = _selection_to_slots(sel, table_row_ptr, limit, BLOCK_SIZE)
    sel = _load_selection(sel_ptr, n_sel, 1, BN, sel_l)
    for t in range(2 * n_pairs):
        st = t % NS
        mbarrier.wait(kv_free.index(st), ((t // NS) & 1) ^ 1)
        _gather_tile(kv_ptr, slot, valid, kv_lat.index(st), kv_rope.index(st), copy_l)
        async_copy.mbarrier_arrive(kv_ready.index(st), increment_count=False)
        slot, valid = _selection_to_slots(sel, table_row_ptr, limit, BLOCK_SIZE)
        sel = _load_selection(sel_ptr, n_sel, t + 2, BN, sel_l)
    # leave no copy of this thread in flight when the partition ends (the consumers wait on them anyway)
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _seesaw_consumer(args, smem, bars, WG: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                     PROXY_FENCE: gl.constexpr):
    sel_ptr, limit, n_sel, n_pairs, qk_scale, o_row_ptr, stride_o_h, lse_row_ptr = args
    q_lat, q_rope, kv_lat, kv_rope, p_smem, m_smem, r_smem = smem
    q_bar, kv_ready, kv_free, p_ready, p_free = bars
    HALF: gl.constexpr = _DV // 2
    OTHER: gl.constexpr = 1 - WG
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)

    m_run = gl.full([_BH], float("-inf"), gl.float32, row_s)
    l_run = gl.zeros([_BH], gl.float32, row_s)
    acc = gl.zeros([_BH, HALF], gl.float32, o_l)
    mbarrier.wait(q_bar, 0)
    for p in range(n_pairs):
        t = 2 * p + WG  # the tile whose QK^T and softmax this warpgroup computes
        u = 2 * p + OTHER  # the other warpgroup's tile of this step
        st = t % NS
        su = u % NS
        sel = _load_selection(sel_ptr, n_sel, t, BN, col_s)
        valid = (sel >= 0) & (sel <= limit)
        # 1. S = Q K_t^T
        mbarrier.wait(kv_ready.index(st), (t // NS) & 1)
        if PROXY_FENCE:
            fence_async_shared()  # cp.async (generic proxy) writes -> wgmma (async proxy) reads
        s = warpgroup_mma(q_lat, kv_lat.index(st).permute((1, 0)), gl.zeros([_BH, BN], gl.float32, s_l),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope, kv_rope.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        # 2. softmax against this warpgroup's running max (log2 domain)
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_t = gl.maximum(m_run, gl.max(s, axis=1))
        m_t_use = gl.where(m_t == float("-inf"), 0.0, m_t)
        pt = gl.exp2(s - m_t_use[:, None])
        r_t = gl.sum(pt, axis=1)
        pt16 = pt.to(gl.bfloat16)
        # 3. publish P_t, m_t, r_t for the other warpgroup
        mbarrier.wait(p_free.index(WG), (p & 1) ^ 1)
        p_smem.index(WG).store(pt16)
        m_smem.slice(WG * _BH, _BH).store(m_t)
        r_smem.slice(WG * _BH, _BH).store(r_t)
        mbarrier.arrive(p_ready.index(WG))
        # 4. O = O * exp2(m - m_t) + P_t V_t[:, own half]
        alpha = gl.exp2(m_run - m_t_use)
        l_run = l_run * alpha + r_t
        m_run = m_t
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        a_t = gl.convert_layout(pt16, p_l)
        acc = warpgroup_mma(a_t, kv_lat.index(st).slice(WG * HALF, HALF, dim=1), acc, is_async=True)
        # 5. the other warpgroup's tile
        mbarrier.wait(p_ready.index(OTHER), p & 1)
        pu16 = p_smem.index(OTHER).load(s_l)
        m_u = m_smem.slice(OTHER * _BH, _BH).load(row_s)
        r_u = r_smem.slice(OTHER * _BH, _BH).load(row_s)
        mbarrier.arrive(p_free.index(OTHER))
        # 6. new max, rescale, O += (P_u * exp2(m_u - M)) V_u[:, own half]
        m_new = gl.maximum(m_run, m_u)
        m_new_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_run - m_new_use)
        beta = gl.exp2(m_u - m_new_use)
        l_run = l_run * alpha + r_u * beta
        m_run = m_new
        a_u = gl.convert_layout((pu16.to(gl.float32) * beta[:, None]).to(gl.bfloat16), p_l)
        mbarrier.wait(kv_ready.index(su), (u // NS) & 1)
        if PROXY_FENCE:
            fence_async_shared()
        acc, a_t = warpgroup_mma_wait(0, deps=[acc, a_t])
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(a_u, kv_lat.index(su).slice(WG * HALF, HALF, dim=1), acc, is_async=True)
        acc, a_u = warpgroup_mma_wait(0, deps=[acc, a_u])
        mbarrier.arrive(kv_free.index(st))
        mbarrier.arrive(kv_free.index(su))
    _store_output(acc, m_run, l_run, o_row_ptr, stride_o_h, lse_row_ptr, WG * HALF, WG == 0, o_l)


@gluon.jit
def _sparse_mla_seesaw_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    table_ptr,
    ctx_ptr,
    limit_bias,
    o_ptr,
    lse_ptr,
    TOPK,
    CHUNK,
    qk_scale,
    stride_q_r,
    stride_q_h,
    stride_idx_r,
    stride_table_r,
    stride_o_r,
    stride_o_s,
    stride_o_h,
    stride_lse_r,
    stride_lse_s,
    BLOCK_SIZE: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    REGS_CONSUMER: gl.constexpr,
    PROXY_FENCE: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4, "the producer (default partition) is one warpgroup: launch with num_warps=4")
    gl.static_assert(NS % 2 == 0, "a step's two tiles must sit in different stages")
    gl.static_assert(NS >= 4, "the producer fills step p + 1 during step p")
    i_r, i_r64, i_h, i_s, i_start, n_sel = _program_split(TOPK, CHUNK)
    n_pairs = gl.cdiv(gl.cdiv(n_sel, BN), 2)
    limit = gl.load(ctx_ptr + i_r) + limit_bias

    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DV], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DR], gl.bfloat16)
    qlat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DV], gl.bfloat16)
    qrope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DR], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, BN], gl.bfloat16)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()

    q_lat = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DV], qlat_sl)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DR], qrope_sl)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DV], lat_sl)
    kv_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DR], rope_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _BH, BN], p_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [2 * _BH], v_sl)
    r_smem = gl.allocate_shared_memory(gl.float32, [2 * _BH], v_sl)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)

    # producer arrivals: one no-increment cp.async arrive per producer thread (one warpgroup)
    mbarrier.init(q_bar, count=128)
    for i in gl.static_range(NS):
        mbarrier.init(kv_ready.index(i), count=128)
        mbarrier.init(kv_free.index(i), count=2)  # one arrive per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)

    q_row_ptr = q_ptr + i_r64 * stride_q_r + (i_h * _BH).to(gl.int64) * stride_q_h
    sel_ptr = idx_ptr + i_r64 * stride_idx_r + i_start
    table_row_ptr = table_ptr + i_r64 * stride_table_r
    o_row_ptr, lse_row_ptr = _output_rows(o_ptr, lse_ptr, i_r64, i_h, i_s, stride_o_r, stride_o_s, stride_o_h,
                                          stride_lse_r, stride_lse_s)
    smem = (q_lat, q_rope, kv_lat, kv_rope, p_smem, m_smem, r_smem)
    bars = (q_bar, kv_ready, kv_free, p_ready, p_free)
    producer_args = (q_row_ptr, stride_q_h, kv_ptr, sel_ptr, table_row_ptr, limit, n_sel, n_pairs)
    consumer_args = (sel_ptr, limit, n_sel, n_pairs, qk_scale, o_row_ptr, stride_o_h, lse_row_ptr)
    gl.warp_specialize(
        [
            (_seesaw_producer, (producer_args, smem, bars, BLOCK_SIZE, BN, NS)),
            (_seesaw_consumer, (consumer_args, smem, bars, 0, BN, NS, PROXY_FENCE)),
            (_seesaw_consumer, (consumer_args, smem, bars, 1, BN, NS, PROXY_FENCE)),
        ],
        [4, 4],
        [REGS_CONSUMER, REGS_CONSUMER],
    )


# ----------------------------------------------------------------------------------------------------------
# variant "seesaw" over an FP8 cache: the same consumers, a producer that dequantises in shared memory
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _selection_to_rows(idx, table_row_ptr, limit, BLOCK_SIZE: gl.constexpr):
    """`_selection_to_slots` with int32 rows (one register; the launcher checks the cache has < 2^31 rows)."""
    valid = (idx >= 0) & (idx <= limit)
    safe = gl.where(valid, idx, 0).to(gl.uint32)
    page = gl.load(table_row_ptr + safe // BLOCK_SIZE, mask=valid, other=0)
    return page * BLOCK_SIZE + (safe % BLOCK_SIZE).to(gl.int32), valid


@gluon.jit
def _prefetch_rows_l2(kv_ptr, row):
    """Bring the 656-byte cache rows `row` (SliceLayout(1, copy_l): a row in lanes 4r .. 4r + 3) into L2 with one
    cp.async.bulk.prefetch.L2 a row (lane % 4 == 0; no register, no shared memory), a step before their copies are
    issued. Rows of masked positions are row 0 of the cache: a harmless prefetch."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .u32 %lane;\n\t.reg .pred %first;\n\tmov.u32 %lane, %laneid;\n\tand.b32 %lane, %lane, 3;\n\t"
        "setp.eq.u32 %first, %lane, 0;\n\t@%first cp.async.bulk.prefetch.L2.global [$1], 656;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l", [kv_ptr + row.to(gl.int64) * _FP8_ROW], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fp8_copy_tile(kv_ptr, row, valid, fp8_dst, scale_dst, rope_dst):
    """cp.async the cache rows `row` of one tile (656 bytes each: 512 e4m3 values, 4 fp32 group scales, 64 bf16 rope
    values): the e4m3 bytes into `fp8_dst` ([4, BN, 128]: group g = latent columns 128g .. 128g + 127), the scales
    into `scale_dst` ([BN, 4]) and the rope into `rope_dst` ([BN, 64], the bf16 kernel's rope stage). Invalid rows
    are zero-filled and read nothing. `row` / `valid` are in SliceLayout(1, rope_l): one row a thread (4 threads a
    row, 8 rows a warp), as every copy layout here, so the layout conversions below move no data."""
    fp8_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
    scale_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    base = kv_ptr + row.to(gl.int64) * _FP8_ROW  # the rows' first bytes
    row3_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, fp8_l))
    base3 = gl.convert_layout(base, row3_l)
    valid3 = gl.convert_layout(valid, row3_l)
    g3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, fp8_l)))
    c3 = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, fp8_l)))
    off3 = (g3 * 128)[:, None, None] + c3[None, None, :]
    async_copy.async_copy_global_to_shared(fp8_dst, base3[None, :, None] + off3, mask=valid3[None, :, None])
    base_s = gl.convert_layout(base, gl.SliceLayout(1, scale_l)).to(gl.pointer_type(gl.float32), bitcast=True)
    valid_s = gl.convert_layout(valid, gl.SliceLayout(1, scale_l))
    gs = gl.arange(0, 4, layout=gl.SliceLayout(0, scale_l))
    async_copy.async_copy_global_to_shared(scale_dst, base_s[:, None] + _DV // 4 + gs[None, :],
                                           mask=valid_s[:, None])
    base_r = base.to(gl.pointer_type(gl.bfloat16), bitcast=True)
    cr = gl.arange(0, _DR, layout=gl.SliceLayout(0, rope_l))
    async_copy.async_copy_global_to_shared(rope_dst, base_r[:, None] + (_DV + 16) // 2 + cr[None, :],
                                           mask=valid[:, None])


@gluon.jit
def _fp8_dequant_tile(fp8_groups, first, scale_src, lat_dst):
    """lat_dst[:, 128g : 128g + 128] = bf16(fp32(e4m3 group g) * scale[:, g]) for the 4 groups, in place: the stage
    `lat_dst` ([BN, 512] bf16, 128-byte swizzle) is 8 column blocks of 64 (block j at bytes 128 BN j), the staged
    groups (`fp8_groups.index(first + g)`, [BN, 128] bytes) fill blocks 4-7. Group g's store covers blocks 2g and
    2g + 1: group 2's over staged groups 0-1, group 3's over staged groups 2-3, all read in iterations <= g; a
    partition barrier between the loads and the store of iterations 2 and 3 orders every thread's reads before the
    stores over them (Triton's own barrier analysis adds one between each load and store of the stage anyway)."""
    dq_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # one row, 2 x 16 values a thread
    for g in gl.static_range(4):
        x = fp8_groups.index(first + g).load(dq_l)
        sc = scale_src.slice(g, 1, dim=1).load(dq_l)
        if g >= 2:
            gl.thread_barrier()
        v = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc
        lat_dst.slice(128 * g, 128, dim=1).store(v.to(gl.bfloat16))


@gluon.jit
def _seesaw_fp8_producer(args, smem, bars, fp8_scales, BLOCK_SIZE: gl.constexpr, BN: gl.constexpr,
                         NS: gl.constexpr, PREFETCH: gl.constexpr):
    q_row_ptr, stride_q_h, kv_ptr, sel_ptr, table_row_ptr, limit, n_sel, n_pairs = args
    q_lat, q_rope, kv_lat, kv_rope, p_smem, m_smem, r_smem = smem
    q_bar, kv_ready, kv_free, p_ready, p_free = bars
    gl.static_assert(BN == 32, "one warpgroup, one row of the tile a thread (4 threads a row)")
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # the bf16 producer's
    sel_l: gl.constexpr = gl.SliceLayout(1, copy_l)
    # views of the latent ring (a view has at most one buffer dimension): stage s as two [4, BN, 128] byte halves
    # (`fp8_halves.index(2s + 1)`: the staged e4m3 groups, the copy's destination) and as 8 [BN, 128] byte blocks
    # (`fp8_groups.index(8s + 4 + g)`: staged group g, read by the dequantisation)
    fp8_halves = kv_lat._reinterpret(gl.uint8, [2 * NS, 4, BN, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    fp8_groups = kv_lat._reinterpret(gl.uint8, [8 * NS, BN, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    _copy_query(q_row_ptr, stride_q_h, q_lat, q_rope, copy_l, 32)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    # software pipeline: the rows of step p are ready when its stages free up, the selection of step p + 1 is
    # in flight meanwhile (its table lookups then wait one load, not two)
    row0, valid0 = _selection_to_rows(_load_selection(sel_ptr, n_sel, 0, BN, sel_l), table_row_ptr, limit, BLOCK_SIZE)
    row1, valid1 = _selection_to_rows(_load_selection(sel_ptr, n_sel, 1, BN, sel_l), table_row_ptr, limit, BLOCK_SIZE)
    sel0 = _load_selection(sel_ptr, n_sel, 2, BN, sel_l)
    sel1 = _load_selection(sel_ptr, n_sel, 3, BN, sel_l)
    for p in range(n_pairs):
        t = 2 * p
        s0 = t % NS
        s1 = (t + 1) % NS
        phase = ((t // NS) & 1) ^ 1  # (t even, NS even: tiles t and t + 1 are in the same round of the ring)
        # the two stages of step p are released together (the end of the consumers' step p - 2): both copies; the
        # scales go to a buffer of their own (two tiles), free again once the previous step's tiles are dequantised
        mbarrier.wait(kv_free.index(s0), phase)
        _fp8_copy_tile(kv_ptr, row0, valid0, fp8_halves.index(2 * s0 + 1), fp8_scales.index(0), kv_rope.index(s0))
        async_copy.commit_group()
        mbarrier.wait(kv_free.index(s1), phase)
        _fp8_copy_tile(kv_ptr, row1, valid1, fp8_halves.index(2 * s1 + 1), fp8_scales.index(1), kv_rope.index(s1))
        async_copy.commit_group()
        # the rows of step p + 1 (and their L2 prefetch) and the selection of step p + 2, while the copies land
        row0, valid0 = _selection_to_rows(sel0, table_row_ptr, limit, BLOCK_SIZE)
        row1, valid1 = _selection_to_rows(sel1, table_row_ptr, limit, BLOCK_SIZE)
        sel0 = _load_selection(sel_ptr, n_sel, t + 4, BN, sel_l)
        sel1 = _load_selection(sel_ptr, n_sel, t + 5, BN, sel_l)
        if PREFETCH:
            _prefetch_rows_l2(kv_ptr, row0)
            _prefetch_rows_l2(kv_ptr, row1)
        # tile t: this thread's copies have landed (wait_group), then every thread's (barrier); dequantise, hand over
        async_copy.wait_group(1)
        gl.thread_barrier()
        _fp8_dequant_tile(fp8_groups, 8 * s0 + 4, fp8_scales.index(0), kv_lat.index(s0))
        fence_async_shared()  # generic-proxy stores -> the consumers' wgmma (async proxy) reads
        mbarrier.arrive(kv_ready.index(s0))  # (a partition barrier, then one thread's arrive: count 1)
        async_copy.wait_group(0)
        gl.thread_barrier()
        _fp8_dequant_tile(fp8_groups, 8 * s1 + 4, fp8_scales.index(1), kv_lat.index(s1))
        fence_async_shared()
        mbarrier.arrive(kv_ready.index(s1))
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _sparse_mla_seesaw_fp8_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    table_ptr,
    ctx_ptr,
    limit_bias,
    o_ptr,
    lse_ptr,
    TOPK,
    CHUNK,
    qk_scale,
    stride_q_r,
    stride_q_h,
    stride_idx_r,
    stride_table_r,
    stride_o_r,
    stride_o_s,
    stride_o_h,
    stride_lse_r,
    stride_lse_s,
    BLOCK_SIZE: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    REGS_CONSUMER: gl.constexpr,
    PROXY_FENCE: gl.constexpr,
    PREFETCH: gl.constexpr,
):
    """`_sparse_mla_seesaw_kernel` over an FP8 cache (`kv_ptr`: uint8 rows of 656 bytes): the same shared memory plus
    1 KiB of scales, the same consumers (`_seesaw_consumer`, unchanged), and a producer that dequantises each tile in
    its stage (`_seesaw_fp8_producer`) and arrives on kv_ready once a tile (count 1)."""
    gl.static_assert(gl.num_warps() == 4, "the producer (default partition) is one warpgroup: launch with num_warps=4")
    gl.static_assert(NS % 2 == 0, "a step's two tiles must sit in different stages")
    gl.static_assert(NS >= 4, "the producer fills step p + 1 during step p")
    i_r, i_r64, i_h, i_s, i_start, n_sel = _program_split(TOPK, CHUNK)
    n_pairs = gl.cdiv(gl.cdiv(n_sel, BN), 2)
    limit = gl.load(ctx_ptr + i_r) + limit_bias

    lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DV], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, _DR], gl.bfloat16)
    qlat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DV], gl.bfloat16)
    qrope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _DR], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, BN], gl.bfloat16)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    sc_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()

    q_lat = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DV], qlat_sl)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [_BH, _DR], qrope_sl)
    kv_lat = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DV], lat_sl)
    kv_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, _DR], rope_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _BH, BN], p_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [2 * _BH], v_sl)
    r_smem = gl.allocate_shared_memory(gl.float32, [2 * _BH], v_sl)
    fp8_scales = gl.allocate_shared_memory(gl.float32, [2, BN, 4], sc_sl)  # the group scales of a step's two tiles
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)

    mbarrier.init(q_bar, count=128)  # the query: one no-increment cp.async arrive per producer thread
    for i in gl.static_range(NS):
        mbarrier.init(kv_ready.index(i), count=1)  # the producer partition's one arrive a tile
        mbarrier.init(kv_free.index(i), count=2)  # one arrive per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)

    q_row_ptr = q_ptr + i_r64 * stride_q_r + (i_h * _BH).to(gl.int64) * stride_q_h
    sel_ptr = idx_ptr + i_r64 * stride_idx_r + i_start
    table_row_ptr = table_ptr + i_r64 * stride_table_r
    o_row_ptr, lse_row_ptr = _output_rows(o_ptr, lse_ptr, i_r64, i_h, i_s, stride_o_r, stride_o_s, stride_o_h,
                                          stride_lse_r, stride_lse_s)
    smem = (q_lat, q_rope, kv_lat, kv_rope, p_smem, m_smem, r_smem)
    bars = (q_bar, kv_ready, kv_free, p_ready, p_free)
    producer_args = (q_row_ptr, stride_q_h, kv_ptr, sel_ptr, table_row_ptr, limit, n_sel, n_pairs)
    consumer_args = (sel_ptr, limit, n_sel, n_pairs, qk_scale, o_row_ptr, stride_o_h, lse_row_ptr)
    gl.warp_specialize(
        [
            (_seesaw_fp8_producer, (producer_args, smem, bars, fp8_scales, BLOCK_SIZE, BN, NS, PREFETCH)),
            (_seesaw_consumer, (consumer_args, smem, bars, 0, BN, NS, PROXY_FENCE)),
            (_seesaw_consumer, (consumer_args, smem, bars, 1, BN, NS, PROXY_FENCE)),
        ],
        [4, 4],
        [REGS_CONSUMER, REGS_CONSUMER],
    )


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


def gluon_launch_plan(batch: int, heads: int, topk: int, n_sms: int, variant: str, splits: int | None = None,
                      fp8: bool = False, config: dict | None = None) -> dict:
    """Tile rows, stages and split count of one launch (splits as `kernel.launch_plan` with 64-head blocks:
    one wave of at most `n_sms` programs; a split covers whole 64-token steps). fp8: an FP8 cache (the seesaw's
    FP8 producer, `SEESAW_FP8`); config: overrides of the variant's launch settings (its dict's keys only)."""
    require(variant in VARIANTS, f"variant must be one of {VARIANTS}, got {variant!r}")
    require(not fp8 or variant == "seesaw", f"an FP8 cache takes the seesaw variant only, got {variant!r}")
    cfg = dict(SEESAW_FP8 if fp8 else SEESAW if variant == "seesaw" else SIMPLE)
    unknown = set(config or {}) - set(cfg)
    require(not unknown, f"config keys must be among {sorted(cfg)}, got {sorted(unknown)}")
    cfg.update(config or {})
    plan = launch_plan(batch, heads, topk, False, n_sms, {"block_h": BLOCK_H, "block_n": 64, "splits": splits})
    cfg["chunk"], cfg["splits"] = plan["chunk"], plan["splits"]
    return cfg


# Triton releases these kernels were built and checked with. Gluon is experimental and its API moves between
# releases (Triton 3.9's `warp_specialize` takes other arguments: these kernels do not compile there), so any other
# release keeps the Triton kernel rather than fail at a user's first prompt.
TRITON_TESTED = ("3.6.",)


def gluon_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, fp8: bool | None = None) -> str | None:
    """Why the Gluon kernels cannot take this call (None: they can): Triton without gluon or a release they are
    not checked with, not an sm_90 GPU, an FP8 cache while the FP8 variant is off (`fp8`, None: the module's
    `FP8`) or one of 2^31 rows or more, a head count not a multiple of 64, or rows not 16-byte aligned for the
    16-byte copies."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if not triton.__version__.startswith(TRITON_TESTED):
        return f"the Gluon kernels are checked with Triton {', '.join(TRITON_TESTED)}x only, not {triton.__version__}"
    if q.device.type != "cuda" or is_interpreter():
        return f"the Gluon kernels run on a CUDA device, not {q.device.type}" + (" (interpreter)" * is_interpreter())
    cap = _capability(q.device)
    if cap != (9, 0):
        return f"the Gluon kernels are written for Hopper sm_90 (wgmma, setmaxnreg), got sm_{cap[0]}{cap[1]}"
    if kv_cache.dtype == torch.uint8:
        if not (FP8 if fp8 is None else fp8):
            return ("the Gluon kernels take an FP8 cache only with gluon_kernels.FP8 (off until the FP8 seesaw is "
                    "timed on the GPU; sparse_mla_decode_gluon runs it explicitly), a bf16 cache always")
        if kv_cache.shape[0] * kv_cache.shape[1] >= 2**31:
            return "the Gluon FP8 producer addresses cache rows in int32: the cache has 2^31 rows or more"
    elif kv_cache.dtype != torch.bfloat16:
        return f"the Gluon kernels read a bf16 or FP8 (uint8) latent cache, got {kv_cache.dtype}"
    if q.shape[1] % BLOCK_H:
        return f"the Gluon kernels take heads in blocks of {BLOCK_H}, got {q.shape[1]} heads"
    if q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "the Gluon kernels copy 16-byte pieces: q's rows and the cache must be 16-byte aligned"
    return None


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def gluon_launch(q, kv_cache, indices, table, stride_table_r, limits, limit_bias, sm_scale, out, lse,
                 variant: str = VARIANT, splits: int | None = None,
                 config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of a Gluon kernel (and the split merge): `kernel._launch`'s arguments, checked by its callers
    (`sparse_mla_decode` / `sparse_mla_prefill`, or `sparse_mla_decode_gluon`); the caller has made sure
    `gluon_unsupported` is None. `limits` [rows] + `limit_bias` is each row's last usable position; the row's
    block table is `table + row * stride_table_r` (0: one table, a prefill chunk's). A uint8 (FP8) cache runs the
    seesaw with its FP8 producer; config: overrides of the variant's launch settings (`gluon_launch_plan`)."""
    n_rows, heads, _ = q.shape
    topk = indices.shape[1]
    dev = q.device
    if n_rows == 0:
        return out, lse
    if topk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    block_size = kv_cache.shape[1]
    is_fp8 = kv_cache.dtype == torch.uint8
    cfg = gluon_launch_plan(n_rows, heads, topk, sm_count(dev, H200_SMS), variant, splits, is_fp8, config)
    n_splits, chunk = cfg["splits"], cfg["chunk"]
    if n_splits > 1:
        po = torch.empty(n_rows, n_splits, heads, D_LATENT, dtype=torch.float32, device=dev)
        plse = torch.empty(n_rows, n_splits, heads, dtype=torch.float32, device=dev)
    else:
        po, plse = out.unsqueeze(1), lse.unsqueeze(1)
    grid = (n_rows, heads // BLOCK_H, n_splits)
    args = (q, kv_cache, indices, table, limits, limit_bias, po, plse, topk, chunk, sm_scale * LOG2E,
            q.stride(0), q.stride(1), indices.stride(0), stride_table_r,
            po.stride(0), po.stride(1), po.stride(2), plse.stride(0), plse.stride(1))
    if is_fp8:
        _sparse_mla_seesaw_fp8_kernel[grid](*args, BLOCK_SIZE=block_size, BN=cfg["block_n"], NS=cfg["stages"],
                                            REGS_CONSUMER=cfg["regs"], PROXY_FENCE=cfg["proxy_fence"],
                                            PREFETCH=cfg["prefetch"], num_warps=cfg["num_warps"])
    elif variant == "seesaw":
        _sparse_mla_seesaw_kernel[grid](*args, BLOCK_SIZE=block_size, BN=cfg["block_n"], NS=cfg["stages"],
                                        REGS_CONSUMER=cfg["regs"], PROXY_FENCE=cfg["proxy_fence"],
                                        num_warps=cfg["num_warps"])
    else:
        _sparse_mla_simple_kernel[grid](*args, BLOCK_SIZE=block_size, BN=cfg["block_n"], NS=cfg["stages"],
                                        num_warps=cfg["num_warps"])
    if n_splits > 1:
        _sparse_mla_combine_kernel[(n_rows, heads, D_LATENT // 128)](
            po, plse, out, lse, heads, n_splits, BLOCK_S=min(32, triton.next_power_of_2(n_splits)), BLOCK_D=128,
            DV=D_LATENT, num_warps=4)
    return out, lse


def sparse_mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    variant: str = VARIANT,
    splits: int | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode (absorbed form) on the Gluon kernels, whatever `sparse_mla_decode` would pick: the
    arguments and results of `sparse_mla_decode`, 64-head blocks only (ValueError otherwise, RuntimeError where the
    kernels cannot run: see `gluon_unsupported`). An FP8 (uint8) cache runs the seesaw's FP8 producer whatever the
    module's `FP8` (the dispatch's switch) says.

    variant: "seesaw" (warp-specialised, the default) or "simple" (one 8-warp partition; bf16 caches only);
    splits: the selection's split count (None: one wave of the SMs, `gluon_launch_plan`); config: overrides of
    the variant's launch settings (`SEESAW`, `SEESAW_FP8` or `SIMPLE` keys, e.g. {"regs": 240}), for benchmarks."""
    require(variant in VARIANTS, f"variant must be one of {VARIANTS}, got {variant!r}")
    require(splits is None or splits >= 1, f"splits must be None or >= 1, got {splits}")
    out, lse = check_decode(q, kv_cache, indices, block_table, context_lens, out, lse)
    require(q.shape[1] % BLOCK_H == 0, f"the Gluon kernels take heads in blocks of {BLOCK_H}, got {q.shape[1]} heads")
    is_fp8 = kv_cache.dtype == torch.uint8
    require(not is_fp8 or variant == "seesaw", f"an FP8 cache takes the seesaw variant only, got {variant!r}")
    gluon_launch_plan(1, q.shape[1], max(indices.shape[1], 1), H200_SMS, variant, splits, is_fp8, config)  # (checks)
    why = gluon_unsupported(q, kv_cache, fp8=True)
    if why is not None:
        raise RuntimeError(f"sparse_mla_decode_gluon cannot run here: {why}")
    return gluon_launch(q, kv_cache, indices, block_table, block_table.stride(0), context_lens, -1, sm_scale, out,
                        lse, variant, splits, config)
