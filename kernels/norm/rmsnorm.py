"""Fused RMSNorm in Triton: one program per row reads the row once, reduces its mean square in
fp32, and writes ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, rounding where the torch
reference rounds (``reference.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import require

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, dim, eps,
                     X_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / dim
    y = (x * tl.math.rsqrt(mean_sq + eps)).to(X_DTYPE).to(tl.float32)  # cast back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (fp32/bf16/fp16, unit stride on the last dim) with weight [D].

    Returns a new contiguous tensor of x's shape in ``torch.result_type(weight, x)``; no autograd
    (inference only)."""
    require(x.dtype in _FLOAT and weight.dtype in _FLOAT, f"x {x.dtype} / weight {weight.dtype} must be float")
    dim = x.shape[-1]
    require(weight.shape == (dim,) and weight.is_contiguous(), f"weight must be [{dim}], got {tuple(weight.shape)}")
    require(x.stride(-1) == 1, "x needs unit stride on its last dimension")
    rows = x.reshape(-1, dim)  # a view when the leading dims are collapsible
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), dim, eps,
                                           X_DTYPE=_TL[x.dtype], BLOCK=block,
                                           num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)
