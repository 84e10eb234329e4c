"""Fused routed-expert MoE kernel vs the torch reference (interpreter at small odd shapes; GPU at
DeepSeek-V3 width with few experts), plus the device-side grouping by slot."""

import os

import pytest
import torch

from hearth.kernels.moe import fused_moe, group_by_slot, max_blocks, moe_reference

HAS_CUDA = torch.cuda.is_available()
CAN_RUN = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not CAN_RUN, reason="needs CUDA or TRITON_INTERPRET=1")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _inputs(t, k, d, i, s, wdtype, seed=0, skip=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.randint(0, s, (t, k), generator=g)
    if skip and t * k > 2:
        ids.view(-1)[torch.randperm(t * k, generator=g)[: t * k // 4]] = -1  # some pairs not for these slots
    w = torch.rand(t, k, generator=g)
    if wdtype == torch.float8_e4m3fn:
        w13 = (torch.randn(s, 2 * i, d, generator=g) * 8).to(wdtype)
        w2 = (torch.randn(s, d, i, generator=g) * 8).to(wdtype)
        s13 = torch.exp2(torch.randint(-9, -6, (s, 2 * _cdiv(i, 128), _cdiv(d, 128)), generator=g).float())
        s2 = torch.exp2(torch.randint(-9, -6, (s, _cdiv(d, 128), _cdiv(i, 128)), generator=g).float())
    else:
        w13 = (torch.randn(s, 2 * i, d, generator=g) * 0.03).to(wdtype)
        w2 = (torch.randn(s, d, i, generator=g) * 0.03).to(wdtype)
        s13 = s2 = None
    return x, ids, w, w13, w2, s13, s2


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got - want).norm() / want.norm()).item()


def _check(t, k, d, i, s, wdtype, device):
    args = _inputs(t, k, d, i, s, wdtype)
    want = moe_reference(*(a.to(device) if a is not None else None for a in args)).cpu()
    on_dev = [a.to(device) if a is not None else None for a in args]
    out = torch.full((t, d), 3.0, device=device)  # accumulates into whatever is there
    got = fused_moe(*on_dev, out=out).cpu() - 3.0
    assert _rel_err(got, want) < 2e-2


@needs_triton
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("t,k,d,i,s", [(1, 8, 200, 72, 10), (7, 2, 64, 160, 3), (33, 4, 130, 96, 5)])
def test_fused_moe_small(t, k, d, i, s, wdtype):
    _check(t, k, d, i, s, wdtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("t", [1, 8, 67])
def test_fused_moe_real_width(t, wdtype):
    _check(t, 8, 7168, 2048, 16, wdtype, "cuda")


@needs_triton
def test_strided_slots_and_layout_errors():
    x, ids, w, w13, w2, _, _ = _inputs(3, 2, 64, 32, 4, torch.bfloat16, skip=False)
    want = moe_reference(x, ids, w, w13, w2)
    big13 = torch.zeros(4, 2 * 32 + 5, 64, dtype=torch.bfloat16)
    big13[:, :64] = w13  # slot stride larger than one expert, as in a byte-buffer view
    got = fused_moe(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), big13[:, :64].to(DEVICE), w2.to(DEVICE)).cpu()
    assert _rel_err(got, want) < 2e-2
    with pytest.raises(ValueError, match="fp32 weights"):
        fused_moe(x, ids, w.half(), w13, w2)
    with pytest.raises(ValueError, match="FP8 weights need both scale tensors"):
        fused_moe(x, ids, w, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("t,k,s,bm", [(1, 8, 256, 16), (9, 4, 3, 16), (40, 8, 6, 32)])
def test_group_by_slot(t, k, s, bm):
    ids = torch.randint(-1, s, (t, k))
    pairs, block_slot = group_by_slot(ids, s, bm)
    assert block_slot.numel() == max_blocks(t * k, s, bm) and pairs.numel() == block_slot.numel() * bm
    flat = ids.flatten()
    seen = []
    for b, slot in enumerate(block_slot.tolist()):
        rows = pairs[b * bm : (b + 1) * bm]
        real = rows[rows < t * k].tolist()
        if slot < 0:
            assert not real
        assert all(flat[p] == slot for p in real)
        assert real == sorted(real)
        seen += real
    assert sorted(seen) == torch.nonzero(flat >= 0).flatten().tolist()
