"""Expert offload benchmark (issue O1): per-layer MoE decode time on DeepSeek-V3.2-shaped layers.

Synthetic FP8 block-scaled experts (hidden 7168, 256 experts of 2048, top-8) for a few MoE layers in
pinned host memory. For batch 1 and 8 with uniform random routing it times, per MoE layer call:
(a) all experts resident on the GPU, (b) naive on-demand fetch (no cache, copy then compute),
(c) Hearth's cache (25% / 50% of the experts; LRU / LFU; with and without overlap), and prints
(d) the link floor = bytes fetched / 55 GB/s, the hit rate and the copy-stream busy share.
Correctness is checked first. Usage: python bench/bench_offload.py [--layers 4] [--steps 12] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.experts import OffloadedExperts, ResidentExperts

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 7168, 2048, 256, 8
LINK_GBPS = 55.0  # pinned host -> GPU, docs/offload.md


def build_store(layers: int) -> ExpertStore:
    """Random FP8 experts with power-of-two block scales, generated on the GPU, copied to the store."""
    store = ExpertStore(ExpertLayout(HIDDEN, INTER, torch.float8_e4m3fn), list(range(layers)), NUM_EXPERTS)
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = 16
    for layer in store.layers:
        w = store.weights(layer)
        for e0 in range(0, NUM_EXPERTS, chunk):
            for dst in (w.w13, w.w2):
                src = torch.randn((chunk, *dst.shape[1:]), device="cuda", generator=g) * 8  # (c, N, K)
                dst[e0:e0 + chunk].copy_(src.to(dst.dtype))
            for dst in (w.s13, w.s2):
                exp = torch.randint(-10, -7, (chunk, *dst.shape[1:]), device="cuda", generator=g)
                dst[e0:e0 + chunk].copy_(torch.exp2(exp.float()))
    torch.cuda.synchronize()
    return store


def routing(steps: int, layers: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [steps, L, T, K] uniform distinct experts per token, weights [steps, L, T, K] fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand((steps, layers, tokens, NUM_EXPERTS), device="cuda", generator=g)
    ids = scores.topk(TOP_K, dim=-1).indices
    w = torch.rand(ids.shape, device="cuda", generator=g)
    return ids, w / w.sum(-1, keepdim=True) * 2.5


class NaiveFetch:
    """Baseline (b): no cache, no overlap: copy the needed experts to staging slots, then compute."""

    def __init__(self, store: ExpertStore, max_experts: int):
        self.store = store
        self.buffer = torch.empty((max_experts, store.layout.record_bytes), dtype=torch.uint8, device="cuda")
        self.weights = store.layout.views(self.buffer)
        self.bytes_fetched = 0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        needed = list(dict.fromkeys(ids.flatten().tolist()))
        lut = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
        for slot, expert in enumerate(needed):
            self.buffer[slot].copy_(self.store.expert(layer, expert), non_blocking=True)
            lut[expert] = slot
        self.bytes_fetched += len(needed) * self.buffer.shape[1]
        ww = self.weights
        out = fused_moe(x, lut.cuda()[ids], w, ww.w13, ww.w2, ww.s13, ww.s2)
        return out.to(x.dtype)


def time_backend(backend, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> float:
    """Mean ms per MoE layer call over steps x layers (CUDA events around the whole sweep: a decode-like
    sequence where each call depends on the previous one's host-side routing)."""
    steps, layers = ids.shape[:2]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for s in range(steps):
        for l in range(layers):
            backend(l, x, ids[s, l], w[s, l])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (steps * layers)


def check_correctness(store: ExpertStore, resident: ResidentExperts) -> None:
    x = torch.randn(8, HIDDEN, device="cuda").bfloat16()
    ids, w = routing(1, 1, 8, seed=99)
    ww = resident._weights[0]
    for t in (1, 8):
        got = fused_moe(x[:t], ids[0, 0, :t], w[0, 0, :t], ww.w13, ww.w2, ww.s13, ww.s2)
        want = moe_reference(x[:t], ids[0, 0, :t], w[0, 0, :t], ww.w13, ww.w2, ww.s13, ww.s2)
        err = ((got - want).norm() / want.norm()).item()
        print(f"check fused_moe vs reference T={t}: rel err {err:.2e}")
        assert err < 2e-2 and not got.isnan().any()
    cache = ExpertCache(store, "cuda", slots_per_layer=64)
    off = OffloadedExperts(cache)
    for t in (1, 8):
        got, want = off(0, x[:t], ids[0, 0, :t], w[0, 0, :t]), resident(0, x[:t], ids[0, 0, :t], w[0, 0, :t])
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"check OffloadedExperts vs ResidentExperts T={t}: rel err {err:.2e}")
        assert err < 1e-2
    del cache, off


