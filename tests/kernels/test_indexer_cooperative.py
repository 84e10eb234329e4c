"""The decode indexer and the cooperative top-k in one launch (`kernels/indexer/decode_cooperative.py`): its logits
against the indexer's within the fp8 dot's error bound, its selection exact on its own logits, the shared workspace
left clean, and where "auto" takes it. One program a row waits for nobody, so those cases run under the CPU
interpreter too; several programs a row (the grid barriers) run on the GPU only."""

import pytest
import torch

from hearth.kernels.indexer import decode_cooperative, indexer_decode_topk, lightning, lightning_indexer_decode
from hearth.kernels.indexer.decode_cooperative import fused_plan, indexer_cooperative_launch, use_fused_cooperative
from hearth.kernels.topk import cooperative
from hearth.kernels.topk.one_launch import new_one_launch_workspace, one_launch_plan
from hearth.kernels.topk.reference import check_topk
from tests.kernels.conftest import requires_cuda
from tests.kernels.test_lightning_indexer import _decode_magnitudes, _filled_cache, _queries
from tests.kernels.test_topk_cooperative import _assert_all_clean

POISON = -7


def _check(q, w, cache, table, ctx, block_size, k, ws, programs=None):
    """One fused call against the indexer: its logits within the indexer's error bound of the two-launch path's,
    exact top-k on them (-1 padded rows of at most k), the workspace clean."""
    n_req = q.shape[0]
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=q.device)
    out = torch.full((n_req, k), POISON, dtype=torch.int32, device=q.device)
    logits = indexer_cooperative_launch(q, w, cache, table, ctx_t, block_size, out, ws, one_launch_plan(k),
                                        programs=programs)
    ref, lengths = lightning_indexer_decode(q, w, cache, table, ctx_t, block_size)
    chosen = logits.clone()
    for b, n in enumerate(ctx):
        if n > k:  # (a row of at most k takes every token without logits)
            mag = _decode_magnitudes(q[b : b + 1], w[b : b + 1], cache, table[b : b + 1], [n], block_size)[0]
            got, want, mag = logits[b, :n].double(), ref[b, :n].double(), mag[0, :n].double()
            assert bool(((got - want).abs() <= 1e-3 * mag + 1e-6).all()), (b, float((got - want).abs().max()))
        else:
            chosen[b] = ref[b]  # (unwritten: any scores do for the padding check)
    check_topk(out, chosen, lengths, k)
    _assert_all_clean(ws)


