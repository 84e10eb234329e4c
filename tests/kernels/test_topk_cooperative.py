"""Cooperative few-row top-k (`kernels/topk/cooperative.py`): every path exact against torch, the shared
workspace left clean (its own barrier counters included), page maps, short rows, the plan's block and where
the path is taken. One program a row waits for nobody, so those cases run under the CPU interpreter too;
several programs a row (the grid barriers) run on the GPU only."""

import pytest
import torch

from hearth.kernels.indexer import indexer_decode_topk, lightning, lightning_indexer_decode
from hearth.kernels.topk import cooperative
from hearth.kernels.topk.cooperative import (
    ARRIVED_DONE,
    ARRIVED_HIST,
    ARRIVED_SPLIT,
    MAX_BLOCK,
    cooperative_block,
    cooperative_topk_launch,
    topk_indices_cooperative,
    use_cooperative,
)
from hearth.kernels.topk.one_launch import (
    HEADER,
    PATH,
    PATH_ROW,
    PATH_SCRATCH,
    PATH_SECOND,
    PATH_TAKE,
    map_through_pages,
    new_one_launch_workspace,
    one_launch_plan,
    topk_indices_one_launch,
)
from hearth.kernels.topk.reference import check_topk
from tests.kernels.conftest import requires_cuda
from tests.kernels.test_lightning_indexer import _filled_cache, _queries, small_decode
from tests.kernels.test_topk_one_launch import POISON, _assert_clean, _rows_for_every_path, gpu_scores

# what the cooperative path takes for _rows_for_every_path's rows: the crowded bin of row 3 needs no scratch
# here (each program writes its own keys above the sub-bin), so only the edge bin and the crowded sub-bin
# fall back to the single-program finish
COOPERATIVE_PATHS = [PATH_SECOND, PATH_TAKE, PATH_SECOND, PATH_SECOND, PATH_TAKE, PATH_SCRATCH, PATH_SCRATCH,
                     PATH_TAKE]


def _assert_all_clean(ws: torch.Tensor) -> None:
    _assert_clean(ws)
    words = [HEADER + w for w in (ARRIVED_HIST, ARRIVED_SPLIT, ARRIVED_DONE)]
    assert bool((ws[:, words] == 0).all()), "the barrier counters must be zeroed"


def _every_path(block: int, device: torch.device) -> None:
    """_rows_for_every_path's rows four at a time (at most four rows take the cooperative path), two calls on
    one workspace with a moved length: exact, the expected path, the workspace clean."""
    n, k = 3000, 200
    s, _ = _rows_for_every_path(n, k, device)
    plan = one_launch_plan(k)  # capacity 800
    for first in (0, 4):
        rows = s[first : first + 4].contiguous()
        ws = new_one_launch_workspace(4, plan, device)
        lengths = torch.full((4,), n, dtype=torch.int32, device=device)
        for call in range(2):
            lengths[0] = n - 17 * call  # decode moves the lengths; the workspace is never re-zeroed
            out = torch.full((4, k), POISON, dtype=torch.int32, device=device)
            topk_indices_cooperative(rows, lengths, k, out=out, workspace=ws, block=block)
            check_topk(out, rows, lengths, k)
            assert ws[:, HEADER + PATH].tolist() == COOPERATIVE_PATHS[first : first + 4]
            _assert_all_clean(ws)


@pytest.mark.parametrize("poll_hist", [False, True])
def test_every_path_exact_and_the_workspace_cleans_itself(poll_hist, device, monkeypatch):
    """One program a row: no barrier waits (so the CPU interpreter runs it too); the histogram's counts sum to
    the row's length, so a first barrier that polls them passes (`POLL_HIST`)."""
    monkeypatch.setattr(cooperative, "POLL_HIST", poll_hist)
    _every_path(4096, device)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("poll_acquire", [True, False])
