"""The training forward: Hearth's own ``DeepseekForCausalLM`` over a whole [B, T] batch at once.

``model(input_ids, ctx)`` (the engine's path) runs attention and the indexer per request and the
experts one at a time, with host syncs: right for serving, slow for training. ``batched_forward``
computes the same function for B whole sequences (positions 0..T-1) from the same modules and
parameters, with no per-request or per-expert Python and no host syncs:

- embedding, RMSNorms, the rotary/YaRN tables, every projection and the final norm + ``lm_head``
  are the model's modules, called on the flat (B*T, ...) batch;
- MLA in the expanded form (``kv_b_proj`` expands the normalised latents into per-head keys and
  values), as ``MLAttention._attend_expanded`` does for a prefill, through
  ``scaled_dot_product_attention`` with the causal mask combined with the DSA top-k mask;
- DSA: each indexer layer scores every causal key (``train.indexer_loss.indexer_scores``), keeps the
  top ``indexer.topk`` with the inference path's tie rule (stable sort: earlier positions first),
  IndexCache "shared" layers reuse the last selection. When ``topk`` covers the context (the dense
  warm-up) the selection is all causal keys, so scoring is skipped and attention is plain causal;
- MoE: the router is the model's ``Gate`` (sigmoid scores, ``noaux_tc`` choice with
  ``e_score_correction_bias``, group limit, normalisation, scaling). The routed experts' weights are
  stacked and every expert runs on every token as two GEMMs; the routing weights (zero for experts
  a token did not choose) scale the SwiGLU activations before the stacked down projection, so the
  output and the gradients (experts, and the router through the chosen experts' weights) equal the
  per-expert path's. With 8 small experts this wastes FLOPs (x E/K on the routed experts) on a GPU
  that has plenty and saves the sort, the gathers and the host sync of a grouped dispatch. On a
  CPU, FLOPs are what counts, so there the MoE module's own forward runs (``experts="module"``).

Optional training-only extras: residual dropout, and the indexer KL objective on the first
``kl_seqs`` sequences. ``tests/test_train_batched.py`` checks logits and gradients against the
``ForwardContext`` path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hearth.engine.models.deepseek import DecoderLayer, DeepseekForCausalLM, MoE
from hearth.engine.models.layers import apply_rotary, dense_weight
from hearth.engine.models.mla import MLAttention
from train.indexer_loss import attention_target, indexer_kl, indexer_scores


@dataclass
class ForwardOut:
    logits: torch.Tensor  # (B, T, vocab) fp32 (bf16 under autocast)
    indexer_kl: torch.Tensor  # scalar: mean over indexer layers (0 when kl_seqs is 0)
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> (E,) routed tokens


@dataclass
class _Batch:
    """Per-forward constants shared by the layers."""

    size: int  # B
    length: int  # T
    cos: torch.Tensor  # (B*T, rope/2)
    sin: torch.Tensor
    causal: torch.Tensor  # (T, T) bool: key t visible to query i iff t <= i
    kl_seqs: int
    dropout: float
    stacked_experts: bool
    indexed: bool = False  # an indexer layer has run (IndexCache "shared" layers reuse its selection)
    selection: torch.Tensor | None = None  # (B, T, T) bool of the last indexer layer; None: causal
    kl: list[torch.Tensor] = field(default_factory=list)


def batched_forward(model: DeepseekForCausalLM, input_ids: torch.Tensor, kl_seqs: int = 0,
                    dropout: float = 0.0, experts: str = "auto") -> ForwardOut:
    """Logits (B, T, vocab) of B whole sequences input_ids (B, T) int64 at positions 0..T-1.

    kl_seqs: the indexer KL objective over the first kl_seqs sequences (0: not computed).
    dropout: residual dropout on the embedding and each attention / FFN output (only in train mode).
    experts: "stacked" (every expert on every token, sync-free: for GPUs), "module" (the MoE
    module's own forward: the chosen tokens of one expert at a time, a host sync per layer; fewer
    FLOPs, so faster on a CPU) or "auto" (stacked on CUDA, module elsewhere).
    """
    if experts == "auto":
        experts = "stacked" if input_ids.is_cuda else "module"
    if experts not in ("stacked", "module"):
        raise ValueError(f"experts must be 'stacked', 'module' or 'auto', not {experts!r}")
    batch, length = input_ids.shape
    device = input_ids.device
    positions = torch.arange(length, device=device).repeat(batch)  # (B*T,)
    rotary = next((l.self_attn.rotary for l in model.layers if isinstance(l.self_attn, MLAttention)), None)
    if rotary is None:
        raise ValueError("batched_forward runs MLA models (the DeepSeek-V3.2 family)")
    cos, sin = rotary.cos_sin(positions)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    ctx = _Batch(batch, length, cos, sin, causal, min(kl_seqs, batch), dropout if model.training else 0.0,
                 experts == "stacked")
    counts: dict[int, torch.Tensor] = {}
    hidden = _drop(model.embed(input_ids.flatten()), ctx)  # (B*T, D)
    for layer in model.layers:
        hidden = _layer(layer, hidden, ctx, counts)
    logits = model.logits(hidden).view(batch, length, -1)
    kl = torch.stack(ctx.kl).mean() if ctx.kl else torch.zeros((), device=device)
    return ForwardOut(logits, kl, counts)


def _drop(x: torch.Tensor, ctx: _Batch) -> torch.Tensor:
    return F.dropout(x, ctx.dropout, training=True) if ctx.dropout > 0 else x


def _layer(layer: DecoderLayer, hidden: torch.Tensor, ctx: _Batch, counts: dict[int, torch.Tensor]) -> torch.Tensor:
    hidden = hidden + _drop(_attention(layer.self_attn, layer.input_layernorm(hidden), ctx), ctx)
    normed = layer.post_attention_layernorm(hidden)
    if not layer.is_moe:
        ffn = layer.mlp(normed)
    elif ctx.stacked_experts:
        ffn = _stacked_moe(layer.mlp, normed, counts)
    else:
        ids, weights = _route(layer.mlp, normed)
        counts[layer.layer] = _counts(ids, len(layer.mlp.experts))
        ffn = layer.mlp(normed, ids, weights)
    return hidden + _drop(ffn, ctx)


def _attention(attn: MLAttention, x: torch.Tensor, ctx: _Batch) -> torch.Tensor:
    """MLAttention.forward for whole sequences: x (B*T, D) normalised -> (B*T, D)."""
    if attn.faithful or attn.mli:
        raise ValueError("batched_forward does not model the faithful FP8 or Multi-layer Indexer modes")
    b, t, n = ctx.size, ctx.length, x.shape[0]
    h, nope, rope, v_dim = attn.n_heads, attn.nope, attn.rope_dim, attn.v_dim
    if hasattr(attn, "q_proj"):
        q_resid = None
        q = attn.q_proj(x)
    else:
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid)
    q = q.view(n, h, nope + rope)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_pe = apply_rotary(q_pe, ctx.cos, ctx.sin, attn.rope_interleave)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora, rope], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv)
    k_pe = apply_rotary(k_pe, ctx.cos, ctx.sin, attn.rope_interleave)  # (N, rope), shared by the heads
    kv = F.linear(c_kv, dense_weight(attn.kv_b_proj)).view(n, h, nope + v_dim)  # the expanded form
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    q_full = torch.cat((q_nope, q_pe.to(q_nope.dtype)), -1).view(b, t, h, nope + rope).transpose(1, 2)
    k_full = torch.cat((k_nope, k_pe.to(k_nope.dtype)[:, None].expand(n, h, rope)), -1)
    k_full = k_full.view(b, t, h, nope + rope).transpose(1, 2)  # (B, H, T, qk)
    v = v.reshape(b, t, h, v_dim).transpose(1, 2)  # (B, H, T, v)

    mask = _selection(attn, x, q_resid, ctx)  # (B, T, T) bool, or None: causal
    if ctx.kl_seqs and attn.indexer is not None:
        s = ctx.kl_seqs
        target = attention_target(q_full[:s].detach(), k_full[:s].detach(), attn.scale, ctx.causal)
        with torch.no_grad():  # as in the paper the indexer's inputs are detached
            xs = x[:s * t].detach()
            resid = attn.q_a_layernorm(attn.q_a_proj(xs))
        scores = indexer_scores(attn.indexer, xs, resid, ctx.cos[:s * t], ctx.sin[:s * t], s)
        ctx.kl.append(indexer_kl(target, scores, ctx.causal))

    dtype = q_full.dtype if q_full.dtype == k_full.dtype == v.dtype else torch.float32
    q_full, k_full, v = q_full.to(dtype), k_full.to(dtype), v.to(dtype)
    if mask is None:
        out = F.scaled_dot_product_attention(q_full, k_full, v, is_causal=True, scale=attn.scale)
    else:
        out = F.scaled_dot_product_attention(q_full, k_full, v, attn_mask=mask[:, None], scale=attn.scale)
    out = out.transpose(1, 2).reshape(n, h * v_dim)  # (B*T, H*v)
    return attn.o_proj(out.to(x.dtype))


def _selection(attn: MLAttention, x: torch.Tensor, q_resid: torch.Tensor | None, ctx: _Batch) -> torch.Tensor | None:
    """The DSA key mask (B, T, T) of this layer (causal & top-k), or None for plain causal attention."""
    if not attn.uses_dsa:
        return None
    if attn.indexer is None:  # IndexCache "shared" layer: the last indexer layer's selection
        if not ctx.indexed:
            raise RuntimeError(f"layer {attn.layer} shares top-k but no earlier layer ran an indexer")
        return ctx.selection
    ctx.indexed = True
    if attn.indexer.topk >= ctx.length:  # the dense warm-up: top-k keeps every causal key
        ctx.selection = None
        return None
    with torch.no_grad():
        scores = indexer_scores(attn.indexer, x, q_resid, ctx.cos, ctx.sin, ctx.size)  # (B, T, T)
        scores.masked_fill_(~ctx.causal, float("-inf"))
        # NOTE: stable sort = the inference path's tie rule (ReLU makes exact ties common).
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :attn.indexer.topk]
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & ctx.causal
    ctx.selection = chosen
    return chosen


def _route(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's router, in fp32 as at inference (autocast would run its linear in bf16)."""
    with torch.autocast(x.device.type, enabled=False):
        return moe.gate(x.float())


