"""Plain-torch references for DSA sparse MLA (absorbed / MQA form over the 576-d latent cache) and the
FP8 656-byte latent format (512 e4m3 + 4 fp32 ue8m0 scales, one per 128 dims, + 64 bf16 rope dims)."""

from __future__ import annotations

import torch

from hearth.kernels._utils import FP8_E4M3, FP8_MAX
from hearth.kernels.indexer.reference import ue8m0_scale

D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE
FP8_TOKEN_BYTES = D_LATENT + 4 * 4 + D_ROPE * 2  # 656


def quantize_latent_fp8(latent: torch.Tensor) -> torch.Tensor:
    """[..., 576] bf16 (512 normalised latent + 64 rope) -> uint8 [..., 656] FP8 cache entries."""
    x = latent.float()
    lat = x[..., :D_LATENT].unflatten(-1, (4, 128))  # (..., 4, 128)
    scale = ue8m0_scale(lat.abs().amax(-1))  # (..., 4)
    q8 = (lat / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3).flatten(-2)
    rope = latent[..., D_LATENT:].to(torch.bfloat16).contiguous()
    parts = [q8.view(torch.uint8), scale.contiguous().view(torch.uint8), rope.view(torch.uint8)]
    return torch.cat(parts, dim=-1)


def dequantize_latent_fp8(entry: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] -> fp32 [..., 576] (dequantised latent, then rope)."""
    lat = entry[..., :D_LATENT].contiguous().view(FP8_E4M3).float().unflatten(-1, (4, 128))
    scale = entry[..., D_LATENT : D_LATENT + 16].contiguous().view(torch.float32)
    rope = entry[..., D_LATENT + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(lat * scale[..., None]).flatten(-2), rope], dim=-1)


def latent_tokens(kv_cache: torch.Tensor) -> torch.Tensor:
    """Paged latent cache (bf16 [nb, bs, 576] or uint8 [nb, bs, 656]) -> fp32 [nb*bs, 576] by physical slot."""
    if kv_cache.dtype == torch.uint8:
        return dequantize_latent_fp8(kv_cache).flatten(0, 1)
    return kv_cache.float().flatten(0, 1)


def sparse_mla_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    table_rows: torch.Tensor,
    limits: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise sparse attention, fp32 math.

    q [R, H, 576]; indices [R, topk] logical positions (valid iff 0 <= idx <= limits[r]);
    table_rows [R, max_blocks] the block table row of each query row; limits [R].
    Returns out fp32 [R, H, 512] (0 for rows with no valid index) and lse fp32 [R, H] (natural log of
    sum exp(sm_scale * q.k), -inf for empty rows)."""
    block_size = kv_cache.shape[1]
    lat = latent_tokens(kv_cache)
    idx = indices.long()
    valid = (idx >= 0) & (idx <= limits[:, None].long())
    safe = torch.where(valid, idx, 0)
    slots = table_rows.long().gather(1, safe // block_size) * block_size + safe % block_size
    kv = lat[slots]  # (R, topk, 576)
    s = torch.einsum("rhd,rnd->rhn", q.float(), kv) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("rhn,rnd->rhd", p, kv[..., :D_LATENT])
    return out, lse


def sparse_mla_decode_ref(q, kv_cache, indices, block_table, context_lens, sm_scale):
    """Decode reference: q [B, H, 576], indices [B, topk], block_table [B, max_blocks],
    context_lens [B] (valid iff index < context_len)."""
    return sparse_mla_ref(q, kv_cache, indices, block_table, context_lens - 1, sm_scale)


def sparse_mla_prefill_ref(q, kv_cache, indices, block_table, positions, sm_scale):
    """Prefill reference: q [T, H, 576], indices [T, topk], block_table [max_blocks] (one request),
    positions [T] (valid iff index <= position)."""
    rows = block_table[None, :].expand(q.shape[0], -1)
    return sparse_mla_ref(q, kv_cache, indices, rows, positions, sm_scale)


def dense_mla_decode_check(q, latent, n_ctx, sm_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent dense check for one request: when every position 0..n_ctx-1 is selected, sparse
    attention equals dense softmax attention over the whole context. q [H, 576], latent [n, 576]."""
    s = (q.double() @ latent[:n_ctx].double().T) * sm_scale
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ latent[:n_ctx, :D_LATENT].double()
    return out, lse
