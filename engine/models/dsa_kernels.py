"""DeepSeek Sparse Attention on the GPU through Hearth's Triton kernels (hearth.kernels).

Used for DSA layers when the model runs on CUDA in bf16 with the kernels' shapes (indexer head
dim 128, 576-wide latents, a power-of-two number of indexer heads >= 16, power-of-two pages >= 16):
- indexer keys are written by the fused rope + FP8 (ue8m0) kernel into the 132-byte paged cache;
- queries are FP8-quantised per (token, head) with their scale folded into the head weights;
- decode requests are scored together (paged lightning indexer + radix top-k, no host sync);
  prefill chunks request by request;
- attention runs the sparse MLA kernels in the absorbed form over the bf16 latent cache.
With tiered keys / latents (``hearth.offload.planned_tiers``) each request's keys are written into its
device ring and a decode step selects coarse-to-fine, and attention reads the request's latent ring +
cache, misses copied from pinned host memory, all by kernels without a host sync; prefill chunks run
the prefill kernels over the request's history streamed through the runner's two history buffers
(``hearth.engine.tiers.PrefillHistories``), or read back into a temporary buffer when it does not fit.
The plain-PyTorch path in mla.py stays the reference; both select with the same semantics (ties
may resolve differently).
"""

from __future__ import annotations

from functools import partial

import torch

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext, SeqSlice, decode_tables
from hearth.engine.models.layers import hadamard_matrix
from hearth.kernels.fused import indexer_q_fp8, rope_
from hearth.kernels.indexer import indexer_decode_topk, indexer_k_cache_write, indexer_prefill_topk
from hearth.kernels.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from hearth.offload.planned_tiers import PlannedKeys

INDEX_BYTES_PER_TOKEN = 132  # 128 e4m3 + one fp32 scale


