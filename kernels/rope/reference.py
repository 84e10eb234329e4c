"""The torch form of the fused rotary embedding."""

from __future__ import annotations

import torch


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [N, ..., d] by per-token angles (cos/sin [N, d/2] fp32) in fp32; returns x's dtype.
    interleaved: pairs (x[2i], x[2i+1]) (DeepSeek); else halves (x[i], x[i + d/2]) (NeoX)."""
    xf = x.float()
    extra = xf.dim() - 2
    c = cos.view(cos.shape[0], *([1] * extra), cos.shape[-1])
    s = sin.view(sin.shape[0], *([1] * extra), sin.shape[-1])
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
