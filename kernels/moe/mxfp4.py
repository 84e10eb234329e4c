"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's released expert weights.

Each group of 32 values shares one e8m0 scale byte (2 ** (s - 127)); each value is an FP4 e2m1 code
(sign bit, two exponent bits, one mantissa bit), two codes a byte with the first in the low nibble.
A checkpoint stores ``*_blocks`` uint8 [..., G, 16] and ``*_scales`` uint8 [..., G] for a row of
``G * 32`` values.
"""

from __future__ import annotations

import torch

# The value of each e2m1 code 0..15.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
E8M0_BIAS = 127
BITS_PER_VALUE = 4 + 8 / MXFP4_GROUP  # 4.25: the code plus its share of the group's scale byte


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16], ``scales`` uint8 [..., G] -> [..., G * 32] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         f"(expected blocks [..., G, {MXFP4_GROUP // 2}] for scales [..., G])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    exponents = (scales.to(torch.int32) - E8M0_BIAS).float()
    return torch.ldexp(lut[codes], exponents[..., None]).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float (K a multiple of 32) -> (blocks, scales): per group the power-of-two scale that
    brings its largest magnitude within 6, each value rounded to the nearest e2m1 code."""
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8], device=weight.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()
