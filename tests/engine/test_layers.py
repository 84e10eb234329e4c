"""Unit tests of the model building blocks: rope layouts and YaRN, FP8 simulation, Hadamard,
FP8 block dequantisation with partial edge blocks, FP8 linear layers with a bias."""

import math

import pytest
import torch

from hearth.engine.config import RopeConfig
from hearth.engine.models import layers
from hearth.engine.models.layers import (
    Fp8Linear,
    apply_rotary,
    dequantize_fp8_blocks,
    fp8_round_trip,
    hadamard_matrix,
    rope_inv_freq,
)
from hearth.engine.testing.tiny import quantize_fp8_blocks


def test_yarn_frequencies_follow_the_reference_ramp():
    """DeepSeek-V3.2: dims i <= 10 keep the base frequency, i >= 23 are divided by 40."""
    rope = RopeConfig(theta=10000.0, rope_type="yarn", factor=40, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0)
    inv = rope_inv_freq(rope, 64)
    base = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    assert torch.allclose(inv[:11], base[:11])
    assert torch.allclose(inv[23:], base[23:] / 40)
    assert rope.attention_factor == 1.0
    assert math.isclose(64**0 * (0.1 * math.log(40) + 1) ** 2, rope.softmax_mscale)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_preserves_norm_and_relative_position(interleaved):
    rope = RopeConfig(theta=10000.0)
    inv = rope_inv_freq(rope, 8)
    q, k = torch.randn(1, 8), torch.randn(1, 8)

    def rot(x, p):
        freqs = torch.tensor([float(p)])[:, None] * inv[None]
        return apply_rotary(x, freqs.cos(), freqs.sin(), interleaved)

    assert torch.allclose(rot(q, 5).norm(), q.norm(), atol=1e-5)
    # q.k depends only on the distance between positions
    assert torch.allclose((rot(q, 7) * rot(k, 3)).sum(), (rot(q, 14) * rot(k, 10)).sum(), atol=1e-5)


def test_interleaved_and_half_split_are_the_same_rotation_permuted():
    inv = rope_inv_freq(RopeConfig(theta=100.0), 8)
    x = torch.randn(3, 8)
    freqs = torch.arange(3).float()[:, None] * inv[None]
    inter = apply_rotary(x, freqs.cos(), freqs.sin(), True)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # pairs (2i, 2i+1) -> (i, i + 4)
    half = apply_rotary(x[:, perm], freqs.cos(), freqs.sin(), False)
    assert torch.allclose(inter[:, perm], half, atol=1e-6)


def test_fp8_round_trip_error_and_power_of_two_scales():
    x = torch.randn(4, 256) * 3
    y = fp8_round_trip(x, block=128)
    rel = ((y - x).abs() / x.abs().clamp_min(1e-3)).max()
    assert 0 < rel <= 2**-3  # e4m3: 3 mantissa bits; subnormals aside the error stays within 2^-4
    assert (y != x).any()


def test_hadamard_is_orthonormal():
    h = hadamard_matrix(32)
    assert torch.allclose(h @ h.T, torch.eye(32), atol=1e-6)
    with pytest.raises(ValueError):
        hadamard_matrix(24)


@pytest.mark.parametrize("shape", [(96, 64), (160, 200), (300, 129)])
def test_fp8_block_dequantization_with_partial_edge_blocks(shape):
    w = torch.randn(shape) * 0.1
    q, scale = quantize_fp8_blocks(w)
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # ue8m0: powers of two
    deq = dequantize_fp8_blocks(q, scale, (128, 128), torch.float32)
    assert ((deq - w).abs() <= w.abs() * 2**-3 + 1e-3).all()
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_blocks(q, torch.cat([scale, scale], 1), (128, 128), torch.float32)


@pytest.mark.parametrize("rows", [1, 7])  # the GEMV and the GEMM kernel
@pytest.mark.parametrize("kernels", [False, True])
def test_fp8_linear_adds_its_bias(monkeypatch, kernels, rows):
    """A kept-FP8 q/k/v projection of GLM-4.5 or Qwen3 has a bias: added after the FP8 product, on the
    per-call dequantisation and on the FP8 kernels (on the CPU under Triton's interpreter)."""
    device = torch.device("cuda" if kernels and torch.cuda.is_available() else "cpu")
    if kernels:
        monkeypatch.setattr(layers, "fp8_kernels_apply", lambda x, block: block == (128, 128))
    w8, scale = quantize_fp8_blocks(torch.randn(72, 200) * 0.1)
    w8, scale, bias = w8.to(device), scale.to(device), torch.randn(72, device=device)
    x = torch.randn(rows, 200, device=device)
    product = x @ dequantize_fp8_blocks(w8, scale, (128, 128), torch.float32).T
    biased = Fp8Linear(w8, scale, (128, 128), torch.float32, bias)(x)
    plain = Fp8Linear(w8, scale, (128, 128), torch.float32)(x)
    assert torch.allclose(biased, product + bias, atol=1e-4)
    assert torch.allclose(plain, product, atol=1e-4)
