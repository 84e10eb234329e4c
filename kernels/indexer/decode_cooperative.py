"""The decode indexer and the cooperative top-k in one launch, for a few rows of one query each (K2 item 1).

Why. At batch 1 the indexer (`decode_persistent`) and the cooperative top-k (`hearth.kernels.topk.cooperative`)
are two launches: on the H200 (2026-12-04, b1 x 128K) 8.7 us and ~9-10 us, 18.8-19.1 us together. The second
starts its work only once the last program of the first has written its logits (PDL hides the launch, not the
tail), then loads the slice those programs just wrote. Here program (row, slice) of the cooperative grid
computes its own slice's logits first and goes straight on to the select with them: no second launch, no wait
on the indexer's slowest program before the first barrier (which waits for every program of the row anyway),
and the slice never leaves the SM's reach.

Per program: the slice's page ids and key scales are loaded up front (they are in flight while the keys are
scored); the keys, chunk by chunk of `BLOCK_T` tokens, each chunk one [BLOCK_T, 128] e4m3 tile scored against
the request's query as `decode_persistent` does (keys x q^T -> [BLOCK_T, H] on the fp8 MMA; Triton's pipeliner
has the next chunks' keys in flight), relu, weighted over heads, stored to the logits row. After a block barrier
the program reads its slice back (its own stores, visible to its threads), scales it by the keys' scales, stores
the scaled logits (the single-program finish re-reads the row) and runs `cooperative_select`. The math is the
persistent kernel's: logit = (sum_h w_h * relu(q_h . k)) * k_scale in fp32 (only the reduction tree over heads may
differ), one query per request at position context_len - 1, so every token of the context is a candidate.

Where. One query per request (next_n == 1), at most `cooperative.MAX_ROWS` rows, `fused_plan`'s programs a row
(each row's keys spread over them by its length, whole chunks a program); never under the CPU interpreter with
more than one program a row (the barriers; the tests run one program a row there).
`indexer_decode_topk(topk="fused_cooperative")` runs it; "auto" takes it at up to `AUTO_ROWS` requests (one)
where `FUSED_COOPERATIVE` is on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from hearth.kernels._utils import FP8_E4M3, is_interpreter, require, sm_count
from hearth.kernels.indexer.decode_persistent import score_chunk
from hearth.kernels.topk import cooperative
from hearth.kernels.topk.cooperative import NUM_WARPS, cooperative_select
from hearth.kernels.topk.one_launch import (
    RANK_BLOCK,
    SELECT_MAXNREG,
    TABLE_WAYS,
    OneLaunchPlan,
    _stamp,
    check_workspace,
    pdl_for_rows,
)
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS

# Whether `indexer_decode_topk`'s "auto" takes this path where `use_fused_cooperative` allows it, at up to AUTO_ROWS
# rows. H200, 2026-12-04 (`K2I_TABLES="0 163840" bash scripts/gpu_verify.sh k2i`), indexer + top-k in us, fused
# against the two launches (persistent indexer, cooperative top-k), contexts 8K / 32K / 128K:
#   one request, tables as wide as the context    9.6 / 10.8 / 18.2 against  9.8 / 12.1 / 18.9
#   one request, 160K tables (the engine's)      13.7 / 15.0 / 20.0 against 14.9 / 18.2 / 22.4
#   two requests, 160K tables                    13.9 / 20.6 / 28.7 against 18.1 / 19.8 / 28.0
# so one request (the desktop's decode) everywhere; at two to four it wins on short contexts only, which the plan
# (made from the table's width, host-known for a CUDA graph) cannot tell apart.
FUSED_COOPERATIVE = True
AUTO_ROWS = 1
BLOCK_T = 128  # tokens of a key chunk (one [BLOCK_T, 128] e4m3 tile, 16 KB)
# The pipeliner's stages, as the persistent indexer's: three key chunks in flight ((stages - 1) / 2). The sm_90
# build (Triton 3.6, `bench/kernel_report.py fused_cooperative`): 128 registers, 4 bytes of spills, 58 KiB of shared
# memory, so two programs fit an SM; at 3 stages it held one chunk buffer (25 KiB) and spilled 20 bytes. On the H200
# a b1 x 128K row scores its 8 chunks a program at ~1.1 us a chunk. 9 / 13 / 17 stages (4 / 6 / 8 chunks in flight
# in 74.5 / 107.5 / 140.5 KiB; 17: one program an SM) were slower at every length, 1-2 rows in 160K tables (2026-12-04,
# `bench_decode_topk.py --fused-stages 9 13 17`: b1 x 128K 20.7 / 22.8 / 24.5 us against 20.0), so a chunk's time is
# its own work in the program, not its loads' latency.
NUM_STAGES = 7
# Programs a row at most (the cooperative top-k's bound: a barrier's cost grows with its arrivals).
MAX_PROGRAMS = cooperative.MAX_PROGRAMS


@triton.jit
def _indexer_cooperative_kernel(
    q_ptr,
    w_ptr,
    cache_u8_ptr,
    cache_f32_ptr,
    table_ptr,
    ctx_ptr,
    x_ptr,
    out_ptr,
    ws_ptr,
    trace_ptr,
    stride_table,
    stride_x,
    stride_out,
    stride_ws,
    stride_blk,
    N,
    K,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    Q_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISE: tl.constexpr,
    CAP: tl.constexpr,
    CAP2: tl.constexpr,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    POLL_ACQUIRE: tl.constexpr,
    POLL_HIST: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    p_trace = trace_ptr + (i_r * tl.num_programs(1) + i_s) * 8  # (the cooperative kernel's stamps)
    _stamp(p_trace, 0, TRACE)
    if PDL:
        gdc_wait()  # the query, its weights and the keys come from the kernels before
    p_x = x_ptr + i_r.to(tl.int64) * stride_x
    p_out = out_ptr + i_r.to(tl.int64) * stride_out
    p_ws = ws_ptr + i_r.to(tl.int64) * stride_ws
    n_len = tl.minimum(tl.maximum(tl.load(ctx_ptr + i_r), 0), N)  # one query: every token of the context
    # the row's keys spread over its programs by its length, not the table's width (a short context in a wide
    # table would leave a few programs scoring whole blocks): whole chunks a program, at most BLOCK
    width = tl.minimum(tl.cdiv(tl.cdiv(n_len, tl.num_programs(1)), BLOCK_T) * BLOCK_T, BLOCK)
    width = tl.maximum(width, BLOCK_T)
    o_t = i_s * width + tl.arange(0, BLOCK)
    b_x = tl.zeros([BLOCK], dtype=tl.float32)
    if (n_len > K) & (i_s * width < n_len):  # (a row of at most K takes every token: no logits needed)
        m_t = (tl.arange(0, BLOCK) < width) & (o_t < n_len)
        p_table = table_ptr + i_r * stride_table  # the table holds < 2**31 entries
        # the slice's scales, in flight while its keys are scored (they scale the logits read back below)
        b_page = tl.load(p_table + o_t // BLOCK_SIZE, mask=m_t, other=0).to(tl.int64)
        b_ks = tl.load(cache_f32_ptr + b_page * (stride_blk // 4) + (BLOCK_SIZE * D // 4) + o_t % BLOCK_SIZE,
                       mask=m_t, other=0.0)
        o_h = tl.arange(0, H)
        o_d = tl.arange(0, D)
        b_qt = tl.trans(tl.load(q_ptr + (i_r * H + o_h)[:, None].to(tl.int64) * D + o_d[None, :]))  # (D, H)
        b_w = tl.load(w_ptr + i_r * H + o_h)
        t_end = tl.minimum(n_len, (i_s + 1) * width)
        for i_c in range(i_s * (width // BLOCK_T), (t_end + BLOCK_T - 1) // BLOCK_T):
            o_c = i_c * BLOCK_T + tl.arange(0, BLOCK_T)
            m_c = o_c < t_end
            b_s = score_chunk(
                cache_u8_ptr, p_table, o_c, m_c, b_qt, stride_blk, BLOCK_T, H, BLOCK_SIZE, D, Q_FP8, UPCAST, PRECISE
            )
            tl.store(p_x + o_c, tl.sum(tl.maximum(b_s, 0.0) * b_w[None, :], axis=1), mask=m_c)
        tl.debug_barrier()  # the block's stores above are visible to all its threads after it
        b_x = tl.load(p_x + o_t, mask=m_t, other=0.0) * b_ks
        tl.store(p_x + o_t, b_x, mask=m_t)  # the scaled logits: the single-program finish re-reads the row
    cooperative_select(
        p_x, p_out, p_ws, out_ptr, p_trace, b_x, o_t, n_len, i_s, width, K,
        CAP, CAP2, 0, BLOCK, FBLOCK, RANK_BLOCK, WAYS, POLL_ACQUIRE, POLL_HIST, NBINS, BITS, PASSES, TRACE,
    )  # fmt: skip


def fused_plan(n_req: int, n_cols: int, device: torch.device) -> tuple[int, int] | None:
    """Programs a row and the most keys one holds (BLOCK): at most `MAX_PROGRAMS` a row and two programs an SM in
    all, BLOCK the power of two (at least a chunk) that covers a row as wide as the table; a row's programs share
    its actual length (`width`, in the kernel). None where BLOCK would exceed `cooperative.MAX_BLOCK`."""
    programs = max(1, min(MAX_PROGRAMS, 2 * sm_count(device, 4) // max(n_req, 1)))
    block = _block(n_cols, programs)
    return (programs, block) if block <= cooperative.MAX_BLOCK else None


def _block(n_cols: int, programs: int) -> int:
    """BLOCK: the power of two (at least a chunk) that covers a row as wide as the table over `programs`."""
    return max(BLOCK_T, triton.next_power_of_2(triton.cdiv(max(n_cols, 1), programs)))


def use_fused_cooperative(n_req: int, next_n: int, n_cols: int, device: torch.device) -> bool:
    """Whether the fused launch takes these rows: one query a request on a CUDA device (never the CPU interpreter:
    the barriers), at most `cooperative.MAX_ROWS` rows, a plan (`fused_plan`)."""
    if next_n != 1 or device.type != "cuda" or is_interpreter() or n_req > cooperative.MAX_ROWS:
        return False
    return fused_plan(n_req, n_cols, device) is not None


def indexer_cooperative_launch(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    workspace: torch.Tensor,
    plan: OneLaunchPlan,
    *,
    logits: torch.Tensor | None = None,
    programs: int | None = None,
    trace: torch.Tensor | None = None,
    fp8_precise: bool = True,
) -> torch.Tensor:
    """The decode indexer's logits and their top-k in one launch, on inputs validated as `lightning_indexer_decode`'s
    (q [B, 1, H, 128]); out [B, k] int32; workspace a clean one-launch workspace of B rows for plan. logits: the
    fp32 [B, table tokens] row buffer (a new one by default; written up to each context's length, the rest left
    as it was). programs: a row's programs (default `fused_plan`'s, where `use_fused_cooperative` allows); one
    program a row waits for no other, so it runs anywhere, the CPU interpreter included. trace: [B, programs, 8]
    int64 stamps, as the cooperative kernel's. Returns the logits."""
    n_req, next_n, heads, dim = q.shape
    require(next_n == 1, f"the fused indexer + top-k takes one query a request, got next_n {next_n}")
    n_cols = block_table.shape[1] * block_size
    check_workspace(workspace, n_req, plan, q.device)
    if logits is None:
        logits = torch.empty(n_req, n_cols, dtype=torch.float32, device=q.device)
    fits = use_fused_cooperative(n_req, 1, n_cols, q.device)
    if programs is None:
        require(fits, f"{n_req} rows of {n_cols} do not fit one resident cooperative launch here")
        programs = fused_plan(n_req, n_cols, q.device)[0]
    require(programs == 1 or fits, f"{programs} programs a row must all be resident at once (one a row here)")
    block = _block(n_cols, programs)
    require(programs == 1 or block <= cooperative.MAX_BLOCK,
            f"{programs} programs a row would hold {block} keys each (at most {cooperative.MAX_BLOCK})")
    grid = (n_req, programs)
    pdl = pdl_for_rows(n_req, q.device)
    args = (
        q, weights, kv_cache, kv_cache.view(torch.float32), block_table, context_lens, logits, out, workspace,
        trace if trace is not None else out, block_table.stride(0), logits.stride(0), out.stride(0),
        workspace.stride(0), kv_cache.stride(0), n_cols, plan.k,
    )  # fmt: skip
    meta = dict(
        H=heads, D=dim, BLOCK_SIZE=block_size, BLOCK_T=BLOCK_T, Q_FP8=q.dtype == FP8_E4M3, UPCAST=is_interpreter(),
        PRECISE=fp8_precise, CAP=plan.capacity, CAP2=plan.capacity2, BLOCK=block, FBLOCK=plan.finish_block,
        RANK_BLOCK=RANK_BLOCK, WAYS=TABLE_WAYS, POLL_ACQUIRE=cooperative.POLL_ACQUIRE,
        POLL_HIST=cooperative.POLL_HIST, NBINS=NBINS, BITS=RADIX_BITS, PASSES=PASSES, PDL=pdl, TRACE=trace is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=SELECT_MAXNREG,
    )  # fmt: skip
    if grid[1] > 1:  # every program of a row must be resident at once: a build that fits fewer would hang
        per_sm = programs_per_sm(args, meta, grid, q.device)
        require(n_req * grid[1] <= per_sm * sm_count(q.device, 4),
                f"the fused indexer + top-k build fits {per_sm} programs an SM: {n_req} x {grid[1]} would not all "
                "be resident")
    _indexer_cooperative_kernel[grid](*args, **meta, launch_pdl=pdl)
    return logits


# Programs of a build that fit an SM at once (registers, shared memory), per build (its constexprs and device).
_PER_SM: dict[tuple, int] = {}


def programs_per_sm(args: tuple, meta: dict, grid: tuple[int, int], device: torch.device) -> int:
    """How many programs of the build these arguments select fit one SM (compiled, not launched, the first time)."""
    key = (device, *meta.values())  # (the build: its constexprs and options, in the launch's fixed order)
    if key not in _PER_SM:
        kernel = _indexer_cooperative_kernel.warmup(*args, **meta, grid=grid)
        kernel._init_handles()  # (loaded on the device: its register count is known from here)
        props = torch.cuda.get_device_properties(device)
        by_regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * 32 * kernel.metadata.num_warps)
        by_shared = props.shared_memory_per_multiprocessor // max(1, kernel.metadata.shared)
        _PER_SM[key] = min(by_regs, by_shared, props.max_threads_per_multi_processor // (32 * NUM_WARPS))
    return _PER_SM[key]
