"""Rotary embedding in Triton: one program per (token, block of heads) reads the rotated part of
x through its strides (e.g. the rope slice of a query projection), the token's cos/sin once, and
writes a new contiguous tensor; same math and rounding points as ``reference.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import require

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_stride_n, x_stride_h, cs_stride,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    n = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    hmask = (hs < heads)[:, None]
    c = tl.load(cos_ptr + n * cs_stride + i)[None, :]
    s = tl.load(sin_ptr + n * cs_stride + i)[None, :]
    base = x_ptr + n * x_stride_n + hs[:, None] * x_stride_h
    obase = out_ptr + (n * heads + hs[:, None]) * (2 * HALF)
    if INTERLEAVED:
        first, second = 2 * i[None, :], 2 * i[None, :] + 1
    else:
        first, second = i[None, :], i[None, :] + HALF
    x1 = tl.load(base + first, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second, mask=hmask, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    dt = out_ptr.dtype.element_ty
    tl.store(obase + first, o1.to(dt), mask=hmask)
    tl.store(obase + second, o2.to(dt), mask=hmask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [N, d] or [N, H, d] (any strides but a unit last one; d a power of two >= 2) by cos/sin
    [N, d/2] fp32. Returns a new contiguous tensor of x's shape and dtype; no autograd."""
    require(x.dim() in (2, 3) and x.dtype in _FLOAT, f"x must be a float [N, d] or [N, H, d], got {tuple(x.shape)}")
    require(x.stride(-1) == 1, "x needs unit stride on its last dimension")
    n, d = x.shape[0], x.shape[-1]
    half = d // 2
    require(d >= 2 and half & (half - 1) == 0, f"rotary dim must be a power of two >= 2, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        require(t.shape == (n, half) and t.dtype == torch.float32 and t.stride(-1) == 1,
                f"{name} must be fp32 [{n}, {half}] with unit last stride, got {t.dtype} {tuple(t.shape)}")
    require(cos.stride(0) == sin.stride(0), "cos and sin need the same row stride")
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n and heads:
        block_h = min(triton.next_power_of_2(heads), 16)
        grid = (n, triton.cdiv(heads, block_h))
        _rotary_kernel[grid](x, cos, sin, out, heads, x.stride(0), stride_h, cos.stride(0),
                             HALF=half, BLOCK_H=block_h, INTERLEAVED=interleaved, num_warps=2,
                             enable_fp_fusion=False)  # no FMA: round each product as torch does
    return out
