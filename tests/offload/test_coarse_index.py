"""Coarse index building blocks: order keys / running top-k against a stable sort (ties, -0.0,
padding), the box bound never below an exact score, page summaries, streamed prefill selection
against the engine's ``Indexer._select``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hearth.engine.kv_cache import SeqSlice
from hearth.engine.models.mla import Indexer
from hearth.offload.coarse_index import (
    KeyChunk,
    PagePool,
    TopkMerger,
    exact_scores,
    page_estimates,
    page_upper_bounds,
    quantize_means,
    select_prefill,
    summarize_pages,
)


def engine_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_len: int, topk: int) -> torch.Tensor:
    """The engine's own selection over keys (T, D) for the last q_len positions."""
    n = keys.shape[0]
    seq = SeqSlice(start=0, q_len=q_len, context_len=n, slots=torch.arange(n))
    return Indexer._select(SimpleNamespace(n_heads=q.shape[1], topk=topk), q, w, keys, seq)


def int_data(n: int, heads: int, q_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small-integer keys/queries and power-of-two weights: every score is exact in any order,
    and ties (many at 0 after the ReLU) are common."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-3, 4, (n, 128), generator=g).float()
    q = torch.randint(-2, 3, (q_len, heads, 128), generator=g).float()
    w = torch.tensor([-1.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (q_len, heads), generator=g)]
    return keys, q, w


@pytest.mark.parametrize("chunk", [1, 7, 300])
def test_merger_matches_stable_sort(chunk: int) -> None:
    g = torch.Generator().manual_seed(chunk)
    scores = torch.randint(-3, 4, (3, 1000), generator=g).float()
    scores[scores == 0] = -0.0  # sort treats -0.0 == +0.0
    scores[:, ::3] = 0.0
    valid = torch.rand(3, 1000, generator=g) > 0.3
    valid[2] = False
    valid[2, :5] = True  # fewer valid entries than k: -1 padding
    merger = TopkMerger(3, 64, torch.device("cpu"))
    for i in range(0, 1000, chunk):
        merger.update(scores[:, i:i + chunk], torch.arange(i, min(i + chunk, 1000)), valid[:, i:i + chunk])
    masked = scores.masked_fill(~valid, -float("inf"))
    idx = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :64]
    ref = torch.where(torch.gather(valid, 1, idx), idx, -1)
    assert torch.equal(merger.positions(), ref)
    assert merger.threshold()[2] == -float("inf")


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_bound_is_never_below_exact_scores(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    ps, pages, heads = 16, 40, 8
    pool = PagePool(pages, ps, 128, fmt, torch.device("cpu"))
    x = torch.randn(pages * ps, 128, generator=g) * torch.rand(pages * ps, 1, generator=g) * 3
    idx = torch.arange(pages * ps)
    scales = torch.exp2(torch.randint(-6, 0, (pages * ps,), generator=g).float()) if fmt == "fp8" else None
    stored = (x / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn) if fmt == "fp8" else x
    pool.write(idx // ps, idx % ps, stored, scales)
    summary = summarize_pages(pool.dequantized(torch.arange(pages)), group=4, bounds=True)
    assert summary.shape == (pages, 2 + ps // 4, 128) and summary.dtype == torch.bfloat16
    for trial in range(5):
        q = torch.randn(heads, 128, generator=g)
        w = torch.randn(heads, generator=g)
        keys, sc = pool.tokens(torch.arange(pages))
        exact = exact_scores(q[None], w[None], keys, sc)[0].view(pages, ps)
        bound = page_upper_bounds(q, w, summary)
        assert bool((bound[:, None] >= exact).all()), f"trial {trial}: bound below an exact score"


def test_group_means() -> None:
    x = torch.randn(3, 16, 128)
    means = summarize_pages(x, group=8, bounds=False)
    assert means.shape == (3, 2, 128)
    torch.testing.assert_close(means.float(), x.view(3, 2, 8, 128).mean(2), rtol=1e-2, atol=1e-2)


def test_fp8_means_estimate_like_float_means() -> None:
    """e4m3 means with a scale per mean: within e4m3 rounding of the float means (a zero mean stays
    zero), and page estimates within a few percent of the float ones."""
    g = torch.Generator().manual_seed(2)
    means = torch.randn(37, 4, 128, generator=g) * torch.rand(37, 4, 1, generator=g) * 5
    means[3, 1] = 0
    m8, scale = quantize_means(means)
    assert m8.dtype == torch.float8_e4m3fn and m8.shape == means.shape and scale.shape == (37, 4)
    back = m8.float() * scale[..., None]
    assert torch.equal(back[3, 1], torch.zeros(128))
    err = (back - means).abs() / means.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert float(err.max()) <= 2**-4  # half an e4m3 step at the top of the range, relative to the absmax
    q, w = torch.randn(8, 128, generator=g), torch.rand(8, generator=g)
    want = page_estimates(q, w, means)
    got = page_estimates(q, w, m8, scale)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize("history,q_len,topk", [(0, 5, 8), (63, 9, 16), (200, 40, 4096), (130, 17, 64)])
def test_select_prefill_matches_engine(history: int, q_len: int, topk: int) -> None:
    keys, q, w = int_data(history + q_len, 4, q_len, seed=history)
    chunks = [KeyChunk(0, p, keys[p:min(p + 48, history)], None) for p in range(0, history, 48)]
    got = select_prefill(q, w, keys[history:], None, history, topk, iter(chunks))
    assert torch.equal(got, engine_select(q, w, keys, q_len, topk))


def test_a_pool_over_a_view_of_pages_reads_those_pages_scales() -> None:
    """PlannedKeys summarises pages p0.. of a history buffer through a pool over buf[p0:]."""
    from hearth.kernels.indexer.reference import act_quant_ue8m0

    k8, ks = act_quant_ue8m0(torch.randn(64, 128) * torch.arange(1, 65)[:, None])  # distinct scales
    pool = PagePool(4, 16, 128, "fp8", torch.device("cpu"))
    idx = torch.arange(64)
    pool.write(idx // 16, idx % 16, k8, ks)
    view = PagePool(2, 16, 128, "fp8", torch.device("cpu"))
    view.buf = pool.buf[2:]
    keys, scales = view.tokens(torch.arange(2))
    assert torch.equal(keys.view(torch.uint8), k8[32:].view(torch.uint8)) and torch.equal(scales, ks[32:])
