"""Paged grouped-query attention for decode: one query token per request over its whole context.

For request b, KV head j and each of its G = H / kv_heads query heads h = j*G + g (the heads that
share a KV head are consecutive, as ``repeat_interleave`` groups them):
    s[t]  = sm_scale * q[b, h] . K[slot(t), j]        for the visible keys t
    out   = sum_t p[t] V[slot(t), j],  p = exp(s) / (sum_t exp(s[t]) + exp(sink[h]))
A key at position t is visible iff t < context_lens[b] and, with a sliding window W,
(context_lens[b] - 1) - t < W. The learned sink logit of gpt-oss joins each row's denominator (an
extra key with no value); without sinks the denominator is the plain softmax's.

The cache is the engine's paged GQA cache: [num_blocks, block_size, 2 * kv_heads * head_dim], each
token's keys for every KV head, then its values. A token at logical position t lives in page
``block_tables[b, t // block_size]`` at row ``t % block_size``.

One program owns (request, KV head, one split of the visible range) and streams BLOCK_N keys at a
time through an online softmax in fp32 (base 2), all G heads of the group at once (one tl.dot of
[G, D] x [D, BLOCK_N]), so each K/V row is read once for the group. With several splits the fp32
partial results are merged, and the sinks added, by a second small kernel. Each split works out its
own range from the request's context length, so the launch shape depends only on host-known bounds
(batch size, ``max_context``): no host synchronisation, and a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, is_interpreter, require

LOG2E = 1.4426950408889634
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200 (132 SMs)


@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    """tl.dot(a, b, acc); fp32 operands in IEEE precision (no TF32), so fp32 models stay exact. Under
    the interpreter (whose bf16 dot is wrong in Triton 3.9) the operands are widened first."""
    if FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _gqa_decode_kernel(
    q_ptr,
    kv_ptr,
    sinks_ptr,
    table_ptr,
    lens_ptr,
    o_ptr,
    lse_ptr,
    KV_HEADS,
    GROUP,
    WINDOW,
    qk_scale,
    stride_q_b,
    stride_q_h,
    stride_kv_slot,
    stride_table_b,
    stride_o_b,
    stride_o_s,
    stride_o_h,
    stride_lse_b,
    stride_lse_s,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PARTIAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_kv = tl.program_id(1)
    i_s = tl.program_id(2)
    n_splits = tl.num_programs(2)
    i_b64 = i_b.to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < GROUP
    o_h = i_kv * GROUP + o_g  # the query heads of this KV head
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_q = tl.load(
        q_ptr + i_b64 * stride_q_b + o_h[:, None] * stride_q_h + o_d[None, :],
        mask=m_g[:, None] & m_d[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)

    ctx_len = tl.load(lens_ptr + i_b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len - WINDOW, 0)
    chunk = tl.cdiv(tl.cdiv(ctx_len - lo, n_splits), BLOCK_N) * BLOCK_N
    start = lo + i_s * chunk
    end = tl.minimum(start + chunk, ctx_len)

    b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    p_k_head = kv_ptr + i_kv * HEAD_DIM + o_d
    p_v_head = kv_ptr + (KV_HEADS + i_kv) * HEAD_DIM + o_d
    for n0 in range(start, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        b_page = tl.load(table_ptr + i_b64 * stride_table_b + o_n // BLOCK_SIZE, mask=m_n, other=0)
        b_slot = b_page.to(tl.int64) * BLOCK_SIZE + o_n % BLOCK_SIZE
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_k_head[None, :] + b_slot[:, None] * stride_kv_slot, mask=m_kv, other=0.0)  # (BLOCK_N, D)
        b_v = tl.load(p_v_head[None, :] + b_slot[:, None] * stride_kv_slot, mask=m_kv, other=0.0)
        b_s = _dot(b_q, tl.trans(b_k), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), FP32_DOT)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))  # log2 domain
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = _dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], FP32_DOT)
        b_m = b_m_new

    p_o = o_ptr + i_b64 * stride_o_b + i_s * stride_o_s + o_h[:, None] * stride_o_h + o_d[None, :]
    m_o = m_g[:, None] & m_d[None, :]
    if PARTIAL:  # fp32 partial output and its log2-sum-exp2; the combine kernel adds the sinks
        m_any = b_l > 0
        b_out = b_acc / tl.where(m_any, b_l, 1.0)[:, None]
        b_lse = tl.where(m_any, b_m + tl.log2(tl.where(m_any, b_l, 1.0)), float("-inf"))
        tl.store(p_o, b_out, mask=m_o)
        tl.store(lse_ptr + i_b64 * stride_lse_b + i_s * stride_lse_s + o_h, b_lse, mask=m_g)
    else:  # the whole visible range (never empty: a request sees at least its own token)
        if HAS_SINKS:
            b_sink = tl.load(sinks_ptr + o_h, mask=m_g, other=0.0).to(tl.float32) * 1.4426950408889634
            b_l += tl.exp2(b_sink - b_m)
        b_out = b_acc / b_l[:, None]
        tl.store(p_o, b_out.to(o_ptr.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["S"])  # the split count follows the context (max_context): it bounds loops only
def _gqa_combine_kernel(
    po_ptr,
    plse_ptr,
    sinks_ptr,
    o_ptr,
    H,
    S,
    stride_o_b,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge S partials of one request: po fp32 [B, S, H, BLOCK_D], plse fp32 [B, S, H] (log2)."""
    i_b = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, BLOCK_D)
    b_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for i_s in range(S):
        b_max = tl.maximum(b_max, tl.load(plse_ptr + (i_b * S + i_s) * H + o_h, mask=m_h, other=float("-inf")))
    if HAS_SINKS:
        b_sink = tl.load(sinks_ptr + o_h, mask=m_h, other=0.0).to(tl.float32) * 1.4426950408889634
        b_max = tl.maximum(b_max, b_sink)
    b_use = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for i_s in range(S):
        b_wt = tl.exp2(tl.load(plse_ptr + (i_b * S + i_s) * H + o_h, mask=m_h, other=float("-inf")) - b_use)
        b_o = tl.load(
            po_ptr + ((i_b * S + i_s) * H + o_h)[:, None] * BLOCK_D + o_d[None, :], mask=m_h[:, None], other=0.0
        )
        b_sum += b_wt
        b_acc += b_wt[:, None] * b_o
    if HAS_SINKS:
        b_sum += tl.exp2(b_sink - b_use)
    b_out = b_acc / tl.where(b_sum > 0, b_sum, 1.0)[:, None]
    p_o = o_ptr + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_d[None, :]
    tl.store(p_o, b_out.to(o_ptr.dtype.element_ty), mask=m_h[:, None] & (o_d < HEAD_DIM)[None, :])


