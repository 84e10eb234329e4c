"""Fused routed-expert SwiGLU over expert cache slots: input checks, path choice and launches.

Two paths, same result. Few (token, k) pairs per slot (decode): the GEMV kernels of ``gemv.py``,
bandwidth-bound, one weight read per block of BLOCK_M <= 8 pairs. More pairs per slot (prefill): the
grouped tl.dot kernels of ``mma.py`` over blocks of 16..64 pairs. Either way gate/up + SwiGLU writes
``h`` in the activation dtype, down writes one fp32 row per pair (and K split), and a last small
kernel adds those rows over k into ``out`` in a fixed order: deterministic, no atomics.

gpt-oss's experts (:class:`ExpertExtras`): per-expert biases on the three projections, the clamped
SwiGLU, and gate/up rows interleaved as its ``gate_up_proj`` stores them; same kernels, other constexprs.

Weights come in three formats (:func:`weight_format`): float; FP8 e4m3 with fp32 128x128 block scales;
MXFP4 as gpt-oss releases it, uint8 code bytes ``[S, N, K/32, 16]`` with uint8 e8m0 scales
``[S, N, K/32]`` passed in place of the weights and their scales, decoded in registers (4.25 bits a
weight read instead of 16).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import torch
import triton
import triton.language as tl

from hearth.kernels.moe.align import group_by_slot
from hearth.kernels.moe.gemv import down_gemv_kernel, gate_up_gemv_kernel, sum_pairs_kernel
from hearth.kernels.moe.mma import down_mma_kernel, gate_up_mma_kernel
from hearth.kernels.moe.mxfp4 import MXFP4_GROUP
from hearth.kernels.moe.reference import SWIGLU_ALPHA

SCALE_BLOCK = 128
_FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)
# Estimated pairs per distinct slot up to which the GEMV path runs (else the tl.dot path).
GEMV_MAX_PAIRS_PER_SLOT = 1.1  # measured on the H200 (bench_moe --sweep): tl.dot wins from T=4 x top-8 on
# MXFP4 experts decoded in registers: the GEMV path won up to T=32 x top-4 of 128 (1.68 pairs a slot: 961 us
# against 1,910 for tl.dot) and lost at T=128 (4.06) on the H200 (bench_moe --dtypes mxfp4 --sweep, 2026-12-02).
GEMV_MAX_PAIRS_PER_SLOT_MXFP4 = 2.0
_SUM_BLOCK = 1024

WeightFormat = Literal["float", "fp8", "mxfp4"]
Mxfp4Decode = Literal["bits", "arith"]


def weight_format(w13: torch.Tensor, s13: torch.Tensor | None) -> WeightFormat:
    """The format of expert weights as :func:`fused_moe` takes them: float (no scales), FP8 (fp32
    scales) or MXFP4 (uint8 code bytes with uint8 e8m0 scales)."""
    if s13 is None:
        return "float"
    return "mxfp4" if w13.dtype == torch.uint8 and s13.dtype == torch.uint8 else "fp8"


@dataclasses.dataclass(frozen=True)
class ExpertExtras:
    """What gpt-oss's experts add to plain SwiGLU experts.

    b13: [S, 2I] gate/up biases (in w13's row order), b2: [S, D] down biases, either may be None.
    swiglu_limit: the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, g = min(gate, l)
    (None = plain SwiGLU). interleaved: w13's rows alternate gate, up (row 2j gate j, row 2j + 1 up j)
    instead of all gate rows then all up rows."""

    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = SWIGLU_ALPHA
    interleaved: bool = False


_PLAIN = ExpertExtras()


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one kernel: output columns and K per step, warps, pipeline depth, K splits."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1  # honoured by the GEMV down kernel only

    def __post_init__(self):
        if SCALE_BLOCK % self.block_n or self.block_k & (self.block_k - 1) or self.split_k < 1:
            raise ValueError(f"block_n must divide {SCALE_BLOCK}, block_k be a power of two, split_k >= 1: {self}")


@dataclasses.dataclass(frozen=True)
class MoeLaunch:
    """How :func:`fused_moe_launch` runs: ``gemv`` picks the path; ``block_m`` pairs per block (1 on
    the GEMV path means one pair per program in pair order, with no grouping pass). ``mxfp4_decode``:
    how MXFP4 weights are decoded in registers, ``bits`` (the default, see ``mxfp4.py``; GEMV tiles then
    need block_k >= 32; 3.9x faster at T=1 on the H200) or ``arith``, the first decode, kept for A/B rows."""

    gemv: bool
    block_m: int
    gate_up: TileConfig
    down: TileConfig
    mxfp4_decode: Mxfp4Decode = "bits"

    def __post_init__(self):
        lo, hi = (1, 8) if self.gemv else (16, 64)
        if self.block_m & (self.block_m - 1) or not lo <= self.block_m <= hi:
            raise ValueError(f"block_m must be a power of two in [1, 8] (GEMV) or [16, 64] (tl.dot): {self}")
        if self.mxfp4_decode not in ("bits", "arith"):
            raise ValueError(f"mxfp4_decode must be 'bits' or 'arith': {self}")

    def describe(self) -> str:
        g, d = self.gate_up, self.down
        path = "gemv" if self.gemv else "mma"
        return (
            f"{path} m{self.block_m} gu(n{g.block_n} k{g.block_k} w{g.num_warps} s{g.num_stages}) "
            f"dn(n{d.block_n} k{d.block_k} w{d.num_warps} s{d.num_stages} x{d.split_k})"
            + ("" if self.mxfp4_decode == "bits" else f" {self.mxfp4_decode}")
        )


def pairs_per_slot(num_pairs: int, num_slots: int) -> float:
    """Expected pairs per distinct slot when ``num_pairs`` pick uniformly among ``num_slots``."""
    distinct = num_slots * (1.0 - (1.0 - 1.0 / max(num_slots, 1)) ** num_pairs)
    return num_pairs / max(distinct, 1.0)


def default_launch(num_pairs: int, num_slots: int, fmt: WeightFormat) -> MoeLaunch:
    """The launch :func:`fused_moe` uses for ``num_pairs`` routed pairs over ``num_slots`` slots of
    experts in format ``fmt``."""
    per_slot = pairs_per_slot(num_pairs, num_slots)
    if per_slot <= (GEMV_MAX_PAIRS_PER_SLOT_MXFP4 if fmt == "mxfp4" else GEMV_MAX_PAIRS_PER_SLOT):
        # H200 sweep (2026-11-29): 8 x 512 tiles, 2 warps, 2 stages streamed 352 MB of FP8 experts in
        # 145 us (57% of HBM) at T=1 and bf16 at 87%; 2-4 rows per block lost to the tl.dot path.
        tile = TileConfig(block_n=8, block_k=512, num_warps=2, num_stages=2)
        return MoeLaunch(gemv=True, block_m=1, gate_up=tile, down=tile)
    block_m = 16 if per_slot <= 16 else 32 if per_slot <= 32 else 64
    tile = TileConfig(block_n=64, block_k=128 if fmt == "fp8" else 64, num_warps=4, num_stages=3)
    return MoeLaunch(gemv=False, block_m=block_m, gate_up=tile, down=tile)


def _check_extras(extras: ExpertExtras, w13: torch.Tensor, d: int, fmt: WeightFormat) -> None:
    s, two_i = w13.shape[:2]
    for name, bias, width in (("b13", extras.b13, two_i), ("b2", extras.b2, d)):
        if bias is not None and (
            bias.shape != (s, width)
            or bias.dtype not in _FLOAT_WEIGHTS
            or bias.stride(1) != 1
            or bias.device != w13.device
        ):
            raise ValueError(
                f"{name} must be a float [S={s}, {width}] tensor with unit last stride on "
                f"{w13.device}, got {bias.dtype} {tuple(bias.shape)}"
            )
    if fmt == "fp8" and extras.interleaved:
        raise ValueError("interleaved gate/up rows are supported for float and MXFP4 weights only")


def _check_mxfp4(w13, w2, s13, s2, d: int) -> None:
    if s2 is None or w2.dtype != torch.uint8 or s2.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weights need uint8 w2 and s2 like w13 and s13, got {w2.dtype} and "
                         f"{None if s2 is None else s2.dtype}")
    s, two_i = w13.shape[:2]
    inter = two_i // 2
    for name, blocks, scales, rows, k in (("w13", w13, s13, two_i, d), ("w2", w2, s2, d, inter)):
        groups = k // MXFP4_GROUP
        if k % MXFP4_GROUP or blocks.shape != (s, rows, groups, MXFP4_GROUP // 2) or scales.shape != blocks.shape[:3]:
            raise ValueError(
                f"MXFP4 {name} blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} must be "
                f"[S={s}, {rows}, {k}/{MXFP4_GROUP}, {MXFP4_GROUP // 2}] / [S, {rows}, {k}/{MXFP4_GROUP}]"
            )
        if blocks.stride(3) != 1 or blocks.stride(2) != MXFP4_GROUP // 2 or scales.stride(2) != 1:
            raise ValueError(f"each row of the MXFP4 {name} blocks and scales must be contiguous")


def _check_inputs(x, slot_ids, weights, w13, w2, s13, s2, out) -> None:
    t, d = x.shape
    s, two_i = w13.shape[:2]
    inter = two_i // 2
    if x.dtype not in _FLOAT_WEIGHTS or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous bf16/fp16/fp32 [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    if slot_ids.shape != weights.shape or slot_ids.shape[0] != t or weights.dtype != torch.float32:
        raise ValueError(
            f"slot_ids {tuple(slot_ids.shape)} and fp32 weights {weights.dtype} "
            f"{tuple(weights.shape)} must both be [T={t}, K]"
        )
    if out is not None and (out.shape != (t, d) or out.dtype != torch.float32 or out.device != x.device):
        raise ValueError(f"out must be fp32 [T={t}, D={d}] on {x.device}, got {out.dtype} {tuple(out.shape)}")
    if weight_format(w13, s13) == "mxfp4":
        _check_mxfp4(w13, w2, s13, s2, d)
        return
    if w13.shape[2:] != (d,) or w2.shape != (s, d, inter):
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match [S, 2I, D] / [S, D, I] with D={d}"
        )
    if w13.stride(2) != 1 or w2.stride(2) != 1 or w13.stride(1) < d or w2.stride(1) < inter:
        raise ValueError("w13 and w2 need unit stride on the last dimension and non-overlapping rows")
    if (s13 is None) != (s2 is None) or (s13 is None) != (w13.dtype in _FLOAT_WEIGHTS):
        raise ValueError(f"FP8 weights need both scale tensors and float weights none (w13 {w13.dtype})")
    if s13 is not None:
        n_i, n_d = triton.cdiv(inter, SCALE_BLOCK), triton.cdiv(d, SCALE_BLOCK)
        if s13.shape != (s, 2 * n_i, n_d) or s2.shape != (s, n_d, n_i):
            raise ValueError(
                f"scales s13 {tuple(s13.shape)} / s2 {tuple(s2.shape)} must be "
                f"[S, {2 * n_i}, {n_d}] / [S, {n_d}, {n_i}]"
            )
        if s13.dtype != torch.float32 or s2.dtype != torch.float32 or s13.stride(2) != 1 or s2.stride(2) != 1:
            raise ValueError("scales must be fp32 with unit stride on the last dimension")


def fused_moe(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    extras: ExpertExtras = _PLAIN,
) -> torch.Tensor:
    """Routed SwiGLU experts: ``out[t] += sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])``.

    x: [T, D] bf16/fp16/fp32, contiguous. slot_ids: [T, K] int (slot in [0, S), or -1 = skip the pair).
    weights: [T, K] fp32. w13: [S, 2I, D] (gate rows 0..I-1, up rows I..2I-1), w2: [S, D, I]; both
    bf16/fp16/fp32, or float8_e4m3fn with s13: [S, 2*ceil(I/128), ceil(D/128)] fp32 (gate scale rows,
    then up scale rows) and s2: [S, ceil(D/128), ceil(I/128)] fp32 (``W = W8 * s[i//128, j//128]``).
    MXFP4 (gpt-oss): w13 uint8 [S, 2I, D/32, 16] and w2 uint8 [S, D, I/32, 16] code bytes (two e2m1
    values a byte, low nibble first) with s13 uint8 [S, 2I, D/32] and s2 uint8 [S, D, I/32] e8m0
    scales, one per 32 values along K (``W = e2m1 * 2 ** (s - 127)``); D and I multiples of 32.
    The slot dimension may have any stride (slots are views into one byte buffer).
    out: optional [T, D] fp32 accumulator. Returns it (or a new one), [T, D] fp32.
    extras: biases, clamped SwiGLU, interleaved rows (gpt-oss; see :class:`ExpertExtras`).
    """
    launch = default_launch(slot_ids.numel(), w13.shape[0], weight_format(w13, s13))
    return fused_moe_launch(x, slot_ids, weights, w13, w2, s13, s2, out, launch=launch, extras=extras)


def fused_moe_launch(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None,
    s2: torch.Tensor | None,
    out: torch.Tensor | None,
    launch: MoeLaunch,
    extras: ExpertExtras = _PLAIN,
) -> torch.Tensor:
    """:func:`fused_moe` with an explicit :class:`MoeLaunch` (tests and the benchmark's sweep)."""
    _check_inputs(x, slot_ids, weights, w13, w2, s13, s2, out)
    fmt = weight_format(w13, s13)
    t, d = x.shape
    _check_extras(extras, w13, d, fmt)
    num_slots, inter = w13.shape[0], w13.shape[1] // 2
    if out is None:
        out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    num_pairs = slot_ids.numel()
    if num_pairs == 0:
        return out
    has_scale, mxfp4 = fmt == "fp8", fmt == "mxfp4"
    bits = launch.mxfp4_decode == "bits"
    if mxfp4 and (launch.gate_up.block_k < 2 or launch.down.block_k < 2):
        raise ValueError(f"MXFP4 weights need block_k >= 2 (a code byte holds two values): {launch}")
    if mxfp4 and bits and launch.gemv and min(launch.gate_up.block_k, launch.down.block_k) < MXFP4_GROUP:
        raise ValueError(f"the MXFP4 bits decode needs GEMV tiles of block_k >= {MXFP4_GROUP} (whole groups): {launch}")
    if mxfp4 and bits and launch.gemv and x.dtype == torch.bfloat16 and x.data_ptr() % 4:
        x = x.clone()  # NOTE: the GEMV reads bf16 activations as int32 pairs: rows 4-byte aligned
    block_m = launch.block_m
    flat_slots = slot_ids.reshape(-1).contiguous()  # (T*K,)
    identity = launch.gemv and block_m == 1
    if identity:
        block_slot = flat_slots.to(torch.int32)
        sorted_pairs = block_slot  # unused: the kernels read pair = block index
    else:
        sorted_pairs, block_slot = group_by_slot(slot_ids, num_slots, block_m)
    num_blocks = block_slot.numel()
    split = launch.down.split_k if launch.gemv else 1
    h = torch.empty((num_blocks * block_m, inter), dtype=x.dtype, device=x.device)  # (rows, I)
    y = torch.empty((split, num_pairs, d), dtype=torch.float32, device=x.device)  # (SPLIT, T*K, D)
    rw = weights.reshape(-1).contiguous()  # (T*K,)
    s13_, s2_ = (w13, w2) if s13 is None else (s13, s2)  # unused pointers when HAS_SCALE and MXFP4 are off
    b13_, b2_ = (w13 if b is None else b for b in (extras.b13, extras.b2))  # likewise without HAS_BIAS
    limit = extras.swiglu_limit
    act = dict(CLAMPED=limit is not None, INTERLEAVED=extras.interleaved, HAS_BIAS=extras.b13 is not None)
    activation = (limit or 0.0, extras.swiglu_alpha)
    down_bias = extras.b2 is not None
    gu, dn = launch.gate_up, launch.down
    common = (num_pairs, d, inter)
    if launch.gemv:
        gate_up_gemv_kernel[(num_blocks, triton.cdiv(inter, gu.block_n))](
            x, w13, s13_, b13_, h, sorted_pairs, block_slot, *common, slot_ids.shape[1],
            triton.cdiv(inter, SCALE_BLOCK), *activation,
            x.stride(0), w13.stride(0), w13.stride(1), s13_.stride(0), s13_.stride(1), b13_.stride(0), h.stride(0),
            HAS_SCALE=has_scale, MXFP4=mxfp4, MXFP4_BITS=bits, IDENTITY=identity, BLOCK_M=block_m, BLOCK_N=gu.block_n,
            BLOCK_K=gu.block_k, num_warps=gu.num_warps, num_stages=gu.num_stages, **act,
        )  # fmt: skip
        k_per_split = triton.cdiv(triton.cdiv(inter, split), dn.block_k) * dn.block_k
        down_gemv_kernel[(num_blocks, triton.cdiv(d, dn.block_n), split)](
            h, w2, s2_, b2_, y, rw, sorted_pairs, block_slot, *common, k_per_split,
            h.stride(0), w2.stride(0), w2.stride(1), s2_.stride(0), s2_.stride(1), b2_.stride(0), y.stride(0),
            y.stride(1), HAS_SCALE=has_scale, MXFP4=mxfp4, MXFP4_BITS=bits, HAS_BIAS=down_bias, IDENTITY=identity,
            BLOCK_M=block_m,
            BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages,
        )  # fmt: skip
    else:
        if has_scale and (gu.block_k > SCALE_BLOCK or dn.block_k > SCALE_BLOCK):
            raise ValueError(f"the tl.dot path needs block_k <= {SCALE_BLOCK} with FP8 weights: {launch}")
        # NOTE: the interpreter's bf16 tl.dot is wrong (triton 3.9 on numpy); fp32 there is exact enough.
        dot_dtype = (
            tl.float32
            if os.environ.get("TRITON_INTERPRET") == "1" or x.dtype == torch.float32
            else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
        )
        precision = "ieee" if dot_dtype == tl.float32 else "tf32"  # tf32 is ignored for 16-bit operands
        meta = dict(HAS_SCALE=has_scale, MXFP4=mxfp4, MXFP4_BITS=bits, DOT_DTYPE=dot_dtype, PRECISION=precision,
                    BLOCK_M=block_m)  # fmt: skip
        gate_up_mma_kernel[(num_blocks, triton.cdiv(inter, gu.block_n))](
            x, w13, s13_, b13_, h, sorted_pairs, block_slot, *common, slot_ids.shape[1],
            triton.cdiv(inter, SCALE_BLOCK), *activation,
            x.stride(0), w13.stride(0), w13.stride(1), s13_.stride(0), s13_.stride(1), b13_.stride(0), h.stride(0),
            BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.num_warps, num_stages=gu.num_stages, **act, **meta,
        )  # fmt: skip
        down_mma_kernel[(num_blocks, triton.cdiv(d, dn.block_n))](
            h, w2, s2_, b2_, y, rw, sorted_pairs, block_slot, *common,
            h.stride(0), w2.stride(0), w2.stride(1), s2_.stride(0), s2_.stride(1), b2_.stride(0), y.stride(1),
            HAS_BIAS=down_bias, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps,
            num_stages=dn.num_stages, **meta,
        )  # fmt: skip
    target = out if out.stride(1) == 1 else torch.zeros((t, d), dtype=torch.float32, device=x.device)
    sum_pairs_kernel[(t, triton.cdiv(d, _SUM_BLOCK))](
        y, flat_slots, target, d, slot_ids.shape[1], y.stride(0), y.stride(1), target.stride(0),
        SPLIT=split, BLOCK=_SUM_BLOCK, num_warps=4,
    )  # fmt: skip
    if target is not out:
        out += target
    return out
