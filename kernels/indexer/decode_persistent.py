"""Persistent decode kernel of the lightning indexer: a fixed grid of about two programs per SM
streams every request's paged FP8 keys with several pages in flight (K2 item 2).

Work split (on the device, so the launch needs no host sync and replays in a CUDA graph): every
request's context is cut into chunks of BLOCK_T tokens (BLOCK_T / block_size pages, or part of a
page for pages above BLOCK_T), numbered request-major; program p of P takes the contiguous run of
global chunks [p * C / P, (p + 1) * C / P), C = all requests' chunks. Each program recomputes the
per-request chunk counts and their prefix sum from `context_lens` (REQ_P2 values, a few hundred
cycles), so batch 1 x 128K and batch 64 x 8K both give every program the same number of chunks
(within one) and no program waits for a straggler. A program's run is a few (request, split) work
items: a split is a contiguous range of chunks of one request; the query tile [next_n * H, 128] and
the head weights are loaded once per work item, not once per chunk.

Per chunk: the block-table entries of its tokens (one gathered load, served from L1), then the keys as
one [BLOCK_T, 128] e4m3 tile and their fp32 scales. Triton's software pipeliner handles the keys: it
sees the block-table load feeding the key addresses and the keys feeding the dot, issues the table
load stages ahead of the key copy (cp.async into shared memory) and the copy ahead of the dot; with
num_stages = 7 that is three 16 KB key buffers (two chunks in flight while one is scored; the
sm_90 build checked offline with Triton 3.6 and 3.9: 59-60 KB of shared memory, 180-182 registers
a thread at 4 warps, no spills, so two programs fit an SM: ~50-70 KB in flight per SM against the ~30 KB that
Little's law asks of an H200 SM at 32 B/ns and ~1 us; 9 and 13 stages, 4 and 6 chunks in flight, were slower at
1-4 requests and every length on the H200, 2026-12-04: b1 x 128K 9.1 / 10.2 us against 8.7). The pipeliner
leaves loads that do not feed a dot synchronous, so the scales are prefetched by hand: each iteration loads the
next chunk's scales (from page ids loaded one iteration earlier) and the page ids of the chunk after. The dot is keys x
q^T -> [BLOCK_T, next_n * H] (keys as the M operand, both operands K-major as Hopper's fp8 MMA
wants), so the weighted sum over heads is a reduction along the accumulator's N axis (within a
thread and its quad) instead of across warps.

Math, identical to `_indexer_decode_kernel`'s: s = q . k in fp32 (fp8 MMA, or bf16 for bf16 queries),
logit = (sum_h w_h * relu(s_h)) * k_scale, -inf after the query's position, nothing written past the
context. Only the summation order over heads differs (a different reduction tree), so results agree
with the tiled kernel and the reference within fp32 rounding, bit for bit where the sums are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels import _utils
from hearth.kernels._utils import (
    FP8_E4M3,
    float_order_key,
    is_interpreter,
    mma,
    mma_fp8,
    pdl_launch_dependents,
)
from hearth.kernels.topk.one_launch import fine_hist_digit, pdl_for_rows
from hearth.kernels.topk.radix import NBINS, RADIX_BITS

CPU_SMS = 4


@triton.jit
def _split_chunks(ctx_ptr, n_req, i_p, n_progs, BLOCK_T: tl.constexpr, REQ_P2: tl.constexpr):
    """Program i_p's share [g_lo, g_hi) of the request-major chunk numbering, with each request's
    context length, first global chunk (b_start) and end (b_end), all [REQ_P2] (padding: empty)."""
    o_r = tl.arange(0, REQ_P2)
    b_ctx = tl.load(ctx_ptr + o_r, mask=o_r < n_req, other=0)
    b_chunks = (tl.maximum(b_ctx, 0) + BLOCK_T - 1) // BLOCK_T
    b_end = tl.cumsum(b_chunks, axis=0)
    b_start = b_end - b_chunks
    total = tl.sum(b_chunks, axis=0).to(tl.int64)
    g_lo = (i_p * total // n_progs).to(tl.int32)
    g_hi = ((i_p + 1) * total // n_progs).to(tl.int32)
    return b_ctx, b_start, b_end, g_lo, g_hi


@triton.jit
def _request_span(b_start, b_end, g_lo, g_hi):
    """Requests [first, end) whose chunks meet [g_lo, g_hi) (starts and ends are non-decreasing)."""
    i_first = tl.sum((b_end <= g_lo).to(tl.int32), axis=0)
    i_end = tl.sum((b_start < g_hi).to(tl.int32), axis=0)
    return i_first, i_end


@triton.jit
def _work_item(b_start, b_end, i_b, g_lo, g_hi, REQ_P2: tl.constexpr):
    """Request i_b's chunks [lo, hi) (request-local numbering) inside [g_lo, g_hi); lo >= hi: none."""
    o_r = tl.arange(0, REQ_P2)
    i_start = tl.sum(tl.where(o_r == i_b, b_start, 0), axis=0)
    i_end = tl.sum(tl.where(o_r == i_b, b_end, 0), axis=0)
    return tl.maximum(g_lo, i_start) - i_start, tl.minimum(g_hi, i_end) - i_start


