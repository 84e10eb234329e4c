"""One-launch decode top-k (`kernels/topk/one_launch.py`): its first digit, each finishing path, the
self-cleaning workspace across calls, and the fused indexer path; exactness by `check_topk` (any tie
order). The general random / ties / strided / layout cases run in test_topk.py's IMPLS."""

import pytest
import torch

from hearth.kernels.indexer import indexer_decode_topk, lightning_indexer_decode
from hearth.kernels.topk import one_launch, topk_indices_one_launch
from hearth.kernels.topk.one_launch import (
    HEADER,
    HIST2,
    INT_MAX,
    INT_MIN,
    KEY_MAX,
    KEY_MIN,
    PATH,
    PATH_FULL,
    PATH_ROW,
    PATH_SCRATCH,
    PATH_SECOND,
    PATH_TAKE,
    _programs_per_row,
    fine_hist_launch,
    map_through_pages,
    new_one_launch_workspace,
    one_launch_plan,
    one_launch_topk_launch,
)
from hearth.kernels.topk.radix import NBINS
from hearth.kernels.topk.reference import (
    check_topk,
    fine_bin_ref,
    order_key_ref,
    sample_positions_ref,
    shares_prefix_ref,
)
from tests.kernels.conftest import requires_cuda
from tests.kernels.test_lightning_indexer import _filled_cache, _queries

POISON = 0x5A5A5A5A


def _assert_clean(ws: torch.Tensor) -> None:
    """What every call must leave behind: zero histograms and counters, min / max sentinels."""
    ws = ws.cpu()
    assert bool((ws[:, : 2 * NBINS] == 0).all()), "histograms must be cleared for the next call"
    assert bool((ws[:, HEADER : HEADER + KEY_MIN] == 0).all()), "counters must be zeroed"
    assert bool((ws[:, HEADER + KEY_MIN] == INT_MAX).all()) and bool((ws[:, HEADER + KEY_MAX] == INT_MIN).all())


def test_fine_bin_is_monotone_with_quarter_binades_inside_its_window(device):
    """The twin is monotone over every float class, its inner bins share the top 11 key bits, and the
    kernel's histogram equals the twin's bin counts."""
    specials = torch.tensor([float("-inf"), -3e38, -1e5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1e-5, 1.0, 1e5, 3e38])
    x = torch.cat([specials, torch.randn(3000) * torch.exp2(torch.randint(-30, 30, (3000,)).float())])
    keys = order_key_ref(x).sort().values  # -0 before +0, unlike a float sort
    bins = fine_bin_ref(keys)
    assert bool((bins[1:] >= bins[:-1]).all()), "fine_bin must not decrease with the key"
    assert bins.min() == 0 and bins.max() == 255
    inner = shares_prefix_ref(bins)
    for b in bins[inner].unique():
        assert (keys[bins == b] >> 21).unique().numel() == 1, f"bin {int(b)} spans more than a quarter binade"
    assert torch.equal(bins[(bins == 127) | (bins == 128)], fine_bin_ref(order_key_ref(torch.tensor([-0.0, 0.0]))))
    assert fine_bin_ref(order_key_ref(torch.tensor([-1e-30, 1e-30]))).tolist() == [126, 129], "zeros alone"
    one, half = fine_bin_ref(order_key_ref(torch.tensor([1.0, 0.5]))).tolist()
    assert one - half == 4  # four bins per binade
    scores = x[torch.randperm(x.numel())][None].to(device)
    ws = new_one_launch_workspace(1, one_launch_plan(16), device)
    fine_hist_launch(scores, torch.tensor([x.numel()], dtype=torch.int32, device=device), 16, ws, block=256)
    want = torch.bincount(fine_bin_ref(order_key_ref(scores.cpu()[0])).long(), minlength=NBINS)
    assert torch.equal(ws[0, :NBINS].cpu().long(), want)


