"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's released expert weights.

Each group of 32 values shares one e8m0 scale byte (2 ** (s - 127)); each value is an FP4 e2m1 code
(sign bit, two exponent bits, one mantissa bit), two codes a byte with the first in the low nibble.
A checkpoint stores ``*_blocks`` uint8 [..., G, 16] and ``*_scales`` uint8 [..., G] for a row of
``G * 32`` values.

:func:`dequantize_mxfp4` is the torch version (loading, the host); :func:`dequantize_mxfp4_into` the
Triton kernel that turns expert records fetched to the GPU as MXFP4 into their float weights;
:func:`mxfp4_tile` the in-register decode the fused MoE kernels use to read MXFP4 weights directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import count_nonfinite

# The value of each e2m1 code 0..15.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
E8M0_BIAS = 127
BITS_PER_VALUE = 4 + 8 / MXFP4_GROUP  # 4.25: the code plus its share of the group's scale byte
_FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)


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


def count_nonfinite_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> int:
    """Values of MXFP4 ``blocks``/``scales`` that dequantise to NaN/inf in ``dtype`` (a scale byte of 255,
    e8m0's NaN, or one too large), without dequantising everything: only the groups whose largest code
    overflows (e2m1 magnitudes grow with a code's low 3 bits) are."""
    top = torch.maximum(blocks & 7, (blocks >> 4) & 7).amax(-1)  # (..., G)
    largest = torch.tensor(FP4_E2M1_VALUES[:8], device=blocks.device)[top.long()]
    bad = ~torch.isfinite(torch.ldexp(largest, scales.float() - E8M0_BIAS).to(dtype))
    return count_nonfinite(dequantize_mxfp4(blocks[bad], scales[bad], dtype)) if bad.any() else 0


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


