"""OffloadedExperts / ResidentExperts equal a plain torch MoE over the checkpoint tensors (CPU)."""

import os

import pytest
import torch

from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertStore
from hearth.offload.experts import OffloadedExperts, ResidentExperts
from hearth.offload.fetch_plan import ACQUIRE, COMPUTE, RELEASE, plan_stream, slot_reuse
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
    backend = OffloadedExperts(cache, streaming="halves")
    events: list[str] = []
    acquire, compute = cache.acquire, backend._compute_round
    monkeypatch.setattr(cache, "acquire", lambda l, e: (events.append(f"acquire {len(e)}"), acquire(l, e))[1])
    monkeypatch.setattr(backend, "_compute_round", lambda *a: (events.append("compute"), compute(*a))[1])
    x, ids, w = _routing(torch.Generator().manual_seed(5), tokens=64)
    _assert_close(backend(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert events[:3] == ["acquire 2", "acquire 2", "compute"]  # round 2's copies before round 1's compute
    assert events.count("compute") == 6 and all(cache.refcount(1, e) == 0 for e in range(NUM_EXPERTS))


@pytest.mark.parametrize(("streaming", "slots", "depth"), [("halves", 5, 8), ("ring", 5, 8), ("ring", 8, 4)])
def test_prefill_follows_its_stream_plan(tmp_path, monkeypatch, streaming, slots, depth):
    """A long prompt needs all 12 experts: the call acquires, computes and releases its rounds in the
    order of its StreamPlan (one compute call per ring round), each round's copies go into the slots
    of the round ``ahead`` earlier (or fresh ones), exactly as :func:`slot_reuse` models, and the result
    equals the reference."""
    from hearth.offload import experts as experts_mod

    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=slots)
    backend = OffloadedExperts(cache, streaming=streaming, ring_depth=depth, host_experts="off")
    plan = plan_stream(NUM_EXPERTS, slots, streaming, depth)
    trace: list[tuple[str, int]] = []
    slots_of: dict[int, list[int]] = {}  # round -> the slots its lease got
    round_of: list = []  # round -> its lease
    last_release: dict[int, int] = {}  # slot -> round that last released it
    waits: list[list[int]] = []
    kernel_calls = [0]
    acquire, release, compute, into = cache.acquire, cache.release, backend._compute_round, experts_mod._experts_into

    def logged_acquire(layer, experts):
        lease = acquire(layer, experts)
        r = len(slots_of)
        slots_of[r] = list(lease.slots)
        round_of.append(lease)
        waits.append(sorted({last_release[s] for s in lease.slots if s in last_release}))
        trace.append((ACQUIRE, r))
        return lease

    def logged_release(lease, record=True):
        r = next(q for q, held in enumerate(round_of) if held is lease)
        trace.append((RELEASE, r))
        last_release.update(dict.fromkeys(lease.slots, r))
        return release(lease, record)

    def logged_compute(lease, *args):
        trace.append((COMPUTE, next(q for q, held in enumerate(round_of) if held is lease)))
        return compute(lease, *args)

    monkeypatch.setattr(cache, "acquire", logged_acquire)
    monkeypatch.setattr(cache, "release", logged_release)
    monkeypatch.setattr(backend, "_compute_round", logged_compute)
    monkeypatch.setattr(experts_mod, "_experts_into", lambda *a: (kernel_calls.__setitem__(0, kernel_calls[0] + 1),
                                                                  into(*a))[1])
    x, ids, w = _routing(torch.Generator().manual_seed(5), tokens=64)
    assert len(set(ids.flatten().tolist())) == NUM_EXPERTS
    _assert_close(backend(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert trace == plan.steps()
    assert waits == slot_reuse(plan, slots)
    if streaming == "ring":
        assert kernel_calls[0] == len(plan.rounds) and plan.ahead == slots // plan.rounds[0] > 2
    assert all(cache.refcount(1, e) == 0 for e in range(NUM_EXPERTS))


@pytest.mark.parametrize("streaming", ["halves", "ring"])
def test_streamed_prefill_reads_the_routing_back_once(tmp_path, monkeypatch, streaming):
    """No host wait inside the round loop: the only read-back of a streamed prefill call is the
    per-expert counts of its routing, before the first copy (the CPU reference kernel's own reads
    excluded)."""
    from hearth.offload import experts as experts_mod

    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=5)
    backend = OffloadedExperts(cache, streaming=streaming, host_experts="off")
    events: list[str] = []
    in_compute = [False]
    into, acquire = experts_mod._experts_into, cache.acquire

    def reader(name):
        original = getattr(torch.Tensor, name)

        def read(t, *args, **kwargs):
            if not in_compute[0]:
                events.append("read-back")
            return original(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    def compute(*args):
        in_compute[0] = True
        try:
            return into(*args)
        finally:
            in_compute[0] = False

    for name in ("tolist", "item", "cpu", "numpy"):
        reader(name)
    monkeypatch.setattr(experts_mod, "_experts_into", compute)
    monkeypatch.setattr(cache, "acquire", lambda l, e: (events.append("acquire"), acquire(l, e))[1])
    x, ids, w = _routing(torch.Generator().manual_seed(9), tokens=80)  # 320 pairs: the prefill path
    want = reference_moe(tensors, 1, x, ids, w)
    events.clear()
    out = backend(1, x, ids, w)
    assert events[0] == "read-back" and events.count("read-back") == 1 and events.count("acquire") > 2
    _assert_close(out, want, rtol=1e-5)


def test_result_does_not_depend_on_residency_or_grouping(tmp_path):
    """Every pair gets its own row, summed over k at the end: a cold cache, a warm one, one group per
    fetched expert, no overlap and a streamed call all give the same bits."""
    store, _ = _store(tmp_path, torch.float8_e4m3fn)
    x, ids, w = _routing(torch.Generator().manual_seed(6), tokens=3)
    x = x.bfloat16()
    outs = []
    for slots, overlap, group_bytes in ((12, True, 1), (12, False, 1 << 30), (5, True, 1), (3, True, 1 << 30)):
        backend = OffloadedExperts(ExpertCache(store, "cpu", slots_per_layer=slots), overlap=overlap,
                                   group_bytes=group_bytes)
        outs.append(backend(1, x, ids, w))  # cold
        outs.append(backend(1, x, ids, w))  # warm (or streamed again)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_fetched_experts_compute_group_by_group(tmp_path, monkeypatch):
    """Resident experts in one call first, then one call per fetched expert, largest first."""
    from hearth.offload import experts as experts_mod

    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=8)
    backend = OffloadedExperts(cache, group_bytes=1)
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [0, 6, 7, 3]])  # 0: 3 pairs, 1 and 3: 2, the rest 1
    w = torch.rand(3, 4, generator=torch.Generator().manual_seed(7))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(8))
    cache.release(cache.acquire(1, [4, 5]))  # resident before the call
    calls: list[int] = []
    into = experts_mod._experts_into
    monkeypatch.setattr(experts_mod, "_experts_into", lambda out, *a: (calls.append(out.shape[0]), into(out, *a)))
    _assert_close(backend(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert calls == [2, 3, 2, 2, 1, 1, 1]  # resident {4, 5}; then 0 (3 pairs), 1, 3, then 2, 6, 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_missed_experts_on_the_host(tmp_path, dtype):
    """host_experts='on': every miss is computed from the store on the host, nothing is fetched."""
    store, tensors = _store(tmp_path, dtype)
    cache = ExpertCache(store, "cpu", slots_per_layer=12)
    backend = OffloadedExperts(cache, host_experts="on")
    cache.release(cache.acquire(2, [0, 1, 2]))
    cache.reset_stats()
    x, ids, w = _routing(torch.Generator().manual_seed(9), tokens=4)
    _assert_close(backend(2, x, ids, w), reference_moe(tensors, 2, x, ids, w), rtol=1e-5)
    st = cache.stats()["layers"][2]
    assert st["misses"] == 0 and st["cpu_computed"] == len(set(ids.flatten().tolist()) - {0, 1, 2})
    assert cache.resident(2) == [0, 1, 2]


def test_auto_host_experts_is_off_without_a_link(tmp_path):
    store, _ = _store(tmp_path, torch.float32)
    assert OffloadedExperts(ExpertCache(store, "cpu", slots_per_layer=4)).host_experts == "off"
    with pytest.raises(ValueError, match="host_experts"):
        OffloadedExperts(ExpertCache(store, "cpu", slots_per_layer=4), host_experts="maybe")


@pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("streaming", ["halves", "ring"])
def test_kernel_offloaded_bitwise_equals_resident(tmp_path, streaming):
    """With the fused kernel: per-expert groups, streamed rounds (two halves or a ring of one-call
    rounds) and a resident run agree bit for bit."""
    store, _ = _store(tmp_path, torch.float8_e4m3fn)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resident = ResidentExperts(store, device, use_kernel=True)
    backend = OffloadedExperts(ExpertCache(store, device, slots_per_layer=5), use_kernel=True, host_experts="off",
                               group_bytes=1, streaming=streaming, ring_depth=2)
    g = torch.Generator().manual_seed(10)
    for tokens in (1, 3, 6, 40):  # 6 tokens need more than 5 experts: streamed; 40 the device pair sort
        x, ids, w = (t.to(device) for t in _routing(g, tokens))
        x = x.bfloat16()
        assert torch.equal(backend(2, x, ids, w), resident(2, x, ids, w))


@pytest.mark.parametrize("max_pairs", [0, 256])
def test_host_and_device_pair_sort_give_the_same_bits(tmp_path, monkeypatch, max_pairs):
    """Decode sorts the pairs on the host (one upload), prefill on the device: the same permutation,
    so the same bits, cold, warm and streamed."""
    from hearth.offload import experts as experts_mod

    store, _ = _store(tmp_path, torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(11)
    calls = [_routing(g, tokens) for tokens in (1, 3, 7)]
    outs = {}
    for limit in (max_pairs, 1 << 20):
        monkeypatch.setattr(experts_mod, "HOST_SORT_MAX_PAIRS", limit)
        for slots in (12, 5):  # 7 tokens need more than 5 experts: streamed
            backend = OffloadedExperts(ExpertCache(store, "cpu", slots_per_layer=slots), group_bytes=1)
            outs[limit, slots] = [backend(1, x.bfloat16(), ids, w) for x, ids, w in calls for _ in range(2)]
    for key, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs[1 << 20, 12])), key


def test_decode_call_reads_back_once_copies_first_uploads_once(tmp_path, monkeypatch):
    """A decode call: one read-back of the routing, then the copies (acquire) before any index is
    uploaded or any compute queued, then one upload of every index the call needs."""
    from hearth.offload import experts as experts_mod

    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=8)
    backend = OffloadedExperts(cache, group_bytes=1)
    cache.release(cache.acquire(1, [0, 1]))
    events: list[str] = []
    in_compute = [False]
    tolist, to_device, into = torch.Tensor.tolist, experts_mod._to_device, experts_mod._experts_into
    acquire = cache.acquire

    def logged_tolist(t, *args):
        if not in_compute[0]:
            events.append("read-back")
        return tolist(t, *args)

    def logged_into(*args):
        events.append("compute")
        in_compute[0] = True
        try:
            return into(*args)
        finally:
            in_compute[0] = False

    monkeypatch.setattr(torch.Tensor, "tolist", logged_tolist)
    monkeypatch.setattr(experts_mod, "_to_device", lambda *a: (events.append("upload"), to_device(*a))[1])
    monkeypatch.setattr(experts_mod, "_experts_into", logged_into)
    monkeypatch.setattr(cache, "acquire", lambda l, e: (events.append("acquire"), acquire(l, e))[1])
    ids = torch.tensor([[0, 2, 3, 1], [5, 0, 2, 6]])
    x, w = torch.randn(2, HIDDEN), torch.rand(2, 4)
    out = backend(1, x, ids, w)
    _assert_close(out, reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert events[:3] == ["read-back", "acquire", "upload"]
    assert events.count("read-back") == events.count("acquire") == events.count("upload") == 1
    assert events[3:] == ["compute"] * 5  # resident {0, 1}, then 2 (2 pairs), 3, 5, 6 one by one


def test_rejects_expert_ids_out_of_range(tmp_path):
    store, _ = _store(tmp_path, torch.float32)
    backend = OffloadedExperts(ExpertCache(store, "cpu", slots_per_layer=4))
    x, w = torch.randn(1, HIDDEN), torch.rand(1, 2)
    for bad in ([[0, NUM_EXPERTS]], [[-1, 3]]):
        with pytest.raises(ValueError, match="expert ids"):
            backend(1, x, torch.tensor(bad), w)
    assert all(backend.cache.refcount(1, e) == 0 for e in range(NUM_EXPERTS))


def test_host_shortcut_agrees_with_choose_host_experts():
    """``_host_may_win`` False must mean choose_host_experts keeps every miss on the link."""
    from hearth.offload.cpu_experts import HostSpeeds, choose_host_experts

    g = torch.Generator().manual_seed(12)
    backend = OffloadedExperts.__new__(OffloadedExperts)
    backend.host_experts = "auto"
    for _ in range(300):
        link, fixed, per_token, transfer = (torch.rand(4, generator=g) * torch.tensor([2.0, 10.0, 2.0, 1.0])).tolist()
        backend.host_speeds = speeds = HostSpeeds(link, fixed, per_token, transfer)
        n = int(torch.randint(1, 40, (1,), generator=g))
        tokens = torch.randint(1, 9, (n,), generator=g).tolist()
        if not backend._host_may_win(n):
            assert not any(choose_host_experts(tokens, speeds, "auto"))
    backend.host_experts = "on"
    assert backend._host_may_win(1) and not backend._host_may_win(0)


def test_one_slot_pool_streams_expert_by_expert(tmp_path):
    """A pool of one slot cannot hold the next round while the current one computes: the experts
    stream one at a time, the result is exact and nothing stays referenced."""
    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=1)
    x, ids, w = _routing(torch.Generator().manual_seed(10), tokens=6)
    _assert_close(OffloadedExperts(cache)(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert all(cache.refcount(1, e) == 0 for e in range(NUM_EXPERTS))


def test_call_streams_through_the_slots_other_leases_leave(tmp_path):
    """Another user (the runahead decoder) holds 4 of the 5 slots: the call reuses the experts it holds
    and streams every other expert through the one slot left; the other user's leases are untouched."""
    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=5)
    other = cache.acquire(1, [0, 1, 2, 3])
    assert cache.available(1) == 1
    x, ids, w = _routing(torch.Generator().manual_seed(11), tokens=64)  # all 12 experts
    _assert_close(OffloadedExperts(cache)(1, x, ids, w), reference_moe(tensors, 1, x, ids, w), rtol=1e-5)
    assert [cache.refcount(1, e) for e in range(NUM_EXPERTS)] == [1] * 4 + [0] * 8
    assert cache.stats()["layers"][1]["cpu_computed"] == 0
    cache.release(other)
    assert cache.available(1) == 5


def test_call_with_every_slot_held_elsewhere_computes_the_rest_on_the_host(tmp_path):
    """Every slot is held by another user: the experts it holds are computed on the device, every
    other one on the host from the store (host_experts off does not forbid this last resort)."""
    store, tensors = _store(tmp_path, torch.float32)
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    other = cache.acquire(1, [0, 1, 2])
    assert cache.available(1) == 0
    x, ids, w = _routing(torch.Generator().manual_seed(12), tokens=8)
    _assert_close(OffloadedExperts(cache, host_experts="off")(1, x, ids, w), reference_moe(tensors, 1, x, ids, w),
                  rtol=1e-5)
    needed = set(ids.flatten().tolist())
    assert cache.stats()["layers"][1]["cpu_computed"] == len(needed - {0, 1, 2})
    assert cache.resident(1) == [0, 1, 2] and all(cache.refcount(1, e) == 1 for e in (0, 1, 2))
    cache.release(other)


# gpt-oss's MXFP4 experts: held and fetched as MXFP4, computed from their dequantised float records.
def _mxfp4_store(tmp_path, dtype: torch.dtype = torch.float32) -> tuple[ExpertStore, dict, list[int]]:
    import json

    from safetensors.torch import load_file

    from hearth.engine.testing.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "gpt_oss", "gpt_oss", seed=4, mxfp4=True)
    config = json.loads((path / "config.json").read_text())
    layers = list(range(config["num_hidden_layers"]))
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    store = ExpertStore.from_stacked_safetensors(path, layers, dtype, config["swiglu_limit"])
    return store, tensors, layers


