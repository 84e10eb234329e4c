"""GPU: pinned store, cache on the copy stream and OffloadedExperts at DeepSeek-V3 width (16 experts)."""

import pytest
import torch

from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.experts import OffloadedExperts, ResidentExperts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HIDDEN, INTER, NUM_EXPERTS, TOP_K = 7168, 2048, 16, 8


@pytest.fixture(scope="module")
def store() -> ExpertStore:
    s = ExpertStore(ExpertLayout(HIDDEN, INTER, torch.float8_e4m3fn), [0, 1], NUM_EXPERTS)
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in s.layers:
        w = s.weights(layer)
        for e in range(NUM_EXPERTS):
            w.w13[e].copy_((torch.randn(w.w13.shape[1:], device="cuda", generator=g) * 8).to(w.w13.dtype))
            w.w2[e].copy_((torch.randn(w.w2.shape[1:], device="cuda", generator=g) * 8).to(w.w2.dtype))
        w.s13.fill_(2.0**-8)
        w.s2.fill_(2.0**-8)
    return s


def test_store_is_pinned(store):
    assert store.is_pinned and store.expert(0, 3).is_pinned()


def test_offloaded_equals_resident(store):
    resident = ResidentExperts(store, "cuda")
    cache = ExpertCache(store, "cuda", slots_per_layer=6)
    offloaded = OffloadedExperts(cache)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step, tokens in enumerate((1, 1, 4, 8, 1)):
        layer = step % 2
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
        ids = torch.stack([torch.randperm(NUM_EXPERTS, device="cuda", generator=g)[:TOP_K] for _ in range(tokens)])
        w = torch.rand(tokens, TOP_K, device="cuda", generator=g)
        want, got = resident(layer, x, ids, w).float(), offloaded(layer, x, ids, w).float()
        assert not got.isnan().any()
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    st = cache.stats()["total"]
    assert st["misses"] > 0 and st["copy_ms"] > 0


def test_in_flight_request_is_merged(store):
    cache = ExpertCache(store, "cuda", slots_per_layer=4)
    first = cache.acquire(0, [5, 6])
    second = cache.acquire(0, [6])  # in flight or done: never a second copy
    assert second.slots == [first.slots[1]]
    second.wait()
    torch.testing.assert_close(cache.buffer[second.slots[0]].cpu(), store.expert(0, 6))
    st = cache.stats()["layers"][0]
    assert st["misses"] == 2 and st["hits"] + st["merged"] == 1
    cache.release(first)
    cache.release(second)
