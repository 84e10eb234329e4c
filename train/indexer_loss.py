"""Training objectives around Hearth's model that its inference code does not need (batched).

- ``indexer_scores``: the DSA lightning indexer's scores of every key for every query of a batch of
  whole sequences, from the indexer's own modules: ``sum_h w[i,h] * relu(q[i,h] . k[t])`` (fp32).
  ``train.batched`` selects the top-k from them (without gradient) and feeds them to the KL below.
- ``indexer_kl``: DeepSeek-V3.2's indexer objective. The top-k selection is not differentiable, so
  the indexer gets no gradient from the language-model loss; instead it learns to match the main
  attention: KL(p || softmax(indexer scores)) over the causal keys, where p is the main attention's
  probability of each key summed over heads and L1-normalised (``attention_target``; the "dense
  warm-up" target, kept dense over all causal keys in the sparse stage too). The indexer's inputs
  are detached, as in the paper, so this loss trains only the indexer.
- ``ExpertLoad`` accumulates routed-token counts per expert (``train.batched`` returns them) and
  nudges ``e_score_correction_bias`` towards balance: DeepSeek-V3's auxiliary-loss-free balancing.
  Everything stays on the device (no host syncs) until ``worst_ratio`` is read for the log.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.engine.models.deepseek import DeepseekForCausalLM, Gate
from hearth.engine.models.mla import Indexer


def indexer_scores(idx: Indexer, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: int) -> torch.Tensor:
    """Unmasked indexer scores (B, T, T) fp32 of ``batch`` whole sequences.

    x (B*T, hidden) and q_resid (B*T, q_lora_rank) are the layer's flat inputs, cos/sin (B*T, rope/2)
    the rotary tables of their positions. The indexer's own rope and (no-op unless faithful)
    Hadamard/FP8 helpers are used, so training scores keys as inference does.
    """
    n = x.shape[0]
    t = n // batch
    q = idx.wq_b(q_resid).view(n, idx.n_heads, idx.head_dim)  # (N, Hi, Di)
    q = idx._faithful(idx._rope(q, cos, sin))
    k = idx._faithful(idx._rope(idx.k_norm(idx.wk(x)), cos, sin))  # (N, Di)
    with torch.autocast(x.device.type, enabled=False):  # inference scores in fp32 too
        w = idx.weights_proj(x.float()).float() * idx.scale  # (N, Hi)
        q = q.float().view(batch, t * idx.n_heads, idx.head_dim)  # (B, T*Hi, Di)
        k = k.float().view(batch, t, idx.head_dim)  # (B, T, Di)
        s = torch.bmm(q, k.transpose(1, 2)).view(batch, t, idx.n_heads, t).relu()  # (B, Tq, Hi, Tk)
        return (s * w.view(batch, t, idx.n_heads, 1)).sum(2)  # (B, Tq, Tk)


@torch.no_grad()
def attention_target(q: torch.Tensor, k: torch.Tensor, scale: float, causal: torch.Tensor) -> torch.Tensor:
    """Main attention's dense causal distribution over keys, summed over heads and normalised.

    q, k: (S, H, T, qk_head_dim) (nope and rope parts concatenated); causal (T, T) bool -> (S, T, T) fp32.
    """
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (S, H, T, T)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    target = probs.sum(1)
    return target / target.sum(-1, keepdim=True)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores)) over the causal keys.

    target, scores: (S, T, T) fp32; causal (T, T) bool.
    """
    log_q = scores.masked_fill(~causal, float("-inf")).log_softmax(-1).masked_fill(~causal, 0.0)
    kl = (target * (target.clamp_min(1e-12).log() - log_q)).sum(-1)  # (S, T)
    return kl.mean()


class ExpertLoad:
    """Per-layer routed-token counts since the last ``update``; aux-loss-free bias balancing."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.gates: dict[int, Gate] = {layer.layer: layer.mlp.gate for layer in model.layers if layer.is_moe}
        self.counts: dict[int, torch.Tensor] = {}
        self.worst_ratio: torch.Tensor | None = None  # max/mean load of the last update (device scalar)

    def add(self, counts: dict[int, torch.Tensor]) -> None:
        """Routed-token counts (n_routed_experts,) per MoE layer, as ``train.batched`` returns them."""
        for layer, c in counts.items():
            self.counts[layer] = self.counts[layer] + c if layer in self.counts else c.detach().float()

    @torch.no_grad()
    def update(self, rate: float) -> None:
        """Move each bias by ``rate`` towards balance; keeps the worst max/mean ratio in ``worst_ratio``."""
        ratios = []
        for layer, counts in self.counts.items():
            bias = self.gates[layer].e_score_correction_bias
            mean = counts.mean()
            bias += rate * torch.sign(mean - counts).to(bias.dtype)
            ratios.append(counts.max() / mean.clamp_min(1))
        if ratios:
            self.worst_ratio = torch.stack(ratios).max()
        self.counts.clear()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (N, vocab), targets (N,)."""
    return F.cross_entropy(logits.float(), targets)
