"""Radix-select, single-pass and sampled top-k vs a sort-based reference; any tie order is accepted
(`check_topk`)."""

from functools import partial

import pytest
import torch

from hearth.kernels.topk import topk_indices, topk_indices_one_launch, topk_indices_sampled, topk_indices_single_pass
from hearth.kernels.topk.reference import check_topk, order_key_ref, topk_ref
from hearth.kernels.topk.sampled import (
    PATH_CANDIDATES,
    PATH_FALLBACK,
    PATH_TIES,
    new_sampled_workspace,
    sampled_plan,
    sampled_topk_launch,
)
from hearth.kernels.topk.single_pass import new_scratch, single_pass_topk_launch
from tests.kernels.conftest import requires_cuda

POISON = 0x5A5A5A5A


def _one_launch_tight(scores, lengths, k, *, out=None):
    """The one-launch select with room for only k survivors: crowded cutoff bins take the row fallback."""
    return topk_indices_one_launch(scores, lengths, k, out=out, capacity=k, programs=2, block=64)


# capacity=1 sends every row longer than k through the single-pass kernel's overflow fallback; the
# sampled variants split rows over several programs of 64-128 keys, sample 64 keys (rows of a few
# hundred are then chunk-sampled) or, with capacity 1, take the ties path or the exact fallback; the
# one-launch variants split rows over 3 programs, or 2 with a survivor buffer of only k entries
IMPLS = {
    "radix": topk_indices,
    "single_pass": topk_indices_single_pass,
    "single_pass_overflow": partial(topk_indices_single_pass, capacity=1),
    "sampled": partial(topk_indices_sampled, programs=3, block=128),
    "sampled_small_sample": partial(topk_indices_sampled, programs=5, block=64, sample=64),
    "sampled_fallback": partial(topk_indices_sampled, programs=2, block=128, capacity=1),
    "one_launch": partial(topk_indices_one_launch, programs=3, block=128),
    "one_launch_tight": _one_launch_tight,
}


