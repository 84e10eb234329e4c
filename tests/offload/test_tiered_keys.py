"""Tiered indexer keys: coarse-to-fine selection equals the engine's exact selection when every
page is a candidate (odd sizes, ties, k > context), recall on clustered keys at a realistic budget,
exact mode and write-back under tiny device budgets, page-cache reuse counting, streamed prefill;
the lagged candidate fetch (recall, exact mode, no host read of a step's own candidates)."""

from __future__ import annotations

import os

import pytest
import torch

from hearth.offload.coarse_index import page_estimates, select_prefill
from hearth.offload.tiered_keys import KeyStreamer, KeyTierConfig, TieredKeys
from tests.offload.test_coarse_index import engine_select, int_data

CPU = torch.device("cpu")
# HEARTH_TEST_DEVICE=cuda also runs the device-dependent tests (pinned copies, side stream) on the GPU
DEVICE = torch.device(os.environ.get("HEARTH_TEST_DEVICE", "cpu"))


def stored(keys: torch.Tensor, fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored keys, scales, dequantised keys) of small-integer keys: exact in every format."""
    if fmt != "fp8":
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        return keys.to(dtype), None, keys
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-3, 3, (keys.shape[0],), generator=g).float())
    return keys.to(torch.float8_e4m3fn), scales, keys * scales[:, None]


def append_randomly(tiers: TieredKeys, keys: torch.Tensor, scales: torch.Tensor | None, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    i = 0
    while i < keys.shape[0]:
        n = min(keys.shape[0] - i, int(torch.randint(1, 90, (1,), generator=g)))
        tiers.append(keys[i:i + n], None if scales is None else scales[i:i + n])
        i += n


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("n", [1, 63, 2049])
@pytest.mark.parametrize("topk", [100, 4096])
@pytest.mark.parametrize("lagged", [False, True])
def test_all_pages_as_candidates_equals_engine(fmt: str, page_size: int, n: int, topk: int, lagged: bool) -> None:
    keys, q, w = int_data(n, 4, 1, seed=n + page_size)
    k_stored, scales, k_deq = stored(keys, fmt, n)
    budget = dict(cache_pages=200, candidate_pages=200) if lagged else dict(cache_pages=3, candidate_pages=10**6)
    cfg = KeyTierConfig(page_size=page_size, key_format=fmt, hot_pages=2, topk=topk, lagged_fetch=lagged, **budget)
    tiers = TieredKeys(cfg, CPU, initial_pages=1)
    append_randomly(tiers, k_stored, scales, n)
    assert torch.equal(tiers.select(q[0], w[0]), engine_select(q, w, k_deq, 1, topk))
    back, back_scales = tiers.read(torch.arange(n))
    assert torch.equal(back.view(torch.uint8), k_stored.view(torch.uint8))
    assert back_scales is None if scales is None else torch.equal(back_scales, scales)


def clustered_keys(n: int, heads: int, seed: int, centroids: int = 256) -> tuple[torch.Tensor, ...]:
    """Keys in runs of 32..511 tokens around one of `centroids` random centroids (unit variance per
    dimension), each run drifting as a random walk (step 0.05) plus noise 0.5; queries near 4 of the
    centroids (noise 0.7); head weights uniform in [-0.2, 0.8)."""
    g = torch.Generator().manual_seed(seed)
    cent = torch.randn(centroids, 128, generator=g)
    lengths = torch.randint(32, 512, (n // 32 + 1,), generator=g)
    run = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:n]  # (n,) run of each token
    walk = torch.cumsum(torch.randn(n, 128, generator=g) * 0.05, 0)
    starts = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1]))
    drift = walk - walk[starts[run]]
    keys = cent[torch.randint(0, centroids, (lengths.numel(),), generator=g)][run] + drift
    keys = keys + 0.5 * torch.randn(n, 128, generator=g)
    hot = cent[torch.randint(0, centroids, (4,), generator=g)]
    q = (hot[torch.randint(0, 4, (heads,), generator=g)] + 0.7 * torch.randn(heads, 128, generator=g)) / 128**0.5
    return keys.to(torch.bfloat16), q, torch.rand(heads, generator=g) - 0.2


@pytest.mark.parametrize("summary_format", ["fp8", "bf16"])
def test_recall_on_clustered_keys_at_a_realistic_budget(summary_format: str) -> None:
    """32K tokens, k = 512, the default 64 candidate pages of 64 (8 k tokens, 1/8 of the context)."""
    n, k = 32768, 512
    recalls = []
    for seed in range(4):
        keys, q, w = clustered_keys(n, 16, seed)
        cfg = KeyTierConfig(page_size=64, key_format="bf16", topk=k, summary_format=summary_format)
        assert cfg.candidate_pages == cfg.cache_pages == 64
        tiers = TieredKeys(cfg, CPU)
        tiers.append(keys)
        ref = engine_select(q[None], w[None], keys, 1, k)
        recalls.append(float(torch.isin(tiers.select(q, w), ref).float().mean()))
    assert sum(recalls) / len(recalls) >= 0.99, recalls
    assert min(recalls) >= 0.95, recalls


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_exact_mode_with_tiny_budgets_never_loses_a_token(fmt: str) -> None:
    """Random appends, a selection after each; one hot page, two cached pages, one candidate."""
    keys, q, w = int_data(900, 4, 60, seed=3)
    k_stored, scales, k_deq = stored(keys, fmt, 3)
    cfg = KeyTierConfig(page_size=16, key_format=fmt, hot_pages=1, cache_pages=2, candidate_pages=1, topk=40,
                        bounds=True, exact=True)
    tiers = TieredKeys(cfg, DEVICE, initial_pages=1)
    g = torch.Generator().manual_seed(4)
    step = 0
    while tiers.num_tokens < 900:
        n = min(900 - tiers.num_tokens, int(torch.randint(1, 40, (1,), generator=g)))
        first = tiers.num_tokens
        new_scales = None if scales is None else scales[first:first + n].to(DEVICE)
        tiers.append(k_stored[first:first + n].to(DEVICE), new_scales)
        got = tiers.select(q[step % 60].to(DEVICE), w[step % 60].to(DEVICE))
        ref = engine_select(q[step % 60][None], w[step % 60][None], k_deq[: first + n], 1, 40)
        assert torch.equal(got.cpu(), ref), f"step {step} at {first + n} tokens"
        step += 1
    back, _ = tiers.read(torch.randperm(900))
    back = back.cpu()
    assert torch.equal(torch.sort(back.float().sum(1)).values, torch.sort(k_stored.float().sum(1)).values)
    s = tiers.stats()
    assert s["misses"] > 0 and s["evictions"] > 0 and s["uncertified_steps"] == 0


def test_budget_mode_flags_inexact_steps() -> None:
    """A step whose selection differs from the exact one must be counted as uncertified."""
    keys, q, w = int_data(2000, 4, 8, seed=5)
    cfg = KeyTierConfig(page_size=16, key_format="fp32", hot_pages=1, cache_pages=4, candidate_pages=2, topk=64,
                        bounds=True)
    tiers = TieredKeys(cfg, CPU)
    tiers.append(keys)
    inexact = 0
    for i in range(8):
        before = tiers.stats()["uncertified_steps"]
        if not torch.equal(tiers.select(q[i], w[i]), engine_select(q[i][None], w[i][None], keys, 1, 64)):
            inexact += 1
            assert tiers.stats()["uncertified_steps"] == before + 1
    assert inexact > 0  # two candidate pages of 125 are not enough here


def test_page_cache_reuse_across_decode_steps() -> None:
    keys, q, w = clustered_keys(8192 + 50, 16, seed=7)
    cfg = KeyTierConfig(page_size=64, key_format="bf16", hot_pages=2, cache_pages=48, candidate_pages=24, topk=256)
    tiers = TieredKeys(cfg, CPU)
    tiers.append(keys[:8192])
    g = torch.Generator().manual_seed(8)
    for step in range(50):
        tiers.append(keys[8192 + step:8193 + step])
        tiers.select(q + 0.01 * torch.randn(q.shape, generator=g), w)
    s = tiers.stats()
    assert s["steps"] == 50 and s["lookups"] == 50 * 24
    assert s["hits"] + s["misses"] == s["lookups"]
    assert s["page_reuse_rate"] == s["hits"] / s["lookups"] and s["page_reuse_rate"] > 0.5
    assert s["bytes_h2d"] == s["misses"] * cfg.page_bytes
    assert 0.5 < s["selection_overlap"] <= 1.0


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_streamed_prefill_matches_engine(fmt: str) -> None:
    """Two layers' histories through the two buffers; each layer then scores a chunk of queries."""
    cfg = KeyTierConfig(page_size=16, key_format=fmt, hot_pages=2, cache_pages=2, candidate_pages=2, topk=70)
    streamer = KeyStreamer(cfg, chunk_pages=3, device=CPU)
    layers = []
    for layer, history in enumerate([157, 0]):
        keys, q, w = int_data(history + 21, 4, 21, seed=10 + layer)
        k_stored, scales, k_deq = stored(keys, fmt, layer)
        tiers = TieredKeys(cfg, CPU, initial_pages=1)
        append_randomly(tiers, k_stored[:history], None if scales is None else scales[:history], layer)
        layers.append((tiers, history, k_stored, scales, k_deq, q, w))
    sources = [(t, h) for t, h, *_ in layers]
    for (tiers, history, k_stored, scales, k_deq, q, w), chunks in zip(layers, streamer.layers(sources)):
        new_scales = None if scales is None else scales[history:]
        tiers.append(k_stored[history:], new_scales)  # the chunk's own keys join the request first
        got = select_prefill(q, w, k_stored[history:], new_scales, history, 70, chunks)
        assert torch.equal(got, engine_select(q, w, k_deq, 21, 70))