@triton.jit
def _e2m1_value(code):
    """The value of e2m1 codes (int32 0..15) as fp32, from the bits: sign, two exponent bits, one
    mantissa bit (exponent 0: subnormal, m / 2)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    magnitude = twice.to(tl.float32) * 0.5
    # the sign as a bit: -0.0 for code 8 (a negation compiled on the GPU gave +0.0)
    return (magnitude.to(tl.int32, bitcast=True) | ((code >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_scale(s):
    """2 ** (s - 127) for e8m0 bytes (int32) from its bits (exact; e8m0 0 is the fp32 subnormal 2 ** -127)."""
    return tl.where(s > 0, s << 23, 0x400000).to(tl.float32, bitcast=True)


# e2m1_pair: the fp32 word with a nibble's sign in bit 31 and its three magnitude bits in bits 22..24
# (the exponent's two low bits and the mantissa's top bit) is the code's value times 2 ** -126 (the
# exponent-0 codes 0.5 and 0 land on fp32's subnormals); the mask keeps those four bits.
_SIGN_MAGNITUDE = tl.constexpr(-0x7E400000)  # 0x81C00000 as an int32 (a larger literal would widen the ops to int64)
_E2M1_UNIT = tl.constexpr(2.0**126)  # undoes the 2 ** -126 (exact: a power of two, results within e2m1's range)


@triton.jit
def e2m1_pair(byte):
    """The values of a code byte's low and high nibble (int32 tensor, the byte in its low 8 bits) as
    exact fp32, from the bits: per nibble a shift placing its sign bit at bit 31, an arithmetic shift
    right by 6 (magnitude bits to 22..24), a mask and one multiply by 2 ** 126."""
    lo = ((byte << 28) >> 6) & _SIGN_MAGNITUDE
    hi = ((byte << 24) >> 6) & _SIGN_MAGNITUDE
    return lo.to(tl.float32, bitcast=True) * _E2M1_UNIT, hi.to(tl.float32, bitcast=True) * _E2M1_UNIT


@triton.jit
def e2m1_nibbles(byte, BITS: tl.constexpr):
    """(low, high) nibble values of code bytes (int32 0..255): :func:`e2m1_pair`, or with BITS off the
    arithmetic decode kept for A/B runs."""
    if BITS:
        lo, hi = e2m1_pair(byte)
    else:
        lo, hi = _e2m1_value(byte & 15), _e2m1_value(byte >> 4)
    return lo, hi


@triton.jit
def mxfp4_tile(p_w, p_s, m_rows, k0, K_END, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """Values k0 .. k0 + BLOCK_K of MXFP4 rows as an fp32 (rows, BLOCK_K) tile, zero from ``K_END`` on
    and in rows off ``m_rows``. ``p_w`` (rows, 1): each row's first code byte; ``p_s`` (rows, 1): its
    first scale byte. k0 and K_END are even (a group is 32 values). BITS: :func:`e2m1_pair`, else the
    arithmetic decode (``_e2m1_value``; kept for A/B runs)."""
    o_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes: two values each
    m = m_rows & (o_j < K_END // 2)[None, :]
    byte = tl.load(p_w + o_j[None, :], mask=m, other=0).to(tl.int32)
    # NOTE: a row's scale bytes are few and reread from cache; one gather per byte keeps the tile simple.
    scale = e8m0_scale(tl.load(p_s + (o_j // 16)[None, :], mask=m, other=127).to(tl.int32))
    lo, hi = e2m1_nibbles(byte, BITS)
    return tl.interleave(lo * scale, hi * scale)  # low nibble first


@triton.jit
def mxfp4_codes(p_w, p_s, m_w, k0, K_END, BLOCK_K: tl.constexpr):
    """Values k0 .. k0 + BLOCK_K of MXFP4 rows, unscaled and split by nibble: (lo, hi) fp32 (rows,
    BLOCK_K // 2) e2m1 values of the even and odd columns, and the rows' fp32 (rows, BLOCK_K // 32)
    group scales. ``p_w`` / ``p_s`` (rows, 1): each row's first code / scale byte; ``m_w`` (rows, 1)
    its mask. k0, K_END and BLOCK_K are multiples of 32; groups from K_END on read as zero."""
    o_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes
    byte = tl.load(p_w + o_j[None, :], mask=m_w & (o_j < K_END // 2)[None, :], other=0).to(tl.int32)
    lo, hi = e2m1_pair(byte)
    o_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(p_s + o_g[None, :], mask=m_w & (o_g < K_END // 32)[None, :], other=127)
    scale = e8m0_scale(s.to(tl.int32))
    return lo, hi, scale


@triton.jit
def x_pairs(p_x, m_x, k0, K_END, BLOCK_K: tl.constexpr):
    """Activations k0 .. k0 + BLOCK_K of one row split into its even and odd columns, fp32 (1, BLOCK_K // 2)
    each (the order of :func:`mxfp4_codes`). ``p_x`` / ``m_x``: (1, 1) pointer to the row's first value
    and mask. bf16 rows are read as one int32 word per pair (the row 4-byte aligned) and widened by bit
    shifts; other dtypes are read whole and split."""
    if p_x.dtype.element_ty == tl.bfloat16:
        o_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p_words = p_x.to(tl.pointer_type(tl.int32))
        word = tl.load(p_words + o_j[None, :], mask=m_x & (o_j < K_END // 2)[None, :], other=0)
        x_e, x_o = (word << 16).to(tl.float32, bitcast=True), (word & -0x10000).to(tl.float32, bitcast=True)
    else:
        o_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(p_x + o_k[None, :], mask=m_x & (o_k < K_END)[None, :], other=0.0).to(tl.float32)
        x_e, x_o = tl.split(tl.reshape(x, (1, BLOCK_K // 2, 2)))
    return x_e, x_o


@triton.jit
def mxfp4_row_dot(x_e, x_o, lo, hi, scale, BLOCK_K: tl.constexpr):
    """(rows,) fp32 sums over a K tile of ``x[k] * W[n, k]`` for one activation row (:func:`x_pairs`) and
    MXFP4 rows (:func:`mxfp4_codes`): per group of 32 the sum of ``x * e2m1``, times the group's scale."""
    prod = x_e * lo + x_o * hi  # (rows, BK/2)
    part = tl.sum(tl.reshape(prod, (prod.shape[0], BLOCK_K // 32, 16)), axis=2)  # (rows, groups)
    return tl.sum(part * scale, axis=1)


@triton.jit
def dequantize_mxfp4_kernel(
    blocks_ptr, scales_ptr, out_ptr, ROW_BYTES,
    stride_be, stride_br, stride_se, stride_sr, stride_oe, stride_or,
    BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, j, e): BLOCK code bytes of one row of matrix ``e`` -> 2 * BLOCK output values."""
    row = tl.program_id(0)
    e = tl.program_id(2)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < ROW_BYTES
    byte = tl.load(blocks_ptr + e * stride_be + row * stride_br + j, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + e * stride_se + row * stride_sr + j // 16, mask=mask, other=127).to(tl.int32)
    scale = e8m0_scale(s)
    # NOTE: low nibble first; interleaved into one contiguous run of 2 * BLOCK values (one wide store).
    lo, hi = e2m1_nibbles(byte, BITS)
    values = tl.interleave(lo * scale, hi * scale)
    k = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + e * stride_oe + row * stride_or + k, values.to(out_ptr.dtype.element_ty), mask=k < 2 * ROW_BYTES)


_DEQUANT_BLOCK = 512  # code bytes per program: 1,024 values


def dequantize_mxfp4_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: bool = True) -> None:
    """:func:`dequantize_mxfp4` on the device into ``out``, one launch for ``n`` matrices of R rows:
    ``blocks`` uint8 [n, R, G, 16], ``scales`` uint8 [n, R, G], ``out`` float [n, R, G * 32]. Rows and
    matrices may be strided (views into expert records); each row's bytes must be contiguous. Allocates
    nothing, so it may run on any stream. ``bits``: :func:`e2m1_pair` (the default), else the arithmetic
    decode (A/B rows)."""
    n, rows, groups = scales.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or out.dtype not in _FLOAT_OUT:
        raise ValueError(f"expected uint8 blocks and scales and a float out, got {blocks.dtype}, {scales.dtype}, "
                         f"{out.dtype}")
    if blocks.shape != (n, rows, groups, MXFP4_GROUP // 2) or out.shape != (n, rows, groups * MXFP4_GROUP):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} / out {list(out.shape)} do not match scales "
                         f"{list(scales.shape)}")
    if blocks.stride(3) != 1 or blocks.stride(2) != MXFP4_GROUP // 2 or scales.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("each row of blocks, scales and out must be contiguous")
    row_bytes = groups * MXFP4_GROUP // 2
    if n == 0 or rows == 0 or row_bytes == 0:
        return
    grid = (rows, triton.cdiv(row_bytes, _DEQUANT_BLOCK), n)
    dequantize_mxfp4_kernel[grid](
        blocks, scales, out, row_bytes, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), out.stride(1), BITS=bits, BLOCK=_DEQUANT_BLOCK,
    )  # fmt: skip
