"""Batch-sized MoE kernels: grouped GEMM (tl.dot) over blocks of expert-sorted (token, k) pairs.

(1) gate/up GEMM + SwiGLU for each block of BLOCK_M pairs of one slot into ``h`` [rows, I];
(2) down GEMM, scaled by the routing weight, into one fp32 row per pair of ``y`` [P, D], summed over
k afterwards. Weights are bf16/fp16/fp32 or FP8 e4m3 with 128x128 block scales; FP8 tiles are widened
in registers and each tile's dot product is multiplied by its one scale (BLOCK_N, BLOCK_K divide 128);
MXFP4 tiles (code bytes and e8m0 scales per 32 values along K) are decoded and scaled in registers
before the dot (:func:`mxfp4_tile`).
Biases, the clamped SwiGLU and interleaved gate/up rows (gpt-oss) as in ``gemv.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hearth.kernels.moe.gemv import gate_up_rows, swiglu
from hearth.kernels.moe.mxfp4 import mxfp4_tile


@triton.jit(do_not_specialize=["num_pairs"])  # routed pairs: a new count per step; masks rows only
def gate_up_mma_kernel(
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
    MXFP4_BITS: tl.constexpr,
    CLAMPED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + i_m).to(tl.int64)
    if slot < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    b_pair = tl.load(pairs_ptr + o_m)
    m_m = b_pair < num_pairs
    b_tok = (b_pair // TOPK).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    r_g, r_u = gate_up_rows(o_n, I, INTERLEAVED)
    p_w = w_ptr + slot * stride_ws
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < D
        m_w = m_n[:, None] & m_k[None, :]
        b_x = tl.load(
            x_ptr + b_tok[:, None] * stride_xt + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )  # (BM, BK)
        if MXFP4:
            p_s = s_ptr + slot * stride_ss
            p_sg, p_su = p_s + r_g[:, None] * stride_sn, p_s + r_u[:, None] * stride_sn
            b_g = mxfp4_tile(p_w + r_g[:, None] * stride_wn, p_sg, m_n[:, None], k0, D, BLOCK_K, MXFP4_BITS)  # (BN, BK)
            b_u = mxfp4_tile(p_w + r_u[:, None] * stride_wn, p_su, m_n[:, None], k0, D, BLOCK_K, MXFP4_BITS)
        else:
            b_g = tl.load(p_w + r_g[:, None] * stride_wn + o_k[None, :], mask=m_w, other=0.0)  # (BN, BK)
            b_u = tl.load(p_w + r_u[:, None] * stride_wn + o_k[None, :], mask=m_w, other=0.0)
        b_x = b_x.to(DOT_DTYPE)
        d_g = tl.dot(b_x, tl.trans(b_g.to(DOT_DTYPE)), input_precision=PRECISION)
        d_u = tl.dot(b_x, tl.trans(b_u.to(DOT_DTYPE)), input_precision=PRECISION)
        if HAS_SCALE:
            # NOTE: BLOCK_N and BLOCK_K divide 128, so one scale covers the whole tile.
            p_s = s_ptr + slot * stride_ss + ((i_n * BLOCK_N) // 128) * stride_sn + k0 // 128
            d_g = d_g * tl.load(p_s)
            d_u = d_u * tl.load(p_s + NUM_SCALE_ROWS * stride_sn)
        acc_g += d_g
        acc_u += d_u
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + slot * stride_bs + r_g, mask=m_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + slot * stride_bs + r_u, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_h = swiglu(acc_g, acc_u, LIMIT, ALPHA, CLAMPED)
    p_h = h_ptr + o_m[:, None].to(tl.int64) * stride_hp + o_n[None, :]
    tl.store(p_h, b_h.to(h_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # routed pairs: a new count per step; masks rows only
def down_mma_kernel(
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
    stride_hp,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_bs,
    stride_yp,
    HAS_SCALE: tl.constexpr,
    MXFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MXFP4_BITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + i_m).to(tl.int64)
    if slot < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    b_pair = tl.load(pairs_ptr + o_m)
    m_m = b_pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    p_w = w_ptr + slot * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < I
        b_h = tl.load(
            h_ptr + o_m[:, None].to(tl.int64) * stride_hp + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )
        if MXFP4:
            p_s = s_ptr + slot * stride_ss + o_n[:, None] * stride_sn
            b_w = mxfp4_tile(p_w + o_n[:, None] * stride_wn, p_s, m_n[:, None], k0, I, BLOCK_K, MXFP4_BITS)
        else:
            b_w = tl.load(
                p_w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0
            )  # (BN, BK)
        d = tl.dot(b_h.to(DOT_DTYPE), tl.trans(b_w.to(DOT_DTYPE)), input_precision=PRECISION)
        if HAS_SCALE:
            d = d * tl.load(s_ptr + slot * stride_ss + ((i_n * BLOCK_N) // 128) * stride_sn + k0 // 128)
        acc += d
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * stride_bs + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_rw = tl.load(rw_ptr + b_pair, mask=m_m, other=0.0)
    acc = acc * b_rw[:, None]
    p_y = y_ptr + b_pair[:, None].to(tl.int64) * stride_yp + o_n[None, :]
    tl.store(p_y, acc, mask=m_m[:, None] & m_n[None, :])
