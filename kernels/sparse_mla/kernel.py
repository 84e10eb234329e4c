"""DSA sparse MLA forward in absorbed (MQA) form over the paged latent cache: the Triton kernel, and the
dispatch to the Gluon kernels (`gluon_kernels.py`) that run instead on an sm_90 GPU with a bf16 cache.

For each query row r (a decode request or a prefill token) and head h:
    s[n]   = sm_scale * q[r, h, :576] . kv[slot(idx[r, n]), :576]   for valid n (0 <= idx <= limit[r])
    out    = softmax(s) @ kv[slot(idx[r, n]), :512],  lse = log sum exp s   (fp32 softmax)
The selection idx[r] (logical token positions, shared by all heads) is mapped to physical slots
through the row's block table. One program owns (row, BLOCK_H heads, one split of the selection) and
streams BLOCK_N gathered latent rows at a time through an online softmax; with several splits the
fp32 partial results are merged by a second small kernel (decode at small batch).
Latent cache: bf16 [num_blocks, block_size, 576] or FP8 uint8 [num_blocks, block_size, 656]
(512 e4m3 + 4 fp32 scales for 128-dim groups + 64 bf16 rope dims), dequantised to bf16 on load.

Design notes (FP8 latents and small batches):
- FP8 tile path (`fp8_tile=True`, the default): each gathered [BLOCK_N, 512] e4m3 tile is loaded once
  per program (16-byte cp.async rows, pipelined like the bf16 tile), the row's 4 group scales as one
  [BLOCK_N, 4] load, and the tile is dequantised once (fp32 product, broadcast over each 128-value
  group through a free reshape, rounded to bf16) into the one shared-memory operand that both dots
  of all the program's heads read. The old path (`fp8_tile=False`) gathered a scale per element
  ([BLOCK_N, 512] fp32 loads and 64-bit addresses: 149 global loads per thread and 412 bytes of
  register spills per tile when compiled for sm_90) and, its scale tile staged in shared memory,
  fitted one pipeline stage only; the tile path needs 190 KiB with two stages at BLOCK_H = BLOCK_N = 64
  (the bf16 tile 221 KiB) and spills less than the bf16 path.
- The 128 heads of a row are two 64-head programs (a [64, 512] fp32 accumulator is what 8 warps can
  hold), so a tile is gathered from HBM once and from L2 a second time.
- Splits (`launch_plan`): rows x head blocks x splits fill one wave of the device's SMs; batch 1-4
  uses 16-head blocks so that fewer splits (fewer fp32 partials to merge) fill the SMs.
- Prefetch depth: the gathered tile is the third load of a chain (selection -> block table -> latent
  row), and Triton's pipeliner gives each load (num_stages - 1) // 3 iterations of latency, so the
  default 3 stages fetch a 64-row tile one tile ahead (two 72 KiB buffers and the 72 KiB query in
  shared memory). Deeper prefetch (32- and 16-row tiles at 7-16 stages) ran slower on the H200: a tile
  costs ~1.9 us whatever its rows, the serial QK -> softmax -> PV chain of the one program an SM holds
  (docs/benchmarks.md, "Sparse MLA: deeper prefetch").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, is_interpreter, is_power_of_two, mma, require, sm_count

# Whether `sparse_mla_decode` / `sparse_mla_prefill` run the Gluon kernels (`gluon_kernels.py`: explicit
# warpgroup MMAs, a cp.async producer and two consumer warpgroups) where they can (an sm_90 GPU, a bf16 cache, or
# an FP8 one once `gluon_kernels.FP8` is on, heads in 64s: `gluon_kernels.gluon_unsupported`); the Triton kernel
# below takes every other call. H200,
# 2026-12-04 (`bench/bench_gluon_mla.py`, 128 heads, top-k 2048 of 32K): decode 13.4 / 35.4 / 111.7 us at batch
# 1 / 8 / 64 against this kernel's 13.8 / 46.1 / 166.6 (327 against 219 TFLOP/s at 64); prefill of 4,096 queries
# 5.91 against 9.81 ms (396 against 238 TFLOP/s).
GLUON_DECODE = True
GLUON_PREFILL = True
D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE
FP8_TOKEN_BYTES = 656
LOG2E = 1.4426950408889634
H200_SMS = 132


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr,
    kv_ptr,
    kv_f32_ptr,
    kv_bf16_ptr,
    idx_ptr,
    table_ptr,
    limit_ptr,
    limit_bias,
    o_ptr,
    lse_ptr,
    H,
    TOPK,
    CHUNK,
    qk_scale,
    stride_q_r,
    stride_q_h,
    stride_idx_r,
    stride_table_r,
    stride_o_r,
    stride_o_s,
    stride_o_h,
    stride_lse_r,
    stride_lse_s,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_TILE: tl.constexpr,
    PARTIAL: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    UPCAST: tl.constexpr,
    Q_RELOAD: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_v = tl.arange(0, DV)
    o_e = tl.arange(0, DR)
    o_g = tl.arange(0, 4)
    i_r64 = i_r.to(tl.int64)
    p_q = q_ptr + i_r64 * stride_q_r + o_h[:, None] * stride_q_h
    if not Q_RELOAD:
        b_q = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)  # (BLOCK_H, 512)
        b_qe = tl.load(p_q + DV + o_e[None, :], mask=m_h[:, None], other=0.0)  # (BLOCK_H, 64)
    n_limit = tl.load(limit_ptr + i_r) + limit_bias  # (decode: context_lens - 1)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    i_start = i_s * CHUNK
    i_end = tl.minimum(i_start + CHUNK, TOPK)
    for i0 in range(i_start, i_end, BLOCK_N):
        o_n = i0 + tl.arange(0, BLOCK_N)
        b_idx = tl.load(idx_ptr + i_r64 * stride_idx_r + o_n, mask=o_n < i_end, other=-1)
        m_n = (b_idx >= 0) & (b_idx <= n_limit)
        b_idx = tl.where(m_n, b_idx, 0)
        b_page = tl.load(table_ptr + i_r64 * stride_table_r + b_idx // BLOCK_SIZE, mask=m_n, other=0)
        b_slot = b_page.to(tl.int64) * BLOCK_SIZE + b_idx % BLOCK_SIZE
        if IS_FP8:
            p_kv = kv_ptr + b_slot[:, None] * 656 + o_v[None, :]
            b_raw = tl.load(p_kv, mask=m_n[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            if FP8_TILE:
                # the row's 4 group scales once ([BLOCK_N, 4]), broadcast over each 128-value group
                p_sc = kv_f32_ptr + b_slot[:, None] * 164 + 128 + o_g[None, :]
                b_sc = tl.load(p_sc, mask=m_n[:, None], other=0.0)
                b_kv = tl.reshape(b_raw.to(tl.float32), (BLOCK_N, 4, DV // 4)) * b_sc[:, :, None]
                b_kv = tl.reshape(b_kv, (BLOCK_N, DV)).to(tl.bfloat16)
            else:
                # old path: one scale load per element ([BLOCK_N, 512] fp32 gathers)
                p_sc = kv_f32_ptr + b_slot[:, None] * 164 + 128 + (o_v // 128)[None, :]
                b_sc = tl.load(p_sc, mask=m_n[:, None], other=0.0)
                b_kv = (b_raw.to(tl.float32) * b_sc).to(tl.bfloat16)
            b_ke = tl.load(kv_bf16_ptr + b_slot[:, None] * 328 + 264 + o_e[None, :], mask=m_n[:, None], other=0.0)
        else:
            p_kv = kv_bf16_ptr + b_slot[:, None] * (DV + DR)
            b_kv = tl.load(p_kv + o_v[None, :], mask=m_n[:, None], other=0.0)
            b_ke = tl.load(p_kv + DV + o_e[None, :], mask=m_n[:, None], other=0.0)
        if Q_RELOAD:
            # re-read q (L1/L2 hits) so it is staged through shared memory, not held in registers
            b_q = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)
            b_qe = tl.load(p_q + DV + o_e[None, :], mask=m_h[:, None], other=0.0)
        b_s = mma(b_q, tl.trans(b_kv), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), UPCAST)
        b_s = mma(b_qe, tl.trans(b_ke), b_s, UPCAST)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))  # log2 domain
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = mma(b_p.to(tl.bfloat16), b_kv, b_acc * b_alpha[:, None], UPCAST)
        b_m = b_m_new
    m_any = b_l > 0
    b_out = b_acc / tl.where(m_any, b_l, 1.0)[:, None]
    b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    p_o = o_ptr + i_r64 * stride_o_r + i_s * stride_o_s + o_h[:, None] * stride_o_h + o_v[None, :]
    if PARTIAL:
        tl.store(p_o, b_out, mask=m_h[:, None])
    else:
        tl.store(p_o, b_out.to(o_ptr.dtype.element_ty), mask=m_h[:, None])
    tl.store(lse_ptr + i_r64 * stride_lse_r + i_s * stride_lse_s + o_h, b_lse, mask=m_h)


@triton.jit(do_not_specialize=["S"])  # the split count follows the step's rows; it bounds a loop only
def _sparse_mla_combine_kernel(
    po_ptr,
    plse_ptr,
    o_ptr,
    lse_ptr,
    H,
    S,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
):
    """Merge S partial (out, lse) of one (row, head): po fp32 [R, S, H, DV], plse [R, S, H].

    One program per (row, head, BLOCK_D columns): BLOCK_S splits are loaded in one [BLOCK_S, BLOCK_D]
    tile (all loads in flight at once; a loop over splits with few programs is latency-bound)."""
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_d = tl.program_id(2)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    b_max = tl.full([], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < S
        b_lse = tl.load(plse_ptr + (i_r * S + o_s) * H + i_h, mask=m_s, other=float("-inf"))
        b_new = tl.maximum(b_max, tl.max(b_lse, axis=0))
        b_use = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_alpha = tl.exp(b_max - b_use)
        b_wt = tl.exp(b_lse - b_use)  # 0 for empty splits (lse -inf)
        p_o = po_ptr + ((i_r * S + o_s) * H + i_h)[:, None] * DV + o_d[None, :]
        b_o = tl.load(p_o, mask=m_s[:, None], other=0.0)
        b_sum = b_sum * b_alpha + tl.sum(b_wt, axis=0)
        b_acc = b_acc * b_alpha + tl.sum(b_wt[:, None] * b_o, axis=0)
        b_max = b_new
    m_any = b_sum > 0
    b_out = b_acc / tl.where(m_any, b_sum, 1.0)
    tl.store(o_ptr + (i_r * H + i_h) * DV + o_d, b_out.to(o_ptr.dtype.element_ty))
    if i_d == 0:
        b_use = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_lse = tl.where(m_any, b_use + tl.log(tl.where(m_any, b_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + i_r * H + i_h, b_lse)


def _check_cache(kv_cache: torch.Tensor, device: torch.device) -> tuple[int, bool]:
    check_tensor("kv_cache", kv_cache, dtypes=(torch.bfloat16, torch.uint8), ndim=3, device=device)
    block_size = kv_cache.shape[1]
    is_fp8 = kv_cache.dtype == torch.uint8
    width = FP8_TOKEN_BYTES if is_fp8 else D_QK
    require(
        kv_cache.shape[2] == width,
        f"kv_cache must be [num_blocks, block_size, {width}] for {kv_cache.dtype}, got {tuple(kv_cache.shape)}",
    )
    require(
        is_power_of_two(block_size) and block_size >= 16,
        f"block_size (kv_cache.shape[1]) must be a power of two >= 16, got {block_size}",
    )
    return block_size, is_fp8


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device; the CPU interpreter plans as for an H200 (132)."""
    return sm_count(device, H200_SMS)


