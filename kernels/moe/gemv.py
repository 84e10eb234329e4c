"""Decode-sized MoE kernels: bandwidth-bound GEMV over expert slots, for few (token, k) pairs per slot.

Each program owns BLOCK_N output rows of one slot and streams those weight rows in wide tiles
(BLOCK_N, BLOCK_K), multiplying them by the block's BLOCK_M (1..8) activation rows with a broadcast
product and a sum over K: no tl.dot, so no 16-row padding. FP8 block scales are folded into the few
activation values (a gather of ``k // 128`` on a [BLOCK_M, BLOCK_K] tile) rather than into the weight
tile, so the weights cost one widening and one FMA per element. BLOCK_N divides 128, so one tile
lies in one scale row. MXFP4 weights (MXFP4: uint8 code bytes and e8m0 scale bytes per group of 32
along K) are decoded in registers from the bits and scaled per group sum (:func:`mxfp4_codes`,
:func:`mxfp4_row_dot`; a block's rows share one decode), or with ``MXFP4_BITS`` off by the first,
arithmetic :func:`mxfp4_tile` (A/B runs). For one row a block (the default) the activations are read
before the weights so that the loop takes the weight tiles' layout: no layout conversion of them.
gpt-oss's experts add per-expert biases, clamp the SwiGLU and interleave the gate and up rows
(HAS_BIAS, CLAMPED, INTERLEAVED; float or MXFP4 weights).

The down kernel may split K; each split writes its own fp32 rows of ``y`` [SPLIT, P, D] and
:func:`sum_pairs_kernel` adds them, with the top-k, into ``out`` in a fixed order (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hearth.kernels.moe.mxfp4 import mxfp4_codes, mxfp4_row_dot, mxfp4_tile, x_pairs


@triton.jit
def gate_up_rows(o_n, I, INTERLEAVED: tl.constexpr):
    """Rows of w13 (and entries of its bias) holding gate and up output ``o_n``: rows j and I + j, or
    2j and 2j + 1 with INTERLEAVED (gpt-oss's gate_up_proj, transposed as it is)."""
    if INTERLEAVED:
        r_g = 2 * o_n
        r_u = r_g + 1
    else:
        r_g = o_n
        r_u = o_n + I
    return r_g, r_u


@triton.jit
def block_row(o_rows, m_rows, r: tl.constexpr):
    """Row ``r`` of a block's (BM, 1) row offsets and mask as (1, 1) tensors (the row itself when BM is 1)."""
    if o_rows.shape[0] == 1:
        return o_rows, m_rows
    one = (tl.arange(0, o_rows.shape[0]) == r)[:, None]
    o_r = tl.sum(tl.where(one, o_rows, 0), axis=0, keep_dims=True)
    m_r = tl.max(tl.where(one, m_rows.to(tl.int32), 0), axis=0, keep_dims=True) > 0
    return o_r, m_r


@triton.jit
def swiglu(g, u, LIMIT, ALPHA, CLAMPED: tl.constexpr):
    """fp32 SwiGLU ``silu(g) * u``, or with CLAMPED gpt-oss's ``(clamp(u, -l, l) + 1) * g' * sigmoid(a * g')``
    with ``g' = min(g, l)``."""
    if CLAMPED:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        out = (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
    else:
        out = g / (1.0 + tl.exp(-g)) * u
    return out


@triton.jit(do_not_specialize=["num_pairs"])  # routed pairs: a new count per step; masks rows only
def gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    h_ptr,
    pairs_ptr,
    block_slot_ptr,
    num_pairs,
    D,
    I,
    TOPK,
    NUM_SCALE_ROWS,
    LIMIT,
    ALPHA,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_bs,
    stride_hp,
    HAS_SCALE: tl.constexpr,
    MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IDENTITY: tl.constexpr,
    MXFP4_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[row] = act(x[tok] Wg^T + bg, x[tok] Wu^T + bu) for the BLOCK_M rows of block ``i_m``, BLOCK_N
    columns (see :func:`swiglu` and :func:`gate_up_rows`)."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + i_m).to(tl.int64)
    if slot < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if IDENTITY:
        b_pair = o_m  # one pair per block, in pair order: no grouping pass
    else:
        b_pair = tl.load(pairs_ptr + o_m)
    m_m = b_pair < num_pairs
    b_tok = (b_pair // TOPK).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    r_g, r_u = gate_up_rows(o_n, I, INTERLEAVED)
    p_g = w_ptr + slot * stride_ws + r_g[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    p_u = w_ptr + slot * stride_ws + r_u[:, None].to(tl.int64) * stride_wn
    p_s = s_ptr + slot * stride_ss + ((i_n * BLOCK_N) // 128) * stride_sn
    p_sg = s_ptr + slot * stride_ss + r_g[:, None].to(tl.int64) * stride_sn  # MXFP4: a scale row per row
    p_su = s_ptr + slot * stride_ss + r_u[:, None].to(tl.int64) * stride_sn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    o_x = b_tok[:, None] * stride_xt  # (BM, 1)
    p_x = x_ptr + o_x
    if MXFP4 and MXFP4_BITS:  # decoded from the bits, scaled per group (see mxfp4.py)
        for k0 in range(0, D, BLOCK_K):
            if BLOCK_M == 1:  # NOTE: x read first, so the loop takes the decoded tiles' layout (no convert)
                x_e, x_o = x_pairs(p_x, m_m[:, None], k0, D, BLOCK_K)
            g_lo, g_hi, g_s = mxfp4_codes(p_g, p_sg, m_n[:, None], k0, D, BLOCK_K)
            u_lo, u_hi, u_s = mxfp4_codes(p_u, p_su, m_n[:, None], k0, D, BLOCK_K)
            for r in tl.static_range(BLOCK_M):  # the decoded tiles serve every row of the block
                if BLOCK_M > 1:
                    o_xr, m_xr = block_row(o_x, m_m[:, None], r)
                    x_e, x_o = x_pairs(x_ptr + o_xr, m_xr, k0, D, BLOCK_K)
                one = (tl.arange(0, BLOCK_M) == r)[:, None]
                y_g = mxfp4_row_dot(x_e, x_o, g_lo, g_hi, g_s, BLOCK_K)
                y_u = mxfp4_row_dot(x_e, x_o, u_lo, u_hi, u_s, BLOCK_K)
                acc_g += tl.where(one, y_g[None, :], 0.0)
                acc_u += tl.where(one, y_u[None, :], 0.0)
    else:
        for k0 in range(0, D, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < D
            m_w = m_n[:, None] & m_k[None, :]
            if MXFP4:
                b_g = mxfp4_tile(p_g, p_sg, m_n[:, None], k0, D, BLOCK_K, False)  # (BN, BK) fp32
                b_u = mxfp4_tile(p_u, p_su, m_n[:, None], k0, D, BLOCK_K, False)
            else:
                b_g = tl.load(p_g + o_k[None, :], mask=m_w, other=0.0)  # (BN, BK)
                b_u = tl.load(p_u + o_k[None, :], mask=m_w, other=0.0)
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            if HAS_SCALE:
                b_xg = b_x * tl.load(p_s + o_k // 128, mask=m_k, other=0.0)[None, :]
                b_xu = b_x * tl.load(p_s + NUM_SCALE_ROWS * stride_sn + o_k // 128, mask=m_k, other=0.0)[None, :]
            else:
                b_xg = b_x
                b_xu = b_x
            acc_g += tl.sum(b_xg[:, None, :] * b_g.to(tl.float32)[None, :, :], axis=2)  # (BM, BN)
            acc_u += tl.sum(b_xu[:, None, :] * b_u.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + slot * stride_bs + r_g, mask=m_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + slot * stride_bs + r_u, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_h = swiglu(acc_g, acc_u, LIMIT, ALPHA, CLAMPED)
    p_h = h_ptr + o_m[:, None].to(tl.int64) * stride_hp + o_n[None, :]
    tl.store(p_h, b_h.to(h_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # routed pairs: a new count per step; masks rows only
def down_gemv_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    rw_ptr,
    pairs_ptr,
    block_slot_ptr,
    num_pairs,
    D,
    I,
    K_PER_SPLIT,
    stride_hp,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_bs,
    stride_ys,
    stride_yp,
    HAS_SCALE: tl.constexpr,
    MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IDENTITY: tl.constexpr,
    MXFP4_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[split, pair] = rw[pair] * (h[row, k-range] Wd[:, k-range]^T (+ bd in split 0)) for one block,
    BLOCK_N columns of D."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_s = tl.program_id(2)
    slot = tl.load(block_slot_ptr + i_m).to(tl.int64)
    if slot < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if IDENTITY:
        b_pair = o_m
    else:
        b_pair = tl.load(pairs_ptr + o_m)
    m_m = b_pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    p_w = w_ptr + slot * stride_ws + o_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    p_s = s_ptr + slot * stride_ss + ((i_n * BLOCK_N) // 128) * stride_sn
    p_sw = s_ptr + slot * stride_ss + o_n[:, None].to(tl.int64) * stride_sn  # MXFP4: a scale row per row
    o_h = o_m[:, None].to(tl.int64) * stride_hp  # (BM, 1)
    p_h = h_ptr + o_h
    k_start = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, I)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4 and MXFP4_BITS:
        for k0 in range(k_start, k_end, BLOCK_K):
            if BLOCK_M == 1:
                h_e, h_o = x_pairs(p_h, m_m[:, None], k0, k_end, BLOCK_K)
            w_lo, w_hi, w_s = mxfp4_codes(p_w, p_sw, m_n[:, None], k0, k_end, BLOCK_K)
            for r in tl.static_range(BLOCK_M):
                if BLOCK_M > 1:
                    o_hr, m_hr = block_row(o_h, m_m[:, None], r)
                    h_e, h_o = x_pairs(h_ptr + o_hr, m_hr, k0, k_end, BLOCK_K)
                one = (tl.arange(0, BLOCK_M) == r)[:, None]
                acc += tl.where(one, mxfp4_row_dot(h_e, h_o, w_lo, w_hi, w_s, BLOCK_K)[None, :], 0.0)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_end
            if MXFP4:
                b_w = mxfp4_tile(p_w, p_sw, m_n[:, None], k0, k_end, BLOCK_K, False)  # (BN, BK) fp32
            else:
                b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # (BN, BK)
            b_h = tl.load(p_h + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # (BM, BK)
            if HAS_SCALE:
                b_h = b_h * tl.load(p_s + o_k // 128, mask=m_k, other=0.0)[None, :]
            acc += tl.sum(b_h[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)  # (BM, BN)
    if HAS_BIAS:  # noqa: SIM102 - a compile-time test, then a run-time one (Triton keeps them apart)
        if i_s == 0:  # the bias once, with the first split
            acc += tl.load(b_ptr + slot * stride_bs + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_rw = tl.load(rw_ptr + b_pair, mask=m_m, other=0.0)
    acc = acc * b_rw[:, None]
    p_y = y_ptr + i_s * stride_ys + b_pair[:, None].to(tl.int64) * stride_yp + o_n[None, :]
    tl.store(p_y, acc, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def sum_pairs_kernel(
    y_ptr,
    slot_ptr,
    out_ptr,
    D,
    TOPK,
    stride_ys,
    stride_yp,
    stride_ot,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] += sum over k (pairs with a slot) and splits of y[split, t*K + k], in a fixed order."""
    i_t = tl.program_id(0)
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOPK):
        pair = i_t * TOPK + k
        # NOTE: rows of skipped pairs (slot -1) are never written; the mask keeps them out.
        m_p = m_n & ((tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(slot_ptr + pair)) >= 0)
        for i_s in tl.static_range(SPLIT):
            acc += tl.load(y_ptr + i_s * stride_ys + pair.to(tl.int64) * stride_yp + o_n, mask=m_p, other=0.0)
    p_o = out_ptr + i_t.to(tl.int64) * stride_ot + o_n
    tl.store(p_o, tl.load(p_o, mask=m_n, other=0.0) + acc, mask=m_n)
