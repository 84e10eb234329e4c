"""Grouped-query attention decode through Hearth's Triton kernel (hearth.kernels.gqa_attention).

Used by the GQA families (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss) on CUDA: decode requests read their
keys and values straight from the paged cache through their block tables, sliding window and sinks
inside the kernel. A step of only single-token decodes (``ForwardContext.decode``) is one launch
over device tensors, with no host synchronisation, which lets ``hearth.engine.cuda_graphs`` capture
it. Prefill chunks stay on the plain-PyTorch path of gqa.py, which remains the reference.
"""

from __future__ import annotations

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext, decode_tables
from hearth.kernels.gqa_attention import gqa_decode

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernels_apply(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the GQA decode kernel can run this model as configured (any head size, ratio, page size)."""
    return device.type == "cuda" and dtype in _DTYPES and not config.is_mla


def _decode_rows(ctx: ForwardContext, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables (`decode_tables`), context lengths and their max."""
    lens = [ctx.seqs[i].context_len for i in rows]
    return decode_tables(ctx, rows), torch.tensor(lens, dtype=torch.int32, device=ctx.positions.device), max(lens)


def attend(attn, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Attention of every token of the step for the GQAttention ``attn`` (its keys and values
    already written to the cache): q (N, H, D) -> (N, H, D)."""
    cache = ctx.cache.latent[attn.layer]
    paged = cache.view(ctx.cache.num_blocks, ctx.cache.block_size, -1)
    sinks = getattr(attn, "sinks", None)
    if ctx.decode is not None:  # all single-token decodes, token i = request i
        meta = ctx.decode
        return gqa_decode(q, paged, meta.block_tables, meta.context_lens, attn.scale, meta.max_context,
                          window=attn.window, sinks=sinks)
    out = torch.empty_like(q)
    decode = [i for i, s in enumerate(ctx.seqs) if s.q_len == 1]
    if decode:
        table, lens, longest = _decode_rows(ctx, decode)
        rows = torch.tensor([ctx.seqs[i].start for i in decode], device=q.device)
        out[rows] = gqa_decode(q[rows], paged, table, lens, attn.scale, longest, window=attn.window, sinks=sinks)
    for seq in ctx.seqs:
        if seq.q_len > 1:
            rows = slice(seq.start, seq.start + seq.q_len)
            out[rows] = attn.attend_request(q[rows], cache[seq.slots], seq).to(q.dtype)
    return out