def default_splits(batch: int, kv_heads: int, max_span: int, block_n: int) -> int:
    """Splits of the context so that a small batch still fills the GPU: about _TARGET_PROGRAMS
    programs in all, never more splits than BLOCK_N tiles in the longest visible range."""
    programs = batch * kv_heads
    if programs >= _TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(max_span, block_n), triton.cdiv(_TARGET_PROGRAMS, programs)))


def gqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    max_context: int,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Decode attention of one query token per request over the paged GQA cache.

    Args:
        q: [B, H, D] bf16/fp16/fp32 with unit last stride; heads h*G..h*G+G-1 share KV head h.
        kv_cache: [num_blocks, block_size, 2 * kv_heads * D], q's dtype, contiguous (keys, then values).
        block_tables: [B, max_blocks] int32 with unit last stride.
        context_lens: [B] int32, >= 1: the request's tokens, this step's included (its query position + 1).
        sm_scale: softmax scale.
        max_context: an upper bound on context_lens (sizes the splits without reading the lengths back).
        window: sliding window W (key t visible iff context_len - 1 - t < W), or None.
        sinks: optional [H] learned sink logits (any float dtype), one extra denominator term per head.
        out: optional preallocated [B, H, D] output in q's dtype (e.g. for CUDA graphs).
        splits: split the visible range over this many programs (default: from the batch and max_context).
        block_n: keys per tile.
    Returns:
        out [B, H, D] in q's dtype.
    """
    check_tensor("q", q, dtypes=_FLOATS, ndim=3, contiguous=False)
    batch, heads, head_dim = q.shape
    require(q.stride(2) == 1, f"q must have unit last stride, got strides {q.stride()}")
    check_tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=3, device=q.device)
    num_blocks, block_size, width = kv_cache.shape
    require(width % (2 * head_dim) == 0, f"kv_cache rows ({width}) must hold 2 * kv_heads * {head_dim} values")
    kv_heads = width // (2 * head_dim)
    require(heads % kv_heads == 0, f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, contiguous=False, device=q.device)
    require(
        block_tables.shape[0] == batch and block_tables.stride(1) == 1,
        f"block_tables must be [{batch}, max_blocks] with unit last stride, got {tuple(block_tables.shape)}",
    )
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), shape=(batch,), device=q.device)
    require(window is None or window >= 1, f"window must be >= 1, got {window}")
    require(max_context >= 1, f"max_context must be >= 1, got {max_context}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=_FLOATS, shape=(heads,), device=q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_tensor("out", out, dtypes=(q.dtype,), shape=(batch, heads, head_dim), contiguous=False, device=q.device)
    require(out.stride(2) == 1, "out must have unit last stride")
    if batch == 0:
        return out

    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = max(16, triton.next_power_of_2(group))
    span = min(max_context, window) if window is not None else max_context
    if splits is None:
        splits = default_splits(batch, kv_heads, span, block_n)
    require(splits >= 1, f"splits must be >= 1, got {splits}")
    partial = splits > 1
    if partial:
        po = torch.empty(batch, splits, heads, block_d, dtype=torch.float32, device=q.device)
        plse = torch.empty(batch, splits, heads, dtype=torch.float32, device=q.device)
    else:
        po, plse = out.unsqueeze(1), out  # plse unused without splits
    sinks_arg = sinks if sinks is not None else q  # an unused pointer without sinks
    _gqa_decode_kernel[(batch, kv_heads, splits)](
        q, kv_cache, sinks_arg, block_tables, context_lens, po, plse,
        kv_heads, group, window or 0, sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(1), block_tables.stride(0),
        po.stride(0), po.stride(1), po.stride(2), plse.stride(0), plse.stride(1) if partial else 0,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, PARTIAL=partial,
        FP32_DOT=is_interpreter() or q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if partial:
        block_h = 16
        _gqa_combine_kernel[(batch, triton.cdiv(heads, block_h))](
            po, plse, sinks_arg, out, heads, splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, HAS_SINKS=sinks is not None, num_warps=4,
        )  # fmt: skip
    return out
