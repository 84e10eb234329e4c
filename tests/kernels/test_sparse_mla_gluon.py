"""The Gluon sparse MLA kernels (kernels/sparse_mla/gluon_kernels.py) against the torch reference, directly and
as what `sparse_mla_decode` / `sparse_mla_prefill` run on an sm_90 GPU (CUDA graphs included).

The kernels are Hopper-only (wgmma, mbarriers, warp specialisation) and cannot run in Triton's CPU
interpreter, so the comparisons run on an sm_90 GPU only; the launch plan, the argument checks and where the
dispatch falls back to the Triton kernel are tested everywhere."""

import pytest
import torch
import triton

from hearth.kernels.sparse_mla import gluon_kernels, sparse_mla_decode, sparse_mla_prefill
from hearth.kernels.sparse_mla.gluon_kernels import (
    BLOCK_H,
    GLUON_ERROR,
    VARIANTS,
    gluon_launch_plan,
    gluon_unsupported,
    sparse_mla_decode_gluon,
)
from hearth.kernels.sparse_mla.reference import quantize_latent_fp8, sparse_mla_decode_ref, sparse_mla_prefill_ref
from tests.kernels.conftest import paged_table, rel_err

OUT_TOL = 1e-2  # bf16 operands (q, latent, probabilities) and bf16 output, as tests/kernels/test_sparse_mla.py
LSE_TOL = 1e-3  # absolute, fp32 softmax statistics
SM_SCALE = 0.1352

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TESTED = GLUON_ERROR is None and triton.__version__.startswith(gluon_kernels.TRITON_TESTED)
requires_hopper = pytest.mark.skipif(
    not HOPPER or not TESTED,
    reason="the Gluon kernels need an sm_90 GPU and a Triton they are checked with (they cannot run in the CPU "
           "interpreter)",
)


def _selection(ctx: torch.Tensor, topk: int, minus_one: float = 0.05) -> torch.Tensor:
    """[B, topk] distinct random logical positions per row: a few past the row's context (invalid), about
    `minus_one` of the slots -1, and -1 padding where the context is shorter than topk."""
    rows = []
    for n in ctx.tolist():
        pool = n + 8  # positions n .. n + 7 are past the context: masked by the kernel
        sel = torch.randperm(pool)[:topk]
        sel = torch.cat([sel, torch.full((topk - sel.numel(),), -1)])
        sel[torch.rand(topk) < minus_one] = -1
        rows.append(sel[torch.randperm(topk)])
    return torch.stack(rows).int()


def _problem(batch: int, heads: int, topk: int, ctx: list[int], block_size: int = 64):
    dev = torch.device("cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    max_blocks = (max(ctx) + 8) // block_size + 1
    num_blocks = batch * max_blocks + 3
    cache = torch.randn(num_blocks, block_size, 576, device=dev).to(torch.bfloat16)
    table = paged_table(batch, max_blocks, num_blocks, dev)
    q = torch.randn(batch, heads, 576, device=dev).to(torch.bfloat16)
    idx = _selection(ctx_t, topk).to(dev)
    return q, cache, idx, table, ctx_t.to(dev)


def _check(out, lse, ref_out, ref_lse):
    """Output within OUT_TOL (relative), lse within LSE_TOL where some index is valid; zeros and -inf
    exactly where none is (also proves every element was written: the outputs start as NaN)."""
    assert rel_err(out.float(), ref_out) < OUT_TOL
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse must be -inf exactly where nothing is valid"
    assert not out[empty].float().abs().any(), "rows with no valid index must be zeros"
    if (~empty).any():
        assert float((lse[~empty] - ref_lse[~empty]).abs().max()) < LSE_TOL


def _poisoned(batch, heads):
    dev = torch.device("cuda")
    return (torch.full((batch, heads, 512), float("nan"), dtype=torch.bfloat16, device=dev),
            torch.full((batch, heads), float("nan"), dtype=torch.float32, device=dev))


def _contexts(batch: int, topk: int) -> list[int]:
    """Context lengths: long ones (the selection is a subset), short ones (fewer valid positions than topk)
    and, from batch 3 on, an empty one (nothing valid: zeros and -inf)."""
    base = [topk + 900, max(topk // 3, 1), 0, 5]
    return [base[i % len(base)] if i < len(base) else topk + 37 * i for i in range(batch)]


@requires_hopper
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("batch", "heads", "topk"),
    [(1, 128, 2048), (1, 64, 300), (3, 128, 300), (3, 64, 2048), (64, 128, 2048), (64, 64, 2048), (3, 128, 45)],
)
def test_decode_matches_reference(variant, batch, heads, topk):
    """Top-k 2048 (64 whole steps of two 32-row tiles), 300 (a partial last tile and an odd tile count) and 45
    (less than one step); masked (-1 and past-the-context) indices; short and empty contexts; 64 and 128 heads;
    the launch plan's splits (batch 1 and 3 split the selection, batch 64 does not)."""
    q, cache, idx, table, ctx = _problem(batch, heads, topk, _contexts(batch, topk))
    out, lse = _poisoned(batch, heads)
    sparse_mla_decode_gluon(q, cache, idx, table, ctx, SM_SCALE, variant=variant, out=out, lse=lse)
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE)
    _check(out, lse, ro, rl)


@requires_hopper
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_decode_forced_splits(variant, splits):
    """Unsplit, split (merged by the combine kernel) and one-step splits at batch 2, block size 16."""
    q, cache, idx, table, ctx = _problem(2, 128, 2048, [3000, 700], block_size=16)
    out, lse = sparse_mla_decode_gluon(q, cache, idx, table, ctx, SM_SCALE, variant=variant, splits=splits)
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE)
    _check(out, lse, ro, rl)


