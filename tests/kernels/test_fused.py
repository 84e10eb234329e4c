"""Fused decode-step kernels (RMSNorm + residual, rotary in place, MLA latent write) against their
torch references at small odd sizes. bf16 results may differ from the reference by one bf16 ulp
(the norm sums in another order; the GPU may fuse products into FMAs); everything else is exact."""

import pytest
import torch

from hearth.kernels.fused import mla_latent_write, rms_norm, rope_
from hearth.kernels.fused.reference import mla_latent_write_ref, rms_norm_ref, rotate_ref


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one bf16 ulp of the larger magnitude, and equal in at least 98% of the elements."""
    got, want = got.float(), want.float()
    ulp = want.abs().clamp_min(1e-30) * 2.0**-7
    assert bool(((got - want).abs() <= ulp * 1.01).all()), float((got - want).abs().max())
    assert (got == want).float().mean() >= 0.98


def _tables(max_pos: int, half: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(half) / half))[None, :]
    return (freqs.cos() * 1.3).to(device), (freqs.sin() * 1.3).to(device)


@pytest.mark.parametrize("d", [7, 96, 700])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_reference(d, weight_dtype, device):
    x = (torch.randn(5, d, device=device) * 3).to(torch.bfloat16)
    w = (torch.rand(d, device=device) + 0.5).to(weight_dtype)
    y, h = rms_norm(x, w, 1e-6)
    assert h is None and y.dtype == torch.promote_types(weight_dtype, torch.bfloat16)
    _ulp_close(y, rms_norm_ref(x, w, 1e-6))


def test_rms_norm_with_residual_returns_the_sum(device):
    base = (torch.randn(3, 2 * 333, device=device)).to(torch.bfloat16)
    x = base[:, ::2].contiguous()
    residual = base[:, 1::2].contiguous()
    w = (torch.rand(333, device=device) + 0.5).to(torch.bfloat16)
    y, h = rms_norm(x, w, 1e-5, residual=residual)
    torch.testing.assert_close(h, x + residual, rtol=0, atol=0)  # the bf16 add, bit for bit
    _ulp_close(y, rms_norm_ref(x + residual, w, 1e-5))


def test_rms_norm_reads_strided_rows(device):
    x = torch.randn(4, 200, device=device).to(torch.bfloat16)[:, 30:130]  # row stride 200
    w = torch.ones(100, device=device, dtype=torch.bfloat16)
    _ulp_close(rms_norm(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offset,rope_dim,width", [(13, 8, 21), (0, 64, 128)])
def test_rope_in_place_matches_reference(interleaved, offset, rope_dim, width, device):
    n, heads = 3, 19  # heads past one 16-head block
    x = torch.randn(n, heads, width, device=device).to(torch.bfloat16)
    positions = torch.tensor([0, 37, 99], device=device)
    cos, sin = _tables(100, rope_dim // 2, device)
    want = x.clone()
    want[..., offset:offset + rope_dim] = rotate_ref(x[..., offset:offset + rope_dim], cos[positions],
                                                     sin[positions], interleaved)
    got = rope_(x, positions, cos, sin, offset, rope_dim, interleaved)
    assert got is x
    torch.testing.assert_close(x[..., :offset], want[..., :offset], rtol=0, atol=0)  # untouched
    torch.testing.assert_close(x[..., offset + rope_dim:], want[..., offset + rope_dim:], rtol=0, atol=0)
    _ulp_close(x, want)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_mla_latent_write_matches_reference(interleaved, weight_dtype, device):
    n, c, r = 5, 64, 16
    kv = (torch.randn(n, c + r, device=device) * 2).to(torch.bfloat16)
    w = (torch.rand(c, device=device) + 0.5).to(weight_dtype)
    positions = torch.tensor([3, 0, 41, 42, 7], device=device)
    slots = torch.tensor([9, 2, 30, 31, 0], device=device)
    cos, sin = _tables(64, r // 2, device)
    got = torch.full((40, c + r), float("nan"), dtype=torch.bfloat16, device=device)
    want = got.clone()
    mla_latent_write(kv, w, 1e-6, positions, cos, sin, interleaved, slots, got)
    mla_latent_write_ref(kv, w, 1e-6, cos[positions], sin[positions], interleaved, slots, want)
    written = torch.zeros(40, dtype=torch.bool, device=device)
    written[slots] = True
    assert bool(got[~written].isnan().all())  # no other slot touched
    _ulp_close(got[written], want[written])


def test_bad_arguments_raise_value_error(device):
    x = torch.randn(2, 3, 10, device=device).to(torch.bfloat16)
    cos, sin = _tables(8, 4, device)
    positions = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="exceed"):
        rope_(x, positions, cos, sin, 4, 8, False)
    with pytest.raises(ValueError, match="rope_dim"):
        rope_(x, positions, cos, sin, 0, 6, False)
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm(torch.randn(2, 8, device=device), torch.ones(8, device=device), 1e-6)
