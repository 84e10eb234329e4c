"""Lightning indexer logits over the paged FP8 indexer-key cache, and the fused indexer + top-k.

logits[q, t] = k_scale[t] * sum_h w[q, h] * relu(q[q, h] . k[t]) for t <= position(q), -inf after.
`w` carries the per-token q scale and the softmax / head scales (the caller folds them); q is e4m3
(multiplied with the e4m3 keys on the tensor cores, fp32 accumulation) or bf16 (keys widened to bf16).

Decode: B requests with `next_n` (1..4) queries each, the last `next_n` positions of the request.
Two kernels, picked by `config["kernel"]`: "persistent" (the default, `decode_persistent.py`: a fixed
grid of about two programs per SM, each streaming a balanced run of (request, split) work items with
several pages in flight; 2.6-2.8x the tiled kernel at batch >= 8 on the H200, 64-69% of HBM bandwidth at
128K) and "tiled" (`_indexer_decode_kernel` below: one program per `TILES * BLOCK_T` cache tokens of one
request; the one for tiered keys' page summaries). Both score all of a request's queries and heads
at once (keys are read once), reduce over heads in registers, and may add the first histogram of their
logits to the top-k workspace (`FUSE_HIST`): the radix select's top byte, or with `FINE_HIST` the first
digit of the one-launch select (`hearth.kernels.topk.one_launch`), which then needs one launch only.
Prefill: one request, a chunk of T queries (the last T positions) against its whole cache; one program
per (BLOCK_Q queries, BLOCK_T keys) tile loops over the heads. Neither materialises [queries, heads, keys].
Cache layout: see `hearth.kernels.indexer.cache_write`.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import (
    FP8_E4M3,
    check_tensor,
    float_order_key,
    is_interpreter,
    is_power_of_two,
    mma,
    mma_fp8,
    require,
)
from hearth.kernels.indexer import decode_cooperative
from hearth.kernels.indexer.decode_cooperative import indexer_cooperative_launch, use_fused_cooperative
from hearth.kernels.indexer.decode_persistent import persistent_config, persistent_decode_launch, sm_count
from hearth.kernels.topk import cooperative
from hearth.kernels.topk.cooperative import cooperative_topk_launch, use_cooperative
from hearth.kernels.topk.one_launch import (
    SAMPLE_SIGMAS,
    check_workspace,
    default_sample,
    fine_hist_digit,
    fine_hist_launch,
    new_one_launch_workspace,
    one_launch_plan,
    one_launch_topk_launch,
)
from hearth.kernels.topk.radix import NBINS, RADIX_BITS, WS_STRIDE, new_workspace, radix_topk_launch
from hearth.kernels.topk.sampled import new_sampled_workspace, sampled_plan, sampled_topk_launch

INDEX_DIM = 128
MAX_NEXT_N = 4


# The tiled decode kernel reads keys at 23-29% of HBM bandwidth on the H200 at every batch and length
# (docs/benchmarks.md). From its launch and its sm_90 build (compiled offline with Triton 3.6 and 3.9;
# not profiled on the GPU), several costs add up:
# - little in flight: the pipeliner gives the keys a single shared-memory buffer (one 8.4 KB tile
#   copied ahead), and the block-table load of the next tile and the scale load of this one stay
#   synchronous (they do not feed the dot), so every tile waits out at least one full memory latency
#   for 8.4 KB: ~8 KB per latency per program where an SM needs ~30 KB;
# - the grid is (B, max_blocks * block_size / (TILES * 64)), sized by the block table's width, not by
#   the contexts, and TILES keeps >= 1056 programs: at batch 1 (TILES = 1) each of ~2048 programs
#   scores one 64-token page after loading context_lens, the 8 KB query tile and the weights, so its
#   fixed work is as large as its streaming, and there is no next tile to prefetch at all;
# - the tile is small: the dot [H, 128] x [128, 64] puts the 64 tokens on N and the heads on M, so the
#   weighted sum over heads reduces across the four warps through shared memory, a barrier per tile;
# - 1056-2112 programs make a few waves of resident programs whose last one runs partly empty.
# The fp32 logits write (4 of every 136 bytes) is not the issue. The persistent kernel
# (`decode_persistent.py`) answers each: three key buffers and prefetched scales, a fixed grid with
# balanced chunks, 128-token tiles with keys as the M operand, the query tile once per work item.
@triton.jit
def _indexer_decode_kernel(
    q_ptr,
    w_ptr,
    cache_u8_ptr,
    cache_f32_ptr,
    table_ptr,
    ctx_ptr,
    logits_ptr,
    len_ptr,
    ws_ptr,
    stride_table,
    stride_logits,
    stride_blk,
    NEXT_N: tl.constexpr,
    NEXT_N_P2: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILES: tl.constexpr,
    Q_FP8: tl.constexpr,
    FUSE_HIST: tl.constexpr,
    FINE_HIST: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    WS_STRIDE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISE: tl.constexpr,
    COLD_PAGE: tl.constexpr,
    COLD_HOT: tl.constexpr,
    GROUP: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_s = tl.program_id(1)
    n_ctx = tl.load(ctx_ptr + i_b)
    if COLD_PAGE > 0:  # the cache holds GROUP summaries per page of COLD_PAGE tokens: score the cold pages'
        n_ctx = tl.maximum((n_ctx + COLD_PAGE - 1) // COLD_PAGE - COLD_HOT, 0) * GROUP
    o_j = tl.arange(0, NEXT_N_P2)
    m_j = o_j < NEXT_N
    o_qpos = n_ctx - NEXT_N + o_j  # position of query j
    i_row0 = i_b * NEXT_N
    if i_s == 0:
        tl.store(len_ptr + i_row0 + o_j, (tl.maximum(o_qpos + 1, 0) + GROUP - 1) // GROUP, mask=m_j)
    i_t0 = i_s * (TILES * BLOCK_T)
    if i_t0 < n_ctx:
        M: tl.constexpr = NEXT_N_P2 * H
        o_m = tl.arange(0, M)
        o_d = tl.arange(0, D)
        m_m = (o_m // H) < NEXT_N
        p_q = q_ptr + (i_row0 * H + o_m)[:, None].to(tl.int64) * D + o_d[None, :]
        b_q = tl.load(p_q, mask=m_m[:, None], other=0.0)
        b_w = tl.load(w_ptr + i_row0 * H + o_m, mask=m_m, other=0.0)
        if FUSE_HIST:
            b_hist = tl.zeros([NEXT_N_P2 * NBINS], dtype=tl.int32)
            n_skip = 0
        for i_tile in range(TILES):
            o_t = i_t0 + i_tile * BLOCK_T + tl.arange(0, BLOCK_T)
            m_t = o_t < n_ctx
            b_page = tl.load(table_ptr + i_b.to(tl.int64) * stride_table + o_t // BLOCK_SIZE, mask=m_t, other=0)
            b_page = b_page.to(tl.int64)
            o_off = o_t % BLOCK_SIZE
            p_k = cache_u8_ptr + (b_page * stride_blk + o_off * D)[:, None] + o_d[None, :]
            b_k = tl.load(p_k, mask=m_t[:, None], other=0)
            p_ks = cache_f32_ptr + b_page * (stride_blk // 4) + (BLOCK_SIZE * D // 4) + o_off
            b_ks = tl.load(p_ks, mask=m_t, other=0.0)
            b_k = b_k.to(tl.float8e4nv, bitcast=True)
            if Q_FP8:
                b_s = mma_fp8(b_q, tl.trans(b_k), tl.zeros([M, BLOCK_T], dtype=tl.float32), UPCAST, PRECISE)
            else:
                b_s = mma(b_q, tl.trans(b_k.to(tl.bfloat16)), tl.zeros([M, BLOCK_T], dtype=tl.float32), UPCAST)
            b_s = tl.maximum(b_s, 0.0) * b_w[:, None]  # (M, BLOCK_T)
            b_l = tl.sum(tl.reshape(b_s, [NEXT_N_P2, H, BLOCK_T]), axis=1) * b_ks[None, :]  # (J, BLOCK_T)
            m_valid = m_j[:, None] & m_t[None, :] & (o_t[None, :] <= o_qpos[:, None])
            b_l = tl.where(m_valid, b_l, float("-inf"))
            if GROUP > 1:  # the best of every GROUP consecutive logits (a page's score from its summaries)
                b_g = tl.max(tl.reshape(b_l, [NEXT_N_P2, BLOCK_T // GROUP, GROUP]), axis=2)
                o_g = (i_t0 + i_tile * BLOCK_T) // GROUP + tl.arange(0, BLOCK_T // GROUP)
                p_g = logits_ptr + (i_row0 + o_j)[:, None].to(tl.int64) * stride_logits + o_g[None, :]
                tl.store(p_g, b_g, mask=m_j[:, None] & (o_g * GROUP < n_ctx)[None, :])
            else:
                p_l = logits_ptr + (i_row0 + o_j)[:, None].to(tl.int64) * stride_logits + o_t[None, :]
                tl.store(p_l, b_l, mask=m_j[:, None] & m_t[None, :])
            if FUSE_HIST:
                b_bin = o_j[:, None] * NBINS + fine_hist_digit(float_order_key(b_l), FINE_HIST, NBINS, BITS)
                b_bin = tl.where(m_valid, b_bin, 0)
                b_hist += tl.histogram(tl.reshape(b_bin, [NEXT_N_P2 * BLOCK_T]), NEXT_N_P2 * NBINS)
                n_skip += tl.sum(tl.sum((~m_valid).to(tl.int32), axis=1), axis=0)
        if FUSE_HIST:
            o_h = tl.arange(0, NEXT_N_P2 * NBINS)
            b_hist -= tl.where(o_h == 0, n_skip, 0)
            p_h = ws_ptr + (i_row0 + o_h // NBINS).to(tl.int64) * WS_STRIDE + o_h % NBINS
            tl.atomic_add(p_h, b_hist, mask=(b_hist > 0) & ((o_h // NBINS) < NEXT_N))


# NOTE: T (the chunk's queries) and n_ctx (its context length) change with every prompt; Triton would
# compile a variant per divisibility of each (16 | value, value == 1), hundreds of ms on the first
# request that hits a new one (a follow-up turn's TTFT). They mask query rows and key tiles; the one
# contiguous use (the logits store's column mask) is a store per tile against H MMAs per tile.
@triton.jit(do_not_specialize=["T", "n_ctx"])
def _indexer_prefill_kernel(
    q_ptr,
    w_ptr,
    cache_u8_ptr,
    cache_f32_ptr,
    table_ptr,
    logits_ptr,
    T,
    n_ctx,
    stride_logits,
    stride_blk,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    Q_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISE: tl.constexpr,
):
    i_q = tl.program_id(0)
    i_t = tl.program_id(1)
    o_q = i_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m_q = o_q < T
    o_qpos = n_ctx - T + o_q
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    i_last = tl.minimum(i_q * BLOCK_Q + BLOCK_Q, T) - 1
    p_l = logits_ptr + o_q[:, None].to(tl.int64) * stride_logits + o_t[None, :]
    m_out = m_q[:, None] & (o_t < n_ctx)[None, :]
    # tiles entirely after the block's last query position need no scoring, only their -inf
    if i_t * BLOCK_T > n_ctx - T + i_last:
        tl.store(p_l, tl.full([BLOCK_Q, BLOCK_T], float("-inf"), dtype=tl.float32), mask=m_out)
    else:
        m_t = o_t < n_ctx
        o_d = tl.arange(0, D)
        b_page = tl.load(table_ptr + o_t // BLOCK_SIZE, mask=m_t, other=0).to(tl.int64)
        o_off = o_t % BLOCK_SIZE
        p_k = cache_u8_ptr + (b_page * stride_blk + o_off * D)[:, None] + o_d[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        if not Q_FP8:
            b_k = b_k.to(tl.bfloat16)
        b_kt = tl.trans(b_k)  # (D, BLOCK_T)
        b_ks = tl.load(cache_f32_ptr + b_page * (stride_blk // 4) + (BLOCK_SIZE * D // 4) + o_off, mask=m_t, other=0.0)
        b_acc = tl.zeros([BLOCK_Q, BLOCK_T], dtype=tl.float32)
        p_q = q_ptr + o_q[:, None].to(tl.int64) * (H * D) + o_d[None, :]
        p_w = w_ptr + o_q.to(tl.int64) * H
        for i_h in range(H):
            b_q = tl.load(p_q + i_h * D, mask=m_q[:, None], other=0.0)
            b_w = tl.load(p_w + i_h, mask=m_q, other=0.0)
            if Q_FP8:
                b_s = mma_fp8(b_q, b_kt, tl.zeros([BLOCK_Q, BLOCK_T], dtype=tl.float32), UPCAST, PRECISE)
            else:
                b_s = mma(b_q, b_kt, tl.zeros([BLOCK_Q, BLOCK_T], dtype=tl.float32), UPCAST)
            b_acc += tl.maximum(b_s, 0.0) * b_w[:, None]
        b_l = b_acc * b_ks[None, :]
        b_l = tl.where(o_t[None, :] <= o_qpos[:, None], b_l, float("-inf"))
        tl.store(p_l, b_l, mask=m_out)


def _check_cache(kv_cache: torch.Tensor, block_size: int, device: torch.device) -> None:
    require(
        is_power_of_two(block_size) and block_size >= 16, f"block_size must be a power of two >= 16, got {block_size}"
    )
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=2, device=device)
    require(
        kv_cache.shape[1] == block_size * (INDEX_DIM + 4),
        f"kv_cache must be [num_blocks, {block_size * 132}] for block_size {block_size}, got {tuple(kv_cache.shape)}",
    )


def _tiled_config(n_req: int, n_cols: int, heads: int, next_n: int) -> dict:
    block_t = 64
    total = n_req * triton.cdiv(n_cols, block_t)
    tiles = 1
    while tiles < 32 and total // (tiles * 2) >= 1056:  # keep >= ~8 waves of 132 SMs
        tiles *= 2
    return {
        "block_t": block_t,
        "tiles": tiles,
        "num_warps": 4 if heads * next_n <= 64 else 8,
        "num_stages": 2,
        "fp8_precise": True,
    }


def _check_decode(q, weights, kv_cache, block_table, context_lens, block_size) -> None:
    check_tensor("q", q, dtypes=(FP8_E4M3, torch.bfloat16), ndim=4)
    n_req, next_n, heads, dim = q.shape
    require(dim == INDEX_DIM, f"q must be [B, next_n, H, 128], got {tuple(q.shape)}")
    require(1 <= next_n <= MAX_NEXT_N, f"next_n must be in 1..{MAX_NEXT_N}, got {next_n}")
    require(is_power_of_two(heads) and heads >= 16, f"H must be a power of two >= 16, got {heads}")
    dev = q.device
    check_tensor("weights", weights, dtypes=(torch.float32,), shape=(n_req, next_n, heads), device=dev)
    _check_cache(kv_cache, block_size, dev)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, contiguous=False, device=dev)
    require(
        block_table.shape[0] == n_req and block_table.stride(1) == 1,
        "block_table must be [B, max_blocks] with unit last stride",
    )
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), shape=(n_req,), device=dev)


def lightning_indexer_decode(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    *,
    workspace: torch.Tensor | None = None,
    config: dict | None = None,
    cold_pages: tuple[int, int, int] | None = None,
    fine_hist: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode indexer logits over the paged FP8 key cache.

    Args:
        q: [B, next_n, H, 128] float8_e4m3fn or bf16, contiguous; next_n in 1..4, H a power of two
            (64 DeepSeek, 32 GLM). Query j of request b sits at position context_lens[b] - next_n + j.
        weights: [B, next_n, H] fp32 contiguous (head weights with the q scale and softmax scales folded in).
        kv_cache: uint8 [num_blocks, block_size*132] (see cache_write's layout).
        block_table: [B, max_blocks] int32, unit last stride.
        context_lens: [B] int32, tokens in the cache per request (this step's included), <= max_blocks*block_size.
        block_size: tokens per page, power of two >= 16.
        workspace: optional zeroed int32 top-k workspace [B*next_n, WS_STRIDE]: if given, the kernel adds
            the first radix-select histogram of each row to it (used by `indexer_decode_topk`).
        fine_hist: the workspace is the one-launch top-k's ([B*next_n, any stride >= 256], see
            `hearth.kernels.topk.one_launch`) and gets the histogram of its first digit (`fine_bin`).
        config: optional launch override: "kernel" ("persistent", the default, or "tiled", the default
            with cold_pages; see the module doc) and that kernel's tuning keys (persistent: block_t, programs,
            num_warps, num_stages, fp8_precise; tiled: block_t, tiles, num_warps, num_stages, fp8_precise).
        cold_pages: (page_size, hot_pages, groups): the cache holds page summaries (tiered keys: the
            mean key of every block_size tokens, `groups` per page of page_size tokens) and
            context_lens counts tokens; the kernel scores the summaries of the cold pages (all but
            the last hot_pages of ceil(context_len / page_size)) and writes each page's score, the
            best of its groups (next_n must be 1; the tiled kernel).
    Returns:
        logits: fp32 [B*next_n, max_blocks*block_size]; row b*next_n+j holds valid logits at t <= that
            query's position and -inf for later t < context_len; columns past context_len are unwritten.
            With cold_pages: [B, max_blocks*block_size // groups] page scores, the cold pages' valid.
        lengths: int32 [B*next_n], valid entries per row (position + 1, >= 0; with cold_pages the
            cold pages).
    """
    _check_decode(q, weights, kv_cache, block_table, context_lens, block_size)
    n_req, next_n, heads, dim = q.shape
    dev = q.device
    n_cols = block_table.shape[1] * block_size
    rows = n_req * next_n
    cold_page, cold_hot, group = cold_pages or (0, 0, 1)
    kernel = (config or {}).get("kernel", "tiled" if cold_pages else "persistent")
    require(kernel in ("persistent", "tiled"), f"config kernel must be 'persistent' or 'tiled', got {kernel!r}")
    require(kernel == "tiled" or cold_pages is None, "page summaries (cold_pages) are scored by the tiled kernel only")
    if kernel == "persistent":
        cfg = persistent_config(n_req, n_cols, heads, next_n, sm_count(dev)) | (config or {})
    else:
        cfg = _tiled_config(n_req, n_cols, heads, next_n) | (config or {})
    if cold_pages is not None:
        require(next_n == 1 and workspace is None, "cold_pages scores one query per request, without a workspace")
        require(cold_page >= 1 and cold_hot >= 0, f"bad cold_pages {cold_pages}")
        require(is_power_of_two(group) and cfg["block_t"] % group == 0 and n_cols % group == 0,
                f"groups ({group}) must be a power of two dividing block_t and the table's tokens")
    logits = torch.empty(rows, n_cols // group, dtype=torch.float32, device=dev)
    lengths = torch.empty(rows, dtype=torch.int32, device=dev)
    require(workspace is not None or not fine_hist, "fine_hist needs a workspace")
    if workspace is not None:
        ws_cols = None if fine_hist else WS_STRIDE
        check_tensor("workspace", workspace, dtypes=(torch.int32,), shape=(rows, ws_cols), device=dev)
        require(workspace.shape[1] >= NBINS, f"workspace rows must hold {NBINS} histogram bins")
    if kernel == "persistent":
        persistent_decode_launch(
            q, weights, kv_cache, block_table, context_lens, block_size, logits, lengths, workspace, cfg, fine_hist
        )
        return logits, lengths
    grid = (n_req, triton.cdiv(n_cols, cfg["tiles"] * cfg["block_t"]))
    _indexer_decode_kernel[grid](
        q,
        weights,
        kv_cache,
        kv_cache.view(torch.float32),
        block_table,
        context_lens,
        logits,
        lengths,
        workspace if workspace is not None else lengths,
        block_table.stride(0),
        logits.stride(0),
        kv_cache.stride(0),
        NEXT_N=next_n,
        NEXT_N_P2=triton.next_power_of_2(next_n),
        H=heads,
        D=INDEX_DIM,
        BLOCK_SIZE=block_size,
        BLOCK_T=cfg["block_t"],
        TILES=cfg["tiles"],
        Q_FP8=q.dtype == FP8_E4M3,
        FUSE_HIST=workspace is not None,
        FINE_HIST=fine_hist,
        NBINS=NBINS,
        BITS=RADIX_BITS,
        WS_STRIDE=workspace.stride(0) if workspace is not None else 0,
        UPCAST=is_interpreter(),
        PRECISE=cfg["fp8_precise"],
        COLD_PAGE=cold_page,
        COLD_HOT=cold_hot,
        GROUP=group,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return logits, lengths


# Decode top-k: the one-launch select, its first histogram added by the indexer (fused) or by a launch of its
# own after the persistent indexer without it (separate; the fused indexer needs 255 registers), against
# the radix select; indexer + top-k on the H200 (bench_dsa.py --only decode_indexer, 2026-12-03, k 2048, us):
#   radix / fused / separate  B1 8K 25.2 / 14.8 / 15.5, B1 32K 27.2 / 17.6 / 17.6, B1 128K 32.2 / 23.5 / 21.9,
#   B8 8K 29.4 / 20.8 / 19.5, B8 128K 103.8 / 88.7 / 81.1, B64 32K 177.3 / 184.8 / 152.5, B64 128K 581.1 / 639.7 /
#   521.3. So one launch everywhere, fused up to 2^15 (row, token) pairs.
ONE_LAUNCH_FUSED_MAX_WORK = 1 << 15

# Kept one-launch workspaces per (device, stream): the select leaves its workspace as it found it, so one
# allocation serves every later call on that stream (calls on one stream run in order). Outgrown ones stay
# referenced: a CUDA graph captured with one keeps its address.
_KEPT_ONE_LAUNCH: dict[tuple[torch.device, int, int, int], list[torch.Tensor]] = {}


def kept_one_launch_workspace(rows: int, plan, device: torch.device) -> torch.Tensor:
    """A clean one-launch workspace of `rows` rows for `plan`, kept for later calls on the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    kept = _KEPT_ONE_LAUNCH.setdefault((device, stream, plan.k, plan.ws_stride), [])
    if not kept or kept[-1].shape[0] < rows:
        kept.append(new_one_launch_workspace(max(rows, 2 * kept[-1].shape[0] if kept else 8), plan, device))
    return kept[-1][:rows]


def indexer_decode_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    k: int,
    *,
    fuse_hist: bool | None = None,
    config: dict | None = None,
    topk: Literal["auto", "radix", "sampled", "one_launch", "cooperative", "fused_cooperative"] = "auto",
    topk_workspace: torch.Tensor | None = None,
    hist_sample: int | None = None,
    hist_sigmas: float = SAMPLE_SIGMAS,
) -> torch.Tensor:
    """Decode indexer + exact top-k: int32 [B, next_n, k] logical token positions, -1 padded.

    Same arguments as `lightning_indexer_decode` plus k (2048 for DeepSeek-V3.2 / GLM-5). Row j of
    request b selects among positions 0..context_lens[b]-next_n+j; unsorted; no host sync.
    topk picks the selection: "auto" (the default: "fused_cooperative" where `use_fused_cooperative` allows it and
    `decode_cooperative.FUSED_COOPERATIVE` is on, at up to `decode_cooperative.AUTO_ROWS` requests and without a
    config for the indexer kernel, else
    "cooperative" where `cooperative.use_cooperative` allows it and `cooperative.COOPERATIVE` is on, else
    "one_launch", with the histogram fused where rows x the block table's token capacity is at most
    `ONE_LAUNCH_FUSED_MAX_WORK`; "radix" whenever fuse_hist is given), "cooperative"
    (`hearth.kernels.topk.cooperative`: histogram, select and finish in one launch for a few rows on a GPU; its
    workspace as "one_launch"'s), "fused_cooperative" (`decode_cooperative`: the indexer's logits and that select in
    one launch, one query a request; config is not used), "radix" (the radix select, whose workspace is zeroed per
    call),
    "sampled" (`hearth.kernels.topk.sampled`, one launch; pass `topk_workspace` from
    `new_sampled_workspace(B * next_n, sampled_plan(max_blocks * block_size, k), device)` to keep it
    across calls, else one is zeroed here) or "one_launch" (`hearth.kernels.topk.one_launch`: the
    indexer adds the first histogram, then one selection launch; pass `topk_workspace` from
    `new_one_launch_workspace(B * next_n, one_launch_plan(k), device)` to keep it across calls: the
    selection leaves it clean, so it needs no zeroing after its allocation; without one, a workspace kept
    per device and stream serves every call, see `kept_one_launch_workspace`).
    fuse_hist: whether the indexer kernel adds the select's first histogram while it writes the logits
    (True) or a separate launch reads the logits for it (False). Default: fused for "one_launch" (its
    design), separate for "radix" (the fused radix histogram measured slower on the H200 with Triton
    3.6's tl.histogram); "sampled" has none. hist_sample: with the separate histogram of "one_launch", count
    one key in every hist_sample of long rows (`fine_hist_launch`; default `default_sample`), the select's band
    hist_sigmas standard deviations of the sample's count wide either side."""
    require(topk in ("auto", "radix", "sampled", "one_launch", "cooperative", "fused_cooperative"),
            f"topk must be auto, radix, sampled, one_launch, cooperative or fused_cooperative, got {topk!r}")
    require(topk not in ("sampled", "cooperative", "fused_cooperative") or not fuse_hist,
            f"fuse_hist: the {topk} select has no histogram to fuse")
    n_req, next_n = q.shape[0], q.shape[1]
    rows = n_req * next_n
    capacity = block_table.shape[-1] * block_size  # host-known: one choice for every replay of a graph
    if topk == "auto":
        if fuse_hist is not None:
            topk = "radix"
        elif decode_cooperative.FUSED_COOPERATIVE and n_req <= decode_cooperative.AUTO_ROWS and config is None \
                and use_fused_cooperative(n_req, next_n, capacity, q.device):
            topk = "fused_cooperative"
        elif cooperative.COOPERATIVE and use_cooperative(rows, capacity, q.device):
            topk, fuse_hist = "cooperative", False
        else:
            topk, fuse_hist = "one_launch", rows * capacity <= ONE_LAUNCH_FUSED_MAX_WORK
    if topk == "cooperative":
        require(use_cooperative(rows, capacity, q.device),
                f"the cooperative top-k does not take {rows} rows of {capacity} here (use_cooperative)")
    if topk == "fused_cooperative":
        require(use_fused_cooperative(n_req, next_n, capacity, q.device),
                f"the fused indexer + top-k does not take {n_req} x {next_n} rows of {capacity} here "
                "(use_fused_cooperative)")
        _check_decode(q, weights, kv_cache, block_table, context_lens, block_size)
        plan = one_launch_plan(k)
        ws = topk_workspace if topk_workspace is not None else kept_one_launch_workspace(rows, plan, q.device)
        out = torch.empty(rows, k, dtype=torch.int32, device=q.device)
        indexer_cooperative_launch(q, weights, kv_cache, block_table, context_lens, block_size, out, ws, plan)
        return out.view(n_req, next_n, k)
    if fuse_hist is None:
        fuse_hist = topk == "one_launch"
    ws = None  # the workspace the indexer adds its histogram to, if any
    if topk == "radix":
        ws = new_workspace(rows, q.device)
    elif topk in ("one_launch", "cooperative"):
        plan = one_launch_plan(k)
        ws = topk_workspace if topk_workspace is not None else kept_one_launch_workspace(rows, plan, q.device)
        check_workspace(ws, rows, plan, q.device)
    logits, lengths = lightning_indexer_decode(
        q,
        weights,
        kv_cache,
        block_table,
        context_lens,
        block_size,
        workspace=ws if fuse_hist else None,
        config=config,
        fine_hist=fuse_hist and topk == "one_launch",
    )
    out = torch.empty(rows, k, dtype=torch.int32, device=q.device)
    if topk == "radix":
        radix_topk_launch(logits, lengths, k, out, ws, first_pass_done=fuse_hist)
    elif topk == "cooperative":
        cooperative_topk_launch(logits, lengths, out, ws, plan)
    elif topk == "one_launch":
        sample = 1 if fuse_hist else hist_sample or default_sample(*logits.shape)  # the fused indexer counts all
        if not fuse_hist:
            fine_hist_launch(logits, lengths, k, ws, sample=sample)
        one_launch_topk_launch(logits, lengths, out, ws, plan, sample=sample, sample_sigmas=hist_sigmas)
    else:
        sampled = sampled_plan(logits.shape[1], k)
        if topk_workspace is None:
            topk_workspace = new_sampled_workspace(rows, sampled, q.device)
        sampled_topk_launch(logits, lengths, out, topk_workspace, sampled)
    return out.view(n_req, next_n, k)


def _check_prefill(q, weights, kv_cache, block_table, context_len, block_size):
    check_tensor("q", q, dtypes=(FP8_E4M3, torch.bfloat16), ndim=3)
    n_q, heads, dim = q.shape
    require(dim == INDEX_DIM, f"q must be [T, H, 128], got {tuple(q.shape)}")
    dev = q.device
    check_tensor("weights", weights, dtypes=(torch.float32,), shape=(n_q, heads), device=dev)
    _check_cache(kv_cache, block_size, dev)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=1, device=dev)
    require(
        n_q <= context_len <= block_table.shape[0] * block_size,
        f"need T <= context_len <= max_blocks*block_size, got T={n_q}, context_len={context_len}",
    )


def _prefill_config(config: dict | None) -> dict:
    return {"block_q": 64, "block_t": 128, "num_warps": 4, "num_stages": 3, "fp8_precise": False} | (config or {})


def _logits_stride(context_len: int) -> int:
    """Row stride (columns) of the prefill logits: the context padded to 16."""
    return triton.cdiv(max(context_len, 1), 16) * 16


# The prefill indexer's [rows, context] fp32 logits are held at most this many bytes at once: a chunk
# whose logits would be larger (2,048 queries x 128K: 1 GiB) is scored and selected in sub-blocks of
# query rows, each sub-block's logits freed before the next is built. The memory planner counts it
# (hearth.engine.runner.CachePlan.scratch_bytes).
PREFILL_LOGITS_BUDGET = 256 << 20


def prefill_block_rows(n_q: int, context_len: int, budget: int, align: int = 64) -> int:
    """Query rows per sub-block of a prefill chunk of n_q queries over context_len keys so that their fp32
    logits (row stride padded to 16) fit ``budget`` bytes: n_q when the whole chunk fits (one block),
    else a multiple of ``align`` (the kernel's BLOCK_Q: each sub-block's tiles then hold the rows the
    whole chunk's tiles would) when at least ``align`` rows fit, else as many as fit, at least 1."""
    rows = max(1, budget // (_logits_stride(context_len) * 4))
    if rows >= n_q:
        return max(n_q, 1)
    return rows - rows % align if rows >= align else rows


def lightning_indexer_prefill(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    block_size: int,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Prefill indexer logits of one request's chunk of queries against its whole cache.

    Args:
        q: [T, H, 128] float8_e4m3fn or bf16 contiguous; query i sits at position context_len - T + i.
        weights: [T, H] fp32 contiguous.
        kv_cache: uint8 [num_blocks, block_size*132]; the chunk's keys must already be written.
        block_table: [max_blocks] int32, the request's pages.
        context_len: host int, tokens in the cache for the request (chunk included).
        block_size: tokens per page, power of two >= 16.
    Returns:
        logits fp32 [T, context_len] (a view; row stride padded to 16): -inf after each query's position.
    """
    _check_prefill(q, weights, kv_cache, block_table, context_len, block_size)
    n_q, heads, _ = q.shape
    cfg = _prefill_config(config)
    stride = _logits_stride(context_len)
    logits = torch.empty(n_q, stride, dtype=torch.float32, device=q.device)
    if n_q > 0:
        grid = (triton.cdiv(n_q, cfg["block_q"]), triton.cdiv(context_len, cfg["block_t"]))
        _indexer_prefill_kernel[grid](
            q,
            weights,
            kv_cache,
            kv_cache.view(torch.float32),
            block_table,
            logits,
            n_q,
            context_len,
            logits.stride(0),
            kv_cache.stride(0),
            H=heads,
            D=INDEX_DIM,
            BLOCK_SIZE=block_size,
            BLOCK_Q=cfg["block_q"],
            BLOCK_T=cfg["block_t"],
            Q_FP8=q.dtype == FP8_E4M3,
            UPCAST=is_interpreter(),
            PRECISE=cfg["fp8_precise"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return logits[:, :context_len]


def indexer_prefill_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    block_size: int,
    k: int,
    *,
    config: dict | None = None,
    logits_budget: int | None = None,
) -> torch.Tensor:
    """Prefill indexer + exact top-k: int32 [T, k] logical positions (<= each query's position), -1 padded.

    Arguments as in `lightning_indexer_prefill`. Never materialises [T, H, context_len]; the fp32 logits
    are [T, context_len] when they fit ``logits_budget`` bytes (default `PREFILL_LOGITS_BUDGET`), one
    indexer launch and one selection as ever. A larger chunk runs in sub-blocks of query rows
    (`prefill_block_rows`), each scored against the keys up to its last query's position (the causal
    part only) and selected into its rows of the output before the next is scored: the same logits
    per row (bit for bit while the blocks are whole BLOCK_Qs, whose tiles hold the rows the chunk's
    would), the same selection, and at most one block's logits held. The selection is the radix select, or `torch.topk`
    past `TORCH_TOPK_MIN_WORK` (row, token) pairs of the whole chunk, where the radix select's four
    passes over the scores lose; decided once per chunk, so a split chunk selects every row with the
    method it would have used whole (a split chunk is past 2^26 pairs at the default budget, and its
    full sub-blocks alone past the threshold)."""
    n_q = q.shape[0]
    cfg = _prefill_config(config)
    budget = PREFILL_LOGITS_BUDGET if logits_budget is None else logits_budget
    rows = prefill_block_rows(n_q, context_len, budget, cfg["block_q"])
    many = n_q * context_len > TORCH_TOPK_MIN_WORK
    if rows >= n_q:
        return _prefill_block_topk(q, weights, kv_cache, block_table, context_len, block_size, k, cfg, many)
    _check_prefill(q, weights, kv_cache, block_table, context_len, block_size)
    out = torch.empty(n_q, k, dtype=torch.int32, device=q.device)
    first = context_len - n_q  # query i sits at position first + i
    for a in range(0, n_q, rows):
        b = min(a + rows, n_q)
        _prefill_block_topk(q[a:b], weights[a:b], kv_cache, block_table, first + b, block_size, k, cfg, many,
                            out=out[a:b])
    return out


def _prefill_block_topk(q, weights, kv_cache, block_table, context_len, block_size, k, cfg, many,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """One block of queries (the last q.shape[0] positions of context_len): logits, then the top-k into
    ``out`` (allocated when None); the logits are freed on return."""
    logits = lightning_indexer_prefill(q, weights, kv_cache, block_table, context_len, block_size, config=cfg)
    n_q = q.shape[0]
    if many:
        return _torch_topk_rows(logits, k, out)
    lengths = (context_len - n_q + 1 + torch.arange(n_q, device=q.device, dtype=torch.int32)).contiguous()
    if out is None:
        out = torch.empty(n_q, k, dtype=torch.int32, device=q.device)
    if n_q > 0:
        radix_topk_launch(logits, lengths, k, out, new_workspace(n_q, q.device))
    return out


# Top-k of many long rows (bench_topk.py on the H200, 2026-12-01, k 2048): the radix select beats torch.topk up
# to 64 x 64K rows (128 vs 145 us) and loses past that (64 x 128K: 229 vs 195 us; 4096 prefill rows: 0.5-0.6x).
TORCH_TOPK_MIN_WORK = 1 << 22


def _torch_topk_rows(logits: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [T, k] indices of each row's k largest logits, -1 for the -inf entries past a query's position
    (and past the row when it is shorter than k); into ``out`` when given."""
    n_q, n = logits.shape
    if out is None:
        out = torch.full((n_q, k), -1, dtype=torch.int32, device=logits.device)
    else:
        out.fill_(-1)
    values, idx = torch.topk(logits, min(k, n), dim=1, sorted=False)
    out[:, : idx.shape[1]] = torch.where(torch.isneginf(values), -1, idx).to(torch.int32)
    return out