def _rows_for_every_path(n: int, k: int, device) -> tuple[torch.Tensor, list[int]]:
    """Rows of n scores and the finishing path each takes with the default capacity (4 k)."""
    s = torch.randn(8, n, device=device)
    # n distinct scores 0.001 apart in [1, 4): the cutoff bin [3.5, 4) keeps ~500, two per sub-bin
    s[0] = 1.0 + 0.001 * torch.randperm(n, device=device).float()
    paths = [PATH_SECOND]
    s[1] = torch.relu(s[1] - 2.5)  # the k-th largest is a 0 tied thousands of times: overflow, all equal
    paths.append(PATH_TAKE)
    s[2] = -torch.arange(n, device=device).float()  # the top-k in the first split only: others keep nothing
    paths.append(PATH_SECOND)
    s[3] = 1.0 + 0.2 * torch.rand(n, device=device)  # every key in the bin [1, 1.25): distinct, overflow
    paths.append(PATH_ROW)
    s[4] = float("-inf")
    s[4, : k // 2] = torch.randn(k // 2, device=device)  # the k-th largest is -inf: equal survivors
    paths.append(PATH_TAKE)
    s[5] = -10.0 + torch.randn(n, device=device)
    s[5, 7 : 7 + 3 * k] = torch.rand(3 * k, device=device) * 1e-6  # cutoff in the clamped edge bin [0, 2^-16)
    paths.append(PATH_SCRATCH)
    s[6] = -10.0 + torch.randn(n, device=device)
    # 700 distinct keys one ulp apart: one sub-bin of the second digit, more than CAP2 = 512 of them
    s[6, 100:800] = (torch.arange(700, device=device, dtype=torch.int32) + 0x3F800000).view(torch.float32)
    paths.append(PATH_SCRATCH)
    s[7] = torch.relu(s[7] - 2.5)
    s[7, 5 : 5 + 3 * k : 30] = 1e-30  # a few tiny positives beside the zeros: those still make a bin of equal keys
    paths.append(PATH_TAKE)
    return s, paths


@pytest.mark.parametrize("scan", [0, 1, 2])
def test_every_path_exact_and_the_workspace_cleans_itself(scan, device):
    """Each way of streaming a slice (`_scan_slice`'s SCAN) takes every finishing path exactly."""
    n, k = 3000, 200
    s, paths = _rows_for_every_path(n, k, device)
    plan = one_launch_plan(k)  # capacity 800
    ws = new_one_launch_workspace(s.shape[0], plan, device)
    lengths = torch.full((s.shape[0],), n, dtype=torch.int32, device=device)
    for call in range(2):
        lengths[0] = n - 17 * call  # decode moves the lengths; the workspace is never re-zeroed
        out = torch.full((s.shape[0], k), POISON, dtype=torch.int32, device=device)
        fine_hist_launch(s, lengths, k, ws, block=128)
        one_launch_topk_launch(s, lengths, out, ws, plan, programs=3, block=128, scan=scan)
        check_topk(out, s, lengths, k)
        assert ws[:, HEADER + PATH].tolist() == paths
        _assert_clean(ws)


@pytest.mark.parametrize("scan", [0, 2])
def test_page_map_writes_token_positions_on_every_path(scan, device):
    """With a page map the select writes what `map_through_pages` makes of its plain output (one launch
    fewer), on every finishing path and for a row no longer than k; the same path is taken."""
    n, k, page = 3000, 200, 16
    s, paths = _rows_for_every_path(n, k, device)
    g = torch.Generator().manual_seed(5)
    table = torch.randperm(400, generator=g)[: -(-n // page)].to(torch.int32).to(device)  # distinct pages
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(1, plan, device)
    for row, path in [*zip(s, paths), (s[0], None)]:
        length = torch.tensor([n if path is not None else k - 3], dtype=torch.int32, device=device)
        outs = []
        for page_map in (None, (table, page)):
            out = torch.full((1, k), POISON, dtype=torch.int32, device=device)
            fine_hist_launch(row[None], length, k, ws, block=128)
            one_launch_topk_launch(row[None].contiguous(), length, out, ws, plan, programs=3, block=128,
                                   page_map=page_map, scan=scan)
            if path is not None:
                assert ws[0, HEADER + PATH].item() == path
            outs.append(out)
        plain, mapped = outs
        check_topk(plain, row[None], length, k)
        # (ties at the cut may be broken differently by two launches: the mapped output must be a
        # top-k itself once mapped back, and where the row has no tie at the cut, the same one)
        inverse = torch.full((400,), -1, dtype=torch.int64, device=device)
        inverse[table.long()] = torch.arange(table.numel(), device=device)
        taken = mapped[0][mapped[0] >= 0].long()
        assert bool((inverse[taken // page] >= 0).all()), "a position outside the page map"
        unmapped = torch.full_like(mapped, -1)
        unmapped[0, : taken.numel()] = (inverse[taken // page] * page + taken % page).int()
        check_topk(unmapped, row[None], length, k)
        if path != PATH_TAKE:
            want = map_through_pages(plain[0].contiguous(), table, page, torch.empty_like(plain[0]))
            assert sorted(mapped[0].tolist()) == sorted(want.tolist())
        _assert_clean(ws)
    with pytest.raises(ValueError, match="one row"):
        rows = s.shape[0]
        one_launch_topk_launch(s, torch.full((rows,), n, dtype=torch.int32, device=device),
                               torch.empty(rows, k, dtype=torch.int32, device=device),
                               new_one_launch_workspace(rows, plan, device), plan, page_map=(table, page))


@pytest.mark.parametrize("n, capacity", [(2500, 1024), (5000, 1023)])
def test_sub_bin_path_matches_torch_topk(n, capacity, device):
    """Distinct scores: the second-histogram path selects torch.topk's index set exactly, also where the
    survivors outnumber the finish's first loaded block (5000 scores: ~1000 survivors, a block of 512)."""
    k = 64
    # distinct scores 2.5 / n apart in [1, 3.5): the cutoff bin [3, 3.5) holds <= n / 5
    s = 1.0 + (2.5 / n) * torch.stack([torch.randperm(n, device=device) for _ in range(3)]).float()
    lengths = torch.tensor([n, n - 1, 1000], dtype=torch.int32, device=device)
    plan = one_launch_plan(k, capacity=capacity)
    assert plan.finish_block == (1024 if capacity == 1024 else 512)
    ws = new_one_launch_workspace(3, plan, device)
    out = topk_indices_one_launch(s, lengths, k, workspace=ws, capacity=capacity, programs=4, block=128)
    assert ws[:, HEADER + PATH].tolist() == [PATH_SECOND] * 3
    for r in range(3):
        want = torch.topk(s[r, : lengths[r]].cpu(), k).indices.sort().values
        assert torch.equal(out[r].cpu().long().sort().values, want)
    assert bool((ws[:, HIST2 : HIST2 + NBINS] == 0).all())


def test_short_rows_odd_sizes_and_capacity(device):
    """L <= k rows (0..L-1 then -1), L = 0, L = k + 1, an odd width, and a capacity of exactly k."""
    n, k = 777, 300
    s = torch.randn(6, n, device=device)
    s[2] = 3.0  # all equal
    s[3, 9:] = float("-inf")
    lengths = torch.tensor([n, k + 1, n, n, k, 0], dtype=torch.int32, device=device)
    for capacity in (None, k):
        out = torch.full((6, k), POISON, dtype=torch.int32, device=device)
        topk_indices_one_launch(s, lengths, k, out=out, capacity=capacity, programs=5, block=64)
        check_topk(out, s, lengths, k)
        assert out[4].tolist() == list(range(k)) and out[5].tolist() == [-1] * k


def test_plan_and_workspace_errors(device):
    with pytest.raises(ValueError, match="capacity"):
        one_launch_plan(64, capacity=63)
    with pytest.raises(ValueError, match="k must"):
        one_launch_plan(0)
    s = torch.randn(2, 100, device=device)
    lengths = torch.full((2,), 100, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices_one_launch(s, lengths, 8, workspace=torch.zeros(2, 10, dtype=torch.int32, device=device))


@pytest.mark.parametrize("kernel", ["persistent", "tiled"])
def test_indexer_one_launch_next_n_2_reuses_its_workspace(kernel, device):
    """The fused indexer adds the fine histogram, one launch selects; next_n = 2, different lengths per
    request (one shorter than k), two decode steps on one workspace."""
    ctx, block_size, next_n, heads, k = [700, 30, 333], 16, 2, 16, 40
    max_blocks = -(-max(ctx) // block_size) + 2
    cache, table = _filled_cache(ctx, block_size, max_blocks, device)
    q = _queries((len(ctx), next_n, heads, 128), "fp8", device)
    w = torch.randn(len(ctx), next_n, heads, device=device)
    rows = len(ctx) * next_n
    ws = new_one_launch_workspace(rows, one_launch_plan(k), device)
    for step in range(2):
        ctx_t = torch.tensor([n + step for n in ctx], dtype=torch.int32, device=device)
        logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx_t, block_size, config={"kernel": kernel})
        idx = indexer_decode_topk(
            q, w, cache, table, ctx_t, block_size, k, config={"kernel": kernel}, topk="one_launch", topk_workspace=ws
        )
        assert idx.shape == (len(ctx), next_n, k)
        check_topk(idx.view(rows, k), logits, lengths, k)
        _assert_clean(ws)


def test_the_sampled_histogram_counts_every_sample_th_key_of_long_rows(device):
    """Rows of at least sample_min * k keys: the bins of one key in every 8 (the torch twin's positions), whatever
    the programs and blocks; shorter rows: every key. The offsets in the runs of 8 vary."""
    n, k = 3001, 40
    s = torch.randn(3, n, device=device) * 3
    lengths = torch.tensor([n, 8 * k - 1, 8 * k], dtype=torch.int32, device=device)
    ws = new_one_launch_workspace(3, one_launch_plan(k), device)
    fine_hist_launch(s, lengths, k, ws, block=256, sample=8, sample_min=8)
    bins = fine_bin_ref(order_key_ref(s.cpu())).long()
    for r, (length, sample) in enumerate([(n, 8), (8 * k - 1, 1), (8 * k, 8)]):
        want = torch.bincount(bins[r, sample_positions_ref(length, sample)], minlength=NBINS)
        assert torch.equal(ws[r, :NBINS].cpu().long(), want), r
    assert sample_positions_ref(n, 8).remainder(8).unique().numel() == 8
    for sample, block in ((3, 256), (32, 256)):
        with pytest.raises(ValueError, match="sample"):
            fine_hist_launch(s, lengths, k, ws, block=block, sample=sample)


def _rows_for_sampled_bands(n: int, k: int, sample: int, device) -> tuple[torch.Tensor, list[set[int]]]:
    """Rows whose sampled band holds the k-th largest (the usual finishing paths), and rows built to
    fool the sample (its positions from the torch twin; PATH_FULL: the whole row again, still exact)."""
    pos = torch.arange(n, device=device)
    s = torch.randn(7, n, device=device)
    paths = [{PATH_SECOND}]  # a band of a few quarter-binade bins
    # distinct, ~90 keys a quarter binade: the band may span more than four bins (then no band digit)
    s[1] = torch.exp(torch.randperm(n, device=device).float() * (8 / n))
    paths.append({PATH_SECOND, PATH_SCRATCH})
    s[2] = torch.relu(s[2] - 2.5)  # the k-th largest is a 0 tied thousands of times
    paths.append({PATH_TAKE})
    s[3] = torch.exp(pos.float() * (8 / n))  # increasing with the position (recent tokens score higher)
    paths.append({PATH_SECOND, PATH_SCRATCH})
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[sample_positions_ref(n, sample)] = True
    sampled = sampled.to(device)
    s[4] = torch.where(sampled, -5.0, 5.0) + 0.01 * torch.randn(n, device=device)  # the sample: all low
    paths.append({PATH_FULL})
    # the sample spread thin over 30 binades (~17 keys a bin), the others far below: fewer than k keys in and
    # above the band
    s[5] = torch.where(sampled, torch.exp2(torch.randperm(n, device=device).float() * (30 / n) - 15), -100.0)
    paths.append({PATH_FULL})
    s[6] = -10.0 + torch.randn(n, device=device)
    s[6, 7 : 7 + 3 * k] = torch.rand(3 * k, device=device) * 1e-6  # the band reaches a clamped edge bin
    paths.append({PATH_SCRATCH, PATH_ROW})
    return s, paths


def test_the_default_samples_only_many_long_rows(monkeypatch, device):
    """Named no sample, the top-level call samples from SAMPLE_MIN_WORK (row, key) pairs (the histogram and the
    select told the same) and counts every key below; either selects exactly."""
    assert one_launch.default_sample(1, 131072) == 1 and one_launch.default_sample(8, 131072) == one_launch.HIST_SAMPLE
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["sample"])
        return fine_hist_launch(*args, **kwargs)

    monkeypatch.setattr(one_launch, "fine_hist_launch", spy)
    n, k = 4099, 64  # rows of more than SAMPLE_MIN_PER_K * k keys: the kernels sample them when told to
    s = torch.randn(2, n, device=device)
    lengths = torch.full((2,), n, dtype=torch.int32, device=device)
    for min_work, want in ((2 * n + 1, 1), (2 * n, one_launch.HIST_SAMPLE)):
        monkeypatch.setattr(one_launch, "SAMPLE_MIN_WORK", min_work)
        check_topk(topk_indices_one_launch(s, lengths, k, block=256), s, lengths, k)
        assert seen[-1] == want


@pytest.mark.parametrize("scan", [0, 1, 2])
def test_a_sampled_histogram_selects_exactly_on_every_path(scan, device):
    """Band finishing: the exact count above and inside the band decides; a band that missed the k-th
    largest recomputes the row; every call leaves the workspace clean. (1 in 2 keys at these small rows:
    the band's margin is SAMPLE_SIGMAS standard deviations, so a 1-in-8 sample needs k in the thousands.)"""
    n, k, sample = 4099, 200, 2
    s, paths = _rows_for_sampled_bands(n, k, sample, device)
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(s.shape[0], plan, device)
    lengths = torch.full((s.shape[0],), n, dtype=torch.int32, device=device)
    for call in range(2):
        lengths[0] = n - 13 * call
        out = torch.full((s.shape[0], k), POISON, dtype=torch.int32, device=device)
        topk_indices_one_launch(s, lengths, k, out=out, workspace=ws, programs=3, block=256, scan=scan,
                                sample=sample, sample_min=8)
        check_topk(out, s, lengths, k)
        got = ws[:, HEADER + PATH].tolist()
        assert all(path in want for path, want in zip(got, paths)), got
        _assert_clean(ws)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,n", [(1, 131072), (64, 131072)])
@pytest.mark.parametrize("kind", ["randn", "relu_zeros", "narrow", "increasing"])
def test_sampled_histogram_real_shapes_gpu(rows, n, kind):
    """1-in-8 histograms at decode shapes: exact, and no row needs the whole-row recount."""
    k = 2048
    s = torch.randn(rows, n, device="cuda")
    if kind == "relu_zeros":
        s = torch.relu(s - 3.0)
    elif kind == "narrow":
        s = 1.0 + torch.rand(rows, n, device="cuda")
    elif kind == "increasing":
        s = torch.arange(n, device="cuda").float()[None].expand(rows, n) * 1e-4 + 0.1 * s
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    lengths[0] = n
    ws = new_one_launch_workspace(rows, one_launch_plan(k), s.device)
    for _ in range(2):
        out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
        topk_indices_one_launch(s, lengths, k, out=out, workspace=ws, sample=8)
        check_topk(out, s, lengths, k)
        assert PATH_FULL not in ws[:, HEADER + PATH].tolist()
        _assert_clean(ws)


def gpu_scores(kind: str, rows: int, n: int) -> torch.Tensor:
    """Decode-like rows on the GPU: randn, ReLU'd (thousands of tied zeros at the cut) or narrow (every key in
    four quarter-binade bins)."""
    s = torch.randn(rows, n, device="cuda")
    if kind == "relu_zeros":
        s = torch.relu(s - 3.0)
    elif kind == "narrow":
        s = 1.0 + torch.rand(rows, n, device="cuda")
    return s


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,n", [(1, 131072), (8, 131072), (64, 131072), (64, 8192)])
@pytest.mark.parametrize("kind", ["randn", "relu_zeros", "narrow"])
@pytest.mark.parametrize("scan", [0, 1, 2])
def test_one_launch_real_shapes_gpu(rows, n, kind, scan):
    k = 2048
    s = gpu_scores(kind, rows, n)
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    lengths[0] = n
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    for _ in range(2):
        out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
        topk_indices_one_launch(s, lengths, k, out=out, workspace=ws, scan=scan)
        check_topk(out, s, lengths, k)
        _assert_clean(ws)


@pytest.mark.gpu
@requires_cuda
def test_one_launch_graph_replay_gpu():
    """Captured once (histogram + selection), replayed over new scores and lengths on one workspace."""
    rows, n, k = 4, 131072, 2048
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    topk_indices_one_launch(s, lengths, k, out=out, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_indices_one_launch(s, lengths, k, out=out, workspace=ws)
    for step in range(5):
        fresh = torch.randn(rows, n, device="cuda")
        s.copy_(fresh if step % 2 else torch.relu(fresh - 3))  # odd steps: ties at 0 across the cutoff
        lengths.copy_(torch.randint(k // 2, n + 1, (rows,), dtype=torch.int32, device="cuda"))
        graph.replay()
        check_topk(out, s, lengths, k)
    _assert_clean(ws)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_trace_stamps_each_program_in_order_gpu(rows):
    """The select's timeline (benchmarks): every program stamps start <= band <= slice done <= arrival, and the
    one that finishes each row stamps once, after every arrival of its row."""
    n, k = 131072, 2048
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    programs = -(-n // one_launch._segment(rows, n, 1024, None, s.device))
    trace = torch.zeros(rows, programs, 8, dtype=torch.int64, device="cuda")
    fine_hist_launch(s, lengths, k, ws)
    one_launch_topk_launch(s, lengths, out, ws, plan, trace=trace)
    check_topk(out, s, lengths, k)
    t = trace.cpu()
    assert bool((t[..., 0] > 0).all()) and bool((t[..., :4].diff(dim=-1) >= 0).all())
    assert bool(((t[..., 4] > 0).sum(dim=1) == 1).all()), "one finish per row"
    assert bool((t[..., 4].max(dim=1).values >= t[..., 3].max(dim=1).values).all())
    with pytest.raises(ValueError, match="trace"):
        one_launch_topk_launch(s, lengths, out, ws, plan, trace=trace[:, :1])


def test_programs_per_row_leave_no_sm_a_third_program():
    """Two programs per SM over all rows, rounded down: never more (an SM holding a third finishes last), never
    fewer than one a row or more than one a block."""
    cpu = torch.device("cpu")
    sms = 4  # what the launch plans for under the interpreter (`sm_count`)
    for rows in range(1, 3 * sms):
        for n, block in ((131072, 1024), (2048, 1024), (1000, 1024)):
            p = _programs_per_row(rows, n, block, cpu)
            assert 1 <= p <= -(-n // block)
            assert rows * p <= 2 * sms or p == 1
            assert rows * (p + 1) > 2 * sms or p == -(-n // block), (rows, n, p)


def test_map_through_pages_gives_the_pages_own_positions(device):
    page = 16
    pages = torch.tensor([7, 2, 9, -1], dtype=torch.int32, device=device)  # a table of pages, -1 past its end
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 3 * page, (1500,), generator=g, dtype=torch.int32).to(device)  # > one block, some -1
    out = map_through_pages(idx, pages, page, torch.empty_like(idx))
    want = [-1 if i < 0 else int(pages[i // page]) * page + i % page for i in idx.tolist()]
    assert out.tolist() == want
