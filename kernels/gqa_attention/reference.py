"""Plain-torch reference of the paged GQA decode kernel: the same attention as the engine's plain
path (hearth.engine.models.gqa), one request at a time, fp32 math."""

from __future__ import annotations

import torch


def gqa_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], kv_cache [num_blocks, block_size, 2 * kv_heads * D] (keys, then values),
    block_tables [B, max_blocks], context_lens [B]. Returns fp32 [B, H, D] (see gqa_decode)."""
    batch, heads, head_dim = q.shape
    block_size = kv_cache.shape[1]
    kv_heads = kv_cache.shape[2] // (2 * head_dim)
    rows = kv_cache.flatten(0, 1).float()  # (slots, 2 * kvh * D)
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    for b in range(batch):
        n = int(context_lens[b])
        pos = torch.arange(n)
        slots = block_tables[b].long().cpu()[pos // block_size] * block_size + pos % block_size
        k, v = rows[slots.to(rows.device)].cpu().view(n, 2, kv_heads, head_dim).unbind(1)
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # (n, H, D)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float().cpu(), k) * sm_scale  # (H, n)
        if window is not None:
            scores[:, pos <= n - 1 - window] = float("-inf")
        if sinks is not None:
            scores = torch.cat((scores, sinks.float().cpu()[:, None]), dim=1)
        probs = torch.softmax(scores, dim=-1)[:, :n]
        out[b] = torch.einsum("ht,thd->hd", probs, v)
    return out