@triton.jit
def _chunk_pages(p_table, i_c, t_end, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Physical page of each token of request-local chunk i_c; 0 from token t_end on (the end of the
    work item or of the context)."""
    o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T)
    return tl.load(p_table + o_t // BLOCK_SIZE, mask=o_t < t_end, other=0)


@triton.jit
def _chunk_scales(
    cache_f32_ptr,
    b_page,
    i_c,
    t_end,
    stride_blk,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
):
    """Chunk i_c's key scales ([BLOCK_T] fp32) from its page ids; 0 from token t_end on."""
    o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T)
    p_ks = cache_f32_ptr + b_page.to(tl.int64) * (stride_blk // 4) + (BLOCK_SIZE * D // 4) + o_t % BLOCK_SIZE
    return tl.load(p_ks, mask=o_t < t_end, other=0.0)


@triton.jit
def score_chunk(
    cache_u8_ptr,
    p_table,
    o_t,
    m_t,
    b_qt,
    stride_blk,
    BLOCK_T: tl.constexpr,
    M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    Q_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """[BLOCK_T, M] fp32 q . k of a chunk's tokens o_t (m_t: those to read) against the queries b_qt [D, M]: each
    token's page from the request's table p_table, its e4m3 key from the page, keys x q^T on the MMA (fp8, or bf16
    for bf16 queries)."""
    o_d = tl.arange(0, D)
    b_kpage = tl.load(p_table + o_t // BLOCK_SIZE, mask=m_t, other=0).to(tl.int64)
    p_k = cache_u8_ptr + (b_kpage * stride_blk + (o_t % BLOCK_SIZE) * D)[:, None] + o_d[None, :]
    b_k = tl.load(p_k, mask=m_t[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    b_acc = tl.zeros([BLOCK_T, M], dtype=tl.float32)
    if Q_FP8:
        b_s = mma_fp8(b_k, b_qt, b_acc, UPCAST, PRECISE)
    else:
        b_s = mma(b_k.to(tl.bfloat16), b_qt, b_acc, UPCAST)
    return b_s


# NOTE: n_req and n_progs change with the batch and the table width; like the prefill kernel's T and
# n_ctx they only bound loops and masks, so they must not compile a variant per divisibility class
# (REQ_P2 already gives one variant per power of two of the batch).
@triton.jit(do_not_specialize=["n_req", "n_progs"])
def _indexer_decode_persistent_kernel(
    q_ptr,
    w_ptr,
    cache_u8_ptr,
    cache_f32_ptr,
    table_ptr,
    ctx_ptr,
    logits_ptr,
    len_ptr,
    ws_ptr,
    n_req,
    n_progs,
    stride_table,
    stride_logits,
    stride_blk,
    NEXT_N: tl.constexpr,
    NEXT_N_P2: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    REQ_P2: tl.constexpr,
    Q_FP8: tl.constexpr,
    FUSE_HIST: tl.constexpr,
    FINE_HIST: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    WS_STRIDE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    i_p = tl.program_id(0)
    pdl_launch_dependents(PDL)  # the top-k launches that follow may take free SM slots now and wait there
    b_ctx, b_start, b_end, g_lo, g_hi = _split_chunks(ctx_ptr, n_req, i_p, n_progs, BLOCK_T, REQ_P2)
    o_r = tl.arange(0, REQ_P2)
    if i_p == 0:
        for j in tl.static_range(NEXT_N):
            tl.store(len_ptr + o_r * NEXT_N + j, tl.maximum(b_ctx - NEXT_N + j + 1, 0), mask=o_r < n_req)
    M: tl.constexpr = NEXT_N_P2 * H
    o_m = tl.arange(0, M)
    m_m = (o_m // H) < NEXT_N
    o_d = tl.arange(0, D)
    o_j = tl.arange(0, NEXT_N_P2)
    m_j = o_j < NEXT_N
    i_first, i_end = _request_span(b_start, b_end, g_lo, g_hi)
    for i_b in range(i_first, i_end):
        c_lo, c_hi = _work_item(b_start, b_end, i_b, g_lo, g_hi, REQ_P2)  # empty for a 0-token request
        n_ctx = tl.sum(tl.where(o_r == i_b, b_ctx, 0), axis=0)
        o_qpos = n_ctx - NEXT_N + o_j  # position of query j
        i_row0 = i_b * NEXT_N
        p_q = q_ptr + (i_row0 * H + o_m)[:, None].to(tl.int64) * D + o_d[None, :]
        b_qt = tl.trans(tl.load(p_q, mask=m_m[:, None], other=0.0))  # (D, M)
        b_w = tl.load(w_ptr + i_row0 * H + o_m, mask=m_m, other=0.0)
        p_table = table_ptr + i_b * stride_table  # the table holds < 2**31 entries
        p_rows = logits_ptr + (i_row0 + o_j)[None, :].to(tl.int64) * stride_logits  # (1, J)
        if FUSE_HIST:
            b_hist = tl.zeros([NEXT_N_P2 * NBINS], dtype=tl.int32)
            n_skip = 0
        # the scales are not pipelined by Triton (they do not feed the dot): by hand, the next chunk's
        # scales and the page ids of the one after are loaded while this chunk is scored
        t_end = tl.minimum(n_ctx, c_hi * BLOCK_T)  # no read past the work item, none past the context
        b_page = _chunk_pages(p_table, c_lo + 1, t_end, BLOCK_T, BLOCK_SIZE)
        b_page_lo = _chunk_pages(p_table, c_lo, t_end, BLOCK_T, BLOCK_SIZE)
        b_ksn = _chunk_scales(cache_f32_ptr, b_page_lo, c_lo, t_end, stride_blk, BLOCK_T, BLOCK_SIZE, D)
        for i_c in range(c_lo, c_hi):
            b_ks = b_ksn
            b_ksn = _chunk_scales(cache_f32_ptr, b_page, i_c + 1, t_end, stride_blk, BLOCK_T, BLOCK_SIZE, D)
            b_page = _chunk_pages(p_table, i_c + 2, t_end, BLOCK_T, BLOCK_SIZE)
            o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T)
            m_t = o_t < n_ctx
            b_s = score_chunk(
                cache_u8_ptr, p_table, o_t, m_t, b_qt, stride_blk, BLOCK_T, M, BLOCK_SIZE, D, Q_FP8, UPCAST, PRECISE
            )
            b_s = tl.maximum(b_s, 0.0) * b_w[None, :]  # (BLOCK_T, M)
            if NEXT_N_P2 == 1:
                b_l = tl.sum(b_s, axis=1)[:, None]  # (BLOCK_T, 1)
            else:
                b_l = tl.sum(tl.reshape(b_s, [BLOCK_T, NEXT_N_P2, H]), axis=2)  # (BLOCK_T, J)
            b_l = b_l * b_ks[:, None]
            m_valid = m_t[:, None] & m_j[None, :] & (o_t[:, None] <= o_qpos[None, :])
            b_l = tl.where(m_valid, b_l, float("-inf"))
            tl.store(p_rows + o_t[:, None], b_l, mask=m_t[:, None] & m_j[None, :])
            if FUSE_HIST:
                b_bin = o_j[None, :] * NBINS + fine_hist_digit(float_order_key(b_l), FINE_HIST, NBINS, BITS)
                b_bin = tl.where(m_valid, b_bin, 0)
                b_hist += tl.histogram(tl.reshape(b_bin, [BLOCK_T * NEXT_N_P2]), NEXT_N_P2 * NBINS)
                n_skip += tl.sum(tl.sum((~m_valid).to(tl.int32), axis=1), axis=0)
        if FUSE_HIST:
            # the masked entries were all counted in bin 0 of query 0
            o_h = tl.arange(0, NEXT_N_P2 * NBINS)
            b_hist -= tl.where(o_h == 0, n_skip, 0)
            p_h = ws_ptr + (i_row0 + o_h // NBINS).to(tl.int64) * WS_STRIDE + o_h % NBINS
            tl.atomic_add(p_h, b_hist, mask=(b_hist > 0) & ((o_h // NBINS) < NEXT_N))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device. The CPU interpreter plans for CPU_SMS: it pays per
    program, idle or not, and a few programs still split requests across programs."""
    return _utils.sm_count(device, CPU_SMS)


def persistent_config(n_req: int, n_cols: int, heads: int, next_n: int, sms: int) -> dict:
    """Launch plan from host-known shapes only (the grid must not depend on context_lens, a device
    tensor). One query (next_n * H <= 64): 128-token chunks, 4 warps, 7 stages (three 16 KB key
    buffers), two programs per SM (182 registers a thread, 60 KB of shared memory each in the sm_90
    build); more queries: 64-token chunks on 8 warps, one program per SM (the [BLOCK_T, next_n * H]
    accumulator). Chunks drop to 64 tokens when the table cannot give every program two of them."""
    rows_m = triton.next_power_of_2(next_n) * heads
    block_t, num_warps, per_sm = (128, 4, 2) if rows_m <= 64 else (64, 8, 1)
    if n_req * triton.cdiv(n_cols, block_t) < 2 * per_sm * sms:
        block_t = 64
    return {
        "block_t": block_t,
        "programs": per_sm * sms,
        "num_warps": num_warps,
        "num_stages": 7,
        "fp8_precise": True,
    }


def persistent_decode_launch(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    logits: torch.Tensor,
    lengths: torch.Tensor,
    workspace: torch.Tensor | None,
    cfg: dict,
    fine_hist: bool = False,
) -> None:
    """Launch on inputs validated by `lightning_indexer_decode`; cfg from `persistent_config` (keys
    block_t, programs, num_warps, num_stages, fp8_precise); fine_hist: the workspace's histogram is
    `one_launch.fine_bin`'s, else the radix select's top byte."""
    n_req, next_n, heads, dim = q.shape
    block_t = cfg["block_t"]
    # at most one program per chunk of the widest possible context: more would only idle
    n_progs = max(1, min(cfg["programs"], n_req * triton.cdiv(block_table.shape[1] * block_size, block_t)))
    _indexer_decode_persistent_kernel[(n_progs,)](
        q,
        weights,
        kv_cache,
        kv_cache.view(torch.float32),
        block_table,
        context_lens,
        logits,
        lengths,
        workspace if workspace is not None else lengths,
        n_req,
        n_progs,
        block_table.stride(0),
        logits.stride(0),
        kv_cache.stride(0),
        NEXT_N=next_n,
        NEXT_N_P2=triton.next_power_of_2(next_n),
        H=heads,
        D=dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        REQ_P2=triton.next_power_of_2(max(n_req, 2)),
        Q_FP8=q.dtype == FP8_E4M3,
        FUSE_HIST=workspace is not None,
        FINE_HIST=fine_hist,
        NBINS=NBINS,
        BITS=RADIX_BITS,
        WS_STRIDE=workspace.stride(0) if workspace is not None else 0,
        UPCAST=is_interpreter(),
        PRECISE=cfg["fp8_precise"],
        PDL=pdl_for_rows(n_req * next_n, q.device),  # the top-k launches after it start early
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
