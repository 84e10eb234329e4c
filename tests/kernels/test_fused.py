"""Fused decode-step kernels (RMSNorm + residual, rotary in place, MLA latent write, the indexer's
query quantisation, the MoE router) against their torch references at small odd sizes. bf16 results
may differ from the reference by one bf16 ulp (the norm sums in another order; the GPU may fuse
products into FMAs); the router's ids are exact (ties: see ``test_router_ties``), its weights within
fp32 rounding; everything else is exact."""

import pytest
import torch

from hearth.kernels.fused import indexer_q_fp8, mla_latent_write, moe_route, rms_norm, rope_
from hearth.kernels.fused.reference import (
    indexer_q_fp8_ref,
    mla_latent_write_ref,
    moe_route_ref,
    rms_norm_ref,
    rotate_ref,
)


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



@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_into_another_buffer(interleaved, device):
    n, heads, nope, rope_dim = 3, 19, 24, 16
    x = torch.randn(n, heads, nope + rope_dim, device=device).to(torch.bfloat16)
    before = x.clone()
    positions = torch.tensor([5, 0, 63], device=device)
    cos, sin = _tables(64, rope_dim // 2, device)
    buf = torch.full((n, heads, 40 + rope_dim), float("nan"), dtype=torch.bfloat16, device=device)
    got = rope_(x, positions, cos, sin, nope, rope_dim, interleaved, out=buf[..., 40:])
    assert got.data_ptr() == buf[..., 40:].data_ptr()
    torch.testing.assert_close(x, before, rtol=0, atol=0)  # x only read
    assert bool(buf[..., :40].isnan().all())
    _ulp_close(buf[..., 40:], rotate_ref(x[..., nope:], cos[positions], sin[positions], interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads,rope_dim", [(19, 16), (64, 64)])
def test_indexer_q_fp8_matches_reference(heads, rope_dim, interleaved, device):
    n, d = 5, 128
    q = (torch.randn(n, heads, d, device=device) * torch.logspace(-5, 3, heads, device=device)[:, None])
    q = q.to(torch.bfloat16)
    q[1, 2] = 0  # an all-zero head: the amax floor
    raw = torch.randn(n, heads, device=device)
    positions = torch.tensor([0, 9, 77, 78, 3], device=device)
    cos, sin = _tables(80, rope_dim // 2, device)
    q8, w = indexer_q_fp8(q, raw, 0.0123, positions, cos, sin, interleaved)
    want8, want_w = indexer_q_fp8_ref(q, raw, 0.0123, cos[positions], sin[positions], interleaved)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (n, heads, d)
    # the rope may differ by one bf16 ulp (FMA), which can move an FP8 code by one step
    codes_equal = (q8.view(torch.uint8) == want8.view(torch.uint8)).float().mean()
    assert codes_equal >= 0.99, float(codes_equal)
    torch.testing.assert_close(q8.float(), want8.float(), rtol=0.07, atol=0)
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)  # power-of-two scales: exact


def test_indexer_q_fp8_without_rope_is_exact(device):
    q = (torch.randn(3, 7, 64, device=device) * 50).to(torch.bfloat16)  # heads not a power of two
    raw = torch.randn(3, 7, device=device)
    q8, w = indexer_q_fp8(q, raw, 0.5)
    want8, want_w = indexer_q_fp8_ref(q, raw, 0.5, None, None, False)
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8))
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)


_ROUTERS = {  # (experts, groups, top-k groups, top-k, sigmoid, top-2 group scores, bias, normalise, scale)
    "deepseek_v3": (256, 8, 4, 8, True, True, True, True, 2.5),
    "odd_groups": (64, 4, 2, 6, True, True, True, True, 1.5),
    "glm5_one_group": (256, 1, 1, 8, True, True, True, True, 2.5),
    "v2_softmax_groups": (160, 8, 3, 6, False, False, False, False, 16.0),
    "no_groups_160": (160, 1, 1, 6, False, False, False, True, 1.0),
    "groups_of_20": (160, 8, 3, 7, True, True, True, True, 1.0),
}


def _route_args(name: str, device):
    e, g, tg, k, sig, top2, has_bias, norm, scale = _ROUTERS[name]
    bias = torch.randn(e, device=device) * 0.1 if has_bias else None
    return e, bias, k, dict(sigmoid=sig, n_group=g, topk_group=tg, group_top2=top2, normalise=norm, scale=scale)


@pytest.mark.parametrize("name", list(_ROUTERS))
@pytest.mark.parametrize("tokens", [1, 7])
def test_router_matches_reference(name, tokens, device):
    e, bias, k, kw = _route_args(name, device)
    logits = torch.randn(tokens, e + 3, device=device)[:, 1:e + 1] * 3  # a strided view
    ids, weights = moe_route(logits, bias, k, **kw)
    want_ids, want_w = moe_route_ref(logits, bias, k, **kw)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, k)
    assert torch.equal(ids, want_ids)  # the same experts in the same order
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=0)


def test_router_near_ties_follow_the_values(device):
    """Choice values one fp32 ulp apart: logits 0 make every score exactly 0.5 and the bias
    0.25 + j * 2^-24 makes the choice 0.75 + j ulp."""
    e, k = 64, 6
    logits = torch.zeros(5, e, device=device)
    distinct = (0.25 + torch.randperm(e) * 2.0**-24).to(device)  # all different, neighbours 1 ulp apart
    few = (0.25 + torch.randint(0, 3, (e,)) * 2.0**-24).to(device)  # near ties and exact ties
    for kw in (dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=2)):
        ids, _ = moe_route(logits, distinct, k, sigmoid=True, **kw)
        assert torch.equal(ids, moe_route_ref(logits, distinct, k, sigmoid=True, **kw)[0])
        ids, _ = moe_route(logits, few, k, sigmoid=True, **kw)
        want, _ = moe_route_ref(logits, few, k, sigmoid=True, **kw)
        assert torch.equal(few[ids], few[want])  # the same values in the same order


def test_router_ties(device):
    """Exact ties: the lower expert (group) index wins and comes first. torch.topk leaves the order of
    equal values unspecified, so against it only the chosen values are compared."""
    logits = torch.tensor([[0.5, 2.0, 2.0, 0.1, 2.0, 0.2, 0.5, 0.5]], device=device)
    ids, w = moe_route(logits, None, 5, sigmoid=True, normalise=False)
    assert ids.tolist() == [[1, 2, 4, 0, 6]]
    want_ids, want_w = moe_route_ref(logits, None, 5, sigmoid=True, normalise=False)
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)
    # two groups of four with equal scores: group 0 is kept
    ids, _ = moe_route(torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]], device=device), None, 2,
                       sigmoid=True, n_group=2, topk_group=1)
    assert ids.tolist() == [[0, 1]]


def test_router_bad_arguments(device):
    logits = torch.randn(2, 12, device=device)
    with pytest.raises(ValueError, match="groups"):
        moe_route(logits, None, 2, sigmoid=True, n_group=5)
    with pytest.raises(ValueError, match="exceeds"):
        moe_route(logits, None, 7, sigmoid=True, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="logits must have dtype"):
        moe_route(logits.to(torch.bfloat16), None, 2, sigmoid=True)

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