def _counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Routed tokens per expert (E,) fp32, without the host sync of bincount on CUDA."""
    return torch.zeros(n_experts, device=ids.device).index_add_(0, ids.flatten(),
                                                                torch.ones(ids.numel(), device=ids.device))


def _stacked_moe(moe: MoE, x: torch.Tensor, counts: dict[int, torch.Tensor]) -> torch.Tensor:
    """MoE.forward with every routed expert on every token: x (N, D) -> (N, D)."""
    ids, weights = _route(moe, x)  # (N, K) int64, (N, K) fp32
    n, n_experts = x.shape[0], len(moe.experts)
    counts[moe.layer] = _counts(ids, n_experts)
    gate_name, up_name, down_name = moe.experts[0]._names
    gate = torch.cat([getattr(e, gate_name).weight for e in moe.experts])  # (E*I, D)
    up = torch.cat([getattr(e, up_name).weight for e in moe.experts])  # (E*I, D)
    down = torch.cat([getattr(e, down_name).weight for e in moe.experts], dim=1)  # (D, E*I)
    inter = gate.shape[0] // n_experts
    g, u = F.linear(x, torch.cat((gate, up))).split(n_experts * inter, dim=-1)  # (N, E*I) each
    act = F.silu(g.float()) * u.float()  # (N, E*I) fp32, as MLP.forward
    routing = torch.zeros(n, n_experts, device=x.device).scatter(1, ids, weights)  # (N, E), 0 = not chosen
    act = (act.view(n, n_experts, inter) * routing[:, :, None]).view(n, n_experts * inter)
    y = F.linear(act.to(x.dtype), down)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y