@requires_hopper
def test_variants_agree():
    """The seesaw (per-warpgroup maxima, P rescaled on exchange) and the simple variant give the same result
    up to bf16 rounding of the probabilities."""
    q, cache, idx, table, ctx = _problem(4, 128, 2048, [4096, 2100, 3000, 9000])
    a, la = sparse_mla_decode_gluon(q, cache, idx, table, ctx, SM_SCALE, variant="seesaw")
    b, lb = sparse_mla_decode_gluon(q, cache, idx, table, ctx, SM_SCALE, variant="simple")
    assert rel_err(a.float(), b.float()) < OUT_TOL
    assert float((la - lb).abs().max()) < LSE_TOL


@pytest.mark.parametrize("batch", [1, 3, 8, 64, 256])
@pytest.mark.parametrize("topk", [45, 300, 2048])
def test_launch_plan_tiles_the_selection(batch, topk):
    """Splits cover the selection exactly in whole 64-token steps and fill at most one wave of 132 SMs."""
    for variant in VARIANTS:
        cfg = gluon_launch_plan(batch, 128, topk, 132, variant)
        assert cfg["chunk"] % 64 == 0
        assert (cfg["splits"] - 1) * cfg["chunk"] < topk <= cfg["splits"] * cfg["chunk"]
        assert cfg["splits"] == 1 or batch * (128 // BLOCK_H) * cfg["splits"] <= 132


def test_rejects_unsupported_shapes():
    """Argument errors are ValueErrors raised before any launch (CPU tensors suffice)."""
    bf = torch.bfloat16
    cache = torch.zeros(4, 64, 576, dtype=bf)
    idx = torch.zeros(1, 64, dtype=torch.int32)
    table = torch.zeros(1, 4, dtype=torch.int32)
    ctx = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="heads in blocks of 64"):
        sparse_mla_decode_gluon(torch.zeros(1, 20, 576, dtype=bf), cache, idx, table, ctx, 0.1)
    with pytest.raises(ValueError, match="bf16 cache"):
        fp8 = torch.zeros(4, 64, 656, dtype=torch.uint8)
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), fp8, idx, table, ctx, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), torch.zeros(4, 48, 576, dtype=bf), idx, table, ctx,
                                0.1)
    with pytest.raises(ValueError, match="variant"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), cache, idx, table, ctx, 0.1, variant="x")
    with pytest.raises(RuntimeError, match="cannot run here"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), cache, idx, table, ctx, 0.1)


def test_the_dispatch_says_why_it_falls_back():
    """Where `sparse_mla_decode` / `sparse_mla_prefill` keep the Triton kernel: a CPU tensor (and the interpreter),
    and, on a GPU, an FP8 cache or heads not in 64s."""
    bf = torch.bfloat16
    why = gluon_unsupported(torch.zeros(1, 64, 576, dtype=bf), torch.zeros(4, 64, 576, dtype=bf))
    assert "CUDA device" in why or "checked with Triton" in why or why == GLUON_ERROR
    if HOPPER and TESTED:
        q, cache = torch.zeros(1, 64, 576, dtype=bf, device="cuda"), torch.zeros(4, 64, 576, dtype=bf, device="cuda")
        assert gluon_unsupported(q, cache) is None
        assert "bf16" in gluon_unsupported(q, torch.zeros(4, 64, 656, dtype=torch.uint8, device="cuda"))
        assert "blocks of 64" in gluon_unsupported(q[:, :16], cache)