@pytest.mark.parametrize("q_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_one_program_a_row_matches_the_indexer_and_the_top_k(q_dtype, block_size, device):
    """Rows longer than k (one over a chunk's edge, one of several chunks), of at most k, and empty, at odd
    lengths, twice on one workspace with moved lengths."""
    k = 100
    ctx = [237, 517, 100, 0]
    max_blocks = -(-600 // block_size)
    cache, table = _filled_cache(ctx, block_size, max_blocks, device)
    q = _queries((4, 1, 16, 128), q_dtype, device)
    w = torch.randn(4, 1, 16, device=device)
    ws = new_one_launch_workspace(4, one_launch_plan(k), device)
    for moved in (0, 9):
        _check(q, w, cache, table, [max(n - moved, 0) for n in ctx], block_size, k, ws, programs=1)


def test_auto_takes_it_where_allowed_and_asked_for_refused_elsewhere(device, monkeypatch):
    """"auto" runs the fused launch only where `use_fused_cooperative` holds, `FUSED_COOPERATIVE` is on and the
    requests are at most `AUTO_ROWS` (one: two take the two launches), without a config for the indexer kernel;
    "fused_cooperative" asked for where it cannot run (the CPU, several queries a request) is refused."""
    block_size, ctx, k = 16, [37, 90], 24
    cache, table = _filled_cache(ctx, block_size, 8, device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = _queries((2, 1, 16, 128), "fp8", device)
    w = torch.randn(2, 1, 16, device=device)
    launches = []
    real = lightning.indexer_cooperative_launch
    monkeypatch.setattr(lightning, "indexer_cooperative_launch",
                        lambda *a, **kw: (launches.append(1), real(*a, **kw))[1])
    for on in (True, False):
        monkeypatch.setattr(decode_cooperative, "FUSED_COOPERATIVE", on)
        for rows in (1, 2):
            launches.clear()
            idx = indexer_decode_topk(q[:rows], w[:rows], cache, table[:rows], ctx_t[:rows], block_size, k)
            assert idx.shape == (rows, 1, k)
            assert len(launches) == (1 if on and rows == 1 and device.type == "cuda" else 0)
    launches.clear()  # a config for the indexer kernel: the two launches, which use it
    monkeypatch.setattr(decode_cooperative, "FUSED_COOPERATIVE", True)
    indexer_decode_topk(q[:1], w[:1], cache, table[:1], ctx_t[:1], block_size, k, config={"kernel": "tiled"})
    assert not launches
    assert not use_fused_cooperative(2, 2, 128, device)  # several queries a request: the two launches
    if device.type != "cuda":
        with pytest.raises(ValueError, match="fused"):
            indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, topk="fused_cooperative")
    with pytest.raises(ValueError, match="fuse_hist"):
        indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, fuse_hist=True, topk="fused_cooperative")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("ctx", [[131072], [100000], [32768, 20000], [8192, 4097, 2049, 2048], [5000, 131000]])
@pytest.mark.parametrize("poll", [(False, False), (True, False), (False, True)])
def test_several_programs_a_row_gpu(ctx, poll, monkeypatch):
    """The default plan (up to `MAX_PROGRAMS` a row, two grid barriers) at real shapes (64 heads, 64-token pages,
    a 128K table: the shorter rows spread over the row's programs by their length), with each way the barriers
    poll, three calls on one workspace with moving lengths."""
    monkeypatch.setattr(cooperative, "POLL_ACQUIRE", poll[0])
    monkeypatch.setattr(cooperative, "POLL_HIST", poll[1])
    cache, table = _filled_cache(ctx, 64, 2048, "cuda")
    q = _queries((len(ctx), 1, 64, 128), "fp8", "cuda")
    w = torch.randn(len(ctx), 1, 64, device="cuda") * 0.01
    ws = new_one_launch_workspace(len(ctx), one_launch_plan(2048), torch.device("cuda"))
    assert fused_plan(len(ctx), 2048 * 64, torch.device("cuda")) is not None
    for moved in (0, 1, 130):
        _check(q, w, cache, table, [n - moved for n in ctx], 64, 2048, ws)


@pytest.mark.gpu
@requires_cuda
def test_auto_with_it_on_in_a_cuda_graph_gpu(monkeypatch):
    """The engine's call with the fused launch on, captured and replayed with moved lengths: an exact top-k of the
    logits the same launch computes eagerly, and the same selection."""
    monkeypatch.setattr(decode_cooperative, "FUSED_COOPERATIVE", True)
    ctx = [32768, 20000]
    cache, table = _filled_cache(ctx, 64, 513, "cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = _queries((2, 1, 64, 128), "fp8", "cuda")
    w = torch.randn(2, 1, 64, device="cuda") * 0.01
    indexer_decode_topk(q, w, cache, table, ctx_t, 64, 2048)  # compiled and the workspace kept before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, 64, 2048)
    plan = one_launch_plan(2048)
    for moved in (0, 3, 700):
        ctx_t.copy_(torch.tensor([n - moved for n in ctx], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        out = torch.empty(2, 2048, dtype=torch.int32, device="cuda")
        ws = new_one_launch_workspace(2, plan, torch.device("cuda"))
        logits = indexer_cooperative_launch(q, w, cache, table, ctx_t, 64, out, ws, plan)  # the same logits, eager
        check_topk(idx.view(-1, 2048), logits, ctx_t, 2048)
        assert torch.equal(idx.view(-1, 2048).sort(dim=-1).values, out.sort(dim=-1).values), moved


@pytest.mark.gpu
@requires_cuda
def test_two_programs_fit_an_sm_gpu():
    """The build the plan takes at 4 x 128K (two programs an SM in all) fits two an SM: registers and shared
    memory (the key chunks' pipeline buffers beside the select's)."""
    ctx = [131072] * 4
    cache, table = _filled_cache(ctx, 64, 2048, "cuda")
    q = _queries((4, 1, 64, 128), "fp8", "cuda")
    w = torch.randn(4, 1, 64, device="cuda") * 0.01
    plan = one_launch_plan(2048)
    ws = new_one_launch_workspace(4, plan, torch.device("cuda"))
    out = torch.empty(4, 2048, dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    decode_cooperative._PER_SM.clear()
    logits = indexer_cooperative_launch(q, w, cache, table, ctx_t, 64, out, ws, plan)
    assert list(decode_cooperative._PER_SM.values()) and min(decode_cooperative._PER_SM.values()) >= 2
    check_topk(out, logits, ctx_t, 2048)
