"""Planned tiers (hearth.offload.planned_tiers): with every cold page a candidate the device-planned
decode selection equals the indexer kernel over the whole key cache; with few candidates it equals the
exact top-k over the pages it chose plus the hot pages (no token of a chosen page is lost through the
page cache, whatever it evicted); latent rows read through the plan equal the rows written; decode
writes (keys and latent rows) leave what a prefill of the same keys and rows leaves."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from hearth.kernels.indexer import indexer_decode_topk, indexer_k_cache_write
from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.offload.coarse_index import PagePool
from hearth.offload.planned_tiers import PlannedKeyConfig, PlannedKeys, PlannedLatentConfig, PlannedLatents

DEVICE = torch.device(os.environ.get("HEARTH_TEST_DEVICE", "cpu"))
PS, HEADS, K = 16, 16, 32


def _keys(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k8, ks = act_quant_ue8m0(torch.randn(n, 128, generator=g))
    q = (torch.randn(HEADS, 128, generator=g) / 10).to(torch.bfloat16)
    return k8.to(DEVICE), ks.to(DEVICE), q.to(DEVICE), (torch.rand(HEADS, generator=g) - 0.3).to(DEVICE)


def _pool(k8, ks) -> PagePool:
    pool = PagePool(k8.shape[0] // PS + 1, PS, 128, "fp8", DEVICE)
    idx = torch.arange(k8.shape[0], device=DEVICE)
    pool.write(idx // PS, idx % PS, k8, ks)
    return pool


def _decode(tiers: PlannedKeys, k8, ks, pos: int) -> None:
    slot = tiers.ring_slot(pos)
    tiers.dev.write(torch.tensor([slot // PS], device=DEVICE), torch.tensor([slot % PS], device=DEVICE),
                    k8[pos:pos + 1], ks[pos:pos + 1])
    tiers.commit()


def _prefill(tiers: PlannedKeys, k8, ks, n: int) -> None:
    buf = tiers.history(n)
    view = PagePool(buf.shape[0], PS, 128, "fp8", DEVICE)
    view.buf = buf
    idx = torch.arange(tiers.num_tokens, tiers.num_tokens + n, device=DEVICE)
    view.write(idx // PS, idx % PS, k8[idx], ks[idx])
    tiers.commit_chunk(buf, n)


@pytest.mark.parametrize("fine_topk", ["radix", "one_launch"])
def test_every_page_a_candidate_equals_the_full_cache(fine_topk):
    k8, ks, q, w = _keys(260, seed=1)
    full = _pool(k8, ks)
    table = torch.arange(full.num_pages, dtype=torch.int32, device=DEVICE)[None]
    tiers = PlannedKeys(PlannedKeyConfig(page_size=PS, hot_pages=2, candidate_pages=32, cache_pages=32, topk=K,
                                         fine_topk=fine_topk), DEVICE, initial_pages=2)
    _prefill(tiers, k8, ks, 150)
    _prefill(tiers, k8, ks, 41)  # a chunk starting inside a page
    for pos in range(191, 215):
        _decode(tiers, k8, ks, pos)
        n = torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE)
        got = tiers.select(q, w, n)[0]
        want = indexer_decode_topk(q[None, None], w[None, None], full.buf, table, n, PS, K).view(-1)
        assert set(got.tolist()) == set(want.tolist())
    keys, scales = tiers.read()
    assert torch.equal(keys.view(torch.uint8), k8[:215].view(torch.uint8)) and torch.equal(scales, ks[:215])


@pytest.mark.parametrize("fine_topk", ["radix", "one_launch"])
def test_few_candidates_score_their_pages_exactly(fine_topk):
    k8, ks, q, w = _keys(400, seed=2)
    full = _pool(k8, ks)
    cfg = PlannedKeyConfig(page_size=PS, hot_pages=1, candidate_pages=3, cache_pages=4, topk=K, fine_topk=fine_topk)
    tiers = PlannedKeys(cfg, DEVICE, initial_pages=4)
    _prefill(tiers, k8, ks, 300)
    misses = 0
    for pos in range(300, 340):
        _decode(tiers, k8, ks, pos)
        # queries that move between steps, so the candidates (and the page cache) churn
        qs = (q.float() + 0.3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(pos)).to(DEVICE)
              ).to(torch.bfloat16)
        got = tiers.select(qs, w, torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE))[0]
        misses += int(tiers.plan.n_miss)
        n_cold = (pos + 1 + PS - 1) // PS - 1
        pages = [p for p in tiers._candidates[0].tolist() if p >= 0] + [n_cold]
        table = torch.tensor([pages], dtype=torch.int32, device=DEVICE)
        n_tab = (len(pages) - 1) * PS + pos + 1 - n_cold * PS
        logical = indexer_decode_topk(qs[None, None], w[None, None], full.buf, table,
                                      torch.tensor([n_tab], dtype=torch.int32, device=DEVICE), PS, K).view(-1)
        want = {pages[i // PS] * PS + i % PS for i in logical.tolist() if i >= 0}
        assert set(got.tolist()) - {-1} == want
    assert misses > 3  # pages were fetched from host memory across steps, not only once


@pytest.mark.parametrize("page_size,hot_pages", [(16, 1), (32, 3)])
def test_decode_writes_equal_a_prefill_of_the_same_keys(page_size, hot_pages):
    """Keys written token by token through the capturable decode path (the cache-write kernel into the
    ring, the write-through kernel) leave the same host pages, summaries, ring and keys as the same
    keys prefilled (the torch path's summaries): from a partial page, across several pages."""
    g = torch.Generator().manual_seed(page_size + hot_pages)
    n0, n = 3 * page_size + 5, 7 * page_size + 3
    k_raw = torch.randn(n, 128, generator=g).to(DEVICE)
    cos, sin = torch.randn(n, 32, generator=g).to(DEVICE), torch.randn(n, 32, generator=g).to(DEVICE)
    write = partial(indexer_k_cache_write, cos=cos, sin=sin, hadamard=True)
    cfg = PlannedKeyConfig(page_size=page_size, hot_pages=hot_pages, candidate_pages=4, cache_pages=4, topk=K)

    def prefill(tiers: PlannedKeys, first: int, last: int) -> None:
        buf = tiers.history(last - first)
        positions = torch.arange(first, last, device=DEVICE)
        write(k_raw[first:last], positions, buf, page_size, positions=positions)
        tiers.commit_chunk(buf, last - first)

    decoded = PlannedKeys(cfg, DEVICE, initial_pages=2)
    prefill(decoded, 0, n0)
    for pos in range(n0, n):
        decoded.reserve(pos)  # grows the pools past page 2 on the way
        decoded.decode_write(k_raw[pos:pos + 1], torch.tensor([pos], device=DEVICE), write)
    prefilled = PlannedKeys(cfg, DEVICE, initial_pages=2)
    prefill(prefilled, 0, n)
    if DEVICE.type == "cuda":  # the host pools are written by the stream (pinned CPU tensors: no implicit sync)
        torch.cuda.synchronize(DEVICE)
    full = n // page_size
    assert torch.equal(decoded.host.buf[:full], prefilled.host.buf[:full])
    summaries = full * cfg.groups  # whole summary blocks of 16 means, then the tail block's first entries
    blocks, tail = divmod(summaries, 16)
    got, want = decoded.means.buf, prefilled.means.buf
    assert torch.equal(got[:blocks], want[:blocks])
    assert torch.equal(got[blocks, :tail * 128], want[blocks, :tail * 128])
    # the tail block's fp32 scales: the decode kernel and torch may round a scale differently in its last bit on the GPU
    got_scales = got[blocks, 16 * 128:16 * 128 + 4 * tail].view(torch.float32)
    want_scales = want[blocks, 16 * 128:16 * 128 + 4 * tail].view(torch.float32)
    torch.testing.assert_close(got_scales, want_scales, rtol=2e-7, atol=0)
    for page in range(max(full + 1 - hot_pages, 0), full):  # the ring's full pages (read() reads the partial one)
        assert torch.equal(decoded.dev.buf[page % hot_pages], prefilled.dev.buf[page % hot_pages])
    keys, scales = decoded.read()
    want_keys, want_scales = prefilled.read()
    assert torch.equal(keys.view(torch.uint8), want_keys.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert decoded.version > 0  # the decode tokens' reserve grew the pools: the kernels wrote the new ones


def test_decode_rows_equal_appended_rows():
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(90, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = PlannedLatentConfig(ring_rows=16, cache_rows=48, topk=40, block=16)
    decoded, appended = PlannedLatents(cfg, DEVICE, initial_rows=8), PlannedLatents(cfg, DEVICE, initial_rows=8)
    decoded.append(rows[:21])
    for pos in range(21, 90):
        decoded.reserve(pos)
        decoded.decode_append(rows[pos:pos + 1], torch.tensor([pos], device=DEVICE))
    appended.append(rows)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    assert torch.equal(decoded.host[:90].to(DEVICE), rows) and torch.equal(decoded.dev[:16], appended.dev[:16])
    assert torch.equal(decoded.history().view(-1, 576)[:90], rows)


@pytest.mark.parametrize("ring,cache,block", [(16, 48, 16), (64, 64, 64)])
def test_latent_rows_through_the_plan_equal_the_written_rows(ring, cache, block):
    g = torch.Generator().manual_seed(ring)
    rows = torch.randn(700, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    lat = PlannedLatents(PlannedLatentConfig(ring_rows=ring, cache_rows=cache, topk=40, block=block), DEVICE,
                         initial_rows=8)
    lat.append(rows[:500])
    for pos in range(500, 530):
        lat.append(rows[pos:pos + 1])
        sel = torch.randperm(pos + 1, generator=g)[:40]
        sel[::7] = -1
        slots = lat.slots(sel.to(torch.int32).to(DEVICE), torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE))
        assert torch.equal((slots >= 0).cpu(), sel >= 0)
        got = lat.paged().view(-1, 576)[slots.clamp(min=0).long()]
        assert torch.equal(got[sel.to(DEVICE) >= 0], rows[sel[sel >= 0].to(DEVICE)])
    assert torch.equal(lat.history().view(-1, 576)[:530], rows[:530])
    with pytest.raises(ValueError, match="cache_rows"):
        PlannedLatentConfig(ring_rows=16, cache_rows=30, topk=40, block=16)