@pytest.fixture
def launches(monkeypatch):
    """The Gluon launches `sparse_mla_decode` / `sparse_mla_prefill` make (their row counts)."""
    rows: list[int] = []
    launch = gluon_kernels.gluon_launch

    def spy(q, *args, **kwargs):
        rows.append(q.shape[0])
        return launch(q, *args, **kwargs)

    monkeypatch.setattr(gluon_kernels, "gluon_launch", spy)
    return rows


@requires_hopper
@pytest.mark.parametrize(("batch", "heads", "topk"), [(1, 128, 2048), (5, 128, 300), (64, 64, 2048)])
def test_sparse_mla_decode_runs_the_gluon_kernel_by_default(launches, batch, heads, topk):
    q, cache, idx, table, ctx = _problem(batch, heads, topk, _contexts(batch, topk))
    out, lse = _poisoned(batch, heads)
    sparse_mla_decode(q, cache, idx, table, ctx, SM_SCALE, out=out, lse=lse)
    assert launches == [batch]
    _check(out, lse, *sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE))
    # {"gluon": False} and any Triton override take the Triton kernel, on the same result
    for config in ({"gluon": False}, {"block_h": 16}):
        t_out, t_lse = sparse_mla_decode(q, cache, idx, table, ctx, SM_SCALE, config=config)
        _check(t_out, t_lse, *sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE))
    assert launches == [batch]


@requires_hopper
def test_an_fp8_cache_and_odd_heads_keep_the_triton_kernel(launches):
    q, cache, idx, table, ctx = _problem(3, 128, 300, _contexts(3, 300))
    fp8 = quantize_latent_fp8(cache)
    out, lse = sparse_mla_decode(q, fp8, idx, table, ctx, SM_SCALE)
    _check(out, lse, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    q16 = q[:, :16].contiguous()
    out, lse = sparse_mla_decode(q16, cache, idx, table, ctx, SM_SCALE)
    _check(out, lse, *sparse_mla_decode_ref(q16, cache, idx, table, ctx, SM_SCALE))
    assert launches == []


@requires_hopper
@pytest.mark.parametrize(("tokens", "topk", "start"), [(7, 2048, 3000), (200, 2048, 0), (96, 300, 150)])
def test_sparse_mla_prefill_runs_the_gluon_kernel_by_default(launches, tokens, topk, start):
    """A chunk of `tokens` queries at positions start.., each selecting up to `topk` of the positions up to its
    own (causal: later ones masked), through one shared block table."""
    dev = torch.device("cuda")
    block_size, n_ctx = 64, start + tokens
    max_blocks = n_ctx // block_size + 2
    cache = torch.randn(max_blocks + 5, block_size, 576, device=dev).to(torch.bfloat16)
    table = torch.randperm(max_blocks + 5)[:max_blocks].int().to(dev)
    q = torch.randn(tokens, 128, 576, device=dev).to(torch.bfloat16)
    positions = torch.arange(start, start + tokens, dtype=torch.int32, device=dev)
    idx = torch.stack([torch.randperm(n_ctx)[:topk] if n_ctx >= topk else
                       torch.cat([torch.randperm(n_ctx), torch.full((topk - n_ctx,), -1)]) for _ in range(tokens)])
    idx = idx.int().to(dev)
    out, lse = _poisoned(tokens, 128)
    sparse_mla_prefill(q, cache, idx, table, positions, SM_SCALE, out=out, lse=lse)
    assert launches == [tokens]
    _check(out, lse, *sparse_mla_prefill_ref(q, cache, idx, table, positions, SM_SCALE))


@requires_hopper
def test_the_gluon_decode_replays_in_a_cuda_graph(launches):
    """Captured once with preallocated outputs, replayed on new selections and context lengths written in place."""
    q, cache, idx, table, ctx = _problem(4, 128, 2048, [5000, 3000, 2100, 9000])
    out, lse = _poisoned(4, 128)
    sparse_mla_decode(q, cache, idx, table, ctx, SM_SCALE, out=out, lse=lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(q, cache, idx, table, ctx, SM_SCALE, out=out, lse=lse)
    for lens in ([4000, 64, 0, 9000], [9000, 8999, 2048, 1]):  # (the table covers 9,024 positions)
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        idx.copy_(_selection(ctx.cpu(), 2048).to(idx.device))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, *sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE))
    assert len(launches) == 2  # (the replays run no Python)
