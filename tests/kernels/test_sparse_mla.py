"""Sparse MLA (absorbed form) over the paged bf16 / FP8-656 latent cache vs the torch reference,
plus an independent dense-attention check when every position is selected."""

import pytest
import torch
import triton

from hearth.kernels.sparse_mla import (
    dequantize_latent_fp8,
    quantize_latent_fp8,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from hearth.kernels.sparse_mla.kernel import launch_plan
from hearth.kernels.sparse_mla.reference import (
    dense_mla_decode_check,
    sparse_mla_decode_ref,
    sparse_mla_prefill_ref,
)
from tests.kernels.conftest import logical_slots, paged_table, rel_err, requires_cuda

OUT_TOL = 1e-2  # bf16 operands (q, latent, probabilities) and bf16 output
LSE_TOL = 1e-3  # absolute, fp32 softmax statistics


def _cache(num_blocks, block_size, fp8, device):
    """Random latents whose four 128-value groups differ in magnitude, so that FP8 entries carry four
    different scales (N(0, 1) groups alone would all get the same power of two)."""
    gain = torch.tensor([1.0, 4.0, 0.25, 2.0], device=device).repeat_interleave(128)
    lat = torch.randn(num_blocks, block_size, 576, device=device)
    lat[..., :512] *= gain
    lat = lat.to(torch.bfloat16)
    return quantize_latent_fp8(lat) if fp8 else lat


def _poisoned(shape_o, shape_l, device):
    return (
        torch.full(shape_o, float("nan"), dtype=torch.bfloat16, device=device),
        torch.full(shape_l, float("nan"), dtype=torch.float32, device=device),
    )


def _selection(n_rows, topk, limits, device):
    """Random distinct logical indices, some invalid (-1, past the limit), per row."""
    rows = []
    for lim in limits.tolist():
        pool = max(lim + 1, 1) + 8  # a few positions past the valid range
        sel = torch.randperm(pool)[:topk]
        sel = torch.cat([sel, torch.full((topk - sel.numel(),), -1)])
        rows.append(sel[torch.randperm(topk)])
    return torch.stack(rows).int().to(device)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_reference(fp8, block_size, splits, device):
    heads, topk = 20, 80  # heads not a power of two, topk not a multiple of the tile
    ctx = torch.tensor([1, 63, 300], dtype=torch.int32, device=device)
    max_blocks = 300 // block_size + 2
    cache = _cache(3 * max_blocks + 1, block_size, fp8, device)
    table = paged_table(3, max_blocks, 3 * max_blocks + 1, device)
    q = torch.randn(3, heads, 576, device=device).to(torch.bfloat16)
    idx = _selection(3, topk, ctx - 1, device)
    out, lse = _poisoned((3, heads, 512), (3, heads), device)
    sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, out=out, lse=lse, config={"splits": splits})
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, 0.1352)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL


@pytest.mark.parametrize("fp8_tile", [True, False])
@pytest.mark.parametrize(
    ("batch", "block_h", "block_n", "splits"),
    [(1, 16, 16, 5), (1, 64, 32, None), (4, 16, 32, 2), (5, 64, 16, 1)],
)
def test_decode_fp8_paths_match_reference(fp8_tile, batch, block_h, block_n, splits, device):
    """The FP8 tile path (dequantised once per tile) and the old per-element path, at odd head counts
    and selection lengths, one and several rows, 16- and 64-head blocks, split and unsplit."""
    heads, topk, block_size = 23, 75, 16
    ctx = torch.randint(1, 200, (batch,), dtype=torch.int32, device=device)
    max_blocks = 200 // block_size + 2
    cache = _cache(batch * max_blocks + 3, block_size, True, device)
    table = paged_table(batch, max_blocks, batch * max_blocks + 3, device)
    q = torch.randn(batch, heads, 576, device=device).to(torch.bfloat16)
    idx = _selection(batch, topk, ctx - 1, device)
    out, lse = _poisoned((batch, heads, 512), (batch, heads), device)
    cfg = {"fp8_tile": fp8_tile, "block_h": block_h, "block_n": block_n, "splits": splits}
    sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, out=out, lse=lse, config=cfg)
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, 0.1352)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL


