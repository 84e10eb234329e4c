"""The middle of a tiered-key decode selection in one program: candidate pages, the fine page
table, its residency plan (``hearth.offload.planned_tiers.PlannedKeys.select`` runs the coarse
indexer before it and the miss gather + fine indexer after it).

Input: the coarse indexer's page scores (``lightning_indexer_decode(..., cold_pages=...)``: the best
summary of every cold page) and the context length (tokens, (1,) int32 on the device). From it the
kernel derives n_pages = ceil(context / page), n_cold = max(n_pages - hot, 0), n_valid = min(n_cold, C)
(no host value: a CUDA graph replays it at every position), then:

1. the C best cold pages (every cold page when n_cold <= C): ``sort`` keeps the row in registers
   (``hearth.kernels.topk.short_row``, rows of at most MAX_SHORT_N pages, ties to the lower page),
   selects with Triton's bitonic top-k and sorts the winners back into page order; ``select``
   selects the same pages in registers by bisecting the k-th largest score (``short_row_select``)
   and lists them in page order with one cumsum, no sort network; ``narrow`` bisects only the row's
   own key range and stops at the first midpoint exactly C pages reach (fewer counts); ``hist`` finds the same cut with
   4 radix histograms of the row in registers (``short_row_hist_select``). Page order keeps the fine
   table's logical positions in token order, so the fine top-k meets ties in the order the
   full-cache kernel does (with every cold page a candidate the table is the full cache's: tiny
   models' tied indexer logits then select the same tokens as tiers off); ``single_pass`` runs
   the single-pass select (``hearth.kernels.topk.single_pass``, any length; every cold page in
   order, else unsorted, ties arbitrary);
2. the fine page table ``pages`` [C + hot]: the n_valid candidates, the hot pages n_cold..n_pages-1,
   then -1; and ``fine_len``, the tokens it covers: context - (n_cold - n_valid) * page;
3. the residency plan of that table (``residency.plan_step``; the plan's ring is the hot pages, so a
   hot page maps to its ring slot): ``plan.slot`` is the fine indexer's block table;
4. zeroes the fine radix top-k's workspace (one launch fewer than a separate fill).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import check_tensor, require
from hearth.kernels.tiered.residency import ResidencyPlan, plan_step, ring_start_of, slot_chunk
from hearth.kernels.topk.radix import NBINS, PASSES, RADIX_BITS
from hearth.kernels.topk.short_row import (
    MAX_SHORT_N,
    short_row_hist_select,
    short_row_narrow_select,
    short_row_select,
    short_row_sizes,
    short_row_topk,
    short_row_warps,
)
from hearth.kernels.topk.single_pass import select_row

CandidateTopk = Literal["sort", "select", "narrow", "hist", "single_pass"]
CANDIDATE_TOPKS = ("sort", "select", "narrow", "hist", "single_pass")


@triton.jit
def _coarse_step_kernel(
    scores_ptr,
    ctx_ptr,
    pages_ptr,
    fine_len_ptr,
    ws_ptr,
    scratch_ptr,
    slot_of_ptr,
    owner_ptr,
    stamp_ptr,
    victims_ptr,
    clock_ptr,
    slot_ptr,
    miss_src_ptr,
    miss_dst_ptr,
    n_miss_ptr,
    C,
    SLOTS,
    CAP,
    PAGE: tl.constexpr,
    HOT: tl.constexpr,
    SORT: tl.constexpr,
    SELECT: tl.constexpr,
    NARROW: tl.constexpr,
    HIST: tl.constexpr,
    N_P2: tl.constexpr,
    K_P2: tl.constexpr,
    T_P2: tl.constexpr,
    S_CHUNK: tl.constexpr,
    WS_N: tl.constexpr,
    WS_P2: tl.constexpr,
    NBINS: tl.constexpr,
    BITS: tl.constexpr,
    PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n_tok = tl.load(ctx_ptr)
    n_pages = (n_tok + PAGE - 1) // PAGE
    n_cold = ring_start_of(n_tok, PAGE, HOT)
    n_valid = tl.minimum(n_cold, C)
    # 1. candidates -> pages[0:n_valid]
    if SELECT | NARROW | HIST:
        o_n = tl.arange(0, N_P2)
        b_s = tl.load(scores_ptr + o_n, mask=o_n < n_cold, other=0.0)
        if HIST:
            m_best = short_row_hist_select(b_s, o_n < n_cold, C, BITS, PASSES)
        elif NARROW:
            m_best = short_row_narrow_select(b_s, o_n < n_cold, C)
        else:
            m_best = short_row_select(b_s, o_n < n_cold, C)
        tl.store(pages_ptr + tl.cumsum(m_best.to(tl.int32), 0) - 1, o_n, mask=m_best)  # in page order
    elif SORT:
        o_n = tl.arange(0, N_P2)
        m_n = o_n < n_cold
        b_best = short_row_topk(tl.load(scores_ptr + o_n, mask=m_n, other=0.0), m_n, N_P2, K_P2)
        o_k = tl.arange(0, K_P2)
        b_best = tl.sort(tl.where(o_k < n_valid, b_best, 2**31 - 1))  # in page order (see the module doc)
        tl.store(pages_ptr + o_k, b_best, mask=o_k < n_valid)
    else:
        if n_cold <= C:
            for i0 in range(0, n_cold, BLOCK):
                o_t = i0 + tl.arange(0, BLOCK)
                tl.store(pages_ptr + o_t, o_t, mask=o_t < n_cold)
        else:
            select_row(scores_ptr, n_cold, pages_ptr, scratch_ptr, scratch_ptr + CAP, C, CAP, NBINS, BITS, PASSES,
                       BLOCK)
    # 2. the hot pages after the candidates, -1 after them; the fine table's tokens
    o_j = tl.arange(0, T_P2)
    o_hot = n_cold + o_j - n_valid
    tl.store(pages_ptr + o_j, tl.where(o_hot < n_pages, o_hot, -1), mask=(o_j >= n_valid) & (o_j < C + HOT))
    tl.store(fine_len_ptr, n_tok - (n_cold - n_valid) * PAGE)
    # 4. (before the plan, which needs the table written) the fine top-k's workspace
    o_w = tl.arange(0, WS_P2)
    tl.store(ws_ptr + o_w, tl.zeros([WS_P2], dtype=tl.int32), mask=o_w < WS_N)
    tl.debug_barrier()
    # 3. residency of the table's pages: plan.slot = the fine block table
    plan_step(pages_ptr, n_cold, slot_of_ptr, owner_ptr, stamp_ptr, victims_ptr, clock_ptr, slot_ptr, miss_src_ptr,
              miss_dst_ptr, n_miss_ptr, C + HOT, SLOTS, HOT, T_P2, S_CHUNK)


def sort_fits(scores: torch.Tensor) -> bool:
    """Whether ``sort`` / ``select`` can hold a page-score row of this width (else ``single_pass`` must run)."""
    return scores.shape[-1] <= MAX_SHORT_N


def coarse_step(
    page_scores: torch.Tensor,
    context_len: torch.Tensor,
    plan: ResidencyPlan,
    pages: torch.Tensor,
    fine_len: torch.Tensor,
    fine_workspace: torch.Tensor,
    scratch: torch.Tensor,
    page_size: int,
    candidates: int,
    method: CandidateTopk = "sort",
) -> None:
    """One launch of the module doc's steps 1-4.

    page_scores: [1, N] fp32 (cold pages first, N >= the cold pages); context_len: (1,) int32 tokens;
    plan: the page cache's residency (ring = the hot pages, ``plan.slot`` [candidates + ring]);
    pages: [candidates + ring] int32 out (the fine table's pages); fine_len: (1,) int32 out;
    fine_workspace: int32, zeroed here; scratch: the single-pass survivors ([1, 2 * capacity] int32,
    ``single_pass.new_scratch``; unused by ``sort``). No host sync."""
    require(method in CANDIDATE_TOPKS, f"candidate top-k must be one of {CANDIDATE_TOPKS}, got {method!r}")
    require(method == "single_pass" or sort_fits(page_scores),
            f"{method} holds at most {MAX_SHORT_N} pages, the scores have {page_scores.shape[-1]}")
    hot, n_table = plan.ring, candidates + plan.ring
    dev = plan.slot.device
    check_tensor("page_scores", page_scores, dtypes=(torch.float32,), ndim=2, device=dev)
    check_tensor("pages", pages, dtypes=(torch.int32,), shape=(n_table,), device=dev)
    require(plan.slot.shape == (n_table,), f"the plan must name {n_table} entries, it names {plan.slot.shape[0]}")
    for name, t in (("context_len", context_len), ("fine_len", fine_len)):
        check_tensor(name, t, dtypes=(torch.int32,), shape=(1,), device=dev)
    in_registers = method != "single_pass"
    n_p2, k_p2 = short_row_sizes(page_scores.shape[-1], candidates) if in_registers else (1, 1)
    _coarse_step_kernel[(1,)](
        page_scores, context_len, pages, fine_len, fine_workspace, scratch,
        plan.slot_of, plan.owner, plan.hit_stamp, plan.victims, plan.clock, plan.slot, plan.miss_src,
        plan.miss_dst, plan.n_miss, candidates, plan.num_slots, scratch.shape[-1] // 2,
        PAGE=page_size, HOT=hot, SORT=method == "sort", SELECT=method == "select",
        NARROW=method == "narrow", HIST=method == "hist", N_P2=n_p2,
        K_P2=k_p2,
        T_P2=triton.next_power_of_2(n_table),
        S_CHUNK=slot_chunk(plan.num_slots), WS_N=fine_workspace.numel(),
        WS_P2=triton.next_power_of_2(fine_workspace.numel()), NBINS=NBINS, BITS=RADIX_BITS, PASSES=PASSES,
        BLOCK=2048, num_warps=short_row_warps(n_p2) if in_registers else 16,
    )
