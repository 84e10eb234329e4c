"""OffloadedExperts / ResidentExperts equal a plain torch MoE over the checkpoint tensors (CPU)."""

import os

import pytest
import torch

from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertStore
from hearth.offload.experts import OffloadedExperts, ResidentExperts
from tests.offload.ckpt_util import make_expert_tensors, reference_moe, write_checkpoint

LAYERS = [1, 2]
NUM_EXPERTS, HIDDEN, INTER, TOP_K = 12, 72, 40, 4
HAS_TRITON_DEVICE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _store(tmp_path, dtype: torch.dtype) -> tuple[ExpertStore, dict]:
    tensors = make_expert_tensors(LAYERS, NUM_EXPERTS, HIDDEN, INTER, dtype, seed=3)
    return ExpertStore.from_safetensors(write_checkpoint(tmp_path / "ckpt", tensors), LAYERS, NUM_EXPERTS), tensors


def _routing(g: torch.Generator, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])  # (T, K)
    w = torch.rand(tokens, TOP_K, generator=g)
    return x, ids, w


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert not got.isnan().any()
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < rtol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_offloaded_equals_reference(tmp_path, dtype, policy):
    store, tensors = _store(tmp_path, dtype)
    cache = ExpertCache(store, "cpu", slots_per_layer=5, policy=policy)  # 5 < 12 experts
    backend = OffloadedExperts(cache)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        layer = LAYERS[step % 2]
        x, ids, w = _routing(g, tokens=1 + 2 * step)  # 1..11 tokens: up to 12 distinct experts, > 5 slots
        out = backend(layer, x, ids, w)
        assert out.dtype == x.dtype and out.shape == x.shape
        _assert_close(out, reference_moe(tensors, layer, x, ids, w), rtol=1e-5)
    st = cache.stats()["total"]
    assert st["misses"] > 0 and st["hits"] > 0
    assert all(cache.refcount(l, e) == 0 for l in LAYERS for e in range(NUM_EXPERTS))


def test_no_overlap_mode_and_global_pool(tmp_path):
    store, tensors = _store(tmp_path, torch.float32)
    backend = OffloadedExperts(ExpertCache(store, "cpu", num_slots=6), overlap=False)
    x, ids, w = _routing(torch.Generator().manual_seed(1), tokens=3)
    _assert_close(backend(2, x, ids, w), reference_moe(tensors, 2, x, ids, w), rtol=1e-5)


def test_resident_equals_reference(tmp_path):
    store, tensors = _store(tmp_path, torch.float8_e4m3fn)
    backend = ResidentExperts(store, "cpu")
    x, ids, w = _routing(torch.Generator().manual_seed(2), tokens=4)
    x = x.bfloat16()
    _assert_close(backend(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=2e-2)


def test_rejects_bad_weights_dtype(tmp_path):
    store, _ = _store(tmp_path, torch.float32)
    x, ids, w = _routing(torch.Generator().manual_seed(2), tokens=2)
    with pytest.raises(ValueError, match="fp32"):
        ResidentExperts(store, "cpu")(1, x, ids, w.half())


@pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1")
def test_offloaded_with_kernel(tmp_path):
    store, tensors = _store(tmp_path, torch.float8_e4m3fn)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = OffloadedExperts(ExpertCache(store, device, slots_per_layer=5), use_kernel=True)
    g = torch.Generator().manual_seed(4)
    for tokens in (1, 5):
        x, ids, w = _routing(g, tokens)
        x = x.bfloat16()
        out = backend(1, x.to(device), ids.to(device), w.to(device)).cpu()
        _assert_close(out, reference_moe(tensors, 1, x, ids, w), rtol=2e-2)


def test_prefill_streams_through_two_halves_of_the_pool(tmp_path, monkeypatch):
    """A long prompt needs all 12 experts with a 5-slot pool: they stream in rounds of 2, the next
    round acquired (its copies started) before the current one computes; the result is exact."""
    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=5)
    backend = OffloadedExperts(cache)
    events: list[str] = []
    acquire, compute = cache.acquire, backend._compute
    monkeypatch.setattr(cache, "acquire", lambda l, e: (events.append(f"acquire {len(e)}"), acquire(l, e))[1])
    monkeypatch.setattr(backend, "_compute", lambda *a: (events.append("compute"), compute(*a))[1])
    x, ids, w = _routing(torch.Generator().manual_seed(5), tokens=64)
    _assert_close(backend(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert events[:3] == ["acquire 2", "acquire 2", "compute"]  # round 2's copies before round 1's compute
    assert events.count("compute") == 6 and all(cache.refcount(1, e) == 0 for e in range(NUM_EXPERTS))