def test_decode_fp8_tile_path_equals_the_old_path(device):
    """Both FP8 paths round the same fp32 products to bf16, so with the same tiles and splits their
    results agree to the last bit (the tile path only loads the scales differently)."""
    batch, heads, topk, block_size = 3, 18, 50, 16
    ctx = torch.tensor([40, 97, 5], dtype=torch.int32, device=device)
    cache = _cache(3 * 8 + 1, block_size, True, device)
    table = paged_table(batch, 8, 3 * 8 + 1, device)
    q = torch.randn(batch, heads, 576, device=device).to(torch.bfloat16)
    idx = _selection(batch, topk, ctx - 1, device)
    base = {"block_h": 32, "block_n": 16, "splits": 2}
    new = sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, config=base | {"fp8_tile": True})
    old = sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, config=base | {"fp8_tile": False})
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


@pytest.mark.parametrize("sm_count", [132, 78])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 64, 256])
def test_launch_plan_fills_one_wave(batch, sm_count):
    """DeepSeek-V3.2 decode shapes: the grid fills at most one wave of the SMs, at least half of it
    when the rows alone cannot, and the splits tile the selection exactly."""
    heads, topk = 128, 2048
    cfg = launch_plan(batch, heads, topk, True, sm_count)
    row_programs = batch * triton.cdiv(heads, cfg["block_h"])
    programs = row_programs * cfg["splits"]
    assert cfg["chunk"] % cfg["block_n"] == 0
    assert (cfg["splits"] - 1) * cfg["chunk"] < topk <= cfg["splits"] * cfg["chunk"]
    if 4 * row_programs >= 3 * sm_count:
        assert cfg["splits"] == 1
    else:
        assert sm_count // 2 < programs <= sm_count
    assert cfg["fp8_tile"] and cfg["num_stages"] == (3 if cfg["splits"] == 1 else 2)  # 3 where rows fill the GPU


def test_both_caches_default_to_the_wave_plan_and_h200_keeps_the_earlier_one():
    """The one-wave plan is the default for the bf16 cache too (16-head blocks at batch 1, one wave of
    splits); plan="h200" picks the earlier plan (64-head blocks, splits aiming at 264 programs)."""
    wave = launch_plan(1, 128, 2048, False, 132)
    assert wave["plan"] == "wave" and wave["block_h"] == 16 and 66 < 8 * wave["splits"] <= 132
    cfg = launch_plan(1, 128, 2048, False, 132, {"plan": "h200"})
    assert (cfg["block_h"], cfg["splits"], cfg["plan"]) == (64, 32, "h200")
    assert launch_plan(64, 128, 2048, False, 132, {"plan": "h200"})["splits"] == 1
    with pytest.raises(ValueError, match="plan"):
        launch_plan(1, 128, 2048, False, 132, {"plan": "fast"})


def test_launch_plan_honours_overrides():
    cfg = launch_plan(1, 128, 2048, True, 132, {"fp8_tile": False, "block_h": 64, "splits": 32})
    assert (cfg["block_h"], cfg["splits"], cfg["chunk"], cfg["num_stages"]) == (64, 32, 64, 1)
    assert launch_plan(1, 128, 2048, True, 132, {"num_stages": 3, "block_n": 32})["num_stages"] == 3
    assert launch_plan(3, 12, 80, False, 132)["block_h"] == 16  # never wider than the heads need


def test_decode_merges_many_splits_with_empty_ones(device):
    """More splits than one combine tile holds (38 > 32), whole splits with no valid index and a
    head count that is not a power of two: the split merge against the reference."""
    heads, topk, context = 12, 600, 700
    ctx = torch.tensor([context], dtype=torch.int32, device=device)
    cache = _cache(48, 16, False, device)
    table = paged_table(1, 45, 48, device)
    q = torch.randn(1, heads, 576, device=device).to(torch.bfloat16)
    idx = _selection(1, topk, ctx - 1, device)
    idx[:, 64:160] = -1  # splits 4..9 of 16 indices select nothing
    out, lse = _poisoned((1, heads, 512), (1, heads), device)
    sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, out=out, lse=lse, config={"splits": 40, "block_n": 16})
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, 0.1352)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL


