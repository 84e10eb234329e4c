"""Fused indexer-key cache write (rope -> Hadamard -> ue8m0 FP8 -> paged store) vs the torch reference."""

import pytest
import torch

from hearth.kernels.indexer import indexer_k_cache_write
from hearth.kernels.indexer.reference import (
    apply_rope_ref,
    hadamard_matrix,
    indexer_k_cache_write_ref,
    read_indexer_k_cache,
)
from tests.kernels.conftest import rel_err, requires_cuda

POISON = 0xAB


def _rope_tables(max_pos: int, half: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _run_case(n, block_size, dtype, rope, hadamard, device, num_blocks=None):
    num_blocks = num_blocks or (n // block_size + 3)
    k = (torch.randn(n, 128) * 3).to(dtype).to(device)
    k[0, 5] = 40.0  # one outlier row
    pos = torch.randint(0, 4096, (n,), device=device)
    cos, sin = _rope_tables(4096, 32, device) if rope else (None, None)
    slots = torch.randperm(num_blocks * block_size)[:n].to(device)
    if n > 2:
        slots[1] = -1  # padding token: must not be written
    cache = torch.full((num_blocks, block_size * 132), POISON, dtype=torch.uint8, device=device)
    ref = cache.clone()
    kw = dict(
        positions=pos if rope else None, cos=cos, sin=sin, rope_interleaved=rope == "interleaved", hadamard=hadamard
    )
    indexer_k_cache_write(k, slots, cache, block_size, **kw)
    indexer_k_cache_write_ref(k, slots, ref, block_size, **kw)
    # bytes: the GPU's Hadamard accumulation order may flip a rare rounding; the interpreter is exact
    frac_equal = (cache == ref).float().mean().item()
    assert frac_equal >= 0.995, f"only {frac_equal:.4f} of cache bytes equal the reference"
    d1, s1 = read_indexer_k_cache(cache, block_size)
    d2, s2 = read_indexer_k_cache(ref, block_size)
    written = slots[slots >= 0].long()
    got = d1[written].float() * s1[written, None]
    want = d2[written].float() * s2[written, None]
    assert rel_err(got, want) < 1e-2  # fp8 values dequantised (one e4m3 step is 6-12% of a value)
    # independent check: dequantised keys approximate the unquantised transform (e4m3: ~3% rms)
    x = k.float()
    if rope:
        x = apply_rope_ref(x, pos, cos, sin, rope == "interleaved")
    if hadamard:
        x = x @ hadamard_matrix(128, device) * 128**-0.5
    assert rel_err(got, x[slots >= 0]) < 0.05
    # ue8m0: power-of-two scales with amax/scale in (224, 448]
    sc = s1[written]
    assert torch.equal(torch.exp2(torch.log2(sc).round()), sc)
    ratio = x[slots >= 0].abs().amax(-1) / sc
    assert bool((ratio <= 448 * 1.01).all()) and bool((ratio > 224 * 0.99).all())


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("rope", [None, "neox", "interleaved"])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_write_matches_reference(block_size, rope, hadamard, dtype, device):
    _run_case(37, block_size, dtype, rope, hadamard, device)


@pytest.mark.parametrize("n", [1, 63])
def test_cache_write_odd_sizes(n, device):
    _run_case(n, 16, torch.bfloat16, "neox", True, device)


def test_tiny_values_hit_the_amax_floor(device):
    cache = torch.full((2, 16 * 132), POISON, dtype=torch.uint8, device=device)
    ref = cache.clone()
    k = torch.full((3, 128), 1e-7, device=device)
    k[1] = 0.0
    slots = torch.tensor([0, 5, 17], device=device)
    indexer_k_cache_write(k, slots, cache, 16)
    indexer_k_cache_write_ref(k, slots, ref, 16)
    assert torch.equal(cache, ref)
    _, s = read_indexer_k_cache(cache, 16)
    assert torch.allclose(s[slots], torch.full((3,), 2.0**-22, device=device))  # 2^ceil(log2(1e-4/448))


@pytest.mark.parametrize("ring_pages", [1, 3])
def test_ring_slots_from_positions_equal_explicit_slots(ring_pages, device):
    """ring_pages: the kernel maps positions to ring slots itself, storing what the explicit slot
    mapping (page % ring_pages) * block_size + offset stores; the blocks after the ring are left alone."""
    bs, n = 16, 9
    k = torch.randn(n, 128, device=device).to(torch.bfloat16)
    pos = torch.tensor([1, 5, 15, 16, 31, 40, 47, 48, 100], device=device)  # across pages and ring wraps
    keep = torch.arange(n, device=device)  # distinct slots in a ring of 3 pages
    if ring_pages == 1:  # one ring page: keep distinct offsets
        keep = torch.tensor([0, 1, 2, 8], device=device)  # offsets 1, 5, 15, 4
    cos, sin = _rope_tables(128, 32, device)
    kw = dict(cos=cos, sin=sin, hadamard=True)
    ring = torch.full((ring_pages + 2, bs * 132), POISON, dtype=torch.uint8, device=device)
    explicit = ring.clone()
    indexer_k_cache_write(k[keep], pos[keep], ring, bs, positions=pos[keep], ring_pages=ring_pages, **kw)
    slots = (pos[keep] // bs) % ring_pages * bs + pos[keep] % bs
    indexer_k_cache_write(k[keep], slots, explicit, bs, positions=pos[keep], **kw)
    assert torch.equal(ring, explicit) and bool((ring[ring_pages:] == POISON).all())
    assert not torch.equal(ring, torch.full_like(ring, POISON))
    with pytest.raises(ValueError, match="ring_pages"):
        indexer_k_cache_write(k, pos, ring, bs, positions=pos, ring_pages=ring_pages + 3, **kw)


def test_hadamard_reference_is_orthogonal():
    h = hadamard_matrix(128)
    assert torch.equal(h @ h.T, 128 * torch.eye(128))
    assert torch.equal(h[1, :4], torch.tensor([1.0, -1.0, 1.0, -1.0]))  # natural (Sylvester) order


def test_rope_reference_matches_complex_rotation():
    x = torch.randn(5, 128)
    pos = torch.randint(0, 50, (5,))
    cos, sin = _rope_tables(50, 32, "cpu")
    rot = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[pos]  # (5, 32) unit complex
    inter = torch.view_as_real(torch.view_as_complex(x[:, :64].reshape(5, 32, 2)) * rot).reshape(5, 64)
    assert torch.allclose(apply_rope_ref(x, pos, cos, sin, True)[:, :64], inter, atol=1e-5)
    neox = torch.complex(x[:, :32], x[:, 32:64]) * rot
    assert torch.allclose(
        apply_rope_ref(x, pos, cos, sin, False)[:, :64], torch.cat([neox.real, neox.imag], -1), atol=1e-5
    )
    assert torch.equal(apply_rope_ref(x, pos, cos, sin, False)[:, 64:], x[:, 64:])


def test_layout_errors(device):
    k = torch.randn(4, 128, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="block_size"):
        indexer_k_cache_write(k, slots, torch.zeros(2, 48 * 132, dtype=torch.uint8, device=device), 48)
    with pytest.raises(ValueError, match="kv_cache"):
        indexer_k_cache_write(k, slots, torch.zeros(2, 16 * 128, dtype=torch.uint8, device=device), 16)
    with pytest.raises(ValueError, match="k must be"):
        indexer_k_cache_write(k[:, :64], slots, torch.zeros(2, 16 * 132, dtype=torch.uint8, device=device), 16)
    with pytest.raises(ValueError, match="dtype"):
        indexer_k_cache_write(k.half(), slots, torch.zeros(2, 16 * 132, dtype=torch.uint8, device=device), 16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rope", ["neox", "interleaved"])
def test_cache_write_real_shapes_gpu(rope):
    _run_case(4096, 64, torch.bfloat16, rope, True, torch.device("cuda"), num_blocks=200)