@pytest.mark.parametrize("summary_format,bounds", [("fp8", False), ("fp8", True), ("bf16", True)])
def test_device_bytes_follow_the_context(summary_format: str, bounds: bool) -> None:
    """Device bytes: pools + summaries of the full pages (exact after one append, then at most
    1/16 spare) + the last selection; the config's estimate agrees."""
    cfg = KeyTierConfig(page_size=16, key_format="fp8", hot_pages=2, topk=64, summary_group=4,
                        summary_format=summary_format, bounds=bounds)
    assert cfg.candidate_pages == cfg.cache_pages == 8 * 64 // 16
    means = 4 * (128 + 4) if summary_format == "fp8" else 4 * 128 * 2  # e4m3 + fp32 scale per mean | bf16
    assert cfg.summary_bytes == 2 * 128 * 2 * bounds + means
    k8 = torch.randn(5000, 128).to(torch.float8_e4m3fn)
    tiers = TieredKeys(cfg, CPU, initial_pages=1)
    tiers.append(k8[:3200], torch.ones(3200))
    tiers.select(torch.randn(4, 128), torch.rand(4))
    assert tiers.device_bytes() == cfg.device_bytes(3200) + 16  # + two scalar counters
    for i in range(3200, 5000):  # decode appends grow the summaries by 1/16 at a time
        tiers.append(k8[i:i + 1], torch.ones(1))
    assert tiers.means.shape[0] <= 5000 // 16 * 17 // 16 + 16
    assert tiers.device_bytes() <= cfg.device_bytes(5000) * 17 // 16 + 16


