"""Grouped-query attention over the paged cache (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss), plain PyTorch.

Each token's cache row holds its keys then its values for every KV head: ``2 * kv_heads * head_dim``
values per layer (the same paged cache the MLA models fill with latents). Rope is NeoX-style
(``rotate_half``) on the first ``rotary_dim`` dims of each head (all of them except for GLM-4.5's
partial rotary); Qwen3 and GLM-4.5 (``use_qk_norm``) RMS-normalise each q / k head before it.
Attention is fp32, causal, with an optional sliding window (a key is visible iff q_pos - k_pos < window;
gpt-oss chooses it per layer). gpt-oss also learns one sink logit per head: it joins each softmax row as
an extra key with no value, so a head can put part of its attention nowhere.

With ``AttentionPaths.use_kernels`` decode requests attend through the Triton paged decode kernel
(models/gqa_kernels.py) instead; prefill chunks always take the plain path below.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext, SeqSlice
from hearth.engine.models.layers import RMSNorm, Rotary, apply_rotary
from hearth.engine.models.mla import PLAIN_ATTENTION, AttentionPaths


class GQAttention(nn.Module):
    """Checkpoint names: q_proj, k_proj, v_proj, o_proj (+ q_norm, k_norm for Qwen3 / GLM-4.5)."""

    def __init__(self, config: ModelConfig, layer: int, paths: AttentionPaths = PLAIN_ATTENTION) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, \
            config.head_dim
        self.scale = config.softmax_scale
        self.window = config.window(layer)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.rotary_dim = config.rotary_dim
        self.rotary = Rotary(config.rope, self.rotary_dim)
        self._kernels = None  # models/gqa_kernels (imports Triton) when the kernel path runs decode
        if paths.use_kernels:
            from hearth.engine.models import gqa_kernels

            self._kernels = gqa_kernels

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: (N, hidden) normalised hidden states of the step's flat batch -> (N, hidden)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(ctx.positions)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        cache = ctx.cache.latent[self.layer]
        cache[ctx.slot_mapping] = torch.cat((k.flatten(1), v.flatten(1)), dim=-1).to(cache.dtype)
        if self._kernels is not None:
            return self.o_proj(self._kernels.attend(self, q, ctx).flatten(1))
        out = torch.empty(n, self.n_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for seq in ctx.seqs:
            rows = slice(seq.start, seq.start + seq.q_len)
            out[rows] = self.attend_request(q[rows], cache[seq.slots], seq).to(x.dtype)
        return self.o_proj(out.flatten(1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on the first rotary_dim dims of each head of x (N, heads, D); the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin, interleaved=False)
        turned, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((apply_rotary(turned, cos, sin, interleaved=False), kept), dim=-1)

    def attend_request(self, q: torch.Tensor, kv: torch.Tensor, seq: SeqSlice) -> torch.Tensor:
        """One request's queries q (q_len, H, D) over its cache rows kv (T, 2 * kv_heads * D) -> (q_len, H, D) fp32."""
        k, v = kv.float().view(-1, 2, self.kv_heads, self.head_dim).unbind(1)  # (T, kvh, D) each
        group = self.n_heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, H, D)
        scores = torch.einsum("qhd,thd->hqt", q.float(), k) * self.scale
        q_pos = torch.arange(seq.first_position, seq.context_len, device=q.device)[:, None]
        k_pos = torch.arange(seq.context_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if self.window is not None:
            visible &= q_pos - k_pos < self.window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if hasattr(self, "sinks"):
            sink = self.sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)  # (H, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqt,thd->qhd", probs, v)