def _release_weights(tensors: dict, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(w13 [E, 2I, D] gate rows then up rows, w2 [E, D, I], b13, b2) of one layer as the release ships them."""
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4

    p = f"model.layers.{layer}.mlp.experts."
    gate_up = dequantize_mxfp4(tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"], dtype)
    down = dequantize_mxfp4(tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"], dtype)
    bias = tensors[p + "gate_up_proj_bias"].to(dtype)
    w13 = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)
    return w13, down, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1), tensors[p + "down_proj_bias"].to(dtype)


def test_mxfp4_store_holds_the_release_bytes_and_unpacks_to_its_weights(tmp_path):
    store, tensors, layers = _mxfp4_store(tmp_path)
    assert store.packing is not None and store.record_bytes == store.packing.record_bytes
    assert store.record_bytes < store.layout.record_bytes / 3  # fp32 weights here: 32 bits against 4.25
    assert store.total_bytes == len(layers) * store.num_experts * store.record_bytes
    with pytest.raises(ValueError, match="MXFP4"):
        store.weights(layers[0])
    for layer in layers:
        want = _release_weights(tensors, layer, torch.float32)
        got = store.layout.views(store.float_records(layer, "cpu"))
        for g, w in zip((got.w13, got.w2, got.b13, got.b2), want):
            assert torch.equal(g, w)
        one = store.expert_weights(layer, 5)
        assert torch.equal(one.w13[0], want[0][5]) and torch.equal(one.b2[0], want[3][5])


def test_mxfp4_cache_keeps_packed_records_in_its_slots(tmp_path):
    """Slots hold the store's MXFP4 records (the fused kernel reads them): a slot is the stored bytes,
    and its views (code bytes, e8m0 scales, float biases) are the release's weights."""
    from hearth.kernels.moe.mxfp4 import dequantize_mxfp4

    store, tensors, layers = _mxfp4_store(tmp_path)
    cache = ExpertCache(store, "cpu", slots_per_layer=3)
    assert cache.buffer.shape[1] == store.packing.record_bytes < store.layout.record_bytes / 3
    lease = cache.acquire(1, [6, 2, 7])
    want = _release_weights(tensors, 1, torch.float32)
    w = cache.weights
    assert w.w13.dtype == w.s13.dtype == torch.uint8
    for expert, slot in zip(lease.experts, lease.slots):
        assert torch.equal(cache.buffer[slot], store.expert(1, expert))
        assert torch.equal(dequantize_mxfp4(w.w13[slot], w.s13[slot], torch.float32), want[0][expert])
        assert torch.equal(dequantize_mxfp4(w.w2[slot], w.s2[slot], torch.float32), want[1][expert])
        assert torch.equal(w.b13[slot], want[2][expert])
    cache.release(lease)
    cache.release(cache.acquire(1, [2, 0]))  # one hit, one miss (evicting one)
    st = cache.stats()["layers"][1]
    assert st["misses"] == 4 and st["hits"] == 1
    assert st["bytes_fetched"] == 4 * store.packing.record_bytes  # MXFP4 bytes, not the float slots'


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_TRITON_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1"))])
def test_mxfp4_offloaded_and_host_computed_equal_resident(tmp_path, use_kernel):
    """Offloaded through a small cache (the fused kernel with gpt-oss's extras, or the torch reference)
    and with every miss computed on the host from the MXFP4 store: the resident result."""
    store, _, layers = _mxfp4_store(tmp_path)
    device = "cuda" if torch.cuda.is_available() and use_kernel else "cpu"
    resident = ResidentExperts(store, device, use_kernel=use_kernel)
    backend = OffloadedExperts(ExpertCache(store, device, slots_per_layer=3), use_kernel=use_kernel,
                               host_experts="off", group_bytes=1)
    on_host = OffloadedExperts(ExpertCache(store, device, slots_per_layer=3), use_kernel=use_kernel,
                               host_experts="on")
    g = torch.Generator().manual_seed(12)
    for tokens in (1, 2, 5):  # 5 tokens x top-2 need more than 3 slots: streamed
        x = torch.randn(tokens, store.layout.hidden, generator=g).to(device)
        ids = torch.stack([torch.randperm(store.num_experts, generator=g)[:2] for _ in range(tokens)]).to(device)
        w = torch.rand(tokens, 2, generator=g).to(device)
        want = resident(layers[1], x, ids, w)
        # NOTE: close, not equal: the resident call may take the kernel's other path (more pairs a slot)
        _assert_close(backend(layers[1], x, ids, w), want, rtol=1e-5)
        _assert_close(on_host(layers[1], x, ids, w), want, rtol=1e-5)
    assert on_host.cache.stats()["total"]["cpu_computed"] > 0
