"""Fused indexer-key cache write: rope (interleaved or NeoX) on the first dims -> optional 128x128
Hadamard -> ue8m0 FP8 quantisation -> store into the paged uint8 indexer cache.

Cache layout (vLLM / DeepGEMM `fp8_paged_mqa_logits`): `kv_cache` is uint8 `[num_blocks, block_size*132]`;
within a page the `block_size*128` e4m3 key bytes come first, token-major (token o at byte `o*128`),
then `block_size` fp32 scales (token o at byte `block_size*128 + 4*o`). slot = block*block_size + offset;
or, for a device ring of `ring_pages` pages (tiered keys), the kernel maps a token position p to the slot
(p // block_size) % ring_pages * block_size + p % block_size itself.
Scale = 2^ceil(log2(max(amax, 1e-4) / 448)) per token (one 128-element group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import (
    check_tensor,
    e4m3_encode,
    exp2_int,
    is_interpreter,
    is_power_of_two,
    mma,
    require,
    round_to_bf16,
    ue8m0_exponent,
)

INDEX_DIM = 128
HADAMARD_SCALE = tl.constexpr(INDEX_DIM**-0.5)


# NOTE: N (the step's tokens) changes with every step; it only masks rows (see lightning.py's note).
@triton.jit(do_not_specialize=["N"])
def _indexer_k_write_kernel(
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_u8_ptr,
    cache_f32_ptr,
    N,
    stride_k,
    stride_cos,
    stride_blk,
    ring_pages,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HADAMARD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    m_n = o_n < N
    p_k = k_ptr + o_n[:, None].to(tl.int64) * stride_k + o_d[None, :]
    b_x = tl.load(p_k, mask=m_n[:, None], other=0.0).to(tl.float32)
    if HAS_ROPE:
        HALF: tl.constexpr = ROPE_DIM // 2
        m_r = o_d < ROPE_DIM
        if INTERLEAVED:
            o_p = o_d ^ 1
            o_f = o_d // 2
            b_sign = tl.where(o_d % 2 == 0, -1.0, 1.0)
        else:
            o_p = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
            o_f = o_d % HALF
            b_sign = tl.where(o_d < HALF, -1.0, 1.0)
        o_p = tl.where(m_r, o_p, o_d)
        o_f = tl.where(m_r, o_f, 0)
        b_xp = tl.load(k_ptr + o_n[:, None].to(tl.int64) * stride_k + o_p[None, :], mask=m_n[:, None], other=0.0)
        b_pos = tl.load(pos_ptr + o_n, mask=m_n, other=0).to(tl.int64)
        m_cs = m_n[:, None] & m_r[None, :]
        b_cos = tl.load(cos_ptr + b_pos[:, None] * stride_cos + o_f[None, :], mask=m_cs, other=1.0)
        b_sin = tl.load(sin_ptr + b_pos[:, None] * stride_cos + o_f[None, :], mask=m_cs, other=0.0)
        # pair (a, b): a' = a cos - b sin, b' = b cos + a sin; dims past ROPE_DIM see cos 1, sin 0
        b_x = b_x * b_cos + b_sign[None, :] * b_xp.to(tl.float32) * b_sin
        if ROUND_BF16:
            b_x = round_to_bf16(b_x)
    if HADAMARD:
        # Sylvester Hadamard H[i, j] = (-1)^popcount(i & j), built in registers
        o_i = tl.arange(0, D)
        v = o_i[:, None] & o_d[None, :]
        v = v ^ (v >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        b_h = 1.0 - 2.0 * (v & 1).to(tl.float32)
        if ROUND_BF16:
            # x and H are exact in bf16: tensor-core products are exact, accumulation fp32
            b_x = mma(b_x.to(tl.bfloat16), b_h.to(tl.bfloat16), tl.zeros([BLOCK_N, D], dtype=tl.float32), UPCAST)
        else:
            b_x = tl.dot(b_x, b_h, input_precision="ieee")
        b_x = b_x * HADAMARD_SCALE
        if ROUND_BF16:
            b_x = round_to_bf16(b_x)
    b_amax = tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-4)
    b_e = ue8m0_exponent(b_amax)
    b_y = b_x * exp2_int(-b_e)[:, None]
    b_y = tl.minimum(tl.maximum(b_y, -448.0), 448.0)
    b_code = e4m3_encode(b_y).to(tl.uint8)
    b_slot = tl.load(slot_ptr + o_n, mask=m_n, other=-1).to(tl.int64)
    m_w = m_n & (b_slot >= 0)
    if RING:  # slot_ptr holds positions: page p // BLOCK_SIZE sits in ring block page % ring_pages
        b_slot = (b_slot // BLOCK_SIZE) % ring_pages * BLOCK_SIZE + b_slot % BLOCK_SIZE
    b_blk = b_slot // BLOCK_SIZE
    b_off = b_slot % BLOCK_SIZE
    p_c = cache_u8_ptr + b_blk[:, None] * stride_blk + b_off[:, None] * D + o_d[None, :]
    tl.store(p_c, b_code, mask=m_w[:, None])
    p_s = cache_f32_ptr + b_blk * (stride_blk // 4) + BLOCK_SIZE * (D // 4) + b_off
    tl.store(p_s, exp2_int(b_e), mask=m_w)


def indexer_k_cache_write(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    block_size: int,
    *,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    hadamard: bool = False,
    ring_pages: int = 0,
) -> None:
    """Rope + (Hadamard) + FP8-quantise indexer keys and store them in the paged cache, in place.

    Args:
        k: [N, 128] bf16 or fp32, contiguous rows (row stride may exceed 128, last-dim stride 1):
            keys after wk + LayerNorm; if `cos` is None the rope is taken as already applied.
        slot_mapping: [N] int32/int64, physical slot = block*block_size + offset; slots < 0 are skipped.
        kv_cache: uint8 [num_blocks, block_size*132], contiguous (layout in the module docstring).
        block_size: tokens per page, a power of two >= 16.
        positions: [N] int32/int64 token positions (rows of cos/sin), needed with cos/sin.
        cos, sin: fp32 [max_pos, R/2] contiguous rope tables (R = rope dims, even, <= 128), rotating the
            first R dims: pairs (2i, 2i+1) when rope_interleaved (GLM) else (i, i+R/2) (DeepSeek-V3.2).
        hadamard: apply the orthonormal 128x128 Sylvester Hadamard (scale 128^-0.5) before quantising.
        ring_pages: if > 0, slot_mapping holds token positions in a ring of the cache's first ring_pages
            blocks (the tiered keys' device ring): position p goes to slot
            (p // block_size) % ring_pages * block_size + p % block_size, computed in the kernel, so a
            caller holding only device-side positions needs no slot arithmetic (no extra launches).
    bf16 inputs are rounded to bf16 after rope and after the Hadamard, as the reference model does.
    """
    require(
        is_power_of_two(block_size) and block_size >= 16, f"block_size must be a power of two >= 16, got {block_size}"
    )
    check_tensor("k", k, dtypes=(torch.bfloat16, torch.float32), ndim=2, contiguous=False)
    require(
        k.shape[1] == INDEX_DIM and k.stride(1) == 1,
        f"k must be [N, 128] with unit last stride, got {tuple(k.shape)} {k.stride()}",
    )
    n = k.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), shape=(n,), device=k.device)
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=2, device=k.device)
    require(
        kv_cache.shape[1] == block_size * (INDEX_DIM + 4),
        f"kv_cache must be [num_blocks, {block_size * 132}] for block_size {block_size}, got {tuple(kv_cache.shape)}",
    )
    require(0 <= ring_pages <= kv_cache.shape[0], f"ring_pages must be in [0, {kv_cache.shape[0]}], got {ring_pages}")
    has_rope = cos is not None
    rope_dim = 0
    if has_rope:
        require(sin is not None and positions is not None, "cos needs sin and positions")
        check_tensor("cos", cos, dtypes=(torch.float32,), ndim=2, device=k.device)
        check_tensor("sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=k.device)
        check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), shape=(n,), device=k.device)
        rope_dim = 2 * cos.shape[1]
        require(0 < rope_dim <= INDEX_DIM, f"rope dims 2*cos.shape[1] must be in (0, 128], got {rope_dim}")
    if n == 0:
        return
    block_n = 16
    grid = (triton.cdiv(n, block_n),)
    dummy = slot_mapping
    _indexer_k_write_kernel[grid](
        k,
        positions if has_rope else dummy,
        cos if has_rope else k,
        sin if has_rope else k,
        slot_mapping,
        kv_cache,
        kv_cache.view(torch.float32),
        n,
        k.stride(0),
        cos.stride(0) if has_rope else 0,
        kv_cache.stride(0),
        max(ring_pages, 1),
        BLOCK_SIZE=block_size,
        D=INDEX_DIM,
        ROPE_DIM=max(rope_dim, 2),
        HAS_ROPE=has_rope,
        INTERLEAVED=rope_interleaved,
        HADAMARD=hadamard,
        ROUND_BF16=k.dtype == torch.bfloat16,
        RING=ring_pages > 0,
        BLOCK_N=block_n,
        UPCAST=is_interpreter(),
        num_warps=4,
    )
