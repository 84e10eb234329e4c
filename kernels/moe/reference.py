"""Plain-torch reference for the fused routed-expert MoE (``hearth.kernels.moe``).

Same contract as :func:`hearth.kernels.moe.fused_moe`: SwiGLU experts read from slot tensors,
``h = silu(x Wg^T) * (x Wu^T)`` in fp32 cast to the activation dtype, ``y = h Wd^T``, and the
weighted sum over the top-k accumulated in fp32. Slow (a Python loop over slots) and simple on purpose.

gpt-oss's experts add biases to the three projections, clamp the SwiGLU (``swiglu_limit``) and
interleave the gate and up rows of w13 (``interleaved``), as the kernel's ``ExpertExtras`` does.
MXFP4 weights (uint8 code bytes with uint8 e8m0 scales, as ``fused_moe`` takes them) are dequantised
with :func:`hearth.kernels.moe.mxfp4.dequantize_mxfp4`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.kernels.moe.mxfp4 import dequantize_mxfp4

SCALE_BLOCK = 128
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid gain


def dequant_block_fp8(w: torch.Tensor, scale: torch.Tensor, block: int = SCALE_BLOCK) -> torch.Tensor:
    """``W[i, j] = w[i, j] * scale[i // block, j // block]`` in fp32; partial edge blocks allowed.

    w: [N, K] any dtype; scale: [ceil(N/block), ceil(K/block)] fp32. Returns [N, K] fp32.
    """
    n, k = w.shape
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]  # (N, K)
    return w.float() * s


def slot_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None,
    s2: torch.Tensor | None,
    slot: int,
    dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot's (gate [I, D], up [I, D], down [D, I]) weights, dequantised and cast to ``dtype``.
    ``interleaved``: w13's rows alternate gate, up (float or MXFP4 weights)."""
    inter = w13.shape[1] // 2
    if w13.dtype == torch.uint8 and s13 is not None and s13.dtype == torch.uint8:  # MXFP4
        gate_up, w_down = dequantize_mxfp4(w13[slot], s13[slot], dtype), dequantize_mxfp4(w2[slot], s2[slot], dtype)
        w_gate, w_up = (gate_up[0::2], gate_up[1::2]) if interleaved else (gate_up[:inter], gate_up[inter:])
    elif interleaved:
        w_gate, w_up, w_down = w13[slot, 0::2], w13[slot, 1::2], w2[slot]
    elif s13 is None:
        w_gate, w_up, w_down = w13[slot, :inter], w13[slot, inter:], w2[slot]
    else:
        rows = s13.shape[1] // 2  # scale rows of the gate half (== ceil(I / 128))
        w_gate = dequant_block_fp8(w13[slot, :inter], s13[slot, :rows])
        w_up = dequant_block_fp8(w13[slot, inter:], s13[slot, rows:])
        w_down = dequant_block_fp8(w2[slot], s2[slot])
    return w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """gpt-oss's activation: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  limit: float | None = None, alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``: x [T, D] -> [T, D] fp32 (silu/product in fp32, cast before down).
    With ``limit`` the clamped SwiGLU instead; ``biases`` (gate, up, down) are added to the projections."""
    b_gate, b_up, b_down = biases or (None, None, None)
    gate = F.linear(x, w_gate, b_gate).float()  # (T, I)
    up = F.linear(x, w_up, b_up).float()
    h = (F.silu(gate) * up if limit is None else clamped_swiglu(gate, up, limit, alpha)).to(x.dtype)
    return F.linear(h, w_down, b_down).float()


def moe_reference(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    interleaved: bool = False,
) -> torch.Tensor:
    """Reference of ``fused_moe``: x [T, D], slot_ids [T, K] (-1 = skip), weights [T, K] fp32,
    w13 [S, 2I, D], w2 [S, D, I], optional FP8 scales s13 [S, 2*ceil(I/128), ceil(D/128)] and
    s2 [S, ceil(D/128), ceil(I/128)], or MXFP4 (w13 [S, 2I, D/32, 16], w2 [S, D, I/32, 16], s13
    [S, 2I, D/32], s2 [S, D, I/32], all uint8); gpt-oss: biases b13 [S, 2I] and b2 [S, D] and the clamped
    SwiGLU, with w13's gate and up rows (and b13's entries) alternating when ``interleaved``.
    Returns [T, D] fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in sorted(set(slot_ids.flatten().tolist()) - {-1}):
        rows, ks = torch.nonzero(slot_ids == slot, as_tuple=True)
        w_gate, w_up, w_down = slot_weights(w13, w2, s13, s2, slot, x.dtype, interleaved)
        biases = None
        if b13 is not None:
            inter = w_gate.shape[0]
            b_gate, b_up = (b13[slot, 0::2], b13[slot, 1::2]) if interleaved else (b13[slot, :inter], b13[slot, inter:])
            biases = (b_gate.to(x.dtype), b_up.to(x.dtype), b2[slot].to(x.dtype))
        y = swiglu_expert(x[rows], w_gate, w_up, w_down, biases, swiglu_limit, swiglu_alpha)  # (n, D)
        out.index_add_(0, rows, y * weights[rows, ks].float()[:, None])
    return out
