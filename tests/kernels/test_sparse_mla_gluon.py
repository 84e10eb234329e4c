"""The Gluon sparse MLA kernels (kernels/sparse_mla/gluon_kernels.py) against the torch reference, directly and
as what `sparse_mla_decode` / `sparse_mla_prefill` run on an sm_90 GPU (CUDA graphs included); the FP8-cache
seesaw also bit for bit against the bf16 seesaw on the dequantised cache.

The kernels are Hopper-only (wgmma, mbarriers, warp specialisation) and cannot run in Triton's CPU
interpreter, so the comparisons run on an sm_90 GPU only; the launch plan, the argument checks, where the
dispatch falls back to the Triton kernel, and offline models of the FP8 producer (its in-place dequantisation,
in torch, against `dequantize_latent_fp8`; the mbarrier protocol of the FP8 seesaw, simulated) are tested
everywhere."""

import inspect
import random

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
from hearth.kernels.sparse_mla.reference import (
    dequantize_latent_fp8,
    quantize_latent_fp8,
    sparse_mla_decode_ref,
    sparse_mla_prefill_ref,
)
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
    fp8 = torch.zeros(4, 64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="seesaw variant only"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), fp8, idx, table, ctx, 0.1, variant="simple")
    with pytest.raises(ValueError, match="config keys"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), fp8, idx, table, ctx, 0.1, config={"reg": 240})
    with pytest.raises(ValueError, match="kv_cache must be"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), fp8[..., :576], idx, table, ctx, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), torch.zeros(4, 48, 576, dtype=bf), idx, table, ctx,
                                0.1)
    with pytest.raises(ValueError, match="variant"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), cache, idx, table, ctx, 0.1, variant="x")
    with pytest.raises(RuntimeError, match="cannot run here"):
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), cache, idx, table, ctx, 0.1)
    with pytest.raises(RuntimeError, match="cannot run here"):  # (an FP8 cache: the FP8 seesaw, whatever FP8 says)
        sparse_mla_decode_gluon(torch.zeros(1, 64, 576, dtype=bf), fp8, idx, table, ctx, 0.1, config={"regs": 240})


def test_the_dispatch_says_why_it_falls_back():
    """Where `sparse_mla_decode` / `sparse_mla_prefill` keep the Triton kernel: a CPU tensor (and the interpreter),
    and, on a GPU, an FP8 cache or heads not in 64s."""
    bf = torch.bfloat16
    why = gluon_unsupported(torch.zeros(1, 64, 576, dtype=bf), torch.zeros(4, 64, 576, dtype=bf))
    assert "CUDA device" in why or "checked with Triton" in why or why == GLUON_ERROR
    if HOPPER and TESTED:
        q, cache = torch.zeros(1, 64, 576, dtype=bf, device="cuda"), torch.zeros(4, 64, 576, dtype=bf, device="cuda")
        fp8 = torch.zeros(4, 64, 656, dtype=torch.uint8, device="cuda")
        assert gluon_unsupported(q, cache) is None
        assert "gluon_kernels.FP8" in gluon_unsupported(q, fp8)  # (FP8 is off by default)
        assert gluon_unsupported(q, fp8, fp8=True) is None
        assert "blocks of 64" in gluon_unsupported(q[:, :16], cache)


def test_fp8_is_off_in_the_dispatch_and_planned_as_the_seesaw():
    """The FP8 seesaw is not in `sparse_mla_decode`'s default dispatch until timed (gluon_kernels.FP8), and its
    launch plan splits the selection as the bf16 seesaw's (so the two can be compared bit for bit)."""
    assert gluon_kernels.FP8 is False
    fp8 = torch.zeros(4, 64, 656, dtype=torch.uint8)
    assert gluon_unsupported(torch.zeros(1, 64, 576, dtype=torch.bfloat16), fp8) is not None
    for batch, topk in [(1, 2048), (3, 300), (64, 2048), (3, 45)]:
        a = gluon_launch_plan(batch, 128, topk, 132, "seesaw")
        b = gluon_launch_plan(batch, 128, topk, 132, "seesaw", fp8=True)
        assert (a["chunk"], a["splits"], a["block_n"], a["stages"]) == (b["chunk"], b["splits"], b["block_n"],
                                                                          b["stages"])
        assert b["regs"] == gluon_kernels.SEESAW_FP8["regs"] and "prefetch" in b
    assert gluon_launch_plan(1, 128, 2048, 132, "seesaw", fp8=True, config={"regs": 240})["regs"] == 240
    with pytest.raises(ValueError, match="seesaw variant only"):
        gluon_launch_plan(1, 128, 2048, 132, "simple", fp8=True)