@pytest.mark.parametrize("poll_hist", [True, False])
def test_every_path_with_several_programs_a_row_gpu(poll_acquire, poll_hist, monkeypatch):
    """12 programs a row of 256 keys: both grid barriers (each way of polling them), the survivors of every
    program."""
    monkeypatch.setattr(cooperative, "POLL_ACQUIRE", poll_acquire)
    monkeypatch.setattr(cooperative, "POLL_HIST", poll_hist)
    _every_path(256, torch.device("cuda"))


def test_spread_by_length_one_program_a_row(device, monkeypatch):
    """`SPREAD`: each program's slice follows the row's length; with one program a row its slice is the row's
    length rounded up, every path exact, the workspace clean; rows of at most k and empty rows as before."""
    monkeypatch.setattr(cooperative, "SPREAD", True)
    _every_path(4096, device)
    n, k = 777, 300
    s = torch.randn(3, n, device=device)
    lengths = torch.tensor([n, k + 1, 0], dtype=torch.int32, device=device)
    out = torch.full((3, k), POISON, dtype=torch.int32, device=device)
    topk_indices_cooperative(s, lengths, k, out=out, block=1024)
    check_topk(out, s, lengths, k)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("kind", ["randn", "edge", "increasing"])
def test_spread_by_length_in_a_wide_table_gpu(rows, kind, monkeypatch):
    """`SPREAD` with the engine's tables (160K wide: 2,048-key blocks): rows of 2K-128K spread over the row's
    programs by their length, three calls on one workspace with moving lengths, exact against torch."""
    monkeypatch.setattr(cooperative, "SPREAD", True)
    n, k = 163840, 2048
    s = gpu_scores("randn", rows, n)
    if kind == "edge":
        s = s * 1e-7
    elif kind == "increasing":
        s = torch.arange(n, device="cuda").float().expand(rows, n).contiguous()
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    assert use_cooperative(rows, n, s.device)  # (four rows of 160K take the one-launch path)
    for call, length in enumerate((8192, 131072, 2049)):
        lengths = torch.randint(k + 1, length + 1, (rows,), dtype=torch.int32, device="cuda")
        lengths[0] = length - call
        out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
        topk_indices_cooperative(s, lengths, k, out=out, workspace=ws)
        check_topk(out, s, lengths, k)
        _assert_all_clean(ws)


def _sub_bin_rows(n: int, k: int, device: torch.device) -> torch.Tensor:
    """Three rows of distinct keys whose k-th largest is in a sub-bin of one-ulp neighbours at 1.1 (the band is the
    quarter binade [1, 1.25)), with 20 band keys above the sub-bin and 40 below: the whole sub-bin needed (30 keys,
    30 needed), ranked from the digit table (30, 20 needed) and from the second scratch (100 > TABLE_WAYS, 50
    needed); keys above the band at 10 + uniform, the rest around -5."""
    rows = []
    for n_sub, n_need in ((30, 30), (30, 20), (100, 50)):
        n_high = k - 20 - n_need
        s = -5.0 + 0.1 * torch.randn(n, device=device)
        s[:n_high] = 10.0 + torch.rand(n_high, device=device)
        o = n_high
        s[o : o + 20] = 1.2 + 0.002 * torch.arange(20, device=device)  # above the sub-bin, in the band
        o += 20
        ulps = torch.arange(n_sub, device=device, dtype=torch.int32) + torch.tensor([1.1]).view(torch.int32).item()
        s[o : o + n_sub] = ulps.view(torch.float32)
        o += n_sub
        s[o : o + 40] = 1.0 + 0.001 * torch.arange(40, device=device)  # below the sub-bin, in the band
        rows.append(s[torch.randperm(n, device=device)])
    return torch.stack(rows)


