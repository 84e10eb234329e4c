"""Fused routed-expert MoE kernel vs the torch reference (interpreter at small odd shapes; GPU at
DeepSeek-V3 width with few experts), both paths (decode GEMV and grouped tl.dot) forced through explicit
launches as well as the default choice, plus the device-side grouping by slot."""

import dataclasses
import os

import pytest
import torch

from hearth.kernels.moe import ExpertExtras, fused_moe, group_by_slot, max_blocks, moe_reference
from hearth.kernels.moe.fused_moe import MoeLaunch, TileConfig, default_launch, fused_moe_launch

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


def _check(t, k, d, i, s, wdtype, device, launch=None, ids=None):
    args = list(_inputs(t, k, d, i, s, wdtype))
    if ids is not None:
        args[1] = ids
    want = moe_reference(*(a.to(device) if a is not None else None for a in args)).cpu()
    on_dev = [a.to(device) if a is not None else None for a in args]
    out = torch.full((t, d), 3.0, device=device)  # accumulates into whatever is there
    if launch is None:
        got = fused_moe(*on_dev, out=out)
    else:
        got = fused_moe_launch(*on_dev, out, launch=launch)
    assert got is out
    assert _rel_err(got.cpu() - 3.0, want) < 2e-2


def _gemv(block_m, block_n=16, block_k=64, split_k=1, num_warps=4):
    gu = TileConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)
    return MoeLaunch(gemv=True, block_m=block_m, gate_up=gu, down=dataclasses.replace(gu, split_k=split_k))


def _mma(block_m=16, block_n=64, block_k=64, num_warps=4):
    tile = TileConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3)
    return MoeLaunch(gemv=False, block_m=block_m, gate_up=tile, down=tile)


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


# Decode GEMV at odd sizes: partial edge blocks in D and I (and in the FP8 scale blocks), K splits
# that leave the last split short or empty, one pair per program (m1, no grouping) and grouped blocks.
@needs_triton
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "t,launch",
    [
        (1, _gemv(1)),
        (1, _gemv(1, block_n=8, block_k=256, split_k=4)),
        (3, _gemv(1, block_k=32, split_k=3)),
        (3, _gemv(2, block_n=32, block_k=128, split_k=2)),
        (3, _gemv(8)),
    ],
    ids=lambda v: v.describe() if isinstance(v, MoeLaunch) else None,
)
def test_gemv_path(t, launch, wdtype):
    _check(t, 4, 200, 72, 5, wdtype, DEVICE, launch=launch)


@needs_triton
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("launch", [_gemv(1, split_k=2), _gemv(4), _mma()], ids=lambda v: v.describe())
def test_repeated_and_skipped_slots(launch, wdtype):
    # a slot twice in one token, a slot shared by all tokens, a whole token skipped
    ids = torch.tensor([[2, 2, 0, -1], [2, 1, -1, 0], [-1, -1, -1, -1]])
    _check(3, 4, 130, 96, 3, wdtype, DEVICE, launch=launch, ids=ids)


# gpt-oss's experts: biases on the three projections, the clamped SwiGLU (a limit low enough to clamp
# on these inputs) and gate/up rows interleaved as in its gate_up_proj; both paths, split K.
@needs_triton
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "t,launch", [(1, _gemv(1, split_k=3)), (3, _gemv(2, block_k=32)), (9, _mma())],
    ids=lambda v: v.describe() if isinstance(v, MoeLaunch) else None,
)
def test_biases_and_clamped_swiglu(t, launch, wdtype, interleaved):
    x, ids, w, w13, w2, _, _ = _inputs(t, 4, 130, 72, 5, wdtype, seed=3)
    x = x.to(wdtype) * 8  # large enough activations that the clamp (limit 0.05) acts
    g = torch.Generator().manual_seed(4)
    b13, b2 = 0.1 * torch.randn(5, 2 * 72, generator=g), 0.1 * torch.randn(5, 130, generator=g)
    extras = ExpertExtras(b13=b13.to(DEVICE), b2=b2.to(DEVICE), swiglu_limit=0.05, interleaved=interleaved)
    want = moe_reference(x, ids, w, w13, w2, b13=b13, b2=b2, swiglu_limit=0.05, interleaved=interleaved)
    plain = moe_reference(x, ids, w, w13, w2, interleaved=interleaved)
    assert _rel_err(plain, want) > 0.1  # the extras matter on these inputs
    dev = [a.to(DEVICE) for a in (x, ids, w, w13, w2)]
    got = fused_moe_launch(*dev, None, None, None, launch=launch, extras=extras).cpu()
    assert _rel_err(got, want) < (2e-2 if wdtype == torch.bfloat16 else 1e-5)