def launch_plan(n_rows: int, heads: int, topk: int, is_fp8: bool, sm_count: int, config: dict | None = None) -> dict:
    """Tile sizes and split count of one launch; `config` entries override the plan's.

    Split-K fills the GPU when rows x head blocks alone cannot: one wave of at most `sm_count`
    programs (one program per SM: the tiles need 190-221 KiB of shared memory), each split at least
    one BLOCK_N tile. With very few rows (decode at batch <= 4) 16-head blocks give 4x the programs
    for the same split count (and 4x fewer fp32 partials to merge than 64-head blocks with 4x the
    splits); their dot falls back from wgmma to mma.sync, which at one or two tiles per program costs
    less than the extra partial traffic."""
    # The one-wave plan is the default for both caches: on the H200 (bench_dsa --only decode_mla,
    # 2026-12-02) it beat the earlier plan (64-head blocks, splits aiming at 264 programs; plan="h200",
    # kept for A/B rows) with the bf16 cache at batch 1 (13.8 vs 16.4 us) and 8 (45.7 vs 58.3), equal at 64.
    cfg = {"block_n": 64, "num_warps": 8, "q_reload": False, "fp8_tile": True, "plan": "wave"} | (config or {})
    if cfg["plan"] not in ("wave", "h200"):
        raise ValueError(f"plan must be 'wave' or 'h200', got {cfg['plan']!r}")
    wave = cfg["plan"] == "wave"
    if cfg.get("block_h") is None:
        few_rows = wave and n_rows * triton.cdiv(heads, 64) * 16 <= sm_count
        cfg["block_h"] = 16 if few_rows else 64
    cfg["block_h"] = min(cfg["block_h"], max(16, triton.next_power_of_2(heads)))
    row_programs = max(1, n_rows * triton.cdiv(heads, cfg["block_h"]))
    tiles = triton.cdiv(topk, cfg["block_n"])
    splits = cfg.get("splits")
    if splits is None and wave:
        splits = 1 if 4 * row_programs >= 3 * sm_count else max(1, min(tiles, sm_count // row_programs))
    elif splits is None:
        splits = 1 if row_programs >= 96 else min(tiles, triton.cdiv(264, row_programs))
    chunk = max(triton.cdiv(triton.cdiv(topk, splits), cfg["block_n"]), 1) * cfg["block_n"]
    cfg["chunk"] = chunk
    cfg["splits"] = max(1, triton.cdiv(topk, chunk))
    if cfg.get("num_stages") is None:
        # the element-wise FP8 path (fp8_tile=False) only fits one stage in shared memory. Where the rows fill
        # the GPU without splits, 3 stages: batch 64 on the H200 (bench_dsa --only decode_mla --sweep,
        # 2026-12-02) 167 vs 179 us with the bf16 cache and 201 vs 216 us with the FP8 tile path
        cfg["num_stages"] = 1 if is_fp8 and not cfg["fp8_tile"] else 3 if cfg["splits"] == 1 else 2
    return cfg


def _outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [rows, H, 512] bf16 and lse [rows, H] fp32: those given, checked, or new ones."""
    n_rows, heads, _ = q.shape
    if out is None:
        out = torch.empty(n_rows, heads, D_LATENT, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(n_rows, heads, dtype=torch.float32, device=q.device)
    check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(n_rows, heads, D_LATENT), device=q.device)
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(n_rows, heads), device=q.device)
    return out, lse


def _gluon_wanted(config: dict | None, default: bool) -> bool:
    """Whether a call asks for the Gluon kernels: config {"gluon": bool} says so; any other config entry (a
    Triton launch override) selects the Triton kernel; no config: the module's default for the call's kind."""
    if config is not None and "gluon" in config:
        return bool(config["gluon"])
    return default and not config


def _launch(q, kv_cache, indices, table, stride_table_r, limits, limit_bias, sm_scale, config, out=None, lse=None,
            gluon: bool = False):
    n_rows, heads, _ = q.shape
    topk = indices.shape[1]
    block_size, is_fp8 = _check_cache(kv_cache, q.device)
    out, lse = _outputs(q, out, lse)
    if n_rows == 0:
        return out, lse
    if _gluon_wanted(config, gluon):
        from hearth.kernels.sparse_mla import gluon_kernels  # (imports this module)

        if gluon_kernels.gluon_unsupported(q, kv_cache) is None:
            return gluon_kernels.gluon_launch(q, kv_cache, indices, table, stride_table_r, limits, limit_bias,
                                              sm_scale, out, lse)
    config = {k: v for k, v in (config or {}).items() if k != "gluon"}
    cfg = launch_plan(n_rows, heads, topk, is_fp8, _sm_count(q.device), config)
    block_h, chunk, splits = cfg["block_h"], cfg["chunk"], cfg["splits"]
    n_hb = triton.cdiv(heads, block_h)
    partial = splits > 1
    if partial:
        po = torch.empty(n_rows, splits, heads, D_LATENT, dtype=torch.float32, device=q.device)
        plse = torch.empty(n_rows, splits, heads, dtype=torch.float32, device=q.device)
    else:
        po, plse = out.unsqueeze(1), lse.unsqueeze(1)
    kv_u8 = kv_cache if is_fp8 else kv_cache.view(torch.uint8)
    kv_f32 = kv_cache.view(torch.float32)
    kv_bf16 = kv_cache.view(torch.bfloat16)
    grid = (n_rows, n_hb, splits)
    _sparse_mla_fwd_kernel[grid](
        q,
        kv_u8,
        kv_f32,
        kv_bf16,
        indices,
        table,
        limits,
        limit_bias,
        po,
        plse,
        heads,
        topk,
        chunk,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        indices.stride(0),
        stride_table_r,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        plse.stride(0),
        plse.stride(1),
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_N=cfg["block_n"],
        IS_FP8=is_fp8,
        FP8_TILE=cfg["fp8_tile"],
        PARTIAL=partial,
        DV=D_LATENT,
        DR=D_ROPE,
        UPCAST=is_interpreter(),
        Q_RELOAD=cfg["q_reload"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if partial:
        # NOTE: one program per (row, head, 128 columns): at batch 1 (128 heads, 32 splits) the merge
        # reads 8 MiB of fp32 partials; the earlier (row, 16 heads) grid ran 8 programs, each
        # looping over the splits, and took longer than the attention itself (15.7 us on the H200)
        block_d = 128
        _sparse_mla_combine_kernel[(n_rows, heads, D_LATENT // block_d)](
            po,
            plse,
            out,
            lse,
            heads,
            splits,
            BLOCK_S=min(32, triton.next_power_of_2(splits)),
            BLOCK_D=block_d,
            DV=D_LATENT,
            num_warps=4,
        )
    return out, lse


def _check_q_indices(q, indices, n_rows_name):
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=3, contiguous=False)
    require(
        q.shape[2] == D_QK and q.stride(2) == 1,
        f"q must be [{n_rows_name}, H, 576] with unit last stride, got {tuple(q.shape)}",
    )
    check_tensor("indices", indices, dtypes=(torch.int32,), ndim=2, contiguous=False, device=q.device)
    require(
        indices.shape[0] == q.shape[0] and indices.stride(1) == 1,
        f"indices must be [{n_rows_name}, topk] with unit last stride, got {tuple(indices.shape)}",
    )


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode, absorbed form.

    Args:
        q: [B, H, 576] bf16 (512 absorbed q_nope then 64 rope dims), unit last stride.
        kv_cache: bf16 [num_blocks, block_size, 576] or uint8 [num_blocks, block_size, 656] (FP8), contiguous.
        indices: [B, topk] int32 logical token positions, -1 = none (shared by all heads).
        block_table: [B, max_blocks] int32, unit last stride.
        context_lens: [B] int32; index i is used iff 0 <= i < context_lens[b].
        sm_scale: softmax scale (0.13523378 DeepSeek-V3.2, 0.0625 GLM-5).
        out, lse: optional preallocated outputs (shapes and dtypes as returned), e.g. for CUDA graphs.
        config: optional overrides of `launch_plan` (block_h, block_n, num_warps, num_stages, splits,
            q_reload, fp8_tile: False selects the old per-element FP8 dequantisation), which select the Triton
            kernel; {"gluon": False} selects it as planned, {"gluon": True} the Gluon kernels where they can
            run (`GLUON_DECODE` / `GLUON_PREFILL`: the default).
    Returns:
        out [B, H, 512] bf16 (zeros where no index is valid), lse [B, H] fp32 natural-log
        log-sum-exp of the scaled scores (-inf where none is valid).
    """
    out, lse = check_decode(q, kv_cache, indices, block_table, context_lens, out, lse)
    return _launch(q, kv_cache, indices, block_table, block_table.stride(0), context_lens, -1, sm_scale, config, out,
                   lse, gluon=GLUON_DECODE)


def check_decode(q, kv_cache, indices, block_table, context_lens, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla_decode`'s argument checks (ValueError naming the argument); returns (out, lse), new where None."""
    _check_q_indices(q, indices, "B")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, contiguous=False, device=q.device)
    require(
        block_table.shape[0] == q.shape[0] and block_table.stride(1) == 1,
        "block_table must be [B, max_blocks] with unit last stride",
    )
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), shape=(q.shape[0],), device=q.device)
    _check_cache(kv_cache, q.device)
    return _outputs(q, out, lse)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill for one request's chunk, absorbed form, per-query selections.

    Args:
        q: [T, H, 576] bf16, unit last stride.
        kv_cache: as in `sparse_mla_decode` (the chunk's latents already written).
        indices: [T, topk] int32 logical positions; index i is used iff 0 <= i <= positions[t] (causal).
        block_table: [max_blocks] int32, the request's pages.
        positions: [T] int32, each query's position in the request.
        sm_scale: softmax scale.
        out, lse, config: as in `sparse_mla_decode`.
    Returns:
        out [T, H, 512] bf16, lse [T, H] fp32 (natural log).
    """
    _check_q_indices(q, indices, "T")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=1, device=q.device)
    check_tensor("positions", positions, dtypes=(torch.int32,), shape=(q.shape[0],), device=q.device)
    return _launch(q, kv_cache, indices, block_table, 0, positions, 0, sm_scale, config, out, lse,
                   gluon=GLUON_PREFILL)


def default_sm_scale(qk_head_dim: int = 192, yarn_factor: float | None = 40.0) -> float:
    """DeepSeek-V3.2's MLA softmax scale qk_head_dim^-0.5 * (0.1 ln(factor) + 1)^2 (no YaRN: plain)."""
    mscale = 1.0 if yarn_factor is None else 0.1 * math.log(yarn_factor) + 1.0
    return qk_head_dim**-0.5 * mscale * mscale