def _sub_bin_ways(block: int, device: torch.device) -> None:
    n, k = 3000, 200
    s = _sub_bin_rows(n, k, device)
    lengths = torch.full((3,), n, dtype=torch.int32, device=device)
    ws = new_one_launch_workspace(3, one_launch_plan(k), device)
    for _ in range(2):
        out = torch.full((3, k), POISON, dtype=torch.int32, device=device)
        topk_indices_cooperative(s, lengths, k, out=out, workspace=ws, block=block)
        assert ws[:, HEADER + PATH].tolist() == [PATH_SECOND] * 3
        for r in range(3):
            want = torch.topk(s[r].cpu(), k).indices.sort().values
            assert torch.equal(out[r].cpu().long().sort().values, want)
        _assert_all_clean(ws)


def test_each_way_of_placing_the_sub_bin(device):
    """Keys above the sub-bin go to their digit's slots; the sub-bin is taken whole, ranked from the digit table
    or ranked from the second scratch: torch.topk's index set each time, the workspace clean."""
    _sub_bin_ways(4096, device)


@pytest.mark.gpu
@requires_cuda
def test_each_way_of_placing_the_sub_bin_with_several_programs_a_row_gpu():
    """12 programs a row: the band's keys and the sub-bin's arrive from several programs."""
    _sub_bin_ways(256, torch.device("cuda"))


def test_a_length_past_the_row_reads_as_the_row(device):
    """Negative scores: a length past the row must not count the missing keys (loaded as 0.0, they would win)."""
    n, k = 3000, 200
    s = -1.0 - torch.rand(1, n, device=device)
    out = topk_indices_cooperative(s, torch.tensor([n + 2000], dtype=torch.int32, device=device), k, block=4096)
    assert torch.equal(out[0].cpu().long().sort().values, torch.topk(s[0].cpu(), k).indices.sort().values)


def test_more_survivors_than_the_capacity_take_the_row(device):
    """A sub-bin over CAP2 with more band keys than the capacity: the fallback finish reads the row itself."""
    n, k = 3000, 200
    s = -10.0 + torch.randn(1, n, device=device)
    s[0, 100:800] = (torch.arange(700, device=device, dtype=torch.int32) + 0x3F800000).view(torch.float32)
    lengths = torch.tensor([n], dtype=torch.int32, device=device)
    ws = new_one_launch_workspace(1, one_launch_plan(k, capacity=300), device)
    out = topk_indices_cooperative(s, lengths, k, workspace=ws, capacity=300, block=4096)
    check_topk(out, s, lengths, k)
    assert ws[0, HEADER + PATH].item() == PATH_ROW
    _assert_all_clean(ws)


def test_sub_bin_path_matches_torch_topk(device):
    """Distinct scores: torch.topk's index set exactly, the whole sub-bin taken or ranked."""
    n, k = 2500, 64
    s = 1.0 + (2.5 / n) * torch.stack([torch.randperm(n, device=device) for _ in range(3)]).float()
    lengths = torch.tensor([n, n - 1, 1000], dtype=torch.int32, device=device)
    ws = new_one_launch_workspace(3, one_launch_plan(k), device)
    out = topk_indices_cooperative(s, lengths, k, workspace=ws, block=4096)
    assert ws[:, HEADER + PATH].tolist() == [PATH_SECOND] * 3
    for r in range(3):
        want = torch.topk(s[r, : lengths[r]].cpu(), k).indices.sort().values
        assert torch.equal(out[r].cpu().long().sort().values, want)
    _assert_all_clean(ws)


