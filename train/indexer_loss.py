"""Training helpers around Hearth's model that its inference code does not need.

- ``AttentionTap`` records each MLA layer's input and the step's ``ForwardContext`` (forward
  pre-hooks), so the DSA indexer can be trained after the forward pass.
- ``indexer_kl_loss``: DeepSeek-V3.2's indexer objective. The top-k selection is not
  differentiable, so the lightning indexer gets no gradient from the language-model loss; instead it
  learns to match the main attention: KL(p || softmax(indexer scores)) over the causal keys, where p
  is the main attention's probability of each key summed over heads and L1-normalised (the
  "dense warm-up" target; we keep it dense over all causal keys in the sparse stage too). The
  indexer's inputs are detached, as in the paper, so this loss trains only the indexer.
- ``ExpertLoad`` counts routed tokens per expert (forward hooks on the routers) and nudges
  ``e_score_correction_bias`` towards balance: DeepSeek-V3's auxiliary-loss-free balancing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.kv_cache import ForwardContext, SeqSlice
from hearth.engine.models.deepseek import DeepseekForCausalLM, Gate
from hearth.engine.models.layers import apply_rotary
from hearth.engine.models.mla import MLAttention


class AttentionTap:
    """Keeps ``(x, ctx)`` of the last forward of every MLA layer that runs an indexer."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.inputs: dict[int, tuple[torch.Tensor, ForwardContext]] = {}
        self._handles = []
        for layer in model.layers:
            attn = layer.self_attn
            if attn.indexer is not None:
                self._handles.append(attn.register_forward_pre_hook(self._hook))

    def _hook(self, module: nn.Module, args: tuple) -> None:
        x, ctx = args
        self.inputs[module.layer] = (x, ctx)

    def clear(self) -> None:
        self.inputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def _attention_target(attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                      causal: torch.Tensor) -> torch.Tensor:
    """Main attention's dense distribution over keys, summed over heads, normalised: (q, T) fp32."""
    w = attn.kv_b_proj.weight.float().view(attn.n_heads, attn.nope + attn.v_dim, attn.kv_lora)
    c_kv, k_pe = latents.float().split([attn.kv_lora, attn.rope_dim], dim=-1)
    k_nope = torch.einsum("tc,hdc->thd", c_kv, w[:, :attn.nope])  # (T, H, nope)
    scores = torch.einsum("qhd,thd->hqt", q_nope.float(), k_nope)
    scores += torch.einsum("qhr,tr->hqt", q_pe.float(), k_pe)
    probs = (scores * attn.scale).masked_fill(~causal[None], float("-inf")).softmax(-1)  # (H, q, T)
    target = probs.sum(0)
    return target / target.sum(-1, keepdim=True)


def _seq_kl(attn: MLAttention, x: torch.Tensor, seq: SeqSlice, ctx: ForwardContext) -> torch.Tensor:
    if seq.first_position != 0:  # the keys are recomputed from this step's rows
        raise ValueError("indexer_kl_loss expects whole sequences (first_position 0)")
    rows = slice(seq.start, seq.start + seq.q_len)
    xs = x[rows].detach()
    positions = ctx.positions[rows]
    cos, sin = attn.rotary.cos_sin(positions)
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(xs))
        q = attn.q_b_proj(q_resid).view(seq.q_len, attn.n_heads, attn.nope + attn.rope_dim)
        q_nope, q_pe = q.split([attn.nope, attn.rope_dim], dim=-1)
        q_pe = apply_rotary(q_pe, cos, sin, attn.rope_interleave)
        latents = ctx.cache.latent[attn.layer][seq.slots].detach()
        q_pos = torch.arange(seq.first_position, seq.context_len, device=x.device)
        causal = torch.arange(seq.context_len, device=x.device)[None, :] <= q_pos[:, None]
        target = _attention_target(attn, q_nope, q_pe, latents, causal)
    idx = attn.indexer
    # NOTE: the indexer's own rope helper, so training and inference score keys identically.
    qi = idx._rope(idx.wq_b(q_resid).view(seq.q_len, idx.n_heads, idx.head_dim), cos, sin)  # (q, Hi, Di)
    ki = idx._rope(idx.k_norm(idx.wk(xs)), cos, sin)  # (T, Di)
    w = idx.weights_proj(xs.float()).float() * idx.scale  # (q, Hi)
    scores = (torch.einsum("qhd,td->qht", qi.float(), ki.float()).relu() * w[:, :, None]).sum(1)  # (q, T)
    log_q = scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
    log_q = log_q.masked_fill(~causal, 0.0)
    kl = (target * (target.clamp_min(1e-12).log() - log_q)).sum(-1)
    return kl.mean()


def indexer_kl_loss(model: DeepseekForCausalLM, tap: AttentionTap, max_seqs: int) -> torch.Tensor:
    """Mean over indexer layers and the first ``max_seqs`` sequences of KL(main attention || indexer)."""
    losses = []
    for layer, (x, ctx) in sorted(tap.inputs.items()):
        attn = model.layers[layer].self_attn
        for seq in ctx.seqs[:max_seqs]:
            losses.append(_seq_kl(attn, x, seq, ctx))
    if not losses:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.stack(losses).mean()


class ExpertLoad:
    """Per-layer routed-token counts since the last ``update``; aux-loss-free bias balancing."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.gates: dict[int, Gate] = {}
        self.counts: dict[int, torch.Tensor] = {}
        for layer in model.layers:
            if layer.is_moe:
                self.gates[layer.layer] = layer.mlp.gate
                layer.mlp.gate.register_forward_hook(self._make_hook(layer.layer))

    def _make_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            ids = output[0].detach().flatten()
            counts = torch.bincount(ids, minlength=module.config.n_routed_experts).float()
            self.counts[layer] = self.counts.get(layer, 0) + counts
        return hook

    @torch.no_grad()
    def update(self, rate: float) -> float:
        """Move each bias by ``rate`` towards balance; returns the worst max/mean load ratio seen."""
        worst = 0.0
        for layer, counts in self.counts.items():
            bias = self.gates[layer].e_score_correction_bias
            mean = counts.mean()
            bias += rate * torch.sign(mean - counts).to(bias.dtype)
            worst = max(worst, float(counts.max() / mean.clamp_min(1)))
        self.counts.clear()
        return worst


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)
