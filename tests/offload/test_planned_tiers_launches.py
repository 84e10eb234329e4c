"""One planned decode read (``PlannedKeys.select`` + ``PlannedLatents.slots``, misses gathered) and a
decode token's writes (``decode_write`` + ``decode_append``) are fixed, short lists of kernel
launches: Triton launches and torch ops that produce a tensor (views and bare allocations launch
nothing) are counted, so a torch glue op or an extra launch that creeps back into the step fails here.
The candidate top-k's two kernels select the same pages."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import triton.runtime.jit
from torch.utils._python_dispatch import TorchDispatchMode

from hearth.kernels.indexer import indexer_k_cache_write, lightning_indexer_decode
from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.kernels.topk.reference import topk_ref
from hearth.offload.coarse_index import PagePool
from hearth.offload.planned_tiers import PlannedKeyConfig, PlannedKeys, PlannedLatentConfig, PlannedLatents

DEVICE = torch.device(os.environ.get("HEARTH_TEST_DEVICE", "cpu"))
PS, HEADS, K = 16, 16, 32
# coarse indexer, coarse step (candidates + fine table + plan), key gather, fine indexer, radix top-k
# (4 histograms + the gather writing token positions); latents: plan, gather. Before the launch diet
# the same read took 47 (12 Triton launches, 35 torch ops). The one-launch fine top-k: the fine indexer adds
# its first histogram, one select writing token positions through the table's pages (one launch fewer).
MAX_LAUNCHES = {"radix": 11, "one_launch": 7}
_ALLOCATIONS = {"empty.memory_format", "empty_strided.default", "empty_like.default"}


class _Launches(TorchDispatchMode):
    """Records torch ops that produce a tensor (no views, no bare allocations) and Triton launches
    (``run`` of a kernel, whose own torch calls under the interpreter are not counted)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.torch: list[str] = []
        self.triton: list[str] = []
        self._in_kernel = False
        classes = [triton.runtime.jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        except ImportError:
            pass
        for cls in classes:
            monkeypatch.setattr(cls, "run", self._counted(cls.run))

    def _counted(self, run):
        def counted(kernel, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(kernel, *args, **kwargs)
            self.triton.append(kernel.__name__ if hasattr(kernel, "__name__") else repr(kernel))
            self._in_kernel = True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._in_kernel = False
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        produces = isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and
                                                     any(isinstance(t, torch.Tensor) for t in out))
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        if not self._in_kernel and produces and not func.is_view and name not in _ALLOCATIONS:
            self.torch.append(name)
        return out


def _tiers(candidate_topk: str, candidates: int, seed: int = 0, fine_topk: str = "radix"):
    g = torch.Generator().manual_seed(seed)
    n = 300
    k8, ks = act_quant_ue8m0(torch.randn(n, 128, generator=g))
    keys = PlannedKeys(PlannedKeyConfig(page_size=PS, hot_pages=2, candidate_pages=candidates, cache_pages=8,
                                        topk=K, candidate_topk=candidate_topk, fine_topk=fine_topk),
                       DEVICE, initial_pages=4)
    buf = keys.history(n)
    view = PagePool(buf.shape[0], PS, 128, "fp8", DEVICE)
    view.buf = buf
    idx = torch.arange(n, device=DEVICE)
    view.write(idx // PS, idx % PS, k8.to(DEVICE), ks.to(DEVICE))
    keys.commit_chunk(buf, n)
    lat = PlannedLatents(PlannedLatentConfig(ring_rows=16, cache_rows=48, topk=K, block=16), DEVICE, initial_rows=n)
    lat.append(torch.randn(n, 576, generator=g).to(torch.bfloat16).to(DEVICE))
    q = (torch.randn(HEADS, 128, generator=g) / 10).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(HEADS, generator=g) - 0.3).to(DEVICE)
    return keys, lat, q, w, torch.tensor([n], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("candidate_topk,fine_topk", [("sort", "radix"), ("select", "radix"), ("single_pass", "radix"),
                                                      ("select", "one_launch"), ("narrow", "one_launch"),
                                                      ("hist", "one_launch")])
def test_one_decode_read_is_a_few_launches(monkeypatch, candidate_topk, fine_topk):
    keys, lat, q, w, n = _tiers(candidate_topk, candidates=4, fine_topk=fine_topk)
    launches = _Launches(monkeypatch)
    with launches:
        sel = keys.select(q, w, n)
        lat.slots(sel[0], n)
    assert not launches.torch, f"torch glue in the decode read: {launches.torch}"
    assert len(launches.triton) <= MAX_LAUNCHES[fine_topk], launches.triton
    assert int(keys.plan.n_miss) == 4 and int(lat.plan.n_miss) > 0  # the read did fetch from both host pools


def test_a_decode_token_writes_with_three_launches(monkeypatch):
    """A decode token's writes: its key into the ring (the cache-write kernel) and the write-through
    of its page with the page's summary (one kernel), its latent row into the ring and host pool (one
    kernel): no torch op, also for the token that fills its page. Before: 30 torch ops and 3 launches."""
    keys, lat, _, _, _ = _tiers("sort", candidates=4)
    g = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(400, 32, generator=g).to(DEVICE), torch.randn(400, 32, generator=g).to(DEVICE)
    write = partial(indexer_k_cache_write, cos=cos, sin=sin, hadamard=True)
    launches = _Launches(monkeypatch)
    for pos in range(300, 300 + PS + 2):  # 300 = 18 * PS + 12: through the end of page 18
        keys.reserve(pos)
        lat.reserve(pos)
        k_raw = torch.randn(1, 128, generator=g).to(torch.bfloat16).to(DEVICE)
        row = torch.randn(1, 576, generator=g).to(torch.bfloat16).to(DEVICE)
        position = torch.tensor([pos], device=DEVICE)
        launches.torch.clear()
        launches.triton.clear()
        with launches:
            keys.decode_write(k_raw, position, write)
            lat.decode_append(row, position)
        assert not launches.torch, f"torch glue in a decode token's writes: {launches.torch}"
        assert launches.triton == ["_indexer_k_write_kernel", "_page_write_kernel", "_row_write_kernel"]


def test_sort_and_single_pass_select_the_same_pages():
    """Few candidates (the single-pass select runs, not its short-row path) over moving queries:
    both candidate top-k kernels pick the same pages (distinct random page scores: no ties) and so
    the same tokens; the sort lists them in page order."""
    (ka, _, q, w, _), (kb, _, _, _, _) = _tiers("sort", candidates=3), _tiers("single_pass", candidates=3)
    for step in range(6):
        qs = (q.float() + 0.3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(DEVICE)
              ).to(torch.bfloat16)
        n = torch.tensor([300 - step], dtype=torch.int32, device=DEVICE)  # any context_len of the written keys
        got_a, got_b = ka.select(qs, w, n)[0].tolist(), kb.select(qs, w, n)[0].tolist()
        assert set(got_a) == set(got_b)
        cand_a, cand_b = ka._candidates[0].tolist(), kb._candidates[0].tolist()
        assert set(cand_a) == set(cand_b) and -1 not in cand_a and cand_a == sorted(cand_a)
        assert ka._pages[0, 3:].tolist() == kb._pages[0, 3:].tolist()  # then the hot pages
    with pytest.raises(ValueError, match="candidate_topk"):
        PlannedKeyConfig(candidate_topk="radix")


@pytest.mark.parametrize("method", ["select", "narrow", "hist"])
def test_select_lists_the_same_candidate_pages_as_sort(method):
    """The in-register selects (bisection; bisection of the row's key range; radix histograms) and the
    bitonic sort give the same fine table, page for page (ties included: each is torch's stable order cut
    at the candidate count), over moving queries."""
    (ka, _, q, w, _), (kb, _, _, _, _) = _tiers("sort", candidates=3), _tiers(method, candidates=3)
    for step in range(6):
        qs = (q.float() + 0.3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(DEVICE)
              ).to(torch.bfloat16)
        n = torch.tensor([300 - step], dtype=torch.int32, device=DEVICE)
        assert ka.select(qs, w, n)[0].tolist() == kb.select(qs, w, n)[0].tolist()
        assert ka._pages.tolist() == kb._pages.tolist()


def test_coarse_scores_are_each_pages_best_summary_and_candidates_the_best_pages():
    """Pages of 64 tokens (4 summaries each): the coarse indexer's fused page score equals the best
    of the page's summary logits, and the candidates are torch's top pages by that score."""
    g = torch.Generator().manual_seed(5)
    n, ps, cand = 700, 64, 4
    k8, ks = act_quant_ue8m0(torch.randn(n, 128, generator=g))
    keys = PlannedKeys(PlannedKeyConfig(page_size=ps, hot_pages=2, candidate_pages=cand, cache_pages=cand, topk=K),
                       DEVICE, initial_pages=4)
    buf = keys.history(n)
    view = PagePool(buf.shape[0], ps, 128, "fp8", DEVICE)
    view.buf = buf
    idx = torch.arange(n, device=DEVICE)
    view.write(idx // ps, idx % ps, k8.to(DEVICE), ks.to(DEVICE))
    keys.commit_chunk(buf, n)
    q = (torch.randn(HEADS, 128, generator=g) / 10).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(HEADS, generator=g) - 0.3).to(DEVICE)
    qb, wb, n_cold = q[None, None], w[None, None], -(-n // ps) - 2
    fused, lengths = lightning_indexer_decode(qb, wb, keys.means.buf, keys._mean_table,
                                              torch.tensor([n], dtype=torch.int32, device=DEVICE), 16,
                                              cold_pages=(ps, 2, 4))
    plain, _ = lightning_indexer_decode(qb, wb, keys.means.buf, keys._mean_table,
                                        torch.tensor([n_cold * 4], dtype=torch.int32, device=DEVICE), 16,
                                        config={"kernel": "tiled"})  # the kernel scoring summaries
    want = plain[0, : n_cold * 4].view(n_cold, 4).amax(dim=1)
    assert int(lengths[0]) == n_cold and torch.equal(fused[0, :n_cold], want)
    keys.select(q, w, torch.tensor([n], dtype=torch.int32, device=DEVICE))
    best = topk_ref(want[None], torch.tensor([n_cold], dtype=torch.int32, device=DEVICE), cand)[0]
    assert keys._candidates[0].tolist() == sorted(best.tolist())  # the best pages, in page order
    assert keys._pages[0, cand:].tolist() == [n_cold, n_cold + 1]  # the hot pages
