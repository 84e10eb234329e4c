"""Fixed host overhead of one offloaded MoE-layer call: :class:`OffloadedExperts` on tiny experts
(hidden 64, inter 32, FP8 + block scales) so copies and expert math cost next to nothing, with
DeepSeek-V3-like counts (256 experts, top-8, a 64- or 128-slot cache per layer, T=1 and T=8), a fresh
uniform routing every call, layers taken in turn as in decode.

Two passes per configuration, after a warm-up that fills the caches:

- plain: median host microseconds per call (``perf_counter`` around the call, no instrumentation); on
  CUDA also the wall time with a device sync before and after each call.
- traced: the same calls with wrappers around the routing read-back (``tolist`` / ``item`` / ``cpu``),
  ``ExpertCache.acquire`` / ``_fetch`` and the expert-compute helper (nothing is added to the code
  under test; the wrappers exist only during this pass). Medians from the call's start of:
  routing on the host (the one sync), first copy enqueued (entry of the first ``_fetch``: its
  bookkeeping is a few dict updates), first compute launch; time inside the compute helper
  (``fused_moe`` launches on CUDA, the torch reference on the CPU) and after the last of them; host
  syncs and compute launches per call (syncs counted outside the compute helper).

    python bench/bench_offload_overhead.py [--device cpu|cuda] [--calls 400] [--tokens 1,8]
        [--slots 64,128] [--streaming halves|ring] [--skip-compute] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from hearth.offload import experts as experts_mod
from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertLayout, ExpertStore
from hearth.offload.experts import OffloadedExperts
from hearth.offload.fetch_plan import HALVES, STREAMING

SYNC_METHODS = ("tolist", "item", "cpu")


def build_store(hidden: int, inter: int, num_experts: int, layers: int, device: torch.device) -> ExpertStore:
    """FP8 experts with power-of-two block scales (the decode format), pinned when ``device`` is CUDA."""
    store = ExpertStore(ExpertLayout(hidden, inter, torch.float8_e4m3fn), range(layers), num_experts,
                        pin=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    for layer in store.layers:
        w = store.weights(layer)
        for dst in (w.w13, w.w2):
            dst.copy_((torch.randn(dst.shape, generator=g) * 8).to(dst.dtype))
        for dst in (w.s13, w.s2):
            dst.copy_(torch.exp2(torch.randint(-10, -7, dst.shape, generator=g).float()))
    return store


def routings(calls: int, tokens: int, num_experts: int, top_k: int, device: torch.device) -> tuple:
    """ids [calls, T, K] (distinct experts per token, uniform), weights [calls, T, K] fp32, x [T, D] bf16."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand((calls, tokens, num_experts), generator=g).topk(top_k, dim=-1).indices
    w = torch.rand(ids.shape, generator=g)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trace:
    """Timestamps (``perf_counter``) of the events of the current call; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[dict[str, float]] = []
        self.in_compute = 0
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.syncs = 0
        self.launches = 0
        self.compute_s = 0.0

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.perf_counter())

    def finish(self) -> None:
        end = time.perf_counter()
        row = {f"to_{k}_us": (v - self.t0) * 1e6 for k, v in self.marks.items()}
        row["compute_us"] = self.compute_s * 1e6
        row["after_compute_us"] = (end - self.marks["last_compute"]) * 1e6 if "last_compute" in self.marks else 0.0
        row.update(total_us=(end - self.t0) * 1e6, syncs=self.syncs, launches=self.launches)
        self.rows.append(row)

    @contextmanager
    def installed(self, cache: ExpertCache):
        """Wrap the routing read-back, the cache's acquire / _fetch and the compute helper while active."""
        saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
        into = experts_mod._experts_into
        acquire, fetch = cache.acquire, cache._fetch
        trace = self

        def counted(fn: Callable) -> Callable:
            def wrapper(t: torch.Tensor, *args, **kwargs):
                out = fn(t, *args, **kwargs)
                if not trace.in_compute and (t.is_cuda or trace.device.type == "cpu"):
                    trace.syncs += 1
                    trace.mark("routing")
                return out
            return wrapper

        def traced_acquire(*args, **kwargs):
            trace.mark("acquire")
            out = acquire(*args, **kwargs)
            trace.mark("acquired")
            return out

        def traced_fetch(*args, **kwargs):
            trace.mark("first_copy")
            return fetch(*args, **kwargs)

        def traced_into(*args, **kwargs):
            start = time.perf_counter()
            trace.mark("first_compute")
            trace.in_compute += 1
            try:
                return into(*args, **kwargs)
            finally:
                trace.in_compute -= 1
                trace.launches += 1
                trace.marks["last_compute"] = end = time.perf_counter()
                trace.compute_s += end - start

        try:
            for name in SYNC_METHODS:
                setattr(torch.Tensor, name, counted(saved[name]))
            experts_mod._experts_into = traced_into
            cache.acquire, cache._fetch = traced_acquire, traced_fetch
            yield self
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)
            experts_mod._experts_into = into
            del cache.acquire, cache._fetch  # back to the class's methods


