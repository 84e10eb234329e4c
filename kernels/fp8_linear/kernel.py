"""FP8 block-scaled linear layers without a dequantised weight in memory: y = x W^T, W e4m3 with one
fp32 scale per 128 x 128 block (``weight_scale_inv`` in DeepSeek / GLM checkpoints).

Two kernels, one result:
- ``gemv_kernel`` (decode of one request): bandwidth-bound. Each program streams BLOCK_N weight rows
  x a K range in (BLOCK_N, BLOCK_K) tiles; the block scales are folded into the few activation values
  (a gather of ``k // 128``), so each weight byte costs one widening and one FMA. For BLOCK_M == 1 the
  products accumulate in a 2-D register tile and are reduced once at the end. K is split across
  programs when the output alone gives too few programs to fill the GPU; splits write fp32 partial rows
  and ``sum_splits_kernel`` adds them in a fixed order (deterministic, no atomics).
- ``gemm_kernel`` (decode batches and prefill): tl.dot tiles; each weight tile is widened and multiplied
  by its block scales in registers, rounded to the activation dtype exactly as the reference dequantises,
  then fed to the tensor cores. For a few rows (a decode batch) one row tile covers them and K is split
  across programs, so the weight is still read once at full bandwidth.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, is_interpreter, mma, require, round_to_bf16

SCALE_BLOCK = 128
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# NOTE: M (the step's rows) changes with every step and only masks rows: not specialised, so a new
# row count never compiles a new variant (16 | M, M == 1) in the middle of a request.
@triton.jit(do_not_specialize=["M"])
def gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[split, m, n] = sum over this split's k of x[m, k] * s[n // 128, k // 128] * W8[n, k]."""
    i_n = tl.program_id(0)
    i_s = tl.program_id(1)
    i_m = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    p_s = s_ptr + ((i_n * BLOCK_N) // 128) * stride_sn  # BLOCK_N divides 128: one scale row per tile
    p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm  # (BM, 1)
    k_start = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_end
            b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(x_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_x = b_x * tl.load(p_s + o_k // 128, mask=m_k, other=0.0)
            acc2 += b_w.to(tl.float32) * b_x[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BN)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_end
            b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # (BN, BK)
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_x = b_x * tl.load(p_s + o_k // 128, mask=m_k, other=0.0)[None, :]  # (BM, BK)
            acc += tl.sum(b_x[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)  # (BM, BN)
    p_y = y_ptr + i_s * stride_ys + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def sum_splits_kernel(p_ptr, y_ptr, MN, stride_ps, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum over splits of p[split, i] (fixed order), cast to y's dtype."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i_s in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + i_s * stride_ps + o, mask=m, other=0.0)
    tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["M"])  # (see gemv_kernel)
def gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """y[split, m, n] = sum over the split's k of x[m, k] * round(W8[n, k] * s[n // 128, k // 128]) for one
    (BLOCK_M, BLOCK_N) tile; program axis 1 is the K split (1 for prefill, several for skinny decode batches)."""
    pid = tl.program_id(0)
    i_s = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # grouped order: GROUP_M row tiles share each weight tile while it is in L2
    first_m = (pid // group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    i_m = first_m + (pid % group) % rows
    i_n = (pid % group) // rows
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn  # (BN, 1): W rows, K contiguous
    p_s = s_ptr + (o_n // 128) * stride_sn  # (BN,)
    k_start = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_end
        a = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)  # (BM, BK)
        b = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # (BN, BK) fp8
        s = tl.load(p_s + k0 // 128, mask=m_n, other=0.0)  # BLOCK_K divides 128: one scale column
        b = b.to(tl.float32) * s[:, None]
        if ROUND_BF16:  # the CPU interpreter's fp32 -> bf16 cast truncates; round as the GPU does
            b = round_to_bf16(b)
        acc = mma(a, tl.trans(b.to(x_ptr.dtype.element_ty)), acc, UPCAST)
    p_y = y_ptr + i_s * stride_ys + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """The one-row kernel: output rows and K per tile, warps, and the programs K splits aim for."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    min_programs: int = 4 * 132  # split K until the grid has this many programs (4 per H200 SM)

    def __post_init__(self) -> None:
        require(SCALE_BLOCK % self.block_n == 0 and self.block_k % SCALE_BLOCK == 0,
                f"block_n must divide {SCALE_BLOCK} and block_k be a multiple of it: {self}")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The tl.dot kernel's tile; ``min_programs`` > 0 splits K until the grid has that many programs."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    min_programs: int = 0

    def __post_init__(self) -> None:
        require(SCALE_BLOCK % self.block_k == 0, f"block_k must divide {SCALE_BLOCK}: {self}")


PREFILL = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)  # H200 sweep's best
SKINNY_ROWS = 64  # up to this many rows the tl.dot kernel runs one row tile with K split (decode batches)


def skinny(m: int) -> GemmConfig:
    """Decode batches of 2..SKINNY_ROWS rows: one row tile, narrow column tiles, K split to fill the GPU."""
    return GemmConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=64, block_k=128, group_m=1,
                      num_warps=4, num_stages=4, min_programs=2 * 132)


def check_weights(weight: torch.Tensor, scale_inv: torch.Tensor, device: torch.device | None = None) -> None:
    """ValueError unless weight is a contiguous 2-D e4m3 tensor and scale_inv its fp32 block scales."""
    check_tensor("weight", weight, dtypes=(torch.float8_e4m3fn,), ndim=2, device=device)
    n, k = weight.shape
    check_tensor("scale_inv", scale_inv, dtypes=(torch.float32,),
                 shape=(triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)), device=weight.device)


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=_ACT_DTYPES, ndim=2, contiguous=False)
    require(x.stride(-1) == 1, f"x must be contiguous along K (strides {x.stride()})")
    require(x.shape[1] == weight.shape[-1], f"x has {x.shape[1]} features, weight expects {weight.shape[-1]}")
    check_weights(weight, scale_inv, x.device)


def _split(k: int, block_k: int, tiles: int, min_programs: int) -> tuple[int, int]:
    """(splits, K per split): split K (in whole BLOCK_K steps) until tiles * splits >= min_programs."""
    steps = triton.cdiv(k, block_k)
    split = max(1, min(steps, triton.cdiv(min_programs, tiles))) if min_programs else 1
    per_split = triton.cdiv(steps, split) * block_k
    return triton.cdiv(k, per_split), per_split


def _sum_splits(partial: torch.Tensor, y: torch.Tensor) -> None:
    block = 1024
    sum_splits_kernel[(triton.cdiv(y.numel(), block),)](partial, y, y.numel(), partial.stride(0),
                                                        SPLIT=partial.shape[0], BLOCK=block)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
             config: GemvConfig | None = None, *, checked: bool = False) -> torch.Tensor:
    """y = x W^T for few rows of x (one is where it pays); x (M, K), weight (N, K) e4m3, scale (N/128, K/128).
    Default tile (H200 sweep, bench_fp8_linear --sweep): 8 rows for long rows (K >= 4096), else 16.
    ``checked``: the caller has validated the arguments (skips about 10 us of host checks per call)."""
    if not checked:
        _check(x, weight, scale_inv)
    m, k = x.shape
    n = weight.shape[0]
    config = config or GemvConfig(block_n=8 if k >= 4096 else 16)
    block_m = 1 if m == 1 else min(8, triton.next_power_of_2(m))
    n_tiles, m_tiles = triton.cdiv(n, config.block_n), triton.cdiv(m, block_m)
    split, k_per_split = _split(k, config.block_k, n_tiles * m_tiles, config.min_programs)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    gemv_kernel[(n_tiles, split, m_tiles)](
        x, weight, scale_inv, out, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0) if split > 1 else 0, n,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
    )
    if split > 1:
        _sum_splits(out, y)
    return y


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
             config: GemmConfig | None = None, *, checked: bool = False) -> torch.Tensor:
    """y = x W^T with tensor-core tiles; same arguments as :func:`fp8_gemv`. The default tile depends on
    the rows: :func:`skinny` up to SKINNY_ROWS (decode batches), ``PREFILL`` beyond."""
    if not checked:
        _check(x, weight, scale_inv)
    m, k = x.shape
    n = weight.shape[0]
    config = config or (skinny(m) if m <= SKINNY_ROWS else PREFILL)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split, k_per_split = _split(k, config.block_k, tiles, config.min_programs)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    upcast = is_interpreter() or x.dtype == torch.float32
    gemm_kernel[(tiles, split)](
        x, weight, scale_inv, out, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0) if split > 1 else 0, n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        UPCAST=upcast, ROUND_BF16=is_interpreter() and x.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        _sum_splits(out, y)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
               weights_checked: bool = False) -> torch.Tensor:
    """y = x W^T for x (..., K): the GEMV kernel for one row, the tl.dot kernel (K split for few rows)
    otherwise. ``weights_checked``: :func:`check_weights` passed for these weights once (a layer's
    weights do not change), so each call checks only x."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weights_checked:
        require(x2.dtype in _ACT_DTYPES and x2.shape[1] == weight.shape[1] and x2.device == weight.device,
                f"x ({x2.dtype}, {x2.shape[1]} features, {x2.device}) does not fit the weight "
                f"({weight.shape[1]} features, {weight.device})")
    else:
        _check(x2, weight, scale_inv)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    gemm = fp8_gemv if x2.shape[0] == 1 else fp8_gemm
    y = gemm(x2, weight, scale_inv, checked=True)
    return y.view(*lead, weight.shape[0])
