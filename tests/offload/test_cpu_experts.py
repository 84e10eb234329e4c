"""Missed experts on the host: the fetch-or-compute decision from given speeds, and the host expert
math against the kernels' torch reference (FP8 block-scaled with partial edge blocks, and bf16)."""

import pytest
import torch

from hearth.kernels.moe import moe_reference
from hearth.offload.cpu_experts import HostSpeeds, choose_host_experts, host_expert, measure_host_speeds
from hearth.offload.expert_store import ExpertLayout, ExpertStore

FAST_HOST = HostSpeeds(link_ms_per_expert=0.8, cpu_fixed_ms=0.1, cpu_ms_per_token=0.05, transfer_ms=0.05)
SLOW_HOST = HostSpeeds(link_ms_per_expert=0.82, cpu_fixed_ms=30.0, cpu_ms_per_token=1.3, transfer_ms=0.05)


def test_policies_on_and_off():
    assert choose_host_experts([1, 2], FAST_HOST, "on") == [True, True]
    assert choose_host_experts([1, 2], FAST_HOST, "off") == [False, False]
    assert choose_host_experts([1, 2], None, "auto") == [False, False]
    assert choose_host_experts([], FAST_HOST, "auto") == []
    with pytest.raises(ValueError):
        choose_host_experts([1], FAST_HOST, "sometimes")


def test_auto_fetches_when_the_host_is_slow():
    """FP8 DeepSeek-V3 experts on a 16-core host (dequantise + 3 GEMVs) versus 0.8 ms per copy."""
    assert choose_host_experts([1] * 6, SLOW_HOST) == [False] * 6


def test_auto_keeps_marginal_wins_on_the_link():
    """32 requests missing 80 experts of a layer: two on a slow host would end the call 2.5% sooner by
    the model; that win is below the least saving, so every miss is fetched (on the H200 such picks
    halved the sync step's throughput)."""
    assert choose_host_experts([1] * 80, SLOW_HOST) == [False] * 80
    assert sum(choose_host_experts([1] * 80, SLOW_HOST, min_saving=0.0)) == 2


def test_auto_balances_link_and_host():
    # 6 misses of 1 token: k on the host costs 0.05 + 0.15 k, the rest 0.8 (6 - k): best k = 5 (0.8 ms).
    assert sum(choose_host_experts([1] * 6, FAST_HOST)) == 5
    # The expert serving the most tokens is the one fetched.
    assert choose_host_experts([1, 1, 8, 1, 1, 1], FAST_HOST) == [True, True, False, True, True, True]
    # Equal times: fetch (the expert is cached for the next step).
    even = HostSpeeds(link_ms_per_expert=1.0, cpu_fixed_ms=1.0, cpu_ms_per_token=0.0, transfer_ms=0.0)
    assert choose_host_experts([1], even) == [False]


def _store(dtype, hidden, inter, num_experts=3) -> ExpertStore:
    store = ExpertStore(ExpertLayout(hidden, inter, dtype), [0], num_experts, pin=False)
    g = torch.Generator().manual_seed(0)
    w = store.weights(0)
    if dtype == torch.float8_e4m3fn:
        w.w13.copy_((torch.randn(w.w13.shape, generator=g) * 8).to(dtype))
        w.w2.copy_((torch.randn(w.w2.shape, generator=g) * 8).to(dtype))
        w.s13.copy_(torch.exp2(torch.randint(-9, -5, w.s13.shape, generator=g).float()))
        w.s2.copy_(torch.exp2(torch.randint(-9, -5, w.s2.shape, generator=g).float()))
    else:
        w.w13.copy_(torch.randn(w.w13.shape, generator=g) * 0.05)
        w.w2.copy_(torch.randn(w.w2.shape, generator=g) * 0.05)
    return store


@pytest.mark.parametrize(
    ("dtype", "hidden", "inter"),
    [(torch.float8_e4m3fn, 256, 128), (torch.float8_e4m3fn, 200, 72), (torch.bfloat16, 96, 40)],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_host_expert_matches_reference(dtype, hidden, inter, x_dtype):
    store = _store(dtype, hidden, inter)
    w = store.weights(0)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    for expert in range(3):
        got = host_expert(x, w, expert)
        ones = torch.ones(5, 1)
        want = moe_reference(x, torch.full((5, 1), expert), ones, w.w13, w.w2, w.s13, w.s2)
        assert got.dtype == torch.float32 and got.shape == (5, hidden) and not got.isnan().any()
        tol = 1e-5 if x_dtype == torch.float32 else 2e-2  # the reference runs bf16 matmuls for bf16 x
        assert ((got - want).norm() / want.norm()).item() < tol


def test_measure_host_speeds_without_a_gpu():
    speeds = measure_host_speeds(_store(torch.float8_e4m3fn, 256, 128), "cpu")
    assert speeds.link_ms_per_expert > 0 and speeds.transfer_ms == 0.0
    assert speeds.cpu_ms(1) > 0 and speeds.cpu_ms_per_token >= 0 and "ms/expert" in speeds.describe()
