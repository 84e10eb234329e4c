"""The torch form of the fused RMSNorm (what Hugging Face's DeepSeek RMSNorm computes)."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D]: normalise in fp32, cast back to x's dtype, then multiply by weight [D] (in the
    promoted dtype of weight and x, as torch would)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