@pytest.mark.parametrize("poll_hist", [False, True])
def test_short_rows_odd_sizes_and_page_map(poll_hist, device, monkeypatch):
    """L <= k rows (0..L-1 then -1), L = 0, L = k + 1, an odd width; a page map writes what
    `map_through_pages` makes of the plain output."""
    monkeypatch.setattr(cooperative, "POLL_HIST", poll_hist)
    n, k, page = 777, 300, 16
    s = torch.randn(4, n, device=device)
    s[2] = 3.0  # all equal
    lengths = torch.tensor([n, k + 1, n, k], dtype=torch.int32, device=device)
    out = torch.full((4, k), POISON, dtype=torch.int32, device=device)
    topk_indices_cooperative(s, lengths, k, out=out, block=1024)
    check_topk(out, s, lengths, k)
    assert out[3].tolist() == list(range(k))
    empty = topk_indices_cooperative(s[:1], torch.zeros(1, dtype=torch.int32, device=device), k, block=1024)
    assert empty[0].tolist() == [-1] * k
    table = torch.randperm(100, generator=torch.Generator().manual_seed(3))[: -(-n // page)].int().to(device)
    ws = new_one_launch_workspace(1, one_launch_plan(k), device)
    plain = topk_indices_cooperative(s[:1], lengths[:1], k, workspace=ws, block=1024)
    mapped = torch.empty_like(plain)
    cooperative_topk_launch(s[:1], lengths[:1], mapped, ws, one_launch_plan(k), block=1024, page_map=(table, page))
    want = map_through_pages(plain[0].contiguous(), table, page, torch.empty_like(plain[0]))
    assert sorted(mapped[0].tolist()) == sorted(want.tolist())
    _assert_all_clean(ws)


def test_plan_blocks_and_where_the_path_is_taken(device):
    """Two programs an SM over the rows at most, a power-of-two block of 256..MAX_BLOCK keys; never under the CPU
    interpreter or past four rows; several programs a row refused where they cannot all be resident."""
    assert cooperative_block(1, 131072, device, sms=132) == 1024  # MAX_PROGRAMS: 128 a row
    assert cooperative_block(4, 131072, device, sms=132) == 2048  # 64 programs a row, 256 in all
    assert cooperative_block(1, 1000, device, sms=132) == 256
    assert cooperative_block(4, 4 * 131072, device, sms=132) is None  # over MAX_BLOCK: the one-launch path
    for rows, n in ((1, 131072), (4, 8192), (3, 1000)):
        block = cooperative_block(rows, n, device, sms=132)
        assert rows * -(-n // block) <= 2 * 132 and block <= MAX_BLOCK
    assert not use_cooperative(5, 8192, device)
    assert not use_cooperative(1, 8192, torch.device("cpu"))
    s = torch.randn(1, 3000, device=device)
    lengths = torch.tensor([3000], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        topk_indices_cooperative(s, lengths, 200, block=1000)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="resident"):
            topk_indices_cooperative(s, lengths, 200, block=256)
        with pytest.raises(ValueError, match="cooperative"):
            topk_indices_cooperative(s, lengths, 200)


def test_indexer_decode_topk_takes_it_where_allowed(device, monkeypatch):
    """"auto" runs the cooperative top-k where `use_cooperative` holds (GPU, <= 4 rows) and the one-launch
    path elsewhere or with it switched off; "cooperative" asked for where it cannot run is refused."""
    args, k, (logits, lengths) = small_decode(device)
    q, w, cache, table, ctx_t, block_size = args
    launches = []
    real = lightning.cooperative_topk_launch
    monkeypatch.setattr(lightning, "cooperative_topk_launch", lambda *a, **kw: (launches.append(1), real(*a, **kw)))
    for on in (True, False):
        monkeypatch.setattr(cooperative, "COOPERATIVE", on)
        launches.clear()
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k)
        check_topk(idx.view(-1, k), logits, lengths, k)
        assert len(launches) == (1 if on and device.type == "cuda" else 0)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="cooperative"):
            indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, topk="cooperative")
    with pytest.raises(ValueError, match="fuse_hist"):
        indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, fuse_hist=True, topk="cooperative")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,n", [(1, 131072), (1, 262144), (2, 32768), (4, 131072), (1, 8192), (3, 5000)])