def link_bandwidth(store: ExpertStore) -> float:
    """GB/s of 32 one-expert pinned copies host -> GPU, back to back."""
    dst = torch.empty((32, store.layout.record_bytes), dtype=torch.uint8, device="cuda")
    dst[0].copy_(store.expert(0, 0))  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(32):
        dst[i].copy_(store.expert(0, i), non_blocking=True)
    end.record()
    end.synchronize()
    return dst.numel() / start.elapsed_time(end) / 1e6


def run_cache(store, x, ids, w, slots: int, policy: str, overlap: bool) -> dict:
    cache = ExpertCache(store, "cuda", slots_per_layer=slots, policy=policy)
    backend = OffloadedExperts(cache, overlap=overlap)
    half = ids.shape[0] // 2
    # NOTE: warm on the first half of the steps, time the second: timed routings were never seen.
    time_backend(backend, x, ids[:half], w[:half])
    cache.reset_stats()
    ids, w = ids[half:], w[half:]
    ms = time_backend(backend, x, ids, w)
    st = cache.stats()["total"]
    calls = ids.shape[0] * ids.shape[1]
    result = {"ms": ms, "hit_rate": st["hit_rate"], "bytes_per_call": st["bytes_fetched"] / calls,
              "copy_busy": st["copy_ms"] / (ms * calls),
              "copy_gbps": st["bytes_fetched"] / max(st["copy_ms"], 1e-9) / 1e6}
    result["floor_ms"] = result["bytes_per_call"] / (LINK_GBPS * 1e6)
    del backend, cache
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, layers {args.layers}, "
          f"expert {ExpertLayout(HIDDEN, INTER, torch.float8_e4m3fn).record_bytes / 1e6:.1f} MB")
    t0 = time.perf_counter()
    store = build_store(args.layers)
    print(f"store: {store.total_bytes / 2**30:.1f} GiB, pinned {store.pinned_bytes / 2**30:.1f} GiB, "
          f"built in {time.perf_counter() - t0:.1f} s; link {link_bandwidth(store):.1f} GB/s (one-expert copies)")
    resident = ResidentExperts(store, "cuda")
    check_correctness(store, resident)
    results = {}
    for tokens in (1, 8):
        ids, w = routing(2 * args.steps, args.layers, tokens, seed=tokens)
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        timed = ids[args.steps:], w[args.steps:]
        time_backend(resident, x, ids[:2], w[:2])
        row = {"resident": {"ms": time_backend(resident, x, *timed)}}
        naive = NaiveFetch(store, min(NUM_EXPERTS, tokens * TOP_K))
        time_backend(naive, x, ids[:2], w[:2])
        naive.bytes_fetched = 0
        ms = time_backend(naive, x, *timed)
        row["naive"] = {"ms": ms, "floor_ms": naive.bytes_fetched / (args.steps * args.layers) / (LINK_GBPS * 1e6)}
        del naive
        for frac in (0.25, 0.5):
            for policy, overlap in (("lru", False), ("lru", True), ("lfu", True)):
                name = f"cache{int(frac * 100)}_{policy}{'' if overlap else '_no_overlap'}"
                row[name] = run_cache(store, x, ids, w, int(NUM_EXPERTS * frac), policy, overlap)
        results[f"batch{tokens}"] = row
        base = row["resident"]["ms"]
        for name, r in row.items():
            extra = "".join(f", {k} {v:.3f}" for k, v in r.items() if k != "ms")
            print(f"T={tokens} {name:24s} {r['ms']:8.3f} ms/layer  x{r['ms'] / base:6.1f} vs resident{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