def test_from_budget_fits() -> None:
    cfg = KeyTierConfig.from_budget(4 << 20, max_tokens=131072, candidate_pages=256)
    assert cfg.device_bytes(131072) <= 4 << 20 and cfg.candidate_pages <= cfg.cache_pages
    with pytest.raises(ValueError):
        KeyTierConfig.from_budget(1000, max_tokens=131072)
    with pytest.raises(ValueError):
        KeyTierConfig(exact=True)
    with pytest.raises(ValueError):
        KeyTierConfig(candidate_pages=8, cache_pages=4, lagged_fetch=True)


@pytest.mark.parametrize("candidates", [3, 100])
def test_kernel_fine_stage_selects_the_torch_fine_stage_set(candidates: int) -> None:
    """The Triton fine stage (CUDA, or the interpreter on the CPU) picks the same tokens as the torch
    one on continuous data (no ties), with a partial hot page and candidates through the page cache."""
    from hearth.kernels.indexer.reference import act_quant_ue8m0

    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    g = torch.Generator().manual_seed(candidates)
    k8, ks = act_quant_ue8m0(torch.randn(1000, 128, generator=g))
    q = (torch.randn(16, 128, generator=g) / 10).to(torch.bfloat16).float()  # exact in the kernel's bf16
    w = torch.rand(16, generator=g)
    got = {}
    for fine_kernel in (False, True):
        cfg = KeyTierConfig(page_size=16, hot_pages=2, cache_pages=100, candidate_pages=candidates, topk=100,
                            fine_kernel=fine_kernel)
        tiers = TieredKeys(cfg, device)
        tiers.append(k8[:500].to(device), ks[:500].to(device))
        tiers.append(k8[500:].to(device), ks[500:].to(device))
        got[fine_kernel] = tiers.select(q.to(device), w.to(device))[0].cpu()
    assert got[True].shape == got[False].shape == (100,)
    assert torch.equal(torch.sort(got[True]).values, torch.sort(got[False]).values)


