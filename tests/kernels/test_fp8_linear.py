"""FP8 block-scaled linear kernels (decode GEMV, prefill tl.dot GEMM) against the dequantise-then-linear
reference, at odd sizes with partial edge blocks, with and without K splits."""

import pytest
import torch

from hearth.kernels.fp8_linear import (
    GemmConfig,
    GemvConfig,
    check_weights,
    dequantize,
    fp8_gemm,
    fp8_gemv,
    fp8_linear,
    fp8_linear_reference,
)
from tests.kernels.conftest import rel_err


def _exact(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 product of x with the weight dequantised to x's dtype (the reference's rounding, no output rounding)."""
    return x.float() @ dequantize(w8, scale, x.dtype).float().T


def _weights(n: int, k: int, device, pow2: bool = True):
    w8 = (torch.randn(n, k) * 8).to(torch.float8_e4m3fn)
    rows, cols = -(-n // 128), -(-k // 128)
    if pow2:
        scale = torch.exp2(torch.randint(-10, -6, (rows, cols)).float())
    else:
        scale = torch.rand(rows, cols) * 1e-3 + 1e-4
    return w8.to(device), scale.to(device)


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("n,k", [(200, 300), (128, 640), (77, 129)])
@pytest.mark.parametrize("min_programs", [1, 10_000])  # no K split / as many splits as K allows
def test_gemv_matches_reference(device, m, n, k, min_programs):
    w8, scale = _weights(n, k, device)
    x = torch.randn(m, k, device=device).bfloat16()
    got = fp8_gemv(x, w8, scale, GemvConfig(block_n=16, block_k=128, min_programs=min_programs))
    want = _exact(x, w8, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, want) < 5e-3  # bf16 output rounding only: the sums are fp32


@pytest.mark.parametrize("m,n,k", [(40, 200, 300), (17, 130, 257)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_matches_reference(device, m, n, k, dtype):
    w8, scale = _weights(n, k, device, pow2=m % 2 == 0)
    x = torch.randn(m, k, device=device).to(dtype)
    got = fp8_gemm(x, w8, scale, GemmConfig(block_m=16, block_n=32, block_k=64, group_m=2, num_stages=1))
    want = _exact(x, w8, scale)
    assert got.dtype == dtype
    assert rel_err(got, want) < (5e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("m", [2, 5, 33])
def test_skinny_decode_batches_split_k(device, m):
    """The default tile for a few rows: one row tile and K split across programs (partials summed)."""
    w8, scale = _weights(70, 520, device)
    x = torch.randn(m, 520, device=device).bfloat16()
    assert rel_err(fp8_gemm(x, w8, scale), _exact(x, w8, scale)) < 5e-3


def test_fp8_linear_keeps_leading_dims_and_picks_a_path(device):
    w8, scale = _weights(96, 256, device)
    for rows in (1, 3, 70):  # GEMV, skinny GEMM, prefill GEMM
        x = torch.randn(rows, 1, 256, device=device).bfloat16()
        got = fp8_linear(x, w8, scale)
        assert got.shape == (rows, 1, 96)
        assert rel_err(got, fp8_linear_reference(x, w8, scale)) < 5e-3


def test_non_power_of_two_scales_equal_the_reference_rounding(device):
    """fp32 activations: the GEMM rounds W8 * s exactly as the reference's dequantisation does."""
    w8, scale = _weights(64, 200, device, pow2=False)
    x = torch.randn(20, 200, device=device)
    got = fp8_gemm(x, w8, scale, GemmConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_stages=1))
    assert rel_err(got, fp8_linear_reference(x, w8, scale)) < 1e-5


def test_bad_scale_shape_is_a_clear_error(device):
    w8, scale = _weights(200, 300, device)
    x = torch.randn(1, 300, device=device).bfloat16()
    with pytest.raises(ValueError, match="scale_inv must have shape"):
        fp8_gemv(x, w8, scale[:, :1].contiguous())
    with pytest.raises(ValueError, match="x has 299 features"):
        fp8_linear(torch.randn(1, 299, device=device).bfloat16(), w8, scale)


def test_weights_checked_once_still_checks_x(device):
    w8, scale = _weights(96, 256, device)
    check_weights(w8, scale)
    x = torch.randn(3, 256, device=device).bfloat16()
    assert rel_err(fp8_linear(x, w8, scale, weights_checked=True), _exact(x, w8, scale)) < 5e-3
    with pytest.raises(ValueError, match="does not fit the weight"):
        fp8_linear(torch.randn(1, 255, device=device).bfloat16(), w8, scale, weights_checked=True)
    with pytest.raises(ValueError, match="scale_inv must have shape"):
        check_weights(w8, scale[:, :1].contiguous())
