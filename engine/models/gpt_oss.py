"""gpt-oss (gpt-oss-20b / 120b) mixture of experts, plain PyTorch.

Checkpoint names under ``model.layers.N.mlp``: ``router.weight`` [E, D] and ``router.bias`` [E];
``experts.gate_up_proj`` [E, D, 2I] with ``gate_up_proj_bias`` [E, 2I], ``experts.down_proj``
[E, I, D] with ``down_proj_bias`` [E, D]. The gate and up columns of ``gate_up_proj`` are
interleaved (column 2j is gate j, 2j + 1 is up j). The release stores the two projections as MXFP4
(``*_blocks`` + ``*_scales``, see :mod:`hearth.kernels.moe.mxfp4`); the loader dequantises them into
these parameters, or, for the fused MoE kernel (which reads MXFP4 directly), keeps them as the
buffers ``*_blocks`` [E, out, in/32, 16] and ``*_scales`` [E, out, in/32] in place of the parameters
(:meth:`GptOssExperts.keep_mxfp4`); the per-expert loop then dequantises the experts it runs.

Router: top-k of the biased logits, softmax over the k chosen. Experts: the clamped SwiGLU
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (alpha 1.702, l 7.0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.kernels.moe.mxfp4 import dequantize_mxfp4
from hearth.kernels.moe.reference import clamped_swiglu


class GptOssRouter(nn.Module):
    """Linear router with bias; the weights are the softmax of the top-k logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) -> (topk_ids (T, K) int64, topk_weights (T, K) fp32)."""
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        top = logits.topk(self.top_k, dim=-1)
        return top.indices, top.values.softmax(dim=-1)


class GptOssExperts(nn.Module):
    """All routed experts of one layer as the checkpoint's stacked tensors."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(e, i, d), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d), requires_grad=False)
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

    def keep_mxfp4(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold projection ``name`` ("gate_up_proj" or "down_proj") as the release's MXFP4 ``blocks``
        uint8 [E, out, in/32, 16] and ``scales`` uint8 [E, out, in/32] instead of its float parameter."""
        delattr(self, name)
        self.register_buffer(name + "_blocks", blocks)
        self.register_buffer(name + "_scales", scales)

    def mxfp4(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(blocks, scales) of projection ``name`` when it is held as MXFP4 (see :meth:`keep_mxfp4`)."""
        blocks, scales = self._buffers.get(name + "_blocks"), self._buffers.get(name + "_scales")
        return None if blocks is None or scales is None else (blocks, scales)

    def _weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        packed = self.mxfp4(name)
        if packed is None:
            return getattr(self, name)[e]
        return dequantize_mxfp4(packed[0][e], packed[1][e], dtype).T  # [out, in] -> the parameter's [in, out]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x (n, D) -> (n, D) fp32 (activation in fp32, cast back before down)."""
        gate_up = (x @ self._weight("gate_up_proj", e, x.dtype) + self.gate_up_proj_bias[e]).float()
        h = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], self.limit, self.alpha).to(x.dtype)
        return (h @ self._weight("down_proj", e, x.dtype) + self.down_proj_bias[e]).float()


class GptOssMoE(nn.Module):
    """Router + experts, with the same interface as ``deepseek.MoE`` (``gate``, ``backend``,
    ``forward(x, ids, weights)``), so offload and the schedulers treat both alike."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config)
        self.shared_experts = None  # gpt-oss has none (the schedulers ask)
        self.backend = None

    @property
    def gate(self) -> GptOssRouter:
        return self.router

    def local_experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Default backend: this module's own expert weights, one expert at a time."""
        del layer
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            y = self.experts.expert(expert, x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (self.backend or self.local_experts)(self.layer, x, ids, weights)
