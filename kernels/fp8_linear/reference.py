"""Plain-torch reference of the FP8 block-scaled linear: dequantise the weight, then ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.kernels.moe.reference import dequant_block_fp8


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W[n, k] = W8[n, k] * s[n // 128, k // 128], rounded to ``dtype``; edge blocks may be partial."""
    return dequant_block_fp8(weight, scale_inv).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """y = x W^T with W dequantised to x's dtype first (what the kernels must reproduce)."""
    return F.linear(x, dequantize(weight, scale_inv, x.dtype))
