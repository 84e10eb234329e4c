"""Fused small kernels of a decode step: each replaces a chain of 5-20 tiny PyTorch kernels (plus
their launch gaps) with one launch.

- ``rms_norm``: RMSNorm of each row, optionally after adding a residual (returns the sum too);
- ``rope_``: rotary embedding in place on a slice of the last dim (MLA's q_pe, the indexer's q),
  cos/sin read from position-indexed tables, so no per-step cos/sin kernels;
- ``mla_latent_write``: MLA's cache row in one pass: RMSNorm of the latent, rope of the shared key,
  both written to the paged latent cache at the token's slot;
- ``indexer_q_fp8``: the DSA indexer's query in one pass: rope, ue8m0 FP8 quantisation per head and
  the head weights with the query scale folded in (``w = weights_proj(x) * scale * q_scale``).

Numerics follow the references in ``reference.py`` (fp32 math, rounded to bf16 where the reference
rounds); the sum order of the norm differs, so results may differ by one bf16 ulp. Rounding to bf16
is done on the bits (``round_to_bf16``) because the CPU interpreter's cast truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import (
    check_tensor,
    e4m3_encode,
    exp2_int,
    require,
    round_to_bf16,
    ue8m0_exponent,
)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, D, stride_x, stride_r, stride_h, stride_y, eps,
                     RESIDUAL: tl.constexpr, ROUND_OUT: tl.constexpr, BLOCK_D: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(x_ptr + i_m * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    if RESIDUAL:
        b_x = round_to_bf16(b_x + tl.load(r_ptr + i_m * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32))
        tl.store(h_ptr + i_m * stride_h + o_d, b_x.to(h_ptr.dtype.element_ty), mask=m_d)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_w * round_to_bf16(b_x * b_r)
    if ROUND_OUT:
        b_y = round_to_bf16(b_y)
    tl.store(y_ptr + i_m * stride_y + o_d, b_y.to(y_ptr.dtype.element_ty), mask=m_d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of the rows of x [M, D] bf16 (unit last stride) with weight [D] (bf16 or fp32).

    With ``residual`` [M, D] bf16 it normalises ``h = x + residual`` (rounded to bf16, as the bf16 add
    is) and returns (norm(h), h); otherwise (norm(x), None). The norm has the promoted dtype of the
    weight and x, as ``weight * normed.to(x.dtype)`` has."""
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2, contiguous=False)
    require(x.stride(1) == 1, f"x must have a unit last stride, got strides {x.stride()}")
    m, d = x.shape
    check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float32), shape=(d,), device=x.device)
    y = torch.empty(m, d, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = None
    if residual is not None:
        check_tensor("residual", residual, dtypes=(torch.bfloat16,), shape=(m, d), contiguous=False, device=x.device)
        require(residual.stride(1) == 1, "residual must have a unit last stride")
        h = torch.empty_like(y, dtype=torch.bfloat16)
    if m:
        _rms_norm_kernel[(m,)](x, residual if residual is not None else x, h if h is not None else y, weight, y, d,
                               x.stride(0), residual.stride(0) if residual is not None else 0,
                               h.stride(0) if h is not None else 0, y.stride(0), eps,
                               RESIDUAL=residual is not None, ROUND_OUT=y.dtype == torch.bfloat16,
                               BLOCK_D=triton.next_power_of_2(d), num_warps=8 if d >= 2048 else 4)
    return y, h


@triton.jit
def _rotate(x1, x2, c, s):
    """The rotated pair, each rounded to bf16 (fp32 products first, as the reference computes them)."""
    a = x1 * c
    b = x2 * s
    e = x2 * c
    f = x1 * s
    return round_to_bf16(a - b), round_to_bf16(e + f)


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, H, OFFSET, OUT_OFFSET, stride_n, stride_h, stride_on,
                 stride_oh, stride_cs, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + i_n).to(tl.int64)
    b_c = tl.load(cos_ptr + pos * stride_cs + o_i)[None, :]
    b_s = tl.load(sin_ptr + pos * stride_cs + o_i)[None, :]
    if INTERLEAVED:
        o_1, o_2 = 2 * o_i, 2 * o_i + 1
    else:
        o_1, o_2 = o_i, HALF + o_i
    p_x = x_ptr + i_n * stride_n + o_h[:, None].to(tl.int64) * stride_h + OFFSET
    b_1 = tl.load(p_x + o_1[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    b_2 = tl.load(p_x + o_2[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    r_1, r_2 = _rotate(b_1, b_2, b_c, b_s)
    p_out = out_ptr + i_n * stride_on + o_h[:, None].to(tl.int64) * stride_oh + OUT_OFFSET
    tl.store(p_out + o_1[None, :], r_1.to(out_ptr.dtype.element_ty), mask=m_h[:, None])
    tl.store(p_out + o_2[None, :], r_2.to(out_ptr.dtype.element_ty), mask=m_h[:, None])


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, device: torch.device) -> None:
    check_tensor("cos", cos, dtypes=(torch.float32,), shape=(None, rope_dim // 2), device=device)
    check_tensor("sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=device)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int,
          rope_dim: int, interleaved: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate dims [offset, offset + rope_dim) of x [N, H, D] bf16 (unit last stride) in place; token n
    at ``positions[n]`` uses row positions[n] of the fp32 tables cos / sin [max_pos, rope_dim / 2]
    (the caller guarantees positions < max_pos). Returns x.

    With ``out`` [N, H, rope_dim] bf16 (unit last stride, any other strides: e.g. the tail of a wider
    buffer) the rotated dims are written there instead and x is only read; returns out."""
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=3, contiguous=False)
    n, heads, width = x.shape
    require(x.stride(2) == 1, f"x must have a unit last stride, got strides {x.stride()}")
    require(rope_dim % 2 == 0 and rope_dim >= 2 and (rope_dim // 2) & (rope_dim // 2 - 1) == 0,
            f"rope_dim must be twice a power of two, got {rope_dim}")
    require(offset >= 0 and offset + rope_dim <= width, f"dims [{offset}, {offset + rope_dim}) exceed {width}")
    check_tensor("positions", positions, dtypes=(torch.int64, torch.int32), shape=(n,), device=x.device)
    _check_tables(cos, sin, rope_dim, x.device)
    dest, dest_offset = (x, offset) if out is None else (out, 0)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(n, heads, rope_dim), contiguous=False,
                     device=x.device)
        require(out.stride(2) == 1, f"out must have a unit last stride, got strides {out.stride()}")
    block_h = min(16, triton.next_power_of_2(heads))
    if n:
        _rope_kernel[(n, triton.cdiv(heads, block_h))](x, dest, positions, cos, sin, heads, offset, dest_offset,
                                                        x.stride(0), x.stride(1), dest.stride(0), dest.stride(1),
                                                        cos.stride(0), HALF=rope_dim // 2, INTERLEAVED=interleaved,
                                                        BLOCK_H=block_h, num_warps=4)
    return dest


@triton.jit
def _indexer_q_fp8_kernel(q_ptr, pos_ptr, cos_ptr, sin_ptr, wr_ptr, q8_ptr, w_ptr, H, stride_n, stride_h,
                          stride_wr, stride_cs, scale, D: tl.constexpr, ROPE_DIM: tl.constexpr,
                          HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, D)
    p_q = q_ptr + i_n * stride_n + o_h[:, None].to(tl.int64) * stride_h
    b_x = tl.load(p_q + o_d[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    if HAS_ROPE:  # the first ROPE_DIM dims, each element against its pair partner
        HALF: tl.constexpr = ROPE_DIM // 2
        m_r = o_d < ROPE_DIM
        if INTERLEAVED:
            o_p, o_f, m_first = o_d ^ 1, o_d // 2, o_d % 2 == 0
        else:
            o_p, o_f, m_first = tl.where(o_d < HALF, o_d + HALF, o_d - HALF), o_d % HALF, o_d < HALF
        o_p = tl.where(m_r, o_p, o_d)
        o_f = tl.where(m_r, o_f, 0)
        b_xp = tl.load(p_q + o_p[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + i_n).to(tl.int64)
        b_c = tl.load(cos_ptr + pos * stride_cs + o_f)[None, :]
        b_s = tl.load(sin_ptr + pos * stride_cs + o_f)[None, :]
        # as _rotate: first of a pair x1 c - x2 s, second x2 c + x1 s, rounded to bf16
        b_a, b_b = b_x * b_c, b_xp * b_s
        b_x = tl.where(m_r[None, :], round_to_bf16(tl.where(m_first[None, :], b_a - b_b, b_a + b_b)), b_x)
    b_e = ue8m0_exponent(tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-4))  # [BLOCK_H]
    b_y = tl.minimum(tl.maximum(b_x * exp2_int(-b_e)[:, None], -448.0), 448.0)
    p_8 = q8_ptr + (i_n * H + o_h[:, None].to(tl.int64)) * D + o_d[None, :]
    tl.store(p_8, e4m3_encode(b_y).to(tl.uint8), mask=m_h[:, None])
    b_w = tl.load(wr_ptr + i_n * stride_wr + o_h, mask=m_h, other=0.0) * scale
    tl.store(w_ptr + i_n * H + o_h, b_w * exp2_int(b_e), mask=m_h)


def indexer_q_fp8(q: torch.Tensor, weights: torch.Tensor, scale: float, positions: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSA indexer's queries for the FP8 scoring kernels: rope (with cos / sin: the first
    2 * cos.shape[1] dims, tables as in ``rope_``; without: taken as applied), then per (token, head)
    ue8m0 FP8 quantisation, and the head weights with the query scale folded in.

    q: [N, H, D] bf16 (unit last stride; D a power of two), weights: [N, H] fp32 (``weights_proj``'s
    output, unit last stride). Returns (q8 [N, H, D] float8_e4m3fn, w [N, H] fp32) with
    q ~= q8 * s[..., None] and w = weights * scale * s (s = 2^ceil(log2(max(amax, 1e-4) / 448)))."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=3, contiguous=False)
    n, heads, d = q.shape
    require(q.stride(2) == 1 and d & (d - 1) == 0, f"q must be [N, H, 2^k] with a unit last stride, got "
                                                     f"{tuple(q.shape)} strides {q.stride()}")
    check_tensor("weights", weights, dtypes=(torch.float32,), shape=(n, heads), contiguous=False, device=q.device)
    require(weights.stride(1) == 1, f"weights must have a unit last stride, got strides {weights.stride()}")
    has_rope = cos is not None
    rope_dim = 2 * cos.shape[1] if has_rope else 0
    if has_rope:
        require(sin is not None and positions is not None, "cos needs sin and positions")
        require(2 <= rope_dim <= d, f"rope dims {rope_dim} must be in [2, {d}]")
        _check_tables(cos, sin, rope_dim, q.device)
        check_tensor("positions", positions, dtypes=(torch.int64, torch.int32), shape=(n,), device=q.device)
    q8 = torch.empty(n, heads, d, dtype=torch.float8_e4m3fn, device=q.device)
    w = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    block_h = min(16, triton.next_power_of_2(heads))
    if n:
        _indexer_q_fp8_kernel[(n, triton.cdiv(heads, block_h))](
            q, positions if has_rope else weights, cos if has_rope else weights, sin if has_rope else weights,
            weights, q8.view(torch.uint8), w, heads, q.stride(0), q.stride(1), weights.stride(0),
            cos.stride(0) if has_rope else 0, scale, D=d, ROPE_DIM=rope_dim, HAS_ROPE=has_rope,
            INTERLEAVED=interleaved, BLOCK_H=block_h, num_warps=4)
    return q8, w


@triton.jit
def _mla_latent_write_kernel(kv_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, stride_kv,
                             stride_cache, stride_cs, eps, C: tl.constexpr, HALF: tl.constexpr,
                             INTERLEAVED: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, C)
    p_kv = kv_ptr + i_n * stride_kv
    b_x = tl.load(p_kv + o_c).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / C + eps)
    b_w = tl.load(w_ptr + o_c).to(tl.float32)
    b_y = round_to_bf16(b_w * round_to_bf16(b_x * b_r))
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    p_out = cache_ptr + slot * stride_cache
    tl.store(p_out + o_c, b_y.to(cache_ptr.dtype.element_ty))
    o_i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + i_n).to(tl.int64)
    b_c = tl.load(cos_ptr + pos * stride_cs + o_i)
    b_s = tl.load(sin_ptr + pos * stride_cs + o_i)
    if INTERLEAVED:
        o_1, o_2 = C + 2 * o_i, C + 2 * o_i + 1
    else:
        o_1, o_2 = C + o_i, C + HALF + o_i
    r_1, r_2 = _rotate(tl.load(p_kv + o_1).to(tl.float32), tl.load(p_kv + o_2).to(tl.float32), b_c, b_s)
    tl.store(p_out + o_1, r_1.to(cache_ptr.dtype.element_ty))
    tl.store(p_out + o_2, r_2.to(cache_ptr.dtype.element_ty))


def mla_latent_write(kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, slots: torch.Tensor,
                     cache: torch.Tensor) -> None:
    """cache[slots[n]] = [rms_norm(kv[n, :C]) * weight, rope(kv[n, C:])] for kv [N, C + R] bf16
    (kv_a_proj_with_mqa's output), C = weight's length (a power of two), cache [num_slots, C + R] bf16;
    rope tables as in ``rope_``."""
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), ndim=2, contiguous=False)
    require(kv.stride(1) == 1, f"kv must have a unit last stride, got strides {kv.stride()}")
    n, width = kv.shape
    check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float32), ndim=1, device=kv.device)
    c = weight.shape[0]
    require(c & (c - 1) == 0 and c < width, f"the latent width {c} must be a power of two below {width}")
    rope_dim = width - c
    require((rope_dim // 2) & (rope_dim // 2 - 1) == 0 and rope_dim >= 2, f"rope dims {rope_dim}: not 2^k")
    check_tensor("cache", cache, dtypes=(torch.bfloat16,), shape=(None, width), device=kv.device)
    check_tensor("positions", positions, dtypes=(torch.int64, torch.int32), shape=(n,), device=kv.device)
    check_tensor("slots", slots, dtypes=(torch.int64, torch.int32), shape=(n,), device=kv.device)
    _check_tables(cos, sin, rope_dim, kv.device)
    if n:
        _mla_latent_write_kernel[(n,)](kv, weight, positions, cos, sin, slots, cache, kv.stride(0), cache.stride(0),
                                       cos.stride(0), eps, C=c, HALF=rope_dim // 2, INTERLEAVED=interleaved,
                                       num_warps=4)