def test_decode_empty_selection_gives_zero_and_neg_inf(device):
    cache = _cache(4, 16, False, device)
    table = torch.arange(4, dtype=torch.int32, device=device)[None]
    q = torch.randn(1, 16, 576, device=device).to(torch.bfloat16)
    idx = torch.tensor([[-1, 50, 63, -1]], dtype=torch.int32, device=device)  # all past context 10
    out, lse = sparse_mla_decode(q, cache, idx, table, torch.tensor([10], dtype=torch.int32, device=device), 0.1)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_full_selection_equals_dense_attention(fp8, device):
    """Independent of the sparse reference: selecting all n positions is dense attention."""
    n, heads, block_size = 63, 16, 16
    cache = _cache(6, block_size, fp8, device)
    table = torch.randperm(6)[:5].int().to(device)[None]
    q = torch.randn(1, heads, 576, device=device).to(torch.bfloat16)
    idx = torch.randperm(n + 9).int().to(device)[None]  # k > context: 9 entries past it
    out, lse = sparse_mla_decode(q, cache, idx, table, torch.tensor([n], dtype=torch.int32, device=device), 0.0625)
    lat = dequantize_latent_fp8(cache) if fp8 else cache.float()
    lat = lat.flatten(0, 1)[logical_slots(table[0], n, block_size)]
    do, dl = dense_mla_decode_check(q[0], lat, n, 0.0625)
    assert rel_err(out[0].float(), do) < OUT_TOL
    assert float((lse[0].double() - dl).abs().max()) < LSE_TOL


def test_fp8_latent_roundtrip():
    lat = torch.randn(7, 576).to(torch.bfloat16)
    lat[3, :128] *= 1e-3
    entry = quantize_latent_fp8(lat)
    assert entry.shape == (7, 656) and entry.dtype == torch.uint8
    back = dequantize_latent_fp8(entry)
    assert torch.equal(back[:, 512:], lat[:, 512:].float())  # rope kept in bf16
    assert rel_err(back[:, :512], lat[:, :512].float()) < 0.05  # e4m3: ~3% rms


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_matches_reference(fp8, block_size, device):
    heads, topk, ctx, n_q = 16, 64, 130, 30
    max_blocks = ctx // block_size + 2
    cache = _cache(max_blocks + 3, block_size, fp8, device)
    table = torch.randperm(max_blocks + 3)[:max_blocks].int().to(device)
    pos = (ctx - n_q + torch.arange(n_q, device=device)).int()
    q = torch.randn(n_q, heads, 576, device=device).to(torch.bfloat16)
    idx = torch.randint(-1, ctx, (n_q, topk), device=device).int()  # includes future positions: masked
    out, lse = _poisoned((n_q, heads, 512), (n_q, heads), device)
    sparse_mla_prefill(q, cache, idx, table, pos, 0.0625, out=out, lse=lse)
    ro, rl = sparse_mla_prefill_ref(q, cache, idx, table, pos, 0.0625)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL


def test_layout_errors(device):
    cache = _cache(4, 16, False, device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)
    ctx = torch.tensor([5], dtype=torch.int32, device=device)
    q = torch.randn(1, 16, 576, device=device).to(torch.bfloat16)
    idx = torch.zeros(1, 8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="q must"):
        sparse_mla_decode(q[..., :512], cache, idx, table, ctx, 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_decode(q, cache[..., :512], idx, table, ctx, 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, cache, idx.long(), table, ctx, 0.1)
    with pytest.raises(ValueError, match="block_size"):
        sparse_mla_decode(q, cache.view(8, 8, 576), idx, table, ctx, 0.1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_real_shapes_gpu(fp8, batch):
    heads, topk, ctx_len, block_size = 128, 2048, 8192, 64
    max_blocks = ctx_len // block_size
    cache = _cache(batch * max_blocks, block_size, fp8, "cuda")
    table = paged_table(batch, max_blocks, batch * max_blocks, "cuda")
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 576, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(ctx_len, device="cuda")[:topk] for _ in range(batch)]).int()
    out, lse = _poisoned((batch, heads, 512), (batch, heads), "cuda")
    sparse_mla_decode(q, cache, idx, table, ctx, 0.1352, out=out, lse=lse)
    ro, rl = sparse_mla_decode_ref(q, cache, idx, table, ctx, 0.1352)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL


@pytest.mark.gpu
@requires_cuda
def test_prefill_real_shapes_gpu():
    heads, topk, ctx, n_q, block_size = 128, 2048, 4096, 256, 64
    cache = _cache(ctx // block_size + 1, block_size, False, "cuda")
    table = torch.randperm(ctx // block_size + 1, device="cuda")[: ctx // block_size].int()
    pos = (ctx - n_q + torch.arange(n_q, device="cuda")).int()
    q = torch.randn(n_q, heads, 576, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(ctx, device="cuda")[:topk] for _ in range(n_q)]).int()
    out, lse = _poisoned((n_q, heads, 512), (n_q, heads), "cuda")
    sparse_mla_prefill(q, cache, idx, table, pos, 0.1352, out=out, lse=lse)
    ro, rl = sparse_mla_prefill_ref(q, cache, idx, table, pos, 0.1352)
    assert rel_err(out.float(), ro) < OUT_TOL
    assert float((lse - rl).abs().max()) < LSE_TOL
