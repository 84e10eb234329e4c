"""Triton grouped SwiGLU over routed tokens, reading expert weights from cache slots by slot index.

Two launches: (1) gate/up GEMM + SwiGLU for each block of expert-sorted (token, k) pairs into
``h`` [P, I]; (2) down GEMM, scaled by the routing weight, into one fp32 row per pair, summed over k
afterwards (deterministic: no atomics). Weights are bf16/fp16/fp32 or FP8 e4m3 with 128x128 block
scales; FP8 tiles are widened in registers and each tile's dot product is multiplied by its one scale.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hearth.kernels.moe.align import group_by_slot

SCALE_BLOCK = 128
_FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    pairs_ptr,
    block_slot_ptr,
    num_pairs,
    D,
    I,
    TOPK,
    NUM_SCALE_ROWS,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ss,
    stride_sn,
    stride_hp,
    HAS_SCALE: tl.constexpr,
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
        b_g = tl.load(p_w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_w, other=0.0)  # (BN, BK)
        b_u = tl.load(p_w + (I + o_n)[:, None] * stride_wn + o_k[None, :], mask=m_w, other=0.0)
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
    b_h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    p_h = h_ptr + o_m[:, None].to(tl.int64) * stride_hp + o_n[None, :]
    tl.store(p_h, b_h.to(h_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
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
    stride_yp,
    HAS_SCALE: tl.constexpr,
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
        b_w = tl.load(
            p_w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0
        )  # (BN, BK)
        d = tl.dot(b_h.to(DOT_DTYPE), tl.trans(b_w.to(DOT_DTYPE)), input_precision=PRECISION)
        if HAS_SCALE:
            d = d * tl.load(s_ptr + slot * stride_ss + ((i_n * BLOCK_N) // 128) * stride_sn + k0 // 128)
        acc += d
    b_rw = tl.load(rw_ptr + b_pair, mask=m_m, other=0.0)
    acc = acc * b_rw[:, None]
    p_y = y_ptr + b_pair[:, None].to(tl.int64) * stride_yp + o_n[None, :]
    tl.store(p_y, acc, mask=m_m[:, None] & m_n[None, :])


def _check_inputs(x, slot_ids, weights, w13, w2, s13, s2) -> None:
    t, d = x.shape
    s, two_i, d_w = w13.shape
    inter = two_i // 2
    if x.dtype not in _FLOAT_WEIGHTS or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous bf16/fp16/fp32 [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    if slot_ids.shape != weights.shape or slot_ids.shape[0] != t or weights.dtype != torch.float32:
        raise ValueError(
            f"slot_ids {tuple(slot_ids.shape)} and fp32 weights {weights.dtype} "
            f"{tuple(weights.shape)} must both be [T={t}, K]"
        )
    if d_w != d or w2.shape != (s, d, inter):
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match [S, 2I, D] / [S, D, I] with D={d}"
        )
    if w13.stride(2) != 1 or w2.stride(2) != 1 or w13.stride(1) < d or w2.stride(1) < inter:
        raise ValueError("w13 and w2 need unit stride on the last dimension and non-overlapping rows")
    if (s13 is None) != (s2 is None) or (s13 is None) != (w13.dtype in _FLOAT_WEIGHTS):
        raise ValueError(f"FP8 weights need both scale tensors and float weights none (w13 {w13.dtype})")
    if s13 is not None:
        n_i, n_d = triton.cdiv(inter, SCALE_BLOCK), triton.cdiv(d, SCALE_BLOCK)
        if s13.shape != (s, 2 * n_i, n_d) or s2.shape != (s, n_d, n_i):
            raise ValueError(
                f"scales s13 {tuple(s13.shape)} / s2 {tuple(s2.shape)} must be "
                f"[S, {2 * n_i}, {n_d}] / [S, {n_d}, {n_i}]"
            )
        if s13.dtype != torch.float32 or s2.dtype != torch.float32 or s13.stride(2) != 1 or s2.stride(2) != 1:
            raise ValueError("scales must be fp32 with unit stride on the last dimension")


def _block_m(num_pairs: int, num_slots: int) -> int:
    per_slot = num_pairs / max(1, min(num_slots, num_pairs))
    return 16 if per_slot <= 16 else 32 if per_slot <= 32 else 64


def fused_moe(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: ``out[t] += sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])``.

    x: [T, D] bf16/fp16/fp32, contiguous. slot_ids: [T, K] int (slot in [0, S), or -1 = skip the pair).
    weights: [T, K] fp32. w13: [S, 2I, D] (gate rows 0..I-1, up rows I..2I-1), w2: [S, D, I]; both
    bf16/fp16/fp32, or float8_e4m3fn with s13: [S, 2*ceil(I/128), ceil(D/128)] fp32 (gate scale rows,
    then up scale rows) and s2: [S, ceil(D/128), ceil(I/128)] fp32 (``W = W8 * s[i//128, j//128]``).
    The slot dimension may have any stride (slots are views into one byte buffer).
    out: optional [T, D] fp32 accumulator. Returns it (or a new one), [T, D] fp32.
    """
    _check_inputs(x, slot_ids, weights, w13, w2, s13, s2)
    t, d = x.shape
    num_slots, inter = w13.shape[0], w13.shape[1] // 2
    if out is None:
        out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    num_pairs = slot_ids.numel()
    if num_pairs == 0:
        return out
    block_m = _block_m(num_pairs, num_slots)
    sorted_pairs, block_slot = group_by_slot(slot_ids, num_slots, block_m)
    num_blocks = block_slot.numel()
    h = torch.empty((num_blocks * block_m, inter), dtype=x.dtype, device=x.device)  # (P, I)
    y = torch.zeros((num_pairs, d), dtype=torch.float32, device=x.device)  # (T*K, D)
    has_scale = s13 is not None
    # NOTE: the interpreter's bf16 tl.dot is wrong (triton 3.9 on numpy); fp32 there is exact enough.
    dot_dtype = (
        tl.float32
        if os.environ.get("TRITON_INTERPRET") == "1" or x.dtype == torch.float32
        else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    )
    precision = "ieee" if dot_dtype == tl.float32 else "tf32"  # tf32 is ignored for 16-bit operands
    block_n, block_k = 64, (128 if has_scale else 64)
    meta = dict(
        HAS_SCALE=has_scale,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    s13_, s2_ = (s13, s2) if has_scale else (w13, w2)  # unused pointers when HAS_SCALE is off
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        s13_,
        h,
        sorted_pairs,
        block_slot,
        num_pairs,
        d,
        inter,
        slot_ids.shape[1],
        triton.cdiv(inter, SCALE_BLOCK),
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13_.stride(0),
        s13_.stride(1),
        h.stride(0),
        **meta,
    )
    rw = weights.reshape(-1).contiguous()  # (T*K,)
    _down_kernel[(num_blocks, triton.cdiv(d, block_n))](
        h,
        w2,
        s2_,
        y,
        rw,
        sorted_pairs,
        block_slot,
        num_pairs,
        d,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2_.stride(0),
        s2_.stride(1),
        y.stride(0),
        **meta,
    )
    out += y.view(t, -1, d).sum(1)  # (T, K, D) -> (T, D)
    return out
