"""Multi-head Latent Attention (MLA) with the optional DSA lightning indexer (plain PyTorch).

Per token the cache holds the normalised latent ``c_kv`` (kv_lora_rank) and the roped shared key
``k_pe`` (qk_rope_head_dim). Two equivalent forms read it:
- prefill (``q_len > 1``): expand every cached latent through ``kv_b_proj`` into per-head keys and
  values and run ordinary attention (cheap per query when many queries share the expansion);
- decode (``q_len == 1``): the absorbed form — fold ``W_uk`` into the query and ``W_uv`` into the
  output, so attention runs directly over the 576-wide latents (MQA with one shared KV head).

DSA: the indexer scores every causal key ``t`` for query ``i`` as
``sum_h w[i,h] * relu(q[i,h] . k[t]) * (d^-1/2 * H^-1/2)`` and keeps the top ``index_topk``;
attention then only sees those keys. IndexCache "shared" layers reuse the selection of the last
layer that ran its indexer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext, SeqSlice
from hearth.engine.models.dsa_kernels import RopeTable, rope_rows
from hearth.engine.models.layers import (
    LayerNorm,
    RMSNorm,
    Rotary,
    apply_rotary,
    dense_weight,
    fp8_round_trip,
    hadamard_matrix,
)
from hearth.kernels.fused import mla_latent_write, rope_
from hearth.kernels.indexer import PREFILL_LOGITS_BUDGET

_SCORE_BUDGET = 1 << 26  # fp32 elements of [queries, heads, keys] scored at once
# A prefill selection holds per (query, key) pair its fp32 score, the causal mask and the stable sort's
# fp32 values and int64 indices; a chunk's queries are selected in blocks of rows holding at most
# _SELECT_BUDGET bytes of these (the kernel path's logits budget).
SELECT_BYTES_PER_PAIR = 4 + 1 + 4 + 8
_SELECT_BUDGET = PREFILL_LOGITS_BUDGET


@dataclass(frozen=True)
class AttentionPaths:
    """How the MLA layers run, fixed when the model is built (``ModelRunner`` decides it).

    use_kernels: the Triton sparse MLA + indexer kernels (CUDA, bf16, the kernels' shapes; the
        cache then holds FP8 indexer keys). mli: Multi-layer Indexer (see ``_selections``).
    """

    use_kernels: bool = False
    mli: bool = False


PLAIN_ATTENTION = AttentionPaths()  # the plain-PyTorch path, every layer its own indexer

class Indexer(nn.Module):
    """The DSA lightning indexer of one layer (HF names: wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, config: ModelConfig, faithful: bool, kernel_rope: RopeTable | None = None) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleaved = config.indexer_rope_interleave
        self.faithful = faithful
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.kernel_rope = kernel_rope  # the kernels' rope table, when the Triton kernels run this layer

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The indexer's rope dims come first in its head (MLA puts them last).
        x_rot, x_pass = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rotary(x_rot, cos, sin, self.interleaved), x_pass), dim=-1)

    def _faithful(self, x: torch.Tensor) -> torch.Tensor:
        """Hadamard then FP8 (ue8m0) round trip, as the official inference code scores."""
        if not self.faithful:
            return x
        h = hadamard_matrix(self.head_dim, x.device)
        return fp8_round_trip((x.float() @ h).to(x.dtype), block=min(128, self.head_dim))

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext, layer: int) -> list[torch.Tensor]:
        """Write this step's keys, then return per request the top-k (q_len, k) int64 logical
        positions (-1 where a query has fewer than k causal keys)."""
        if self.kernel_rope is not None:
            from hearth.engine.models.dsa_kernels import indexer_select

            return indexer_select(self, x, q_resid, ctx, layer, self.kernel_rope)
        n = x.shape[0]
        q = self.wq_b(q_resid).view(n, self.n_heads, self.head_dim)  # (N, H, D)
        q = self._faithful(self._rope(q, cos, sin))
        k = self._faithful(self._rope(self.k_norm(self.wk(x)), cos, sin))  # (N, D)
        w = self.weights_proj(x.float()).float() * self.scale  # (N, H)
        if ctx.cache.key_tiers is not None:
            return [self._select_tiered(q[s.start:s.start + s.q_len], w[s.start:s.start + s.q_len],
                                        k[s.start:s.start + s.q_len], s, ctx.cache.key_tiers.get(s.seq_id, layer))
                    for s in ctx.seqs]
        keys = ctx.cache.index_keys[layer]
        keys[ctx.slot_mapping] = k.to(keys.dtype)
        return [self._select(q[s.start:s.start + s.q_len], w[s.start:s.start + s.q_len], keys[s.slots], s)
                for s in ctx.seqs]

    def _select_tiered(self, q, w, k_new, seq: SeqSlice, tiers) -> torch.Tensor:
        """Keys in host/device tiers (hearth.offload.tiered_keys): decode selects coarse-to-fine,
        a prefill chunk scores the whole history read back from the tiers."""
        if tiers.num_tokens != seq.first_position:
            raise RuntimeError(f"tiered keys of request {seq.seq_id} hold {tiers.num_tokens} tokens, "
                               f"the step starts at position {seq.first_position}")
        tiers.append(k_new.to(torch.float32 if tiers.config.key_format == "fp32" else torch.bfloat16))
        if seq.q_len == 1:
            return tiers.select(q[0].float(), w[0])
        k_all, _ = tiers.read(torch.arange(seq.context_len, device=q.device))
        return self._select(q, w, k_all, seq)

    def _select(self, q: torch.Tensor, w: torch.Tensor, k_all: torch.Tensor, seq: SeqSlice) -> torch.Tensor:
        """Exact top-k of the request's queries q (q_len, H, D) over its keys k_all (T, D). A chunk whose
        selection would hold more than _SELECT_BUDGET bytes runs in blocks of query rows (a multiple of
        the rows scored per einsum when at least that many fit), each row's selection as in one block."""
        k_all = k_all.float()
        qf = q.float()
        chunk = max(1, _SCORE_BUDGET // max(1, self.n_heads * seq.context_len))  # queries per einsum
        k = min(self.topk, seq.context_len)
        n_q = q.shape[0]
        rows = max(1, _SELECT_BUDGET // max(1, seq.context_len * SELECT_BYTES_PER_PAIR))
        if rows >= n_q:
            return _select_rows(qf, w, k_all, seq.first_position, chunk, k)
        if rows >= chunk:
            rows -= rows % chunk  # each block's einsums over the rows the whole chunk's would take
        out = torch.empty(n_q, k, dtype=torch.long, device=q.device)
        for a in range(0, n_q, rows):
            out[a:a + rows] = _select_rows(qf[a:a + rows], w[a:a + rows], k_all, seq.first_position + a, chunk, k)
        return out


def _select_rows(qf: torch.Tensor, w: torch.Tensor, k_all: torch.Tensor, first: int, chunk: int,
                 k: int) -> torch.Tensor:
    """(n, k) int64 top-k positions of the queries qf (n, H, D) fp32 at positions first.. (weights w (n, H))
    over the keys k_all (T, D) fp32, -1 where a query has fewer than k causal keys; scored ``chunk`` queries
    per einsum."""
    scores = torch.cat([
        torch.einsum("qhd,td->qht", qf[i:i + chunk], k_all).relu_().mul_(w[i:i + chunk, :, None]).sum(1)
        for i in range(0, qf.shape[0], chunk)
    ])  # (n, T)
    q_pos = torch.arange(first, first + qf.shape[0], device=scores.device)
    causal = torch.arange(k_all.shape[0], device=scores.device)[None, :] <= q_pos[:, None]
    scores.masked_fill_(~causal, float("-inf"))
    # NOTE: ReLU makes exact ties (often at 0) common; a stable sort breaks them toward earlier
    # positions so chunked prefill, decode and one-shot prefill select the same keys.
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    valid = torch.gather(causal, 1, idx)
    return torch.where(valid, idx, torch.full_like(idx, -1))


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream MLI indexers run on, one per device (creating one per layer and step costs)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _causal_mask(seq: SeqSlice, device: torch.device) -> torch.Tensor:
    """(q_len, context_len) bool: query i (position first+i) may see key t iff t <= first+i."""
    q_pos = torch.arange(seq.first_position, seq.context_len, device=device)
    return torch.arange(seq.context_len, device=device)[None, :] <= q_pos[:, None]


def _selection_mask(selection: torch.Tensor, seq: SeqSlice) -> torch.Tensor:
    """(q_len, context_len) bool of the selected keys (causal by construction)."""
    mask = torch.zeros(seq.q_len, seq.context_len + 1, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, torch.where(selection < 0, seq.context_len, selection), True)
    return mask[:, :-1] & _causal_mask(seq, selection.device)


class MLAttention(nn.Module):
    """MLA (+ DSA) of one layer. Checkpoint names: q_proj | q_a_proj, q_a_layernorm, q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, indexer.*"""

    def __init__(self, config: ModelConfig, layer: int, faithful: bool = False,
                 paths: AttentionPaths = PLAIN_ATTENTION) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.scale = config.softmax_scale
        self.rope_interleave = config.rope_interleave
        self.faithful = faithful
        self.uses_dsa = config.has_indexer
        qk = config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6, use_kernel=paths.use_kernels and self.uses_dsa)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, config.hidden_size, bias=False)
        self.rotary = Rotary(config.rope, self.rope_dim)
        self.use_kernels = paths.use_kernels and self.uses_dsa
        self.mli = paths.mli
        # The kernels' cos/sin tables (indexer and MLA rope); None on the plain path
        self.rope_table = RopeTable(self.rotary) if self.use_kernels else None
        self.indexer = Indexer(config, faithful, self.rope_table) if config.runs_indexer(layer) else None
        # Force a form for tests: None = absorbed for single-token queries, expanded otherwise.
        self.force_absorbed: bool | None = None
        # MLI on CUDA: the side stream this layer's indexer runs on, joined before the output projection.
        self._pending_side: torch.cuda.Stream | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: (N, hidden) normalised hidden states of the step's flat batch -> (N, hidden)."""
        n = x.shape[0]
        tables, cos, sin = None, None, None
        if self.rope_table is not None:  # the kernels read cos/sin rows by position
            tables = self.rope_table.get(rope_rows(ctx), x.device)
        else:
            cos, sin = self.rotary.cos_sin(ctx.positions)
        if hasattr(self, "q_proj"):
            q_resid = None
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(n, self.n_heads, self.nope + self.rope_dim)
        if tables is not None:  # kernel path: q_pe roped straight into the tail of the absorbed query
            # (q_pe names the whole (N, H, 576) buffer here: sparse_attention fills its head with q_nope W_uk)
            q_nope = q[..., :self.nope]
            q_pe = torch.empty(n, self.n_heads, self.kv_lora + self.rope_dim, dtype=q.dtype, device=q.device)
            rope_(q, ctx.positions, *tables, self.nope, self.rope_dim, self.rope_interleave,
                  out=q_pe[..., self.kv_lora:])
        else:
            q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
            q_pe = apply_rotary(q_pe, cos, sin, self.rope_interleave)
        kv_a = self.kv_a_proj_with_mqa(x)
        if tables is not None and not self.faithful and ctx.cache.latent_tiers is None:
            # norm + rope + paged-cache write in one kernel (tiered latents go to each request's tiers)
            mla_latent_write(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, ctx.positions, *tables,
                             self.rope_interleave, ctx.slot_mapping, ctx.cache.latent[self.layer])
        else:
            if tables is not None:
                cos, sin = (t[ctx.positions] for t in tables)
            kv, k_pe = kv_a.split([self.kv_lora, self.rope_dim], dim=-1)
            kv = self.kv_a_layernorm(kv)
            if self.faithful:
                kv = fp8_round_trip(kv, block=min(128, self.kv_lora))
            k_pe = apply_rotary(k_pe, cos, sin, self.rope_interleave)
            self._write_latents(torch.cat((kv, k_pe), dim=-1), ctx)

        selections = self._selections(x, q_resid, cos, sin, ctx)
        side = self._pending_side
        if tables is not None:  # (the kernel path runs DSA layers only: selections are set)
            from hearth.engine.models.dsa_kernels import sparse_attention

            out = sparse_attention(self, q_nope, q_pe, ctx, selections).to(x.dtype)
            return self._finish(out, side, x)
        out = torch.empty(n, self.n_heads, self.v_dim, dtype=x.dtype, device=x.device)
        for i, seq in enumerate(ctx.seqs):
            rows = slice(seq.start, seq.start + seq.q_len)
            latents, mask = self._latents(seq, None if selections is None else selections[i], ctx)
            absorbed = seq.q_len == 1 if self.force_absorbed is None else self.force_absorbed
            attend = self._attend_absorbed if absorbed else self._attend_expanded
            out[rows] = attend(q_nope[rows], q_pe[rows], latents, mask).to(x.dtype)
        return self._finish(out, side, x)

    def _write_latents(self, rows: torch.Tensor, ctx: ForwardContext) -> None:
        """This step's latent rows (N, kv_lora + rope) into the paged cache or the request tiers."""
        tiers = ctx.cache.latent_tiers
        if tiers is None:
            cache = ctx.cache.latent[self.layer]
            cache[ctx.slot_mapping] = rows.to(cache.dtype)
            return
        for seq in ctx.seqs:
            tier = tiers.get(seq.seq_id, self.layer)
            if tiers.planned and seq.q_len == 1:  # the kernel path's decode row: launches only (capturable)
                tier.decode_append(rows[seq.start:seq.start + 1], ctx.positions[seq.start:seq.start + 1])
                continue
            if tier.num_tokens != seq.first_position:
                raise RuntimeError(f"latent tiers of request {seq.seq_id} hold {tier.num_tokens} tokens, "
                                   f"the step starts at position {seq.first_position}")
            tier.append(rows[seq.start:seq.start + seq.q_len].to(tiers.config.dtype))

    def _latents(self, seq: SeqSlice, selection: torch.Tensor | None,
                 ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (R, kv_lora + rope), mask (q_len, R)) the request's queries attend over: its whole
        history, or with tiered latents in decode only the rows its selection names."""
        tiers = ctx.cache.latent_tiers
        device = ctx.positions.device
        if tiers is None:
            rows = ctx.cache.latent[self.layer][seq.slots]
        elif seq.q_len == 1 and selection is not None:
            rows, positions = tiers.get(seq.seq_id, self.layer).gather(selection[0])  # (k, W), (k,)
            return rows, (positions >= 0)[None, :]
        else:
            rows = tiers.get(seq.seq_id, self.layer).read(torch.arange(seq.context_len, device=device))
        mask = _causal_mask(seq, device) if selection is None else _selection_mask(selection, seq)
        return rows, mask

    def _finish(self, out: torch.Tensor, side: torch.cuda.Stream | None, x: torch.Tensor) -> torch.Tensor:
        if side is not None:  # the next layer reads this layer's selection: join the side stream
            torch.cuda.current_stream(x.device).wait_stream(side)
            self._pending_side = None
        return self.o_proj(out.flatten(1))

    def _selections(self, x, q_resid, cos, sin, ctx: ForwardContext) -> list[torch.Tensor] | None:
        """Top-k per request for this layer's attention.

        Plain DSA: this layer's own indexer, or (IndexCache "shared" layers) the last full layer's.
        MLI: an indexer layer attends the previous indexer layer's selection while its own indexer
        (independent of this layer's attention, so it can run concurrently on a side stream)
        feeds the layers after it; the first indexer layer has no predecessor and uses its own.
        """
        if not self.uses_dsa:
            return None
        previous = [ctx.selections[i] for i in range(len(ctx.seqs))] if len(ctx.selections) == len(ctx.seqs) \
            else None
        if self.indexer is None:
            if previous is None:
                raise RuntimeError(f"layer {self.layer} shares top-k but no earlier layer ran an indexer")
            return previous
        if self.mli and previous is not None and x.is_cuda:
            side = _side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                chosen = self.indexer(x, q_resid, cos, sin, ctx, self.layer)
            self._pending_side = side  # joined in _finish, before the output projection
        else:
            chosen = self.indexer(x, q_resid, cos, sin, ctx, self.layer)
        ctx.selections = dict(enumerate(chosen))
        return previous if self.mli and previous is not None else chosen

    def _kv_b(self) -> torch.Tensor:
        return dense_weight(self.kv_b_proj).view(self.n_heads, self.nope + self.v_dim, self.kv_lora)

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1)

    def _attend_expanded(self, q_nope, q_pe, latents, mask) -> torch.Tensor:
        """Expanded heads. q_nope (q, H, nope), q_pe (q, H, rope), latents (T, 576) -> (q, H, v)."""
        w = self._kv_b().float()
        c_kv, k_pe = latents.float().split([self.kv_lora, self.rope_dim], dim=-1)
        k_nope = torch.einsum("tc,hdc->thd", c_kv, w[:, :self.nope])  # (T, H, nope)
        v = torch.einsum("tc,hdc->thd", c_kv, w[:, self.nope:])  # (T, H, v)
        scores = torch.einsum("qhd,thd->hqt", q_nope.float(), k_nope)
        scores += torch.einsum("qhr,tr->hqt", q_pe.float(), k_pe)
        probs = self._softmax(scores * self.scale, mask[None])  # (H, q, T)
        return torch.einsum("hqt,thd->qhd", probs, v)

    def _attend_absorbed(self, q_nope, q_pe, latents, mask) -> torch.Tensor:
        """Absorbed form over the latent cache: scores = (q_nope W_uk) . c_kv + q_pe . k_pe."""
        w = self._kv_b().float()
        c_kv, k_pe = latents.float().split([self.kv_lora, self.rope_dim], dim=-1)
        q_abs = torch.einsum("qhd,hdc->qhc", q_nope.float(), w[:, :self.nope])  # (q, H, kv_lora)
        scores = torch.einsum("qhc,tc->hqt", q_abs, c_kv) + torch.einsum("qhr,tr->hqt", q_pe.float(), k_pe)
        probs = self._softmax(scores * self.scale, mask[None])  # (H, q, T)
        o_lat = torch.einsum("hqt,tc->qhc", probs, c_kv)  # (q, H, kv_lora)
        return torch.einsum("qhc,hdc->qhd", o_lat, w[:, self.nope:])
