"""Plain-torch references of the fused decode-step kernels: the same arithmetic as the model's
plain-PyTorch layers (hearth.engine.models.layers), written here because kernels import only torch."""

from __future__ import annotations

import torch

from hearth.kernels.indexer.reference import act_quant_ue8m0


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) with the norm in fp32, cast to x.dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [N, ..., d] with cos/sin [N, d/2], in fp32, returned in x.dtype:
    pairs (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + d/2])."""
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


def mla_latent_write_ref(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """cache[slots] = [rms_norm(kv[:, :C]), rope(kv[:, C:])] for kv [N, C + R] (C = cache width - R)."""
    rope = kv.shape[1] - weight.shape[0]
    c_kv, k_pe = kv.split([weight.shape[0], rope], dim=-1)
    rows = torch.cat((rms_norm_ref(c_kv, weight, eps), rotate_ref(k_pe, cos, sin, interleaved)), dim=-1)
    cache[slots] = rows.to(cache.dtype)


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, *, sigmoid: bool, n_group: int = 1,
                  topk_group: int = 1, group_top2: bool = True, normalise: bool = True,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-family router after the gate matmul (the model's ``Gate``): see ``moe_route``."""
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, logits.shape[-1] // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if group_top2 else grouped.max(dim=-1).values
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def indexer_q_fp8_ref(q: torch.Tensor, weights: torch.Tensor, scale: float, cos: torch.Tensor | None,
                      sin: torch.Tensor | None, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rope of q's first dims (cos / sin [N, R/2] rows, or None) -> ue8m0 FP8 per (token, head), and
    weights * scale * q_scale: see ``indexer_q_fp8``."""
    if cos is not None:
        rope = 2 * cos.shape[1]
        q = torch.cat((rotate_ref(q[..., :rope], cos, sin, interleaved), q[..., rope:]), dim=-1)
    q8, q_scale = act_quant_ue8m0(q)
    return q8, weights * scale * q_scale