def _skip_compute(monkey: bool):
    """Optionally replace the expert math by a no-op (the CPU reference dwarfs the overhead otherwise)."""
    into = experts_mod._experts_into

    @contextmanager
    def ctx():
        if monkey:
            experts_mod._experts_into = lambda *args, **kwargs: None
        try:
            yield
        finally:
            experts_mod._experts_into = into
    return ctx()


def median(rows: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def run_config(store: ExpertStore, slots: int, tokens: int, args, device: torch.device) -> dict:
    layers = len(store.layers)
    cache = ExpertCache(store, device, slots_per_layer=slots)
    # group_bytes=1: one compute launch per fetched expert, as with DeepSeek-V3's 44 MB experts
    backend = OffloadedExperts(cache, host_experts="off", group_bytes=args.group_bytes, streaming=args.streaming)
    warm = max(1, -(-2 * slots // (tokens * args.top_k))) * layers  # enough calls to fill every pool
    calls = warm + 2 * args.calls
    ids, w = routings(calls, tokens, store.num_experts, args.top_k, device)
    x = torch.randn(tokens, store.layout.hidden, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    batches = iter([(i % layers, ids[i], w[i]) for i in range(calls)])  # indexed here, not in the timed call

    def call() -> None:
        layer, ids_i, w_i = next(batches)
        backend(layer, x, ids_i, w_i)

    with _skip_compute(args.skip_compute):
        for _ in range(warm):
            call()
        sync(device)
        cache.reset_stats()
        host, wall = [], []
        for _ in range(args.calls):  # plain pass: the call as the engine makes it
            if device.type == "cuda":
                sync(device)
            start = time.perf_counter()
            call()
            host.append((time.perf_counter() - start) * 1e6)
            if device.type == "cuda":
                sync(device)
                wall.append((time.perf_counter() - start) * 1e6)
        trace = Trace(device)
        with trace.installed(cache):
            for _ in range(args.calls):
                sync(device)
                trace.reset()
                call()
                trace.finish()
        sync(device)
    st = cache.stats()["total"]
    rows = trace.rows
    result = {
        "slots": slots, "tokens": tokens, "hit_rate": st["hit_rate"],
        "misses_per_call": st["misses"] / (2 * args.calls),
        "host_us": statistics.median(host), "wall_us": statistics.median(wall) if wall else None,
        "traced_total_us": median(rows, "total_us"),
        "to_routing_us": median(rows, "to_routing_us"), "to_acquire_us": median(rows, "to_acquire_us"),
        "to_first_copy_us": median(rows, "to_first_copy_us"), "to_acquired_us": median(rows, "to_acquired_us"),
        "to_first_compute_us": median(rows, "to_first_compute_us"), "compute_us": median(rows, "compute_us"),
        "after_compute_us": median(rows, "after_compute_us"),
        "syncs_per_call": statistics.mean(r["syncs"] for r in rows),
        "launches_per_call": statistics.mean(r["launches"] for r in rows),
    }
    result["overhead_us"] = result["traced_total_us"] - result["compute_us"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=400, help="timed calls per pass")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--slots", default="64,128", help="cache slots per layer")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group-bytes", type=int, default=1, help="OffloadedExperts group_bytes (1: one per expert)")
    p.add_argument("--streaming", choices=STREAMING, default=HALVES,
                   help="OffloadedExperts streaming plan of calls larger than the pool (prefill: --tokens 4096)")
    p.add_argument("--skip-compute", action="store_true", help="no expert math (launch count still reported)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    store = build_store(args.hidden, args.inter, args.experts, args.layers, device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), torch "
          f"{torch.__version__}, {args.experts} experts of {store.layout.record_bytes} B, top-{args.top_k}, "
          f"{args.layers} layers, {args.calls} calls per pass, compute {'skipped' if args.skip_compute else 'on'}")
    print("us per call (medians) | host (plain pass) | wall | routing on host | first copy | first compute "
          "| in compute | after compute | traced total | total - compute | syncs | launches | hit")
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for slots in (int(s) for s in args.slots.split(",")):
            r = run_config(store, slots, tokens, args, device)
            results.append(r)
            wall = f"{r['wall_us']:.0f}" if r["wall_us"] is not None else "-"
            print(f"T={tokens} slots={slots:<4} | {r['host_us']:7.1f} | {wall} | {r['to_routing_us']:6.1f} | "
                  f"{r['to_first_copy_us']:6.1f} | {r['to_first_compute_us']:6.1f} | {r['compute_us']:7.1f} | "
                  f"{r['after_compute_us']:6.1f} | {r['traced_total_us']:7.1f} | {r['overhead_us']:7.1f} | "
                  f"{r['syncs_per_call']:.2f} | {r['launches_per_call']:.1f} | {r['hit_rate']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