def kernels_apply(config: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton DSA kernels can run this model as configured."""
    heads = config.index_n_heads or 0
    return (
        device.type == "cuda" and dtype == torch.bfloat16 and config.has_indexer
        and config.index_head_dim == 128 and config.latent_dim == 576 and config.qk_rope_head_dim <= 128
        and heads >= 16 and heads & (heads - 1) == 0 and block_size >= 16 and block_size & (block_size - 1) == 0
    )


class RopeTable:
    """fp32 cos/sin tables [max_pos, R/2] for the cache-write kernel, grown on demand."""

    def __init__(self, rotary) -> None:
        self.rotary = rotary
        self.cos = self.sin = None

    def get(self, needed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < needed:
            size = max(needed, 2 * (0 if self.cos is None else self.cos.shape[0]), 4096)
            cos, sin = self.rotary.cos_sin(torch.arange(size, device=device))
            self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        return self.cos, self.sin


def rope_rows(ctx: ForwardContext) -> int:
    """Rows the step's rope tables need (largest position + 1), known on the host (no sync)."""
    if ctx.decode is not None:
        return ctx.decode.max_context
    return max(s.context_len for s in ctx.seqs)


def indexer_select(indexer, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext, layer: int,
                   rope_table: RopeTable) -> list[torch.Tensor]:
    """Kernel version of Indexer.forward: write keys, score, select. Returns per request (q_len, k)
    int64 logical positions, -1 padded."""
    n = x.shape[0]
    cache = ctx.cache.index_keys[layer]
    bs = ctx.cache.block_size
    k_raw = indexer.k_norm(indexer.wk(x)).contiguous()  # (N, 128), rope applied inside the kernel
    table_cos, table_sin = rope_table.get(rope_rows(ctx), x.device)
    write = partial(indexer_k_cache_write, cos=table_cos, sin=table_sin, rope_interleaved=indexer.interleaved,
                    hadamard=indexer.faithful)
    if ctx.cache.key_tiers is None:  # tiered keys are written per request, into the request's tiers
        write(k_raw, ctx.slot_mapping, cache, bs, positions=ctx.positions)
    q = indexer.wq_b(q_resid).view(n, indexer.n_heads, indexer.head_dim)
    raw_w = indexer.weights_proj(x.float())  # (N, H) fp32
    if indexer.faithful:  # rope, then the reference's Hadamard rotation (keys get it inside the write kernel)
        q = rope_(q, ctx.positions, table_cos, table_sin, 0, indexer.rope_dim, indexer.interleaved)
        q = (q.float() @ hadamard_matrix(indexer.head_dim, q.device)).to(q.dtype)
        q8, w = indexer_q_fp8(q, raw_w, indexer.scale)
    else:  # rope + FP8 quantisation + the weights fold in one kernel
        q8, w = indexer_q_fp8(q, raw_w, indexer.scale, ctx.positions, table_cos, table_sin, indexer.interleaved)
    if ctx.cache.key_tiers is not None:
        return [_select_tiered(indexer.topk, k_raw, q8, w, ctx, seq, layer, ctx.cache.key_tiers.get(seq.seq_id, layer),
                               write) for seq in ctx.seqs]
    if ctx.decode is not None:  # all single-token decodes, token i = request i: no per-request work
        meta = ctx.decode
        picked = indexer_decode_topk(q8.unsqueeze(1), w.unsqueeze(1), cache, meta.block_tables, meta.context_lens,
                                     bs, indexer.topk)  # (B, 1, k) int32
        return list(picked.unbind(0))
    out: list[torch.Tensor | None] = [None] * len(ctx.seqs)
    decode = [i for i, s in enumerate(ctx.seqs) if s.q_len == 1]
    if decode:
        rows = torch.tensor([ctx.seqs[i].start for i in decode], device=x.device)
        lens = torch.tensor([ctx.seqs[i].context_len for i in decode], dtype=torch.int32, device=x.device)
        picked = indexer_decode_topk(q8[rows].unsqueeze(1).contiguous(), w[rows].unsqueeze(1).contiguous(), cache,
                                     decode_tables(ctx, decode), lens, bs, indexer.topk)  # (B, 1, k)
        for r, i in enumerate(decode):
            out[i] = picked[r].long()
    for i, seq in enumerate(ctx.seqs):
        if seq.q_len == 1:
            continue
        rows = slice(seq.start, seq.start + seq.q_len)
        out[i] = indexer_prefill_topk(q8[rows].contiguous(), w[rows].contiguous(), cache, seq.block_table,
                                      seq.context_len, bs, indexer.topk).long()
    return out


def _decode_context_len(ctx: ForwardContext, seq: SeqSlice) -> torch.Tensor:
    """(1,) int32 context length of a decode token on the device (no host value: the same launch
    serves every step of a captured graph): a view of the step's decode lengths when every request
    decodes (token i = request i; no launch), else from the token's position."""
    if ctx.decode is not None:
        return ctx.decode.context_lens[seq.start:seq.start + 1]
    return (ctx.positions[seq.start:seq.start + 1] + 1).to(torch.int32)


def _select_tiered(topk: int, k_raw: torch.Tensor, q8: torch.Tensor, w: torch.Tensor, ctx: ForwardContext,
                   seq: SeqSlice, layer: int, tiers: PlannedKeys, write) -> torch.Tensor:
    """One request's keys into its tiers and its selection: a decode token (its host phase done before
    the step, ``hearth.engine.tiers.DecodeTiers.prepare``) goes to the device ring and selects
    coarse-to-fine, launches only, so a CUDA graph can capture it; a prefill chunk scores its history
    (the streamed buffer, else read back), the chunk's keys written into it."""
    rows = slice(seq.start, seq.start + seq.q_len)
    positions, bs, dev = ctx.positions[rows], ctx.cache.block_size, q8.device
    if seq.q_len == 1:
        tiers.decode_write(k_raw[rows], positions, write)
        return tiers.select(q8[seq.start], w[seq.start], _decode_context_len(ctx, seq))
    if tiers.num_tokens != seq.first_position:
        raise RuntimeError(f"tiered keys of request {seq.seq_id} hold {tiers.num_tokens} tokens, "
                           f"the step starts at position {seq.first_position}")
    history = None if ctx.cache.histories is None else ctx.cache.histories.keys(ctx, layer, seq)
    if history is None:
        history = tiers.history(seq.q_len)
    write(k_raw[rows], positions, history, bs, positions=positions)
    table = torch.arange(history.shape[0], dtype=torch.int32, device=dev)
    picked = indexer_prefill_topk(q8[rows].contiguous(), w[rows].contiguous(), history, table, seq.context_len, bs,
                                  topk)
    tiers.commit_chunk(history, seq.q_len)
    return picked.long()


def _attend_tiered(attn, q: torch.Tensor, ctx: ForwardContext, selections: list[torch.Tensor]) -> torch.Tensor:
    """Absorbed sparse MLA per request over its tiered latents: (N, H, 512) latent outputs."""
    out_lat = torch.empty(q.shape[0], q.shape[1], attn.kv_lora, dtype=torch.bfloat16, device=q.device)
    for seq, selection in zip(ctx.seqs, selections):
        tiers = ctx.cache.latent_tiers.get(seq.seq_id, attn.layer)
        rows = slice(seq.start, seq.start + seq.q_len)
        if seq.q_len == 1:
            slots = tiers.slots(selection.view(-1), _decode_context_len(ctx, seq))
            out_lat[rows], _ = sparse_mla_decode(q[rows], tiers.paged(), slots[None], tiers.table, tiers.lens,
                                                 attn.scale)
            continue
        history = None if ctx.cache.histories is None else ctx.cache.histories.latents(ctx, attn.layer, seq)
        if history is None:
            history = tiers.history()
        table = torch.arange(history.shape[0], dtype=torch.int32, device=q.device)
        out_lat[rows], _ = sparse_mla_prefill(q[rows], history, selection.to(torch.int32).contiguous(), table,
                                              ctx.positions[rows].to(torch.int32), attn.scale)
    return out_lat


def sparse_attention(attn, q_nope: torch.Tensor, q: torch.Tensor, ctx: ForwardContext,
                     selections: list[torch.Tensor]) -> torch.Tensor:
    """Absorbed sparse MLA for every request of the step: (N, H, v_head_dim). q (N, H, 576) bf16
    holds the roped q_pe in its last dims; q_nope (N, H, nope) absorbed through W_uk fills the rest."""
    w = attn._kv_b()  # (H, nope + v, kv_lora)
    # q_abs = q_nope W_uk written into q's head (no concatenation): (H, N, nope) @ (H, nope, 512)
    torch.bmm(q_nope.transpose(0, 1), w[:, : attn.nope], out=q[..., : attn.kv_lora].transpose(0, 1))
    if ctx.cache.latent_tiers is not None:
        out_lat = _attend_tiered(attn, q, ctx, selections)
        return torch.einsum("nhc,hdc->nhd", out_lat.to(w.dtype), w[:, attn.nope:])
    latents = ctx.cache.latent[attn.layer].view(ctx.cache.num_blocks, ctx.cache.block_size, -1)
    if ctx.decode is not None:  # all single-token decodes: one launch, selections stacked as they are
        meta = ctx.decode
        idx = stacked_selections(selections).to(torch.int32)  # (B, k)
        out_lat, _ = sparse_mla_decode(q, latents, idx, meta.block_tables, meta.context_lens, attn.scale)
        return torch.einsum("nhc,hdc->nhd", out_lat.to(w.dtype), w[:, attn.nope:])
    out_lat = torch.empty(q.shape[0], q.shape[1], attn.kv_lora, dtype=torch.bfloat16, device=q.device)
    decode = [i for i, s in enumerate(ctx.seqs) if s.q_len == 1]
    if decode:
        rows = torch.tensor([ctx.seqs[i].start for i in decode], device=q.device)
        lens = torch.tensor([ctx.seqs[i].context_len for i in decode], dtype=torch.int32, device=q.device)
        idx = _pad_indices([selections[i].view(-1) for i in decode]).to(torch.int32)
        o, _ = sparse_mla_decode(q[rows].contiguous(), latents, idx, decode_tables(ctx, decode), lens, attn.scale)
        out_lat[rows] = o
    for i, seq in enumerate(ctx.seqs):
        if seq.q_len == 1:
            continue
        rows = slice(seq.start, seq.start + seq.q_len)
        positions = ctx.positions[rows].to(torch.int32)
        o, _ = sparse_mla_prefill(q[rows].contiguous(), latents, selections[i].to(torch.int32).contiguous(),
                                  seq.block_table, positions, attn.scale)
        out_lat[rows] = o
    return torch.einsum("nhc,hdc->nhd", out_lat.to(w.dtype), w[:, attn.nope:])


def _pad_indices(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def stacked_selections(selections: list[torch.Tensor]) -> torch.Tensor:
    """The decode selections (each k contiguous values) as one (B, k) tensor: a view when they are
    evenly spaced rows of one buffer (the indexer's output, the piecewise selection buffer), else a copy."""
    first = selections[0]
    k = first.numel()
    step = selections[1].storage_offset() - first.storage_offset() if len(selections) > 1 else k
    rows = step >= k and all(
        s.numel() == k and s.is_contiguous() and s.dtype == first.dtype
        and s.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and s.storage_offset() == first.storage_offset() + i * step for i, s in enumerate(selections))
    if rows:
        return first.as_strided((len(selections), k), (step, 1), first.storage_offset())
    return torch.stack([s.view(-1) for s in selections])
