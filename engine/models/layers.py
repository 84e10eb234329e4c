"""Building blocks shared by the DeepSeek-family models: RMSNorm, rotary embeddings (YaRN,
interleaved and half-split layouts), FP8 block-scaled linear layers and the FP8 / Hadamard
simulation used by the "faithful" mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.config import RopeConfig
from hearth.kernels.fp8_linear import check_weights, fp8_linear
from hearth.kernels.fused import rms_norm
from hearth.kernels.fused.reference import rotate_ref

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as HF does).

    use_kernel (the DSA kernel path): bf16 rows go through one fused Triton kernel
    (``hearth.kernels.fused.rms_norm``) instead of six PyTorch kernels; same arithmetic."""

    def __init__(self, dim: int, eps: float = 1e-6, use_kernel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.use_kernel = use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.dtype == torch.bfloat16:
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one kernel on the kernel path."""
        if self.use_kernel and x.dtype == residual.dtype == torch.bfloat16 and x.dim() == 2:
            normed, total = rms_norm(x, self.weight, self.eps, residual=residual)
            return normed, total
        total = residual + x
        return self(total), total


class LayerNorm(nn.Module):
    """LayerNorm with bias computed in fp32 (the DSA indexer's k_norm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def check_fp8_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """Raise ValueError unless scale_inv has one value per (partial) block of the 2-D weight."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    expected = (math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 scale shape {tuple(scale_inv.shape)} does not match weight {rows}x{cols} "
                         f"with {br}x{bc} blocks (expected {expected})")


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """W = W8 * s[i // br, j // bc] for a block-scaled FP8 weight; edge blocks may be partial."""
    check_fp8_scales(weight, scale_inv, block)
    rows, cols = weight.shape
    br, bc = block
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def fp8_kernels_apply(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether Fp8Linear multiplies through Hearth's FP8 kernels (CUDA, 128x128 blocks) rather than a
    per-call dequantisation (tests force the kernels on the CPU, under Triton's interpreter)."""
    return x.is_cuda and block == (128, 128)


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays FP8 e4m3 with 128x128 block scales (the checkpoint
    format). Parameter names match the checkpoint (``weight``, ``weight_scale_inv``, ``bias``).

    On CUDA it runs Hearth's FP8 kernels (a GEMV for decode, a tl.dot GEMM for prefill), which read
    the FP8 bytes and never build a dequantised weight; elsewhere it dequantises block-wise per call.
    The bias (GLM-4.5's and Qwen3's q/k/v projections) stays in the compute dtype and is added after
    the product. ``dense_weight`` (MLA's absorbed ``kv_b_proj``, used as per-head matrices rather than
    a linear) is dequantised once and kept."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 compute_dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.block = block
        self.compute_dtype = compute_dtype
        self.out_features, self.in_features = weight.shape
        self._dense: torch.Tensor | None = None
        if block == (128, 128):  # the kernels' layout: checked once here, not on every call
            check_weights(self.weight, self.weight_scale_inv)

    def dense_weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, self.compute_dtype)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_kernels_apply(x, self.block):
            weight = dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        y = fp8_linear(x, self.weight, self.weight_scale_inv, weights_checked=True)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The weight of a Linear or Fp8Linear as a dense tensor in the compute dtype."""
    if isinstance(linear, Fp8Linear):
        return linear.dense_weight()
    return linear.weight


# --------------------------------------------------------------------------------------------
# Rotary embeddings


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim // 2] (fp32) for default rope or YaRN, as in the reference code."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type != "yarn":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary(nn.Module):
    """cos/sin for given positions; applies the rotation in either layout.

    interleaved=True rotates pairs (x[2i], x[2i+1]) and writes them back in place (DeepSeek's
    layout); interleaved=False rotates (x[i], x[i + d/2]) (NeoX / rotate_half).
    """

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, dim), persistent=False)
        self.attention_factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # (N, d/2)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


# Rotate x [N, ..., d] with cos/sin [N, d/2] in fp32, returned in x.dtype: the plain path and the
# fused kernels' reference are one function.
apply_rotary = rotate_ref


# --------------------------------------------------------------------------------------------
# FP8 / Hadamard simulation ("faithful" mode of the official DeepSeek inference code)


def fp8_round_trip(x: torch.Tensor, block: int = 128, pow2_scale: bool = True) -> torch.Tensor:
    """Quantise x per ``block`` channels to e4m3 with (power-of-two) scales, then dequantise.

    amax is floored at 1e-4 as in the reference ``act_quant``. Returns x.dtype.
    """
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = amax / FP8_MAX
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(shape).to(x.dtype)


def hadamard_matrix(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Sylvester Hadamard matrix of size n (a power of two), scaled by n^-1/2 (orthonormal)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n**-0.5).to(device)