# ---- lagged candidate fetch ----------------------------------------------------------------------
def drifting(q: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    """(steps, H, D) decode queries: q plus a random walk of step 0.02 per dimension (the bench's)."""
    g = torch.Generator().manual_seed(seed)
    return q + torch.cumsum(0.02 * torch.randn(steps, *q.shape, generator=g), 0) / 128**0.5


def decode_recalls(keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, cfg: KeyTierConfig, n: int,
                   steps: int) -> tuple[list[float], dict[str, float]]:
    """Prefill n keys, then per step append one key and select; recall of each step vs the engine."""
    tiers = TieredKeys(cfg, CPU)
    tiers.append(keys[:n])
    recalls = []
    for s in range(steps):
        tiers.append(keys[n + s:n + s + 1])
        ref = engine_select(q[s][None], w[None], keys[: n + s + 1], 1, cfg.topk)
        recalls.append(float(torch.isin(tiers.select(q[s], w), ref).float().mean()))
    return recalls, tiers.stats()


def test_lagged_recall_on_clustered_keys_at_the_default_budget() -> None:
    """The key sets of the realistic-budget test (32K tokens, k 512, default 64 candidate pages);
    prefill to 32672 tokens, then 48 one-token steps with drifting queries: the lagged steps (all
    but the first) keep recall >= 0.99 and lose at most 0.002 against the synchronous path on the
    same steps; page 507 leaves the hot ring when token 32704 opens page 511."""
    n, k, steps = 32768 - 96, 512, 48
    lagged, sync = [], []
    for seed in range(4):
        keys, q0, w = clustered_keys(32768, 16, seed)
        q = drifting(q0, steps, seed)
        for out, lag in ((lagged, True), (sync, False)):
            cfg = KeyTierConfig(page_size=64, key_format="bf16", topk=k, lagged_fetch=lag)
            recalls, s = decode_recalls(keys, q, w, cfg, n, steps)
            out.append(sum(recalls[1:]) / (steps - 1))
            assert s["candidate_reads"] == (1 if lag else steps)
            assert s["lagged_steps"] == (steps - 1 if lag else 0) and s["demoted_pages"] == (1 if lag else 0)
    assert sum(lagged) / len(lagged) >= 0.99, (lagged, sync)
    assert min(lagged) >= 0.95, (lagged, sync)
    assert all(a >= b - 0.002 for a, b in zip(lagged, sync)), (lagged, sync)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_lagged_exact_mode_with_tiny_budgets_never_loses_a_token(fmt: str) -> None:
    """One-token decode appends after a prefill, a selection after each, one hot page, two cached
    pages, one candidate: lagged steps, demoted pages, evictions, and still the exact selection."""
    keys, q, w = int_data(700, 4, 60, seed=6)
    k_stored, scales, k_deq = stored(keys, fmt, 6)
    cfg = KeyTierConfig(page_size=16, key_format=fmt, hot_pages=1, cache_pages=2, candidate_pages=1, topk=40,
                        bounds=True, exact=True, lagged_fetch=True)
    tiers = TieredKeys(cfg, DEVICE, initial_pages=1)
    tiers.append(k_stored[:300].to(DEVICE), None if scales is None else scales[:300].to(DEVICE))
    for i in range(300, 700):
        tiers.append(k_stored[i:i + 1].to(DEVICE), None if scales is None else scales[i:i + 1].to(DEVICE))
        got = tiers.select(q[i % 60].to(DEVICE), w[i % 60].to(DEVICE))
        assert torch.equal(got.cpu(), engine_select(q[i % 60][None], w[i % 60][None], k_deq[: i + 1], 1, 40)), i
    s = tiers.stats()
    assert s["candidate_reads"] == 1 and s["lagged_steps"] == 399 and s["demoted_pages"] == 400 // 16
    assert s["misses"] > 0 and s["evictions"] > 0 and s["uncertified_steps"] == 0


def test_lagged_step_never_reads_its_own_candidates() -> None:
    """Step t posts its candidates (the coarse top pages of its own query) without reading them;
    step t+1's append fetches exactly those; only the first step after a prefill or bulk append
    reads candidate ids back (the synchronous path)."""
    keys, q0, w = clustered_keys(8192 + 40, 16, seed=11)
    q = drifting(q0, 40, seed=11)
    cfg = KeyTierConfig(page_size=64, key_format="bf16", hot_pages=2, topk=256, candidate_pages=24, cache_pages=32,
                        lagged_fetch=True)
    tiers = TieredKeys(cfg, CPU)
    reads = []
    read_back = tiers._read_back
    tiers._read_back = lambda top: reads.append(tiers._step) or read_back(top)  # count the blocking reads
    tiers.append(keys[:8000])
    posted = None  # the first step is synchronous: it posts nothing
    for s in range(30):
        tiers.append(keys[8000 + s:8001 + s])
        if posted is not None:  # the fetch this append started is the one step s - 1 posted
            assert bool((tiers._slot_of_page[posted] >= 0).all()), s
        tiers.select(q[s], w)
        assert reads == [0], s
        if s:
            n_cold = tiers.num_cold_pages
            want = torch.topk(page_estimates(q[s], w, tiers.means[:n_cold], tiers.mean_scales[:n_cold]), 24).indices
            posted = tiers._pending_ids[: tiers._pending].clone()
            assert torch.equal(torch.sort(posted).values, torch.sort(want).values), s  # this step's own ranking
    tiers.append(keys[8030:8040])  # bulk append: the next step is synchronous again
    tiers.select(q[30], w)
    assert reads == [0, 30] and tiers.stats()["lagged_steps"] == 29