class _Recorder:
    """Stands in for a @gluon.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.mark.parametrize(("batch", "splits"), [(64, None), (2, 3)])
def test_fp8_launch_passes_the_kernels_arguments(monkeypatch, batch, splits):
    """`gluon_launch` on a uint8 cache calls the FP8 seesaw with one value per kernel parameter (the launch's
    runtime arguments, then the constexprs by name, `SEESAW_FP8`'s settings and config overrides), merging the
    splits with the combine kernel (checked here with CPU tensors and recorders in place of the kernels)."""
    fn = gluon_kernels._sparse_mla_seesaw_fp8_kernel
    names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    kernel, combine = _Recorder(), _Recorder()
    monkeypatch.setattr(gluon_kernels, "_sparse_mla_seesaw_fp8_kernel", kernel)
    monkeypatch.setattr(gluon_kernels, "_sparse_mla_combine_kernel", combine)
    fp8 = torch.zeros(8, 64, 656, dtype=torch.uint8)
    q = torch.zeros(batch, 128, 576, dtype=torch.bfloat16)
    idx = torch.zeros(batch, 2048, dtype=torch.int32)
    table = torch.zeros(batch, 8, dtype=torch.int32)
    ctx = torch.ones(batch, dtype=torch.int32)
    out, lse = torch.empty(batch, 128, 512, dtype=torch.bfloat16), torch.empty(batch, 128)
    gluon_kernels.gluon_launch(q, fp8, idx, table, 8, ctx, -1, 0.1, out, lse, splits=splits,
                               config={"prefetch": False})
    (grid, args, kwargs), = kernel.calls
    n_const = sum(1 for n in names if n.isupper() and n not in ("TOPK", "CHUNK"))
    assert len(args) == len(names) - n_const and set(kwargs) - {"num_warps"} == set(names[len(args):])
    assert args[1] is fp8 and kwargs["PREFETCH"] is False and kwargs["REGS_CONSUMER"] == gluon_kernels.SEESAW_FP8[
        "regs"] and kwargs["BLOCK_SIZE"] == 64 and kwargs["num_warps"] == 4
    n_splits = grid[2]
    assert grid[:2] == (batch, 2) and (n_splits > 1) == (splits == 3 or batch < 64) and len(combine.calls) == (
        n_splits > 1)


# ----------------------------------------------------------------------------------------------------------
# the FP8 producer, modelled offline
# ----------------------------------------------------------------------------------------------------------

NAN_E4M3 = (0x7F, 0xFF)  # e4m3fn's NaNs (no infinities); `quantize_latent_fp8` never writes them


def _emulate_fp8_stage(rows: torch.Tensor) -> torch.Tensor:
    """The FP8 producer's shared-memory dataflow for one tile, in torch: `rows` uint8 [BN, 656] cache rows (zeros
    for masked positions, as the zero-filling copies) -> the bf16 [BN, 512] latent tile the consumers read.

    The stage (1024 BN bytes) is 8 column blocks of [BN, 64] bf16, block j at bytes 128 BN j (the 128-byte
    swizzle permutes 16-byte pieces within a block's rows: left out). The copies put e4m3 group g (latent columns
    128g ..) at bytes 512 BN + 128 BN g as [BN, 128] (`fp8_halves.index(2s + 1)` = `fp8_groups.index(8s + 4 + g)`)
    and the scales in their own [BN, 4] buffer. Iteration g loads staged group g (every thread, then a barrier),
    converts e4m3 -> f16 -> f32 (cvt.rn.f16x2.e4m3x2, HADD2.F32: exact), multiplies by the fp32 scale (FMUL: one
    rounding), rounds to bf16 (cvt.rn.bf16x2.f32) and stores column blocks 2g and 2g + 1. Asserts that no store
    covers a staged group that is not yet loaded."""
    bn = rows.shape[0]
    stage = torch.zeros(1024 * bn, dtype=torch.uint8)
    stage[512 * bn:] = rows[:, :512].reshape(bn, 4, 128).transpose(0, 1).reshape(-1)
    scales = rows[:, 512:528].contiguous().view(torch.float32)  # [BN, 4]
    loaded: set[int] = set()
    for g in range(4):
        lo = 512 * bn + 128 * bn * g
        x = stage[lo: lo + 128 * bn].reshape(bn, 128).clone()
        loaded.add(g)
        v = x.view(torch.float8_e4m3fn).to(torch.float16).to(torch.float32) * scales[:, g: g + 1]
        out = v.to(torch.bfloat16)
        w_lo, w_hi = 256 * bn * g, 256 * bn * (g + 1)
        for h in range(4):  # staged groups under this store
            s_lo = 512 * bn + 128 * bn * h
            if s_lo < w_hi and s_lo + 128 * bn > w_lo:
                assert h in loaded, f"group {g}'s store covers staged group {h} before it is loaded"
        stage[w_lo:w_hi] = out.reshape(bn, 2, 64).transpose(0, 1).contiguous().view(torch.uint8).reshape(-1)
    return stage.view(torch.bfloat16).reshape(8, bn, 64).transpose(0, 1).reshape(bn, 512)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def test_fp8_in_place_dequantisation_is_bit_exact():
    """The producer's stage (emulated) holds bf16(dequantize_latent_fp8(row)) bit for bit: cache rows from
    `quantize_latent_fp8` with four distinct group scales, masked (zero-filled) rows, every non-NaN e4m3 code, and
    fp32 scales that are not powers of two (the product rounds once in fp32, then to bf16, as torch's)."""
    torch.manual_seed(0)
    gain = torch.tensor([0.25, 1.0, 4.0, 64.0]).repeat_interleave(128)
    lat = torch.randn(32, 576)
    lat[:, :512] *= gain * torch.exp(torch.randn(32, 1))
    rows = quantize_latent_fp8(lat.to(torch.bfloat16))
    assert len({float(s) for s in rows[:, 512:528].contiguous().view(torch.float32).flatten()}) >= 4
    rows[[3, 17, 30]] = 0  # masked positions: the copies zero-fill them
    want = dequantize_latent_fp8(rows)[:, :512].to(torch.bfloat16)
    assert torch.equal(_bits(_emulate_fp8_stage(rows)), _bits(want))
    assert not _emulate_fp8_stage(rows)[[3, 17, 30]].float().abs().any()
    # every e4m3 code (NaNs aside) against scales that are not powers of two, tiny and large ones included
    codes = torch.tensor([c for c in range(256) if c not in NAN_E4M3], dtype=torch.uint8)
    for scale in (1.0, 0.3, 3.7e-3, 1.1e-30, 2.0**-126, 7.1e25, 1.9e34, 1e38):
        rows = torch.zeros(32, 656, dtype=torch.uint8)
        rows[:, :512] = codes[torch.randint(0, codes.numel(), (32, 512))]
        sc = torch.tensor([scale, -scale * 1.7, scale / 3, scale * 0.999]).repeat(32, 1)
        rows[:, 512:528] = sc.view(torch.uint8)
        want = dequantize_latent_fp8(rows)[:, :512].to(torch.bfloat16)
        assert torch.equal(_bits(_emulate_fp8_stage(rows)), _bits(want)), scale


class _Barrier:
    """An mbarrier: `count` arrivals complete the current phase; try_wait(parity) is true once the phase of that
    parity has completed (a fresh barrier counts the phase before phase 0, parity 1, as completed)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def done(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def _simulate_fp8_seesaw(n_pairs: int, ns: int, seed: int) -> None:
    """The FP8 seesaw's mbarrier protocol (`_seesaw_fp8_producer` against the unchanged `_seesaw_consumer`),
    stepped in a random interleaving: no deadlock, and every read finds the tile it expects, dequantised, in a
    stage no one writes while a consumer still reads it (from its QK until its kv_free arrive)."""
    q_bar, ready = _Barrier(1), [_Barrier(1) for _ in range(ns)]  # (q_bar's 128 cp.async arrives: one here)
    free = [_Barrier(2) for _ in range(ns)]
    p_ready, p_free = [_Barrier(1) for _ in range(2)], [_Barrier(1) for _ in range(2)]
    stage: list[tuple[str, int] | None] = [None] * ns
    in_use: list[set[int]] = [set() for _ in range(ns)]
    p_buf: list[int | None] = [None, None]

    def write(s, what):
        assert not in_use[s], f"stage {s} written while consumer(s) {in_use[s]} read it"
        stage[s] = what

    def producer():
        q_bar.arrive()
        for p in range(n_pairs):
            t = 2 * p
            s0, s1, phase = t % ns, (t + 1) % ns, ((t // ns) & 1) ^ 1
            for s, tile in ((s0, t), (s1, t + 1)):
                yield free[s], phase
                write(s, ("staged", tile))
                yield None  # (a point where the others may run)
            for s, tile in ((s0, t), (s1, t + 1)):
                write(s, ("bf16", tile))  # the dequantisation, in place
                yield None
                ready[s].arrive()
                yield None

    def consumer(w):
        yield q_bar, 0
        for p in range(n_pairs):
            t, u = 2 * p + w, 2 * p + 1 - w
            st, su = t % ns, u % ns
            yield ready[st], (t // ns) & 1
            assert stage[st] == ("bf16", t)
            in_use[st].add(w)
            yield p_free[w], (p & 1) ^ 1
            p_buf[w] = t
            p_ready[w].arrive()
            yield p_ready[1 - w], p & 1
            assert p_buf[1 - w] == u
            p_free[1 - w].arrive()
            yield ready[su], (u // ns) & 1
            assert stage[su] == ("bf16", u) and stage[st] == ("bf16", t)
            in_use[su].add(w)
            in_use[st].discard(w)
            free[st].arrive()
            in_use[su].discard(w)
            free[su].arrive()

    rng = random.Random(seed)
    agents = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {name: None for name in agents}
    while agents:
        runnable = [n for n in agents if not waiting[n] or waiting[n][0].done(waiting[n][1])]
        assert runnable, f"deadlock: {[(n, waiting[n][0].phase, waiting[n][1]) for n in agents]}"
        name = rng.choice(runnable)
        try:
            waiting[name] = next(agents[name])
        except StopIteration:
            del agents[name]


@pytest.mark.parametrize("n_pairs", [0, 1, 2, 3, 8, 33])
def test_fp8_seesaw_barrier_protocol(n_pairs):
    """kv_ready counts 1 (the producer partition's one arrive a tile, after its stores and fence), kv_free 2 (both
    consumers), p_ready / p_free 1; the producer waits kv_free with the parity of the ring round before (a fresh
    barrier passes), both stages of a step in one round (NS even)."""
    for seed in range(40):
        _simulate_fp8_seesaw(n_pairs, gluon_kernels.SEESAW_FP8["stages"], seed)


# ----------------------------------------------------------------------------------------------------------
# the FP8 seesaw on the GPU
# ----------------------------------------------------------------------------------------------------------


def _fp8_problem(batch: int, heads: int, topk: int, ctx: list[int], block_size: int = 64):
    """`_problem` with an FP8 cache whose four 128-value groups differ in magnitude (four distinct scales a row)."""
    q, cache, idx, table, ctx_t = _problem(batch, heads, topk, ctx, block_size)
    gain = torch.tensor([0.25, 1.0, 4.0, 2.0], device=cache.device).repeat_interleave(128)
    lat = cache.float()
    lat[..., :512] *= gain
    return q, quantize_latent_fp8(lat.to(torch.bfloat16)), idx, table, ctx_t


def _check_fp8_against_bf16(q, fp8, idx, table, ctx, splits=None):
    """The FP8 seesaw against the reference on the FP8 cache, then bit for bit against the bf16 seesaw on the
    dequantised cache (same splits, same consumer register budget): the stages hold the same bf16 values."""
    out, lse = _poisoned(*q.shape[:2])
    sparse_mla_decode_gluon(q, fp8, idx, table, ctx, SM_SCALE, splits=splits, out=out, lse=lse)
    _check(out, lse, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    deq = dequantize_latent_fp8(fp8).to(torch.bfloat16)
    ref_out, ref_lse = sparse_mla_decode_gluon(q, deq, idx, table, ctx, SM_SCALE, splits=splits,
                                               config={"regs": gluon_kernels.SEESAW_FP8["regs"]})
    d_out = float((out.float() - ref_out.float()).abs().max())
    d_lse = float((lse - ref_lse).nan_to_num(0.0, 0.0, 0.0).abs().max())
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"max |dout| {d_out}, max |dlse| {d_lse}"


@requires_hopper
@pytest.mark.parametrize(("batch", "heads", "topk"),
                         [(1, 128, 2048), (3, 128, 300), (64, 128, 2048), (3, 64, 45), (3, 128, 2048)])
def test_fp8_decode_matches_reference_and_the_bf16_seesaw(batch, heads, topk):
    """Top-k 2048 / 300 (a partial last tile and an odd tile count) / 45 (less than a step); masked (-1, past the
    context) indices; short and an empty context (batch 3: zeros and -inf); the plan's splits (batch 1 and 3)."""
    _check_fp8_against_bf16(*_fp8_problem(batch, heads, topk, _contexts(batch, topk)))


@requires_hopper
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_fp8_decode_forced_splits(splits):
    """Unsplit, split (merged by the combine kernel) and one-step splits at batch 2, block size 16."""
    _check_fp8_against_bf16(*_fp8_problem(2, 128, 2048, [3000, 700], block_size=16), splits=splits)


@requires_hopper
@pytest.mark.parametrize("config", [{"regs": 240}, {"prefetch": False}])
def test_fp8_decode_launch_settings(config):
    """The settings the benchmark compares (producer at 24 registers; no L2 prefetch) give the same result."""
    q, fp8, idx, table, ctx = _fp8_problem(3, 128, 2048, _contexts(3, 2048))
    out, lse = sparse_mla_decode_gluon(q, fp8, idx, table, ctx, SM_SCALE)
    out2, lse2 = sparse_mla_decode_gluon(q, fp8, idx, table, ctx, SM_SCALE, config=config)
    _check(out2, lse2, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    if "regs" not in config:
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@requires_hopper
def test_fp8_dispatch_when_switched_on(launches, monkeypatch):
    """With gluon_kernels.FP8 on, `sparse_mla_decode` / `sparse_mla_prefill` give an FP8 cache to the FP8 seesaw
    ({"gluon": False} still takes the Triton kernel's FP8 tile path); a CUDA-graph replay included."""
    monkeypatch.setattr(gluon_kernels, "FP8", True)
    q, fp8, idx, table, ctx = _fp8_problem(5, 128, 300, _contexts(5, 300))
    out, lse = _poisoned(5, 128)
    sparse_mla_decode(q, fp8, idx, table, ctx, SM_SCALE, out=out, lse=lse)
    assert launches == [5]
    _check(out, lse, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    t_out, t_lse = sparse_mla_decode(q, fp8, idx, table, ctx, SM_SCALE, config={"gluon": False})
    _check(t_out, t_lse, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    assert launches == [5]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(q, fp8, idx, table, ctx, SM_SCALE, out=out, lse=lse)
    ctx.copy_(torch.tensor([1100, 64, 0, 9, 700], dtype=torch.int32))  # (the table covers 1,216 positions)
    idx.copy_(_selection(ctx.cpu(), 300).to(idx.device))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, *sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE))
    # prefill: a chunk of 96 queries at positions 150.., each selecting up to 300 positions up to its own
    dev = torch.device("cuda")
    tokens, start = 96, 150
    positions = torch.arange(start, start + tokens, dtype=torch.int32, device=dev)
    p_idx = torch.stack([torch.randperm(start + tokens)[:300] for _ in range(tokens)]).int().to(dev)
    p_table = table[0].contiguous()
    pq = torch.randn(tokens, 128, 576, device=dev).to(torch.bfloat16)
    out, lse = _poisoned(tokens, 128)
    sparse_mla_prefill(pq, fp8, p_idx, p_table, positions, SM_SCALE, out=out, lse=lse)
    assert launches == [5, 5, tokens]
    _check(out, lse, *sparse_mla_prefill_ref(pq, fp8, p_idx, p_table, positions, SM_SCALE))


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
