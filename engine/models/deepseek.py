"""MoE decoder in plain PyTorch: the DeepSeek family (DeepSeek-V3.2, GLM-5, DeepSeek-V3, DeepSeek-V2,
MLA attention) and Qwen3-MoE / Mixtral / GLM-4.5 / gpt-oss (grouped-query attention, models/gqa.py;
gpt-oss's router and experts in models/gpt_oss.py).

Module names follow the Hugging Face checkpoints so tensor names map one to one
(``model.layers.N.self_attn.q_a_proj.weight``, ``model.layers.N.mlp.experts.E.gate_proj.weight``,
Mixtral's ``model.layers.N.block_sparse_moe.experts.E.w1.weight``...).

The model runs layer by layer for any subset of the running requests: ``embed``, then per layer
``attend`` (norm + attention + residual), ``ffn_input`` (norm), ``route`` (router) and
``ffn`` (MoE or dense MLP + residual), then ``logits``. ``forward`` is one policy over those
pieces (all requests through all layers); the runahead scheduler uses others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext
from hearth.engine.models.gpt_oss import GptOssMoE
from hearth.engine.models.gqa import GQAttention
from hearth.engine.models.layers import RMSNorm
from hearth.engine.models.mla import PLAIN_ATTENTION, AttentionPaths, MLAttention
from hearth.kernels.fused import moe_route

# backend(layer, x (T, D), topk_ids (T, K) int64, topk_weights (T, K) fp32) -> (T, D)
ExpertsBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); silu and product in fp32 as the reference does.
    ``names`` are the checkpoint's (gate, up, down) module names (Mixtral: w1, w3, w2)."""

    def __init__(self, hidden: int, intermediate: int,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        self._names = names
        setattr(self, names[0], nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names[1], nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names[2], nn.Linear(intermediate, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self._names)
        h = F.silu(gate(x).float()) * up(x).float()
        return down(h.to(x.dtype))


class Gate(nn.Module):
    """The router: scores in fp32, optional group limit, top-k, weight normalisation, scaling.

    use_kernel (the DSA kernel path): everything after the gate matmul in one Triton kernel
    (``hearth.kernels.fused.moe_route``), the same experts in the same order."""

    def __init__(self, config: ModelConfig, use_kernel: bool = False) -> None:
        super().__init__()
        self.config = config
        self.use_kernel = use_kernel
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size), requires_grad=False)
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) -> (topk_ids (T, K) int64, topk_weights (T, K) fp32)."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        if self.use_kernel:
            return self._route_kernel(logits)
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if c.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
        if c.topk_method != "greedy" and c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            if c.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = group_scores.topk(c.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if self._normalises():
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def _normalises(self) -> bool:
        # NOTE: DeepSeek's V2 code would skip it for top-1 routing; config.py refuses norm_topk_prob on V2.
        return self.config.norm_topk_prob

    def _route_kernel(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        grouped = c.topk_method != "greedy" and c.n_group > 1
        bias = self.e_score_correction_bias.float() if c.topk_method == "noaux_tc" else None
        return moe_route(logits, bias, c.num_experts_per_tok, sigmoid=c.scoring_func == "sigmoid",
                         n_group=c.n_group if grouped else 1, topk_group=c.topk_group if grouped else 1,
                         group_top2=c.topk_method == "noaux_tc", normalise=self._normalises(),
                         scale=c.routed_scaling_factor)


class MoE(nn.Module):
    """Routed experts (+ shared experts). Experts run through a pluggable backend so they can
    live in host RAM behind a GPU cache (hearth.offload) without the model knowing."""

    def __init__(self, config: ModelConfig, layer: int, kernel_router: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Gate(config, kernel_router)
        self.experts = nn.ModuleList(
            [MLP(config.hidden_size, config.moe_intermediate_size, config.expert_proj_names)
             for _ in range(config.n_routed_experts)]
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts else None
        )
        self.backend: ExpertsBackend | None = None

    def local_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Default backend: this module's own expert weights, one expert at a time."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count:
                tokens = token_of[start:start + count]
                y = self.experts[expert](x[tokens]).float() * weight_of[start:start + count, None]
                out.index_add_(0, tokens, y)
            start += count
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        backend = self.backend or self.local_experts
        y = backend(self.layer, x, ids, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def fused_norms(config: ModelConfig, attention: AttentionPaths) -> bool:
    """Whether the RMSNorms run as fused Triton kernels: on the DSA kernel path (CUDA, bf16)."""
    return attention.use_kernels and config.has_indexer


def _moe(config: ModelConfig, layer: int, fused: bool) -> nn.Module:
    return GptOssMoE(config, layer) if config.model_type == "gpt_oss" else MoE(config, layer, fused)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, faithful: bool, attention: AttentionPaths) -> None:
        super().__init__()
        self.layer = layer
        fused = fused_norms(config, attention)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = MLAttention(config, layer, faithful, attention) if config.is_mla \
            else GQAttention(config, layer, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.is_moe = config.is_moe_layer(layer)
        # NOTE: registered under the checkpoint's module name (Mixtral: block_sparse_moe); `mlp` reads it.
        self._mlp_name = config.moe_module if self.is_moe else "mlp"
        ffn = _moe(config, layer, fused) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        setattr(self, self._mlp_name, ffn)

    @property
    def mlp(self) -> nn.Module:
        return self._modules[self._mlp_name]

    def attend(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return hidden + self.self_attn(self.input_layernorm(hidden), ctx)

    def ffn_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(hidden)

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert choice for each token, or None for a dense layer."""
        return self.mlp.gate(normed) if self.is_moe else None

    def ffn(self, hidden: torch.Tensor, normed: torch.Tensor,
            routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return hidden + self.ffn_output(normed, routing)

    def ffn_output(self, normed: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The MLP's (or MoE's) output, before the residual add."""
        return self.mlp(normed) if routing is None else self.mlp(normed, *routing)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream ``hidden + pending`` (pending: the previous layer's MLP
        output, not yet added). Returns (residual after attention, this layer's MLP output): their sum
        leaves the layer, added by the next norm (on the kernel path each add + norm is one kernel)."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            normed, hidden = self.input_layernorm.add_norm(pending, hidden)
        normed, hidden = self.post_attention_layernorm.add_norm(self.self_attn(normed, ctx), hidden)
        return hidden, self.ffn_output(normed, self.route(normed))


class DeepseekModel(nn.Module):
    """``model.*`` of the checkpoint (embed_tokens, layers, norm)."""

    def __init__(self, config: ModelConfig, faithful: bool, attention: AttentionPaths) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i, faithful, attention)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_norms(config, attention))


class DeepseekForCausalLM(nn.Module):
    """The whole network; checkpoint names ``model.*`` and ``lm_head.weight``."""

    def __init__(self, config: ModelConfig, faithful: bool = False,
                 attention: AttentionPaths = PLAIN_ATTENTION) -> None:
        super().__init__()
        self.config = config
        self.attention = attention
        self.model = DeepseekModel(config, faithful, attention)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm (of hidden + pending, the last layer's MLP output) + lm_head with fp32
        accumulation and output: (N, D) -> (N, vocab)."""
        normed = self.model.norm(hidden) if pending is None else self.model.norm.add_norm(pending, hidden)[0]
        weight = self.lm_head.weight
        if normed.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
            # fp32 out of the 16-bit GEMM: the same products as upcasting first, without an fp32 copy
            # of the vocabulary matrix every step
            try:
                return torch.mm(normed.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            except (NotImplementedError, RuntimeError, TypeError):  # a torch without mm(out_dtype=)
                pass
        return F.linear(normed.float(), weight.float())

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, all_logits: bool = False) -> torch.Tensor:
        """All requests through all layers; logits of each request's last token (B, vocab), or of
        every token (N, vocab) with all_logits."""
        hidden, pending = self.embed(input_ids), None
        for layer in self.model.layers:
            hidden, pending = layer(hidden, ctx, pending)
        if not all_logits and ctx.decode is None:  # (a decode step's tokens are its requests' last tokens)
            last = ctx.last_token_indices()
            hidden, pending = hidden[last], pending[last]
        return self.logits(hidden, pending)