@pytest.mark.parametrize("kind", ["randn", "relu_zeros", "narrow", "edge", "increasing"])
def test_cooperative_real_shapes_gpu(rows, n, kind):
    """The default plan (up to `MAX_PROGRAMS` a row, two grid barriers) against torch, three calls on one
    workspace with moving lengths."""
    k = 2048
    s = gpu_scores("randn" if kind in ("edge", "increasing") else kind, rows, n)
    if kind == "edge":
        s = s * 1e-7  # the cutoff in the clamped edge bin: the single-program finish
    elif kind == "increasing":
        s = torch.arange(n, device="cuda").float().expand(rows, n).contiguous()  # the top-k in the last programs
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    assert use_cooperative(rows, n, s.device)
    for call in range(3):
        lengths = torch.randint(n // 2, n + 1, (rows,), dtype=torch.int32, device="cuda")
        lengths[0] = n - call
        out = torch.full((rows, k), POISON, dtype=torch.int32, device="cuda")
        topk_indices_cooperative(s, lengths, k, out=out, workspace=ws)
        check_topk(out, s, lengths, k)
        _assert_all_clean(ws)
    one = topk_indices_one_launch(s, lengths, k)  # the same index sets where the k-th largest is not tied
    if kind in ("randn", "increasing"):
        assert torch.equal(out.sort(dim=1).values, one.sort(dim=1).values)


@pytest.mark.gpu
@requires_cuda
def test_two_programs_fit_an_sm_and_graph_replay_gpu():
    """The build leaves room for two programs an SM (registers and shared memory: the barriers need every
    program resident); captured once, replayed over new scores and lengths; the trace's stamps in order."""
    rows, n, k = 1, 131072, 2048
    s = torch.randn(rows, n, device="cuda")
    lengths = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    plan = one_launch_plan(k)
    ws = new_one_launch_workspace(rows, plan, s.device)
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    kernel = cooperative_topk_launch(s, lengths, out, ws, plan)
    props = torch.cuda.get_device_properties(0)
    assert kernel.n_regs * 32 * kernel.metadata.num_warps * 2 <= props.regs_per_multiprocessor
    assert 2 * kernel.metadata.shared <= props.shared_memory_per_multiprocessor
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cooperative_topk_launch(s, lengths, out, ws, plan)
    for step in range(5):
        fresh = torch.randn(rows, n, device="cuda")
        s.copy_(fresh if step % 2 else torch.relu(fresh - 3))
        lengths.copy_(torch.randint(k // 2, n + 1, (rows,), dtype=torch.int32, device="cuda"))
        graph.replay()
        check_topk(out, s, lengths, k)
    _assert_all_clean(ws)
    programs = -(-n // cooperative_block(rows, n, s.device))
    trace = torch.zeros(rows, programs, 8, dtype=torch.int64, device="cuda")
    lengths.fill_(n)
    cooperative_topk_launch(s, lengths, out, ws, plan, trace=trace)
    check_topk(out, s, lengths, k)
    t = trace.cpu()
    assert bool((t[..., 0] > 0).all()) and bool((t[..., :4].diff(dim=-1) >= 0).all())
    assert bool((t[..., 7] >= t[..., 3]).all() and (t[..., 4] >= t[..., 7]).all()), "placed, arrived, then done"
    assert bool(t[..., 1].min() >= t[..., 0].max()), "no program passes the first barrier before all start"
    assert bool((t[..., 3].amin(dim=1) >= t[..., 2].amax(dim=1)).all()), "nor the second before all split"


@pytest.mark.gpu
@requires_cuda
def test_indexer_decode_topk_cooperative_real_shapes_gpu():
    """The engine's call at batch 1-4 x 32K (auto: cooperative) against the one-launch path on the same logits."""
    ctx = [32768, 20000, 4097, 2049]
    cache, table = _filled_cache(ctx, 64, 513, "cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = _queries((4, 1, 64, 128), "fp8", "cuda")
    w = torch.randn(4, 1, 64, device="cuda") * 0.01
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx_t, 64)
    for topk in ("auto", "cooperative"):
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, 64, 2048, topk=topk)
        check_topk(idx.view(-1, 2048), logits, lengths, 2048)
