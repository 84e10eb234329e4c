"""Fused RMSNorm and rotary kernels against their torch references: odd widths, strided inputs, both
rope layouts, fp32 and bf16; on the CPU under Triton's interpreter, on the GPU for real."""

from __future__ import annotations

import pytest
import torch

from hearth.kernels.norm import rms_norm, rms_norm_reference
from hearth.kernels.rope import apply_rotary, apply_rotary_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's CPU interpreter truncates float -> bf16 casts (the GPU rounds to nearest even): on the CPU a
# bf16 result may sit one step lower per cast.
CAST_ULPS = 1 if DEVICE == "cuda" else 2


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, rounded_to: torch.dtype) -> bool:
    """got within ``ulps`` roundings to ``rounded_to`` of want (fp32: a few fp32 ulps)."""
    if rounded_to == torch.float32:
        return bool(((got - want).abs() <= 1e-5 * want.abs().clamp_min(1.0)).all())
    step = 2.0 ** -7 * want.float().abs().clamp_min(2.0 ** -100)  # a bf16/fp16 step at each value (upper bound)
    return bool(((got.float() - want.float()).abs() <= ulps * step).all())


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 7), (5, 100), (3, 2, 576), (2, 1536)])
def test_rms_norm_matches_reference(shape, dtype, wdtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(wdtype).to(DEVICE)
    got, want = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    # fp32 sums in another order: at most one rounding step of the output dtype apart (per cast on the CPU)
    assert _within_ulps(got, want, CAST_ULPS, x.dtype)


def test_rms_norm_strided_rows_and_empty():
    x = torch.randn(6, 256, device=DEVICE)[:, :128]  # row stride 256
    w = torch.rand(128, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert rms_norm(torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(64, device=DEVICE), 1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [None, 1, 3, 20])
def test_rotary_matches_reference_on_strided_views(heads, dtype, interleaved):
    n, d = 5, 64
    g = torch.Generator().manual_seed(7 + (heads or 0))
    width = (heads or 1) * (128 + d)
    full = torch.randn(n, width, generator=g).to(dtype).to(DEVICE)
    if heads is None:  # like k_pe: the rope columns of a [N, 576] projection
        x = full[:, 128:128 + d]
    else:  # like q_pe: the rope part of each head of a [N, H, 192] projection
        x = full.view(n, heads, 128 + d)[..., 128:]
    angles = torch.rand(n, d // 2, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos(), angles.sin()
    got, want = apply_rotary(x, cos, sin, interleaved), apply_rotary_reference(x, cos, sin, interleaved)
    assert got.is_contiguous() and got.dtype == dtype
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got, want)  # same products and sums, no FMA contraction
    else:
        assert _within_ulps(got, want, 1, dtype)


def test_rotary_rejects_bad_shapes():
    x = torch.randn(4, 48, device=DEVICE)
    cos = torch.ones(4, 24, device=DEVICE)
    with pytest.raises(ValueError):
        apply_rotary(x, cos, cos, True)  # 48 / 2 is not a power of two