@pytest.fixture(params=list(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _run(scores, lengths, k, impl=topk_indices):
    out = torch.full((scores.shape[0], k), POISON, dtype=torch.int32, device=scores.device)
    idx = impl(scores, lengths, k, out=out)
    assert idx.data_ptr() == out.data_ptr()
    check_topk(idx, scores, lengths, k)
    return idx


@pytest.mark.parametrize("n,k", [(1, 4), (63, 16), (2049, 64), (2049, 2048), (100, 2048), (5000, 300)])
def test_topk_random_rows(n, k, device, impl):
    lengths = torch.tensor([n, max(n - 1, 0), n // 2, min(k, n), min(k + 1, n), 0], dtype=torch.int32)
    scores = torch.randn(6, n, device=device) * 10
    _run(scores, lengths.to(device), k, impl)


def test_topk_ties_and_infinities(device, impl):
    n, k = 3000, 100
    s = torch.randn(8, n, device=device)
    s[0] = torch.randint(0, 5, (n,), device=device).float()  # heavy ties across the threshold
    s[1] = 1.0  # all equal
    s[2] = float("-inf")  # -inf row longer than k: any k indices are valid
    s[3, ::2] = float("-inf")  # half -inf
    s[4] = -s[4].abs()  # all negative
    s[5] = torch.where(torch.rand(n, device=device) < 0.5, 0.0, -0.0)  # signed zeros tie
    s[6, :50] = float("inf")
    s[7] = torch.randn(n, device=device).half().float() * 1e-30  # tiny values, close keys
    lengths = torch.tensor([n, n, n, 2 * k + 1, n - 7, n, 77, n], dtype=torch.int32, device=device)
    _run(s, lengths, k, impl)


def test_topk_strided_rows(device, impl):
    base = torch.randn(4, 700, device=device)
    scores = base[:, :600]  # row stride 700
    _run(scores, torch.tensor([600, 599, 1, 300], dtype=torch.int32, device=device), 128, impl)


def test_reference_is_a_valid_topk():
    s = torch.randint(0, 3, (5, 200)).float()
    s[2] = float("-inf")
    lengths = torch.tensor([200, 10, 150, 0, 64], dtype=torch.int32)
    check_topk(topk_ref(s, lengths, 64), s, lengths, 64)


def test_check_rejects_a_wrong_set():
    s = torch.arange(10.0)[None]
    lengths = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(AssertionError):
        check_topk(torch.tensor([[9, 8, 6]], dtype=torch.int32), s, lengths, 3)


def test_single_pass_index_sets_match_reference(device):
    n, k = 1001, 37
    s = torch.randperm(7 * n, device=device)[: 5 * n].float().view(5, n) - 2000.0  # distinct values
    lengths = torch.tensor([n, n - 3, 38, 37, 5], dtype=torch.int32, device=device)
    ref = topk_ref(s, lengths, k)
    for impl in (topk_indices_single_pass, partial(topk_indices_single_pass, capacity=2)):
        got = _run(s, lengths, k, impl)
        assert torch.equal(got.sort(dim=1).values.cpu(), ref.sort(dim=1).values.cpu())


def test_single_pass_compacts_the_cutoff_bin_or_falls_back(device):
    """The scratch buffer holds exactly the cutoff bin's (key, index) pairs in row order when they fit,
    and stays untouched when they overflow (the fallback reads the row instead); results are exact."""
    n, k = 1500, 37
    cap = 4 * k
    s = torch.randn(6, n, device=device)
    # a top-digit bin spans two binades: 60 keys planted in [8, 32) make the cutoff bin, compacted
    s[0, torch.randperm(n, device=device)[:60]] = 8.0 + 24.0 * torch.rand(60, device=device)
    s[1] = torch.relu(s[1] - 2.5)  # fewer than k positives: the k-th is 0, tied ~1490 times: overflow
    s[2] = torch.randint(0, 4, (n,), device=device).float()  # duplicates, the cutoff bin [2, 4) overflows
    s[3] = float("-inf")
    s[3, :10] = torch.randn(10, device=device)  # the k-th is -inf, tied 110 times within the length: fits
    lengths = torch.tensor([n, n - 1, n, 120, k + 1, k - 5], dtype=torch.int32, device=device)
    out = torch.full((6, k), POISON, dtype=torch.int32, device=device)
    scratch = new_scratch(6, k, device, capacity=cap).fill_(POISON)
    single_pass_topk_launch(s, lengths, k, out, scratch)
    check_topk(out, s, lengths, k)
    outcomes = []
    for r in range(6):
        n_r = int(lengths[r])
        row_scratch = scratch[r].cpu()
        if n_r <= k:
            assert bool((row_scratch == POISON).all()), f"row {r}: short rows need no scratch"
            continue
        key = order_key_ref(s[r, :n_r]).cpu()
        cut = int(key.topk(k).values[-1]) >> 24
        surv = torch.nonzero((key >> 24) == cut).flatten()
        if surv.numel() <= cap:
            outcomes.append("fits")
            assert torch.equal(row_scratch[cap : cap + surv.numel()], surv.int()), f"row {r}: survivor indices"
            assert torch.equal(row_scratch[: surv.numel()], key[surv]), f"row {r}: survivor keys"
            assert bool((row_scratch[surv.numel() : cap] == POISON).all()), f"row {r}: wrote past the survivors"
        else:
            outcomes.append("overflow")
            assert bool((row_scratch == POISON).all()), f"row {r}: an overflowing row must not compact"
    assert outcomes == ["fits", "overflow", "overflow", "fits", "fits"], outcomes


def test_sampled_odd_sizes_and_k_near_length(device):
    """Rows not a multiple of the block or the sample chunk, k = L - 1, L = k + 1, L <= k, L = 0,
    -inf padding past a short valid prefix, all-equal rows: exact through whichever path they take."""
    n, k = 777, 500
    s = torch.randn(7, n, device=device)
    s[2] = 3.0  # all equal
    s[3, 9:] = float("-inf")  # the k-th largest is -inf, tied hundreds of times
    s[4] = torch.randint(0, 3, (n,), device=device).float()
    lengths = torch.tensor([n, k + 1, n, n, 701, k, 0], dtype=torch.int32, device=device)
    for sample in (None, 64):
        _run(s, lengths, k, partial(topk_indices_sampled, programs=4, block=64, sample=sample))
    _run(s[:, :n], torch.full((7,), n, dtype=torch.int32, device=device), n - 1, topk_indices_sampled)


def _sampled_once(s, lengths, k, ws, plan, programs=4, block=128):
    out = torch.full((s.shape[0], k), POISON, dtype=torch.int32, device=s.device)
    sampled_topk_launch(s, lengths, out, ws, plan, programs=programs, block=block)
    check_topk(out, s, lengths, k)
    return out


def test_sampled_paths_and_workspace_reuse(device):
    """Each row takes the path its scores call for (recorded in the workspace's path word), the
    counters are back to zero after every call, and one workspace serves repeated calls unchanged."""
    n, k = 3000, 100
    plan = sampled_plan(n, k, sample=256)
    assert plan.capacity >= 4 * k
    ws = new_sampled_workspace(5, plan, device)
    s = torch.randn(5, n, device=device)
    s[1] = torch.relu(s[1] - 2.5)  # ~20 positives: the k-th largest is a 0 tied ~2980 times
    # the sample reads 8 chunks of 32 keys; put k + 200 large keys where it never looks
    sampled = (torch.arange(256) // 32) * n // 8 + torch.arange(256) % 32
    unseen = torch.ones(n, dtype=torch.bool)
    unseen[sampled] = False
    s[2, torch.nonzero(unseen).flatten()[: k + 200].to(device)] = 100.0 + torch.rand(k + 200, device=device)
    s[3] = -1.0
    s[3, sampled.to(device)] = 5.0 + torch.rand(256, device=device)  # fewer than k keys >= the sampled cutoff
    lengths = torch.tensor([n, n, n, n, k], dtype=torch.int32, device=device)
    for call in range(3):
        # later calls move the lengths (as decode does) without re-zeroing the workspace
        lengths[0] = n - call
        _sampled_once(s, lengths, k, ws, plan)
        paths = ws[:, 3].tolist()
        assert paths[:4] == [PATH_CANDIDATES, PATH_TIES, PATH_CANDIDATES, PATH_FALLBACK], paths
        assert paths[4] == 0, "a row with L <= k never touches its workspace"
        assert bool((ws[:, :3] == 0).all()), "counters must be zeroed for the next call"
    # k + 200 unseen large keys exceed a capacity of 256: the exact fallback takes over
    small = sampled_plan(n, k, sample=256, capacity=256)
    ws_small = new_sampled_workspace(5, small, device)
    _sampled_once(s, lengths, k, ws_small, small)
    assert ws_small[2, 3].item() == PATH_FALLBACK


def test_sampled_index_sets_match_reference(device):
    n, k = 1001, 37
    s = torch.randperm(7 * n, device=device)[: 5 * n].float().view(5, n) - 2000.0  # distinct values
    lengths = torch.tensor([n, n - 3, 38, 37, 5], dtype=torch.int32, device=device)
    ref = topk_ref(s, lengths, k)
    for impl in (IMPLS["sampled"], IMPLS["sampled_small_sample"], IMPLS["sampled_fallback"]):
        got = _run(s, lengths, k, impl)
        assert torch.equal(got.sort(dim=1).values.cpu(), ref.sort(dim=1).values.cpu())


def test_sampled_plan_bounds():
    plan = sampled_plan(131072, 2048)
    assert (plan.sample, plan.capacity) == (4096, 8192)
    assert plan.ws_stride % 32 == 0 and plan.ws_stride >= 4 + 2 * 8192 + 2048
    with pytest.raises(ValueError, match="k must"):
        sampled_plan(131072, 8192)
    with pytest.raises(ValueError, match="sample"):
        sampled_plan(1000, 10, sample=100)
    with pytest.raises(ValueError, match="capacity"):
        sampled_plan(1000, 10, capacity=3)


def test_layout_errors(device, impl):
    s = torch.randn(2, 10, device=device)
    lengths = torch.tensor([10, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="scores"):
        impl(s.double(), lengths, 4)
    with pytest.raises(ValueError, match="lengths"):
        impl(s, lengths.long(), 4)
    with pytest.raises(ValueError, match="k must"):
        impl(s, lengths, 0)
    with pytest.raises(ValueError, match="unit last stride"):
        impl(s.t(), torch.tensor([2] * 10, dtype=torch.int32, device=device), 1)
    with pytest.raises(ValueError, match="out"):
        impl(s, lengths, 4, out=torch.empty(2, 5, dtype=torch.int32, device=device))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,n", [(64, 131072), (1, 1 << 20), (4096, 8192)])
@pytest.mark.parametrize("name", ["radix", "single_pass", "sampled"])
def test_topk_real_shapes_gpu(rows, n, name):
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    lengths[0] = n
    idx = _run(s, lengths, 2048, IMPLS[name])
    # cross-check a few rows against torch.topk's value set
    for r in range(min(rows, 4)):
        want = torch.topk(s[r, : lengths[r]], 2048).values.sort().values
        assert torch.equal(s[r, idx[r].long()].sort().values, want)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["relu_zeros", "duplicates", "narrow"])
@pytest.mark.parametrize("name", ["single_pass", "sampled"])
def test_hard_rows_gpu(kind, name):
    """64 x 128K decode rows whose cutoff bin is crowded: exact through the compaction or the fallback."""
    rows, n, k = 64, 131072, 2048
    s = torch.randn(rows, n, device="cuda")
    if kind == "relu_zeros":
        s = torch.relu(s - 3.0)  # ~180 positives per row: the k-th largest is a tied 0
    elif kind == "duplicates":
        s = torch.randint(0, 100, (rows, n), device="cuda").float()
    else:
        s = 1.0 + torch.rand(rows, n, device="cuda")  # every key in the top-digit bin [0.5, 2)
    lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
    _run(s, lengths, k, IMPLS[name])


@pytest.mark.gpu
@requires_cuda
def test_sampled_graph_replay_gpu():
    """Captured once, replayed over new scores and lengths with the same workspace: exact each time."""
    rows, n, k = 4, 131072, 2048
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    plan = sampled_plan(n, k)
    ws = new_sampled_workspace(rows, plan, s.device)
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    sampled_topk_launch(s, lengths, out, ws, plan)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampled_topk_launch(s, lengths, out, ws, plan)
    for step in range(5):
        fresh = torch.randn(rows, n, device="cuda")
        s.copy_(fresh if step % 2 else torch.relu(fresh - 3))  # odd steps: ties at 0 across the cutoff
        lengths.copy_(torch.randint(k // 2, n + 1, (rows,), dtype=torch.int32, device="cuda"))
        graph.replay()
        check_topk(out, s, lengths, k)