@needs_triton
def test_extras_layout_errors():
    x, ids, w, w13, w2, s13, s2 = _inputs(2, 2, 64, 32, 4, torch.float8_e4m3fn, skip=False)
    with pytest.raises(ValueError, match="interleaved"):
        fused_moe(x, ids, w, w13, w2, s13, s2, extras=ExpertExtras(interleaved=True))
    x, ids, w, w13, w2, _, _ = _inputs(2, 2, 64, 32, 4, torch.bfloat16, skip=False)
    with pytest.raises(ValueError, match="b2"):
        fused_moe(x, ids, w, w13, w2, extras=ExpertExtras(b2=torch.zeros(4, 63)))


@needs_triton
def test_unwritten_buffers_stay_out(monkeypatch):
    """Poison every torch.empty inside fused_moe: rows the kernels must not read would show as NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        buf = empty(*args, **kwargs)
        return buf.fill_(float("nan")) if buf.is_floating_point() else buf.fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)
    for launch in (_gemv(1, split_k=2), _gemv(2), _mma()):
        _check(3, 4, 64, 40, 6, torch.bfloat16, DEVICE, launch=launch)


def test_default_launch_picks_gemv_for_decode():
    assert default_launch(8, 64, "fp8").gemv and default_launch(8, 64, "fp8").block_m == 1
    assert not default_launch(8 * 4, 64, "fp8").gemv  # from 4 tokens the tl.dot path measured faster
    assert not default_launch(8 * 32, 64, "fp8").gemv
    assert not default_launch(8 * 128, 64, "fp8").gemv
    # MXFP4 experts (top-4 of 128, gpt-oss): the GEMV path up to 32 tokens, tl.dot at 128
    assert default_launch(4 * 32, 128, "mxfp4").gemv and not default_launch(4 * 128, 128, "mxfp4").gemv
    assert default_launch(4, 128, "mxfp4").mxfp4_decode == "bits"
    with pytest.raises(ValueError, match="block_m"):
        MoeLaunch(gemv=True, block_m=16, gate_up=TileConfig(16, 64), down=TileConfig(16, 64))
    with pytest.raises(ValueError, match="block_n"):
        TileConfig(block_n=96, block_k=64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "t,launch",
    [
        (1, _gemv(1, block_k=512)),
        (1, _gemv(1, block_n=32, block_k=256, split_k=2, num_warps=8)),
        (4, _gemv(2, block_k=256)),
        (8, _gemv(8, block_k=128)),
        (40, _mma(block_m=16, block_n=128, block_k=128, num_warps=8)),
    ],
    ids=lambda v: v.describe() if isinstance(v, MoeLaunch) else None,
)
def test_launches_real_width(t, launch, wdtype):
    _check(t, 8, 7168, 2048, 16, wdtype, "cuda", launch=launch)


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


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,rows,groups", [(1, 1, 1), (3, 5, 3), (2, 7, 17)])
def test_mxfp4_dequantize_kernel_equals_reference(n, rows, groups, out_dtype):
    """Every code and a spread of scales, strided views into records (as the expert cache's slots are),
    and row lengths that are not a multiple of the kernel's block: bit for bit the torch dequantiser."""
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_into

    g = torch.Generator().manual_seed(n * 100 + rows * 10 + groups)
    blocks = torch.randint(0, 256, (n, rows, groups, 16), generator=g, dtype=torch.uint8)
    blocks.view(-1)[:8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # 0..15
    scales = torch.randint(112, 139, (n, rows, groups), generator=g, dtype=torch.uint8)  # 2^-15 .. 2^11: fp16 too
    # Records of 40 spare bytes a row: blocks, scales and out are all strided views, as in a slot.
    rec = torch.zeros((n, rows, groups * 16 + 40), dtype=torch.uint8)
    rec[..., : groups * 16] = blocks.flatten(-2)
    srec = torch.zeros((n, rows, groups + 7), dtype=torch.uint8)
    srec[..., :groups] = scales
    out = torch.full((n, rows, groups * 32 + 5), 7.0, dtype=out_dtype, device=DEVICE)
    rec, srec = rec.to(DEVICE), srec.to(DEVICE)
    dequantize_mxfp4_into(rec[..., : groups * 16].unflatten(-1, (groups, 16)), srec[..., :groups],
                          out[..., : groups * 32])
    got = out[..., : groups * 32].cpu()
    assert torch.equal(got, dequantize_mxfp4(blocks, scales, out_dtype))
    assert (out[..., groups * 32 :] == 7.0).all()  # nothing written past a row
    assert got.abs().max() > 0


def test_mxfp4_dequantize_kernel_refuses_bad_layouts():
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4_into

    blocks, scales = torch.zeros(1, 2, 3, 16, dtype=torch.uint8), torch.zeros(1, 2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4_into(blocks, scales, torch.zeros(1, 2, 95))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4_into(blocks.float(), scales, torch.zeros(1, 2, 96))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_mxfp4_into(blocks, scales, torch.zeros(1, 2, 192)[..., ::2])


# MXFP4 experts (gpt-oss's release format) read directly: code bytes and e8m0 scales decoded in
# registers. D and I multiples of 32 but not of the tiles (partial edge tiles in N and K), several
# experts, top-k 2-4, with and without gpt-oss's extras, against the reference on dequantised weights.
def _mxfp4_inputs(t, k, d, i, s, seed=0):
    from hearth.kernels.moe.mxfp4 import quantize_mxfp4

    x, ids, w, w13, w2, _, _ = _inputs(t, k, d, i, s, torch.float32, seed=seed)
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return x, ids, w, b13, b2, s13, s2  # blocks [S, N, K/32, 16], scales [S, N, K/32]


def _dequantised(w13, w2, s13, s2):
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4

    return dequantize_mxfp4(w13, s13, torch.bfloat16), dequantize_mxfp4(w2, s2, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize(
    "t,k,d,i,s,launch",
    [
        (1, 4, 160, 96, 5, None),  # default: the GEMV path
        (33, 2, 96, 224, 4, None),  # default: the tl.dot path
        (1, 3, 160, 96, 5, _gemv(1, block_n=8, block_k=128, split_k=3)),
        (3, 4, 160, 96, 5, _gemv(2, block_n=32, block_k=32)),
        (3, 4, 160, 96, 5, _gemv(8)),
        (9, 2, 160, 96, 3, _mma(block_k=32)),
    ],
    ids=lambda v: v.describe() if isinstance(v, MoeLaunch) else None,
)
@pytest.mark.parametrize("decode", ["bits", "arith"])
def test_mxfp4_weights(t, k, d, i, s, launch, decode):
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(t, k, d, i, s)
    launch = dataclasses.replace(launch or default_launch(ids.numel(), s, "mxfp4"), mxfp4_decode=decode)
    f13, f2 = _dequantised(w13, w2, s13, s2)
    want = moe_reference(x, ids, w, f13, f2)
    assert torch.equal(moe_reference(x, ids, w, w13, w2, s13, s2), want)  # the reference reads MXFP4 too
    dev = [a.to(DEVICE) for a in (x, ids, w, w13, w2, s13, s2)]
    out = torch.full((t, d), 3.0, device=DEVICE)
    got = fused_moe(*dev, out=out) if launch is None else fused_moe_launch(*dev, out, launch=launch)
    assert got is out
    assert _rel_err(got.cpu() - 3.0, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 67])
def test_mxfp4_weights_gpt_oss_width(t):
    """gpt-oss-120b's expert width (2880 x 2880) with its extras, the default launch (GEMV at T=1, tl.dot
    from a few tokens on): the kernels compiled for real, against the reference on dequantised weights."""
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(t, 4, 2880, 2880, 16, seed=7)
    f13, f2 = _dequantised(w13, w2, s13, s2)
    g = torch.Generator().manual_seed(8)
    b13, b2 = 0.1 * torch.randn(16, 2 * 2880, generator=g), 0.1 * torch.randn(16, 2880, generator=g)
    x = x.bfloat16()
    want = moe_reference(x, ids, w, f13, f2, b13=b13, b2=b2, swiglu_limit=7.0, interleaved=True)
    extras = ExpertExtras(b13=b13.cuda(), b2=b2.cuda(), swiglu_limit=7.0, interleaved=True)
    got = fused_moe(*(a.cuda() for a in (x, ids, w, w13, w2, s13, s2)), extras=extras).cpu()
    assert _rel_err(got, want) < 2e-2


@needs_triton
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "t,launch", [(1, _gemv(1, split_k=2)), (3, _gemv(2, block_k=32)), (9, _mma())],
    ids=lambda v: v.describe() if isinstance(v, MoeLaunch) else None,
)
@pytest.mark.parametrize("decode", ["bits", "arith"])
def test_mxfp4_weights_with_extras(t, launch, interleaved, decode):
    launch = dataclasses.replace(launch, mxfp4_decode=decode)
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(t, 3, 96, 160, 5, seed=5)
    x = x * 8  # large enough activations that the clamp (limit 0.05) acts
    g = torch.Generator().manual_seed(6)
    b13, b2 = 0.1 * torch.randn(5, 2 * 160, generator=g), 0.1 * torch.randn(5, 96, generator=g)
    f13, f2 = _dequantised(w13, w2, s13, s2)
    want = moe_reference(x, ids, w, f13, f2, b13=b13, b2=b2, swiglu_limit=0.05, interleaved=interleaved)
    extras = ExpertExtras(b13=b13.to(DEVICE), b2=b2.to(DEVICE), swiglu_limit=0.05, interleaved=interleaved)
    dev = [a.to(DEVICE) for a in (x, ids, w, w13, w2, s13, s2)]
    got = fused_moe_launch(*dev, None, launch=launch, extras=extras).cpu()
    assert _rel_err(got, want) < 2e-2


@needs_triton
def test_mxfp4_layout_errors():
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(2, 2, 64, 32, 4)
    with pytest.raises(ValueError, match="uint8 w2 and s2"):
        fused_moe(x, ids, w, w13, w2, s13, None)
    with pytest.raises(ValueError, match="MXFP4 w2 blocks"):
        fused_moe(x, ids, w, w13, w2[:, :32], s13, s2[:, :32])
    with pytest.raises(ValueError, match="MXFP4 w13 blocks"):
        fused_moe(x[:, :32].contiguous(), ids, w, w13, w2[:, :32], s13, s2[:, :32])
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.zeros(4, 64, 2, 32, dtype=torch.uint8)
        fused_moe(x, ids, w, wide[..., :16], w2, s13, s2)


@needs_triton
@pytest.mark.parametrize("bits", [True, False], ids=["bits", "arith"])
def test_mxfp4_decode_every_code_and_scale(bits):
    """Each of the 16 codes under every scale byte 0..254 (e8m0's subnormal 2 ** -127, 1, 127 = 1.0, up
    to 2 ** 127, where the larger codes overflow to inf): bit for bit the torch dequantiser, -0.0 included."""
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_into

    scales = torch.arange(255, dtype=torch.uint8)[:, None]  # (255, 1): one group a row
    codes = torch.arange(16, dtype=torch.uint8)
    row = torch.cat((codes | (codes.flip(0) << 4), codes << 4))  # 32 bytes: every code in both nibbles
    blocks = row.view(2, 16)[None].expand(255, 2, 16).reshape(255, 2, 16)  # rows of two groups
    scales = torch.cat((scales, 254 - scales), dim=1)  # the second group: the other end of the range
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    out = torch.empty((1, 255, 64), device=DEVICE)
    dequantize_mxfp4_into(blocks[None].to(DEVICE), scales[None].to(DEVICE), out, bits=bits)
    wrong = (out[0].cpu().view(torch.int32) != want.view(torch.int32)).nonzero().tolist()  # bits: -0.0 vs 0.0 counts
    assert not wrong, [(scales[r, c // 32].item(), c, out[0, r, c].item(), want[r, c].item()) for r, c in wrong[:8]]
    low_first = [0.0, -6.0, 0.5, -4.0, 1.0, -3.0, 1.5, -2.0, 2.0, -1.5, 3.0, -1.0, 4.0, -0.5, 6.0, -0.0]
    assert want[127, :16].tolist() == low_first
    assert want[0, 2] == 2.0**-128 and want[254, 6] == 1.5 * 2.0**127 and want[254, 8] == float("inf")


@needs_triton
@pytest.mark.parametrize("decode", ["bits", "arith"])
def test_mxfp4_gemv_wide_scale_range(decode):
    """Groups scaled from 2 ** -40 to 2 ** 40 within one row (the bits decode scales per group sum, not
    per value), tiles that cover several groups and a partial last one, one and four rows a block."""
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(3, 4, 160, 96, 5, seed=9)
    g = torch.Generator().manual_seed(10)
    s13 = (s13.int() + torch.randint(-40, 41, s13.shape, generator=g)).to(torch.uint8)
    s2 = (s2.int() + torch.randint(-8, 9, s2.shape, generator=g)).to(torch.uint8)
    f13, f2 = _dequantised(w13, w2, s13, s2)
    want = moe_reference(x.float(), ids, w, f13.float(), f2.float())
    dev = [a.to(DEVICE) for a in (x.float(), ids, w, w13, w2, s13, s2)]
    for launch in (_gemv(1, block_k=64, split_k=2), _gemv(4, block_n=32, block_k=128)):
        got = fused_moe_launch(*dev, None, launch=dataclasses.replace(launch, mxfp4_decode=decode)).cpu()
        assert _rel_err(got, want) < 1e-5


def test_mxfp4_launch_errors():
    x, ids, w, w13, w2, s13, s2 = _mxfp4_inputs(1, 2, 64, 32, 4)
    with pytest.raises(ValueError, match="whole groups"):
        fused_moe_launch(x, ids, w, w13, w2, s13, s2, None,
                         launch=dataclasses.replace(_gemv(1, block_k=16), mxfp4_decode="bits"))
    with pytest.raises(ValueError, match="mxfp4_decode"):
        dataclasses.replace(_gemv(1), mxfp4_decode="lut")
