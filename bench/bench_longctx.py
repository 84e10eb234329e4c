"""Long context on a small GPU at DeepSeek-V3.2 shapes: 64 indexer heads x 128,
FP8 indexer keys (132 B/token), FP8 MLA latents (656 B/token), 128 attention heads, k 2048, 61 layers.

    python bench/bench_longctx.py [--out DIR] [--contexts 32768,131072,524288] [--time-limit 330]
    python bench/bench_longctx.py --small        # CPU smoke test: tiny shapes, torch stand-ins

Sections, each printed as it finishes (the row format of docs/benchmarks.md) and written to DIR/bench_longctx.json:
  0. check: coarse-to-fine with every page a candidate == exact selection; tiered latents == gather.
  1. one layer of decode (indexer + top-k + sparse MLA) per context: (a) all on the GPU with the Triton
     kernels (indexer_decode_topk over the full paged FP8 key cache, sparse_mla_decode over the FP8
     latent cache), eager and in a CUDA graph; (b) tiered keys + tiered latents per budget
     (candidate_pages:hot_rows:cache_pages:summary_format[:lag]): coarse stage in torch, fine stage with
     the same Triton indexer over the device page cache, sparse_mla_decode reading the latent hot buffer.
     The tiered step has host syncs (candidate page ids, latent misses) and cannot be graphed: its
     time is wall time per step; "keys" is the GPU time from the key append to the end of the key
     selection (CUDA events: idle gaps while the host waits or launches count). With ":lag" the keys
     use the lagged candidate fetch (KeyTierConfig.lagged_fetch: a step scores the previous step's
     candidates, no host read of its own; the first step after the prefill is synchronous).
     Recall = |tiered selection & full-cache selection| / k against the same kernel over every key;
     with --recall-seeds N also on N - 1 more key sets (recall only, no timing), since recall varies
     with the data more than with the step (0.973 vs 0.995 at 128K c128).
     Device bytes per layer and per request (x61), page-cache reuse, latent hit rate, host->GPU bytes.
  2. a 61-layer decode stack per context: per layer the Triton indexer (F layers) + sparse MLA + a small
     bf16 MLP (hidden 7168 -> --mlp-inter -> 7168); attention/indexer queries are fixed per layer (the
     q/kv projections are not modelled). Modes: IndexCache at retention 1 (= the unmodified model,
     all on the GPU), 1/2, 1/4 (S layers reuse the last F layer's top-k and hold no indexer keys), and
     MLI at the same retentions (an F layer attends the previous F layer's selection while its own
     indexer runs on a side stream, joined after its attention). Timed as CUDA-graph replays (eager
     timing too), tok/s = 1 / step; with --planned also every layer on planned tiers (section 1p).
     CUDA-graph times are replays back to back (since 2026-12-02 third session; before, one replay
     between events with a sync, which added the graph's launch latency: both are logged).
  1p. (--planned) the kernel path of tiered keys + latents (hearth.offload.planned_tiers: coarse page
     scores, candidate pages, page / row residency and fetches from mapped pinned host memory, fine
     indexer, sparse MLA; no host sync): its read side (select + latent rows + attention at the
     context, this step's key and latent written) timed eagerly and as CUDA-graph replays against (a)
     graphed; recall against the full-cache selection; key bytes on the device. Replays repeat one
     step, so after the first its candidates are all cache hits: the eager steps over fresh queries
     (the first 24 of --steps) report the miss rate and recall. --candidate-topk picks the candidate
     pages' top-k kernels, one run each (sort; select, the default: the row in registers;
     single_pass) for an A/B in one call, --fine-topk the fine top-k (radix, one_launch) the same way.
  5. (--prefill-buffers: this section only) prefill of one long prompt in chunks (--prefill-chunk, the
     engine's max_num_batched_tokens) through --prefill-layers layers of tiered keys + latents on the
     kernel path: per layer the chunk's keys written into the layer's key history, the prefill indexer
     + top-k, the write-through, the chunk's latents appended, sparse MLA prefill over the latent
     history. "temporary": each layer and chunk reads its history back into a new device buffer
     (PlannedKeys/PlannedLatents.history, copies in stream order); "buffers": the two history buffers
     sized for --prefill-max-len (default: the largest context), layer j + 1 copied on a copy stream
     while layer j computes (hearth.offload.history_buffers). Reports wall time and the peak of GPU
     memory allocated / reserved above what was allocated before the tiers and buffers existed (the
     inputs of one chunk, shared by the modes, are excluded). The indexer's fp32 logits are in both,
     at most --prefill-logits-budget bytes at once (PREFILL_LOGITS_BUDGET: the chunk's query rows in
     blocks); "unbounded": the buffers again with one [chunk, context] block of logits (1 GiB at a
     2,048-token chunk and 128K), the peak before the budget.
  3. capacity: max concurrent 128K requests in --budget-gb of GPU memory for caches, COMPUTED as
     floor(budget / device bytes per request) from section 1 and 2's byte counts (not run).
  4. targets: key memory ratio, tiered slowdown, recall, MLI vs IndexCache at 1/2, capacity ratio.

Keys are SYNTHETIC with clustered structure (no trained DSA indexer fits this machine): runs of
32..511 tokens around 1 of 256 centroids, random-walk drift, noise 0.5, FP8 e4m3 with ue8m0 per-token
scales; decode queries sit near 4 centroids and drift slightly from step to step, so consecutive
steps select mostly the same pages. Latents are random (their values do not change the timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hearth.kernels.indexer import PREFILL_LOGITS_BUDGET
from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.kernels.sparse_mla.reference import quantize_latent_fp8
from hearth.kernels.tiered import CANDIDATE_TOPKS
from hearth.offload.coarse_index import PagePool, TopkMerger, exact_scores
from hearth.offload.history_buffers import HistoryBuffers, LayerSources
from hearth.offload.planned_tiers import PlannedKeyConfig, PlannedKeys, PlannedLatentConfig, PlannedLatents
from hearth.offload.tiered_keys import KeyTierConfig, TieredKeys
from hearth.offload.tiered_latents import LatentTierConfig, TieredLatents

BW = 4.278e12  # device copy ceiling, bytes/s (docs/benchmarks.md)
LAT_B, KEY_B = 656, 132  # FP8 latent and indexer-key bytes per token per layer
ATTN_HEADS, HIDDEN = 128, 7168
SM_SCALE = 0.13523378  # DeepSeek-V3.2 softmax scale (sparse_mla docs)
RESULT: dict = {"rows": [], "meta": {}}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(msg, flush=True)


def save(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_longctx.json").write_text(json.dumps(RESULT, indent=1, default=str))


def over_time(args, what: str) -> bool:
    if time.perf_counter() - T0 > args.time_limit:
        log(f"  SKIPPED (time limit {args.time_limit:.0f} s): {what}")
        RESULT["rows"].append(dict(section="skipped", what=what))
        return True
    return False


def emit(section: str, what: str, shape: str, t_s: float, base_s: float | None, nbytes: float, **extra) -> dict:
    gbs = nbytes / t_s / 1e9
    row = dict(section=section, what=what, shape=shape, us=t_s * 1e6, gbs=gbs, pct=100 * gbs * 1e9 / BW,
               base_us=base_s * 1e6 if base_s else None, ratio=base_s / t_s if base_s else None, **extra)
    RESULT["rows"].append(row)
    base = f"base {base_s * 1e6:10.1f} us  x{base_s / t_s:6.2f}" if base_s else "base         n/a"
    log(f"{what:34s} {shape:28s} {t_s * 1e6:10.1f} us {gbs:8.1f} GB/s {row['pct']:5.1f}%  {base}")
    return row


# ---- data -------------------------------------------------------------------------------------
def clustered_keys(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """(n, 128) fp32 keys in drifting runs around 256 centroids (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cent = torch.randn(256, 128, generator=g).to(device)
    lengths = torch.randint(32, 512, (n // 32 + 1,), generator=g)
    run = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:n].to(device)
    starts = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1])).to(device)
    walk = torch.cumsum(torch.randn(n, 128, generator=g).to(device) * 0.05, 0)
    keys = cent[torch.randint(0, 256, (lengths.numel(),), generator=g).to(device)][run]
    return keys + walk - walk[starts[run]] + 0.5 * torch.randn(n, 128, generator=g).to(device)


def queries(heads: int, steps: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, H, 128) queries near 4 centroids, drifting per step, and (H,) head weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)  # same centroids as clustered_keys(seed)
    cent = torch.randn(256, 128, generator=g)
    hot = cent[torch.randint(0, 256, (4,), generator=torch.Generator().manual_seed(seed + 1))]
    q0 = hot[torch.randint(0, 4, (heads,), generator=g)] + 0.7 * torch.randn(heads, 128, generator=g)
    drift = torch.cumsum(0.02 * torch.randn(steps, heads, 128, generator=g), 0)
    w = (torch.rand(heads, generator=g) - 0.2) / heads
    q = ((q0 + drift) / 128**0.5).to(torch.bfloat16).float()  # exactly representable in the kernel's bf16
    return q.to(device), w.to(device)


def fp8_latents(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """(n, 656) uint8 FP8 latent cache entries of random latents, built in chunks."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(n, LAT_B, dtype=torch.uint8, device=device)
    for i in range(0, n, 1 << 16):
        m = min(1 << 16, n - i)
        out[i:i + m] = quantize_latent_fp8(torch.randn(m, 576, generator=g, device=device).to(torch.bfloat16))
    return out


def key_pool(k8: torch.Tensor, ks: torch.Tensor, ps: int) -> PagePool:
    """The paged FP8 indexer-key cache (kernel layout) holding keys in order."""
    n = k8.shape[0]
    pool = PagePool(math.ceil(n / ps), ps, 128, "fp8", k8.device)
    idx = torch.arange(n, device=k8.device)
    pool.write(idx // ps, idx % ps, k8, ks)
    return pool


def exact_topk(q: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-torch exact selection over all keys (Indexer._select order), chunked over tokens."""
    merger = TopkMerger(1, min(k, k8.shape[0]), q.device)
    for i in range(0, k8.shape[0], 1 << 16):
        pos = torch.arange(i, min(i + (1 << 16), k8.shape[0]), device=q.device)
        merger.update(exact_scores(q[None], w[None], k8[i:i + (1 << 16)], ks[i:i + (1 << 16)]), pos)
    return merger.positions()[0]


# ---- timing -----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device):
    """(result, seconds) of one synchronised call."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def eager_time(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call, back to back (launch overhead included)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        times.append(timed(fn, device)[1])
    return statistics.median(times)


def graph_time(fn, reps: int) -> float | None:
    """Seconds per replay of fn captured in a CUDA graph, replayed back to back (the median over 5 runs of
    reps replays: the GPU time with the gaps between the graph's kernels, as when the step is one part of a
    bigger graph); None when capture fails. Also logs one replay between events with a sync (which adds
    the graph's launch latency: what an earlier version of this bench reported)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()  # warm up (Triton compiles) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        alone = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            alone.append(start.elapsed_time(end) * 1e-3)
        runs = []
        for _ in range(5):
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e-3 / reps)
        del graph
        t = statistics.median(runs)
        log(f"    (graph: {t * 1e6:.1f} us a replay back to back; {statistics.median(alone) * 1e6:.1f} us one replay "
            "with a sync)")
        return t
    except Exception as exc:  # noqa: BLE001 - report and fall back to eager timing
        log(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:160]}; eager timing only)")
        torch.cuda.synchronize()
        return None


def kernel_breakdown(fn, label: str, reps: int = 20) -> None:
    """``--profile``: GPU time per call of ``fn`` by kernel (torch.profiler over eager calls, after one
    untimed call), so the gap between two step times can be split into the kernels that make it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.self_device_time_total / reps, e.count / reps, e.key) for e in prof.key_averages()
                   if e.self_device_time_total > 0), reverse=True)
    total = sum(us for us, _, _ in rows)
    log(f"    kernels of {label}: {total:.1f} us of GPU time per call in {sum(n for _, n, _ in rows):.0f} kernels")
    for us, count, name in rows[:14]:
        log(f"      {us:8.1f} us  x{count:<4.0f} {name[:100]}")
    RESULT.setdefault("kernels", {})[label] = [dict(us=us, count=count, name=name) for us, count, name in rows]


# ---- ops: Triton kernels on CUDA, plain-torch stand-ins on the CPU -------------------------------
class Ops:
    """Indexer + top-k over a paged FP8 key cache and sparse MLA decode over a paged FP8 latent cache."""

    def __init__(self, device: torch.device, ps: int, k: int) -> None:
        self.device, self.ps, self.k = device, ps, k
        self.cuda = device.type == "cuda"

    def indexer(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                lens: torch.Tensor) -> torch.Tensor:
        """q (H, 128) fp32, w (H,), keys uint8 (P, ps*132), table (1, P) int32, lens (1,) -> (1, k) int32."""
        if self.cuda:
            from hearth.kernels.indexer import indexer_decode_topk

            qb = q.to(torch.bfloat16)[None, None]
            return indexer_decode_topk(qb, w.float()[None, None], keys, table, lens, self.ps, self.k).view(1, -1)
        pool = PagePool(keys.shape[0], self.ps, 128, "fp8", self.device)
        pool.buf = keys
        k8, ks = pool.tokens(table[0].long())
        n = int(lens[0])
        return exact_topk(q, w, k8[:n], ks[:n], self.k)[None].int()

    def attention(self, q: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor, table: torch.Tensor,
                  lens: torch.Tensor) -> torch.Tensor:
        """q (1, 128, 576) bf16, cache uint8 (blocks, ps, 656), idx (1, k) int32 -> (1, 128, 512)."""
        if self.cuda:
            from hearth.kernels.sparse_mla import sparse_mla_decode

            return sparse_mla_decode(q, cache, idx, table, lens, SM_SCALE)[0]
        rows = cache.view(-1, LAT_B)[idx[0].long().clamp(min=0)].float()  # stand-in: read the rows
        return (rows[:, :512].sum(0) * q[0, :, :512].float()).to(torch.bfloat16)[None]


# ---- 0. correctness ------------------------------------------------------------------------------
def check(device: torch.device, ps: int) -> None:
    """With every page a candidate the tiered selection equals the exact one (torch fine stage), the
    kernel fine stage picks the same set, and tiered latents return the rows of an in-memory gather."""
    n, heads = 3000, 64
    k8, ks = act_quant_ue8m0(clustered_keys(n, device, seed=99))
    q, w = queries(heads, 3, device, seed=99)
    want = exact_topk(q[0], w, k8, ks, 2048)
    for fine_kernel in (False, True) if device.type == "cuda" else (False,):
        tiers = TieredKeys(KeyTierConfig(page_size=ps, hot_pages=2, cache_pages=64, candidate_pages=10**6,
                                         fine_kernel=fine_kernel), device)
        tiers.append(k8[:1000], ks[:1000])
        tiers.append(k8[1000:], ks[1000:])
        got = tiers.select(q[0], w)[0]
        same = torch.equal(torch.sort(got).values, torch.sort(want).values) if fine_kernel else torch.equal(got, want)
        assert same, f"tiered selection (fine_kernel={fine_kernel}) differs from the exact selection"
    rows = fp8_latents(n, device, seed=5)
    lat = TieredLatents(LatentTierConfig(width=LAT_B, dtype=torch.uint8, hot_rows=2112), device)
    lat.append(rows)
    for _ in range(3):
        out, _ = lat.gather(want)
        assert torch.equal(out, rows[want]), "tiered latents differ from the in-memory gather"
        want = torch.randperm(n, device=device)[:2048]
    stages = "torch and Triton fine stage" if device.type == "cuda" else "torch fine stage"
    log(f"  check ok: tiered keys == exact top-k (ctx {n}, page {ps}, {stages}); tiered latents == gather")


# ---- 1. one layer ----------------------------------------------------------------------------------
def tiered_recall(ctx: int, kcfg: KeyTierConfig, seed: int, args, device: torch.device, ops: Ops) -> list[float]:
    """Recall per decode step of tiered keys alone on the key set of `seed` (no latents, no timing)."""
    steps = args.steps if ctx <= 131072 else max(6, args.steps // 3)
    n = ctx + steps
    k8, ks = act_quant_ue8m0(clustered_keys(n, device, seed=seed))
    q, w = queries(args.heads, steps, device, seed=seed)
    pool = key_pool(k8, ks, args.page_size)
    table = torch.arange(pool.num_pages, device=device, dtype=torch.int32)[None]
    tiers = TieredKeys(kcfg, device)
    tiers.append(k8[:ctx], ks[:ctx])
    recalls = []
    for s in range(steps):
        tiers.append(k8[ctx + s:ctx + s + 1], ks[ctx + s:ctx + s + 1])
        sel = tiers.select(q[s], w)[0]
        ref = ops.indexer(q[s], w, pool.buf, table, torch.tensor([ctx + s + 1], device=device, dtype=torch.int32))
        ref = ref[0].long()
        recalls.append(float(torch.isin(sel, ref[ref >= 0]).float().sum() / (ref >= 0).sum()))
    return recalls


def run_layer(ctx: int, budgets: list[tuple[int, int, int | None, str, bool]], args, device: torch.device,
              ops: Ops) -> dict:
    """Section 1 at one context; returns the numbers sections 3 and 4 use."""
    ps, k, heads, layers = args.page_size, args.topk, args.heads, args.layers
    steps = args.steps if ctx <= 131072 else max(6, args.steps // 3)
    n = ctx + steps
    k8, ks = act_quant_ue8m0(clustered_keys(n, device, seed=ctx))  # (n, 128) e4m3, (n,) fp32
    latents = fp8_latents(n, device, seed=ctx)  # (n, 656)
    q, w = queries(heads, steps, device, seed=ctx)
    q_attn = (torch.randn(1, ATTN_HEADS, 576, device=device) / 8).to(torch.bfloat16)
    pool = key_pool(k8, ks, ps)
    n_blocks = math.ceil(n / ps)
    lat_cache = torch.zeros(n_blocks * ps, LAT_B, dtype=torch.uint8, device=device)
    lat_cache[:n] = latents
    lat_cache = lat_cache.view(n_blocks, ps, LAT_B)
    table = torch.arange(n_blocks, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device=device, dtype=torch.int32)
    shape = f"ctx{ctx // 1024}K H{heads} k{k} p{ps}"

    def full_step() -> torch.Tensor:
        sel = ops.indexer(q[0], w, pool.buf, table, lens)
        return ops.attention(q_attn, lat_cache, sel, table, lens)

    t_eager = eager_time(full_step, device, reps=20 if ops.cuda else 2)
    t_graph = graph_time(full_step, reps=50) if ops.cuda else None
    if args.profile and ops.cuda:
        kernel_breakdown(full_step, f"all on GPU {ctx // 1024}K")
    keys_dev, lat_dev = ctx * KEY_B, ctx * LAT_B
    read = ctx * KEY_B + k * LAT_B
    res = dict(ctx=ctx, all_eager=t_eager, all_graph=t_graph, all_key_bytes=keys_dev, all_lat_bytes=lat_dev,
               tiered=[])
    emit("layer", "(a) all on GPU, eager", shape, t_eager, None, read, key_mb=keys_dev / 2**20,
         latent_mb=lat_dev / 2**20, request_gb=(keys_dev + lat_dev) * layers / 2**30)
    if t_graph:
        emit("layer", "(a) all on GPU, CUDA graph", shape, t_graph, None, read)
    log(f"    all on GPU: keys {keys_dev / 2**20:.1f} MB + latents {lat_dev / 2**20:.1f} MB per layer, "
        f"{(keys_dev + lat_dev) * layers / 2**30:.2f} GB per request ({layers} layers)")

    for cand, hot_rows, cache, summary, lag in budgets:
        if over_time(args, f"layer tiered c{cand} hot{hot_rows} ctx {ctx}{' lag' if lag else ''}"):
            break
        hot_rows = math.ceil(hot_rows / ps) * ps  # the hot buffer doubles as a paged kernel cache
        kcfg = KeyTierConfig(page_size=ps, cache_pages=cache, candidate_pages=cand, topk=k, summary_format=summary,
                             fine_kernel=ops.cuda, lagged_fetch=lag)
        cache = kcfg.cache_pages
        label = f"c{cand} cache{cache} {summary}" + (" lag" if lag else "")
        key_events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)] if ops.cuda else None
        tiers = TieredKeys(kcfg, device)
        tiers.append(k8[:ctx], ks[:ctx])
        lat = TieredLatents(LatentTierConfig(width=LAT_B, dtype=torch.uint8, hot_rows=hot_rows), device,
                            initial_rows=n)
        lat.append(latents[:ctx])
        hot_table = torch.arange(hot_rows // ps, device=device, dtype=torch.int32)[None]
        hot_lens = torch.tensor([hot_rows], device=device, dtype=torch.int32)

        def tiered_step(p: int, s: int, tiers=tiers, lat=lat, hot_table=hot_table, hot_lens=hot_lens,
                        key_events=key_events) -> torch.Tensor:
            if key_events:
                key_events[s][0].record()
            tiers.append(k8[p:p + 1], ks[p:p + 1])
            sel = tiers.select(q[s], w)
            if key_events:
                key_events[s][1].record()
            lat.append(latents[p:p + 1])
            slots = lat.slots(sel[0])
            ops.attention(q_attn, lat.hot.view(-1, ps, LAT_B), slots.int()[None], hot_table, hot_lens)
            return sel

        times, recalls = [], []
        for s in range(steps):
            p = ctx + s
            sel, dt = timed(lambda p=p, s=s: tiered_step(p, s), device)
            times.append(dt)
            if ops.cuda or s % max(1, steps // 3) == 0 or s == steps - 1:
                ref = ops.indexer(q[s], w, pool.buf, table, torch.tensor([p + 1], device=device, dtype=torch.int32))
                ref = ref[0].long()
                recalls.append(float(torch.isin(sel[0], ref[ref >= 0]).float().sum() / (ref >= 0).sum()))
        warm = times[len(times) // 4:]
        t_tier = statistics.median(warm)
        t_keys = statistics.median([a.elapsed_time(b) * 1e-3 for a, b in key_events[len(times) // 4:]]) \
            if key_events else None
        seed_recalls = [min(recalls)] + [min(tiered_recall(ctx, kcfg, ctx + 1000 * j, args, device, ops))
                                         for j in range(1, args.recall_seeds)]
        ksx, lsx = tiers.stats(), lat.stats()
        key_b, lat_b = tiers.device_bytes(), lat.config.device_bytes
        read_t = kcfg.summary_bytes * tiers.num_cold_pages + (cand + kcfg.hot_pages) * kcfg.page_bytes + k * LAT_B
        row = emit("layer", f"(b) tiered {label} hot{hot_rows}", shape, t_tier, t_eager, read_t,
                   vs_graph=(t_graph / t_tier) if t_graph else None, key_mb=key_b / 2**20, latent_mb=lat_b / 2**20,
                   request_gb=(key_b + lat_b) * layers / 2**30, key_ratio=keys_dev / key_b,
                   recall=min(recalls), recall_mean=sum(recalls) / len(recalls), page_reuse=ksx["page_reuse_rate"],
                   latent_hit=lsx["hit_rate"], h2d_kb_step=(ksx["bytes_h2d"] + lsx["bytes_h2d"]) / steps / 1024,
                   selection_overlap=ksx["selection_overlap"], steps=steps, recall_seeds=seed_recalls,
                   summary_format=summary, summary_mb=(key_b - (cache + kcfg.hot_pages) * kcfg.page_bytes) / 2**20,
                   lagged=lag, keys_us=t_keys * 1e6 if t_keys else None, candidate_reads=ksx["candidate_reads"],
                   lagged_steps=ksx["lagged_steps"])
        res["tiered"].append(dict(label=label, cand=cand, cache=cache, hot=hot_rows, t=t_tier, key_bytes=key_b,
                                  lat_bytes=lat_b, recall=row["recall"], recall_mean=row["recall_mean"],
                                  recall_seeds=min(seed_recalls)))
        log(f"    keys {key_b / 2**20:.2f} MB/layer ({keys_dev / key_b:.2f}x less than all on GPU; pools "
            f"{(cache + kcfg.hot_pages) * kcfg.page_bytes / 2**20:.2f} + summaries etc. {row['summary_mb']:.2f}), "
            f"recall min over {len(seed_recalls)} key sets {min(seed_recalls):.4f} "
            f"{[round(r, 4) for r in seed_recalls]}")
        log(f"    latents "
            f"{lat_b / 2**20:.2f} MB/layer, {row['request_gb']:.3f} GB/request; recall min {row['recall']:.4f} "
            f"mean {row['recall_mean']:.4f}; page reuse {row['page_reuse']:.3f}; latent hit {row['latent_hit']:.3f}; "
            f"h2d {row['h2d_kb_step']:.0f} KB/step; overlap {row['selection_overlap']:.3f}; "
            f"slowdown vs eager x{t_tier / t_eager:.2f}" + (f", vs graph x{t_tier / t_graph:.2f}" if t_graph else ""))
        log(f"    key part of the step {f'{t_keys * 1e6:.1f} us' if t_keys else 'n/a'} (GPU events); "
            f"{ksx['candidate_reads']} blocking candidate reads, {ksx['lagged_steps']} lagged steps in {steps}")
    return res


def run_planned(ctx: int, budgets: list[tuple[int, int, int | None, str, bool]], args, device: torch.device,
                base: dict, candidate_topk: str, fine_topk: str = "one_launch") -> None:
    """Section 1p at one context (CUDA): planned tiers against all on the GPU (base = run_layer's result),
    the candidate pages picked by ``candidate_topk``."""
    from hearth.kernels.sparse_mla import sparse_mla_decode

    ps, k, heads = args.page_size, args.topk, args.heads
    steps = min(args.steps, 24)
    n = ctx + steps
    k8, ks = act_quant_ue8m0(clustered_keys(n, device, seed=ctx))
    latents = fp8_latents(n, device, seed=ctx)
    q, w = queries(heads, steps, device, seed=ctx)
    q8, qs = act_quant_ue8m0(q)  # the engine's FP8 queries, scale folded into the head weights
    wq = (w * qs).float().contiguous()  # (steps, H), as the engine's indexer_q_fp8 hands them to select
    q_attn = (torch.randn(1, ATTN_HEADS, 576, device=device) / 8).to(torch.bfloat16)
    pool = key_pool(k8, ks, ps)
    table = torch.arange(pool.num_pages, device=device, dtype=torch.int32)[None]
    shape = f"ctx{ctx // 1024}K H{heads} k{k} p{ps}"
    t_base = base["all_graph"] or base["all_eager"]
    for cand, hot_rows, cache, _, _ in budgets:
        if over_time(args, f"planned c{cand} {candidate_topk} {fine_topk} ctx {ctx}"):
            break
        kcfg = PlannedKeyConfig(page_size=ps, hot_pages=4, candidate_pages=cand, cache_pages=cache or cand, topk=k,
                                candidate_topk=candidate_topk, fine_topk=fine_topk)
        lcfg = PlannedLatentConfig.from_hot_rows(hot_rows, k, ps, width=LAT_B, dtype=torch.uint8)
        keys, lat = filled_planned_tiers(kcfg, lcfg, ctx, n, k8, ks, latents, device)
        state = {}

        def read_side(s: int, keys=keys, lat=lat, state=state) -> tuple[torch.Tensor, torch.Tensor]:
            sel = keys.select(q8[s], wq[s], state["n"])
            slots = lat.slots(sel[0], state["n"])
            return sparse_mla_decode(q_attn, lat.paged(), slots[None], lat.table, lat.lens, SM_SCALE)[0], sel

        recalls, misses, times = [], [], []
        for s in range(steps):
            p = ctx + s
            slot = keys.ring_slot(p)
            keys.dev.write(torch.tensor([slot // ps], device=device), torch.tensor([slot % ps], device=device),
                           k8[p:p + 1], ks[p:p + 1])
            keys.commit()
            lat.append(latents[p:p + 1])
            state["n"] = torch.tensor([p + 1], device=device, dtype=torch.int32)
            (_, sel), dt = timed(lambda s=s: read_side(s), device)
            times.append(dt)
            misses.append(int(keys.plan.n_miss))
            ref = Ops(device, ps, k).indexer(q[s], w, pool.buf, table, state["n"])[0].long()
            recalls.append(float(torch.isin(sel[0].long(), ref[ref >= 0]).float().sum() / (ref >= 0).sum()))
        t_eager = statistics.median(times[len(times) // 4:])
        t_graph = graph_time(lambda: read_side(steps - 1)[0], reps=50)
        t = t_graph or t_eager
        if args.profile:
            kernel_breakdown(lambda: read_side(steps - 1)[0],
                             f"planned c{cand} {candidate_topk} {fine_topk} {ctx // 1024}K")
        key_b = keys.device_bytes()
        emit("layer", f"(p) planned c{cand} cache{kcfg.cache_pages} hot{lcfg.ring_rows + lcfg.cache_rows} "
             f"{kcfg.candidate_topk} {kcfg.fine_topk}", shape,
             t, t_base, kcfg.page_bytes * (cand + kcfg.hot_pages) + k * LAT_B, eager_us=t_eager * 1e6,
             graph_us=t_graph * 1e6 if t_graph else None, vs_all_graph=t / t_base, recall=min(recalls),
             recall_mean=sum(recalls) / len(recalls), key_mb=key_b / 2**20,
             key_ratio=base["all_key_bytes"] / key_b, page_misses_per_step=sum(misses[1:]) / max(1, steps - 1))
        per_step = sum(misses[1:]) / max(1, steps - 1)
        base.setdefault("planned", []).append(dict(label=f"c{cand} {kcfg.candidate_topk} {kcfg.fine_topk}",
                                                   slowdown=t / t_base, recall=min(recalls),
                                                   key_ratio=base["all_key_bytes"] / key_b))
        log(f"    planned: x{t / t_base:.2f} of all-on-GPU {'graph' if base['all_graph'] else 'eager'} "
            f"(target <= 1.15); recall min {min(recalls):.4f} (>= 0.99); keys {key_b / 2**20:.2f} MB/layer, "
            f"{base['all_key_bytes'] / key_b:.2f}x less (>= 4); page misses/step {per_step:.1f}")


# ---- 5. prefill through two history buffers -------------------------------------------------------
def prefill_chunk_layer(keys: PlannedKeys, lat: PlannedLatents, buffers: HistoryBuffers | None, layer: int,
                        first: int, chunk: dict, args, logits_budget: int | None = None) -> None:
    """One layer of one prefill chunk, as hearth.engine.models.dsa_kernels runs it for a tiered request
    (``logits_budget``: the indexer's, default PREFILL_LOGITS_BUDGET)."""
    from hearth.kernels.indexer import indexer_prefill_topk
    from hearth.kernels.sparse_mla import sparse_mla_prefill

    ps, n = args.page_size, chunk["rows"].shape[0]
    lat.append(chunk["rows"])  # (buffers: also into the layer's latent history, staged by begin)
    history = keys.history(n) if buffers is None else buffers.keys(layer, "r")
    pool = PagePool(history.shape[0], ps, 128, "fp8", history.device)
    pool.buf = history
    pos = chunk["positions"][:n] + first
    pool.write(pos // ps, pos % ps, chunk["k8"], chunk["ks"])
    table = torch.arange(history.shape[0], dtype=torch.int32, device=history.device)
    picked = indexer_prefill_topk(chunk["q8"], chunk["w"], history, table, first + n, ps, args.topk,
                                  logits_budget=logits_budget)
    keys.commit_chunk(history, n)
    latents = lat.history() if buffers is None else buffers.latents(layer, "r")
    sparse_mla_prefill(chunk["q"], latents, picked, table[:latents.shape[0]], pos.to(torch.int32), SM_SCALE)


UNBOUNDED_LOGITS = 1 << 62  # a chunk's whole [chunk, context] logits in one block


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def run_prefill(ctx: int, args, device: torch.device, heads_attn: int, warmup: bool = False) -> dict:
    """Section 5 at one prompt length: prefill time and peak GPU memory, temporary vs two buffers, and the
    buffers with the indexer's logits unbounded (one [chunk, context] fp32 block, as before the budget)."""
    ps, n, layers = args.page_size, args.prefill_chunk, args.prefill_layers
    g = torch.Generator(device=device).manual_seed(ctx)
    k8, ks = act_quant_ue8m0(torch.randn(n, 128, device=device, generator=g))
    q8, qs = act_quant_ue8m0(torch.randn(n, args.heads, 128, device=device, generator=g) / 10)
    chunk = dict(k8=k8, ks=ks, q8=q8.contiguous(), w=(torch.rand(n, args.heads, device=device, generator=g) * qs)
                 .contiguous(), rows=(torch.randn(n, 576, device=device, generator=g) / 8).to(torch.bfloat16),
                 q=(torch.randn(n, heads_attn, 576, device=device, generator=g) / 8).to(torch.bfloat16),
                 positions=torch.arange(n, device=device))
    kcfg = PlannedKeyConfig(page_size=ps, hot_pages=4, candidate_pages=256, cache_pages=256, topk=args.topk)
    lcfg = PlannedLatentConfig.from_hot_rows(4096 + ps, args.topk, ps, width=576, dtype=torch.bfloat16)
    max_len = args.prefill_max_len or ctx
    result = {}
    for mode in ("temporary", "buffers", "unbounded"):
        sync(device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if cuda else (0, 0)
        keys = [PlannedKeys(kcfg, device, initial_pages=math.ceil(ctx / ps)) for _ in range(layers)]
        lats = [PlannedLatents(lcfg, device, initial_rows=ctx) for _ in range(layers)]
        buffers = HistoryBuffers(max_len, ps, device, keys=True, latent_width=576) if mode != "temporary" else None
        budget = UNBOUNDED_LOGITS if mode == "unbounded" else args.prefill_logits_budget
        sync(device)
        t0 = time.perf_counter()
        for first in range(0, ctx, n):
            part = chunk if first + n <= ctx else {**chunk, **{key: chunk[key][:ctx - first]
                                                               for key in ("k8", "ks", "q8", "w", "rows", "q")}}
            if buffers is not None:
                buffers.begin([("r", first, part["rows"].shape[0])],
                              [LayerSources(layer, {"r": keys[layer]}, {"r": lats[layer]}) for layer in range(layers)])
            for layer in range(layers):
                prefill_chunk_layer(keys[layer], lats[layer], buffers, layer, first, part, args, budget)
        sync(device)
        t = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base[0], torch.cuda.max_memory_reserved() - base[1]) if cuda \
            else (None, None)
        result[mode] = dict(s=t, peak_alloc=peak[0], peak_reserved=peak[1],
                            buffer_bytes=buffers.nbytes if buffers is not None else 0)
        del keys, lats, buffers
    if warmup:
        return result
    tmp, buf, unb = result["temporary"], result["buffers"], result["unbounded"]
    budget = args.prefill_logits_budget or PREFILL_LOGITS_BUDGET
    shape = f"ctx{_tokens(ctx)} chunk{n} L{layers} H{args.heads}/{heads_attn}"
    history_b = ctx * (KEY_B + 576 * 2) * layers  # each layer's history read once per chunk, on average half
    emit("prefill", "(5) two history buffers", shape, buf["s"], tmp["s"], history_b * math.ceil(ctx / n) / 2,
         temporary_s=tmp["s"], buffers_s=buf["s"], unbounded_s=unb["s"], logits_budget=budget,
         **{f"{m}_{k}": v for m in result for k, v in result[m].items() if k != "s"})
    log(f"    prefill {_tokens(ctx)}: temporary {tmp['s']:.2f} s, peak {_mib(tmp['peak_alloc'])} allocated / "
        f"{_mib(tmp['peak_reserved'])} reserved; buffers {buf['s']:.2f} s (x{tmp['s'] / buf['s']:.2f}), peak "
        f"{_mib(buf['peak_alloc'])} / {_mib(buf['peak_reserved'])} (buffers {_mib(buf['buffer_bytes'])}, "
        f"sized for {_tokens(max_len)}); logits budget {_mib(budget) if budget >= 2**20 else f'{budget} B'}, "
        f"unbounded (as before): {unb['s']:.2f} s, peak {_mib(unb['peak_alloc'])} / {_mib(unb['peak_reserved'])}")
    return result


# ---- 2. 61-layer stack ----------------------------------------------------------------------------
def planned_stack_layers(ctx: int, layers: int, k8: torch.Tensor, ks: torch.Tensor, latents: torch.Tensor, args,
                         device: torch.device) -> list[tuple]:
    """Every layer its own planned tiers (section 1p's first budget) holding the same ctx keys and latents."""
    cand, hot_rows, cache, _, _ = parse_budget(args.budgets.split(",")[0])
    ps, k = args.page_size, args.topk
    kcfg = PlannedKeyConfig(page_size=ps, hot_pages=4, candidate_pages=cand, cache_pages=cache or cand, topk=k,
                            candidate_topk=args.candidate_topk[0], fine_topk=args.fine_topk[0])
    lcfg = PlannedLatentConfig.from_hot_rows(hot_rows, k, ps, width=LAT_B, dtype=torch.uint8)
    return [filled_planned_tiers(kcfg, lcfg, ctx, ctx, k8, ks, latents, device) for _ in range(layers)]


def filled_planned_tiers(kcfg: PlannedKeyConfig, lcfg: PlannedLatentConfig, ctx: int, room: int, k8: torch.Tensor,
                         ks: torch.Tensor, latents: torch.Tensor, device: torch.device
                         ) -> tuple[PlannedKeys, PlannedLatents]:
    """Planned tiers holding the first ctx keys and latents (prefilled), with room for `room` tokens."""
    keys = PlannedKeys(kcfg, device, initial_pages=math.ceil(room / kcfg.page_size))
    buf = keys.history(ctx)
    view = PagePool(buf.shape[0], kcfg.page_size, 128, "fp8", device)
    view.buf = buf
    idx = torch.arange(ctx, device=device)
    view.write(idx // kcfg.page_size, idx % kcfg.page_size, k8[:ctx], ks[:ctx])
    keys.commit_chunk(buf, ctx)
    lat = PlannedLatents(lcfg, device, initial_rows=room)
    lat.append(latents[:ctx])
    return keys, lat


def run_stack(ctx: int, args, device: torch.device, ops: Ops) -> dict:
    """Section 2 at one context: step time of IndexCache and MLI at retentions 1, 1/2, 1/4, and (--planned)
    of every layer reading tiered keys + latents on the kernel path."""
    ps, k, heads, layers = args.page_size, args.topk, args.heads, args.layers
    hidden, inter = (HIDDEN, args.mlp_inter) if ops.cuda else (256, 64)
    n_blocks = math.ceil(ctx / ps)
    k8, ks = act_quant_ue8m0(clustered_keys(ctx, device, seed=ctx + 1))
    key_tpl = key_pool(k8, ks, ps).buf  # (P, ps*132)
    lat_tpl = torch.zeros(n_blocks * ps, LAT_B, dtype=torch.uint8, device=device)
    lat_tpl[:ctx] = fp8_latents(ctx, device, seed=ctx + 2)
    planned = planned_stack_layers(ctx, layers, k8, ks, lat_tpl[:ctx], args, device) \
        if args.planned and ops.cuda and "tiered" in args.stack_modes else None
    del k8, ks
    lat_tpl = lat_tpl.view(n_blocks, ps, LAT_B)
    keys = [key_tpl.clone() for _ in range(layers)]  # every layer its own caches: no cross-layer L2 reuse
    lats = [lat_tpl.clone() for _ in range(layers)]
    del key_tpl, lat_tpl
    q, w = queries(heads, layers, device, seed=ctx + 1)
    g = torch.Generator(device=device).manual_seed(3)
    q_attn = [(torch.randn(1, ATTN_HEADS, 576, device=device, generator=g) / 8).to(torch.bfloat16)
              for _ in range(layers)]
    w1 = [(torch.randn(hidden, inter, device=device, generator=g) / hidden**0.5).to(torch.bfloat16)
          for _ in range(layers)]
    w2 = [(torch.randn(inter, hidden, device=device, generator=g) / inter**0.5).to(torch.bfloat16)
          for _ in range(layers)]
    x0 = torch.randn(1, hidden, device=device).to(torch.bfloat16)
    table = torch.arange(n_blocks, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device=device, dtype=torch.int32)
    side = torch.cuda.Stream(device) if ops.cuda else None
    shape = f"ctx{ctx // 1024}K {layers} layers"
    res = {"ctx": ctx}

    def layer_body(i: int, x: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        out = ops.attention(q_attn[i], lats[i], sel, table, lens)  # (1, 128, 512)
        h = x + out.reshape(1, -1)[:, :hidden]
        return x + torch.relu(h @ w1[i]) @ w2[i]

    def make_planned_step():
        from hearth.kernels.sparse_mla import sparse_mla_decode

        q8, qs = act_quant_ue8m0(q)  # the engine's FP8 queries, scale folded into the head weights
        wq = (w[None] * qs).float().contiguous()  # (layers, H)

        def step() -> torch.Tensor:
            x = x0
            for i, (tier_keys, tier_lat) in enumerate(planned):
                sel = tier_keys.select(q8[i], wq[i], lens)
                slots = tier_lat.slots(sel[0], lens)
                out = sparse_mla_decode(q_attn[i], tier_lat.paged(), slots[None], tier_lat.table, tier_lat.lens,
                                        SM_SCALE)[0]
                h = x + out.reshape(1, -1)[:, :hidden]
                x = x + torch.relu(h @ w1[i]) @ w2[i]
            return x

        return step

    def make_step(freq: int, mli: bool | str):
        if mli == "planned":
            return make_planned_step()
        full = [i % freq == 0 for i in range(layers)]

        def step() -> torch.Tensor:
            x, sel = x0, None
            for i in range(layers):
                if not full[i]:
                    x = layer_body(i, x, sel)
                elif mli and sel is not None and side is not None:
                    main = torch.cuda.current_stream(device)
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        nxt = ops.indexer(q[i], w, keys[i], table, lens)
                    out = ops.attention(q_attn[i], lats[i], sel, table, lens)
                    # Joined after the attention, as mla.py does. NOTE: nxt needs no record_stream: the side
                    # stream allocates again only after waiting for main, which has then read nxt.
                    main.wait_stream(side)
                    h = x + out.reshape(1, -1)[:, :hidden]
                    x = x + torch.relu(h @ w1[i]) @ w2[i]
                    sel = nxt
                else:
                    own = ops.indexer(q[i], w, keys[i], table, lens)
                    x = layer_body(i, x, sel if (mli and sel is not None) else own)
                    sel = own
            return x

        return step

    modes = [("IndexCache r=1 (all on GPU)", 1, False), ("IndexCache r=1/2", 2, False),
             ("IndexCache r=1/4", 4, False), ("MLI r=1", 1, True), ("MLI r=1/2", 2, True), ("MLI r=1/4", 4, True)]
    modes = [m for m in modes if m[0] in args.stack_modes or m[0] == "IndexCache r=1 (all on GPU)"]
    if planned:
        modes.append(("tiered keys+latents r=1 (planned)", 1, "planned"))
    base = None
    reps = 20 if ctx <= 131072 else 8
    for name, freq, mli in modes:
        if over_time(args, f"stack {name} ctx {ctx}"):
            break
        step = make_step(freq, mli)
        t_eager = eager_time(step, device, reps=5 if ops.cuda else 1)
        t_graph = graph_time(step, reps) if ops.cuda else None
        t = t_graph or t_eager
        base = base or t
        n_full = sum(i % freq == 0 for i in range(layers))
        req_bytes = layers * ctx * LAT_B + n_full * ctx * KEY_B
        if mli == "planned":
            req_bytes = sum(tk.device_bytes() + tl_.device_bytes() for tk, tl_ in planned)
        read = layers * k * LAT_B + n_full * ctx * KEY_B + layers * 2 * hidden * inter * 2
        emit("stack", name, shape, t, base, read, tok_s=1 / t, eager_us=t_eager * 1e6,
             graph_us=t_graph * 1e6 if t_graph else None, request_gb=req_bytes / 2**30, indexer_layers=n_full)
        log(f"    {1 / t:8.1f} tok/s ({'graph' if t_graph else 'eager'}; eager {t_eager * 1e3:.2f} ms); "
            f"{n_full} indexer layers; GPU memory per request {req_bytes / 2**30:.2f} GB")
        res[name] = dict(t=t, request_bytes=req_bytes)
    return res


# ---- 3./4. capacity and targets ---------------------------------------------------------------------
def capacity(layer128: dict | None, stack128: dict | None, args) -> None:
    budget = args.budget_gb * 2**30
    log(f"\n## 3. Max concurrent 128K requests in {args.budget_gb:.0f} GiB of GPU cache memory "
        "(COMPUTED: floor(budget / device bytes per request), not run)")
    rows = []
    if layer128:
        rows.append(("all on GPU", args.layers * (layer128["all_key_bytes"] + layer128["all_lat_bytes"])))
        for t in layer128["tiered"]:
            rows.append((f"tiered keys+latents {t['label']} hot{t['hot']}", args.layers * (t["key_bytes"] +
                                                                                          t["lat_bytes"])))
            rows.append((f"tiered keys only {t['label']}", args.layers * (t["key_bytes"] + layer128["all_lat_bytes"])))
    if stack128:
        for name in ("IndexCache r=1/2", "IndexCache r=1/4"):
            if name in stack128:
                rows.append((name, stack128[name]["request_bytes"]))
    base = None
    for name, b in rows:
        n = int(budget // b)
        base = base or n
        RESULT["rows"].append(dict(section="capacity", what=name, request_gb=b / 2**30, max_requests=n,
                                   ratio=n / base if base else None, budget_gib=args.budget_gb))
        log(f"{name:40s} {b / 2**30:8.3f} GB/request  -> {n:6d} requests  x{n / base if base else 0:.2f}")


def targets(layers_by_ctx: dict, stacks_by_ctx: dict) -> None:
    log("\n## 4. Targets")
    out = {}
    l128, s128 = layers_by_ctx.get(131072), stacks_by_ctx.get(131072)
    if l128:
        for t in l128["tiered"]:
            ratio = l128["all_key_bytes"] / t["key_bytes"]
            slow = t["t"] / (l128["all_graph"] or l128["all_eager"])
            slow_e = t["t"] / l128["all_eager"]
            ok = ratio >= 4 and slow <= 1.15 and t["recall_seeds"] >= 0.99
            log(f"  tiered {t['label']} @128K (the host-synchronised path of the CPU engine, not the GPU's): key "
                f"memory {ratio:.2f}x smaller (>= 4), per-layer time x{slow:.2f} of "
                f"all-on-GPU {'graph' if l128['all_graph'] else 'eager'} (x{slow_e:.2f} of eager; <= 1.15), recall "
                f"min {t['recall']:.4f} mean {t['recall_mean']:.4f}, min over key sets {t['recall_seeds']:.4f} "
                f"(>= 0.99): {'MET' if ok else 'NOT MET'}")
            out[f"tiered_{t['label'].replace(' ', '_')}"] = dict(key_ratio=ratio, slowdown=slow, slowdown_eager=slow_e,
                                                                 recall=t["recall"], recall_seeds=t["recall_seeds"],
                                                                 met=ok)
        for t in l128.get("planned", []):  # the kernel path (what the engine runs on a GPU)
            ok = t["key_ratio"] >= 4 and t["slowdown"] <= 1.15 and t["recall"] >= 0.99
            log(f"  planned tiers {t['label']} @128K (the GPU engine's path): key memory {t['key_ratio']:.2f}x "
                f"smaller (>= 4), per-layer time x{t['slowdown']:.2f} of all-on-GPU (<= 1.15), recall min "
                f"{t['recall']:.4f} (>= 0.99): {'MET' if ok else 'NOT MET'}")
            out[f"planned_{t['label'].replace(' ', '_')}"] = dict(t, met=ok)
    for ctx, stack in sorted(stacks_by_ctx.items()):
        tiered = stack.get("tiered keys+latents r=1 (planned)")
        if tiered:
            ratio = stack["IndexCache r=1 (all on GPU)"]["t"] / tiered["t"]
            log(f"  stack with tiered keys+latents @{ctx // 1024}K: {100 * ratio:.1f}% of all-on-GPU tok/s "
                f"(>= 85%): {'MET' if ratio >= 0.85 else 'NOT MET'}")
            out[f"stack_tiers_{ctx // 1024}k"] = ratio
    if s128 and "MLI r=1/2" in s128 and "IndexCache r=1/2" in s128:
        gain = s128["IndexCache r=1/2"]["t"] / s128["MLI r=1/2"]["t"] - 1
        log(f"  MLI r=1/2 vs IndexCache r=1/2 @128K: {100 * gain:+.1f}% decode tok/s (>= +10%): "
            f"{'MET' if gain >= 0.10 else 'NOT MET'}")
        out["mli_half_gain"] = gain
    caps = [r for r in RESULT["rows"] if r.get("section") == "capacity"]
    if caps:
        best = max(caps, key=lambda r: r["max_requests"])
        log(f"  capacity: best {best['what']} x{best['ratio']:.2f} the all-on-GPU 128K requests (>= 2x; computed)")
        out["capacity_best"] = dict(what=best["what"], ratio=best["ratio"])
    RESULT["targets"] = out


STACK_MODES = ["IndexCache r=1/2", "IndexCache r=1/4", "MLI r=1", "MLI r=1/2", "MLI r=1/4", "tiered"]


def parse_budget(text: str) -> tuple[int, int, int | None, str, bool]:
    """candidate_pages:hot_rows[:cache_pages[:summary[:lag]]] -> (cand, hot_rows, cache or None, summary, lag)."""
    v = text.split(":")
    if len(v) > 5 or (len(v) == 5 and v[4] != "lag"):
        raise SystemExit(f"bad budget {text!r}: the fifth field can only be 'lag'")
    return (int(v[0]), int(v[1]), int(v[2]) if len(v) > 2 and v[2] else None, v[3] if len(v) > 3 else "fp8",
            len(v) == 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_longctx.json")
    ap.add_argument("--small", action="store_true", help="CPU-sized smoke test")
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--stack-contexts", default=None, help="contexts of section 2 (default: --contexts)")
    ap.add_argument("--budgets", default="256:4096:256:fp8,320:4096:320:fp8,128:4096:192:bf16",
                    help="candidate_pages:latent_hot_rows[:key_cache_pages (default = candidates)"
                         "[:summary fp8|bf16 (default fp8)[:lag (lagged candidate fetch)]]],...; the first is "
                         "the engine default at k 2048; an empty key_cache_pages field takes the default")
    ap.add_argument("--recall-seeds", type=int, default=1, help="key sets for the recall of each budget (>= 1)")
    ap.add_argument("--steps", type=int, default=24, help="tiered decode steps per budget (a third at 512K)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--mlp-inter", type=int, default=1024)
    ap.add_argument("--budget-gb", type=float, default=64.0, help="GPU memory for caches in section 3")
    ap.add_argument("--time-limit", type=float, default=330.0, help="seconds; later configurations are skipped")
    ap.add_argument("--skip-stack", action="store_true")
    ap.add_argument("--planned", action="store_true",
                    help="also time the kernel path of tiered keys + latents (section 1p, CUDA only)")
    ap.add_argument("--candidate-topk", nargs="+", choices=CANDIDATE_TOPKS, default=["narrow"],
                    help="section 1p's candidate-page top-k, one run each: the row in registers sorted by the "
                         "bitonic top-k (sort), bisected (select; narrow: over the row's own key range, stopping "
                         "at an exact count) or cut by radix histograms (hist), or the single-pass select")
    ap.add_argument("--fine-topk", nargs="+", choices=["radix", "one_launch"], default=["one_launch"],
                    help="section 1p's fine top-k, one run each (with every --candidate-topk): the radix select "
                         "or the one-launch select after the fine indexer's histogram")
    ap.add_argument("--stack-modes", nargs="+", default=STACK_MODES, choices=STACK_MODES,
                    help="section 2's modes (the all-on-GPU base always runs); 'tiered' (with --planned, CUDA): "
                         "every layer reads planned tiers (the first --budgets entry, --candidate-topk and "
                         "--fine-topk's first)")
    ap.add_argument("--profile", action="store_true",
                    help="print the GPU time of each kernel of the all-on-GPU and the planned steps (CUDA only)")
    ap.add_argument("--prefill-buffers", action="store_true",
                    help="run section 5 only: prefill through the two history buffers against temporary buffers")
    ap.add_argument("--prefill-contexts", default="32768,65536,131072", help="prompt lengths of section 5")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--prefill-layers", type=int, default=4, help="layers of section 5")
    ap.add_argument("--prefill-logits-budget", type=int, default=None,
                    help="bytes of the prefill indexer's logits held at once (default: PREFILL_LOGITS_BUDGET, "
                         "256 MiB; --small: 4096, so its chunks run in row blocks)")
    ap.add_argument("--prefill-max-len", type=int, default=None,
                    help="max_model_len the buffers are sized for (default: the largest prompt)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if args.small:
        args.contexts, args.steps, args.topk, args.layers = "8192,16384", 6, 512, 4
        args.budgets = "64:1024,64:1024::fp8:lag,32:2048:48:bf16"  # default candidates at k 512 (also lagged), fewer
        args.stack_contexts = "8192"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    import triton

    RESULT["meta"] = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=name, torch=torch.__version__,
                          triton=triton.__version__, argv=sys.argv, keys="synthetic clustered (see docstring)",
                          args=vars(args))
    log(f"# {RESULT['meta']['date']} {name} torch {torch.__version__} triton {triton.__version__}")
    if args.prefill_buffers:
        prefill_section(args, device)
        return
    ops = Ops(device, args.page_size, args.topk)
    log("\n## 0. Check")
    check(device, args.page_size)
    budgets = [parse_budget(b) for b in args.budgets.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    stack_contexts = [] if args.skip_stack else [int(c) for c in (args.stack_contexts or args.contexts).split(",")]
    # Priority order under the time limit: 32K/128K layers, the 128K stack (the MLI target), then the rest.
    tasks = [("layer", c) for c in contexts if c <= 131072] + [("stack", c) for c in stack_contexts if c == 131072]
    tasks += [("stack", c) for c in stack_contexts if c < 131072] + [("layer", c) for c in contexts if c > 131072]
    tasks += [("stack", c) for c in stack_contexts if c > 131072]
    layers_by_ctx, stacks_by_ctx = {}, {}
    for kind, ctx in tasks:
        if over_time(args, f"{kind} ctx {ctx}"):
            continue
        if kind == "layer":
            log(f"\n## 1. One layer at {ctx // 1024}K: indexer + top-k + sparse MLA decode (tiered wall time per "
                "step; base = all on GPU, eager)")
            layers_by_ctx[ctx] = run_layer(ctx, budgets, args, device, ops)
            if args.planned and ops.cuda:
                log(f"\n## 1p. One layer at {ctx // 1024}K, tiered keys + latents on the kernel path (base = all on "
                    "GPU, CUDA graph)")
                for method in args.candidate_topk:
                    for fine in args.fine_topk:
                        run_planned(ctx, budgets, args, device, layers_by_ctx[ctx], method, fine)
        else:
            log(f"\n## 2. {args.layers}-layer decode stack at {ctx // 1024}K: IndexCache vs MLI (tok/s; base = "
                "retention 1, the unmodified model)")
            stacks_by_ctx[ctx] = run_stack(ctx, args, device, ops)
        save(args)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cap_ctx = 131072 if 131072 in layers_by_ctx else (max(layers_by_ctx) if layers_by_ctx else None)
    capacity(layers_by_ctx.get(cap_ctx), stacks_by_ctx.get(cap_ctx), args)
    targets(layers_by_ctx, stacks_by_ctx)
    RESULT["meta"]["seconds"] = time.perf_counter() - T0
    save(args)
    log(f"\n# done in {time.perf_counter() - T0:.0f} s; JSON: {Path(args.out) / 'bench_longctx.json'}")


def prefill_section(args, device: torch.device) -> None:
    """Section 5 for every --prefill-contexts length (--small: tiny shapes under TRITON_INTERPRET=1)."""
    heads_attn = ATTN_HEADS
    if args.small:
        args.prefill_contexts, args.prefill_chunk, args.prefill_layers = "96,160", 32, 2
        args.topk, args.heads, args.page_size, heads_attn = 64, 16, 16, 16
        args.prefill_logits_budget = args.prefill_logits_budget or 4096
    contexts = [int(c) for c in args.prefill_contexts.split(",")]
    args.prefill_max_len = args.prefill_max_len or max(contexts)
    log(f"\n## 5. Prefill of one prompt through {args.prefill_layers} layers of tiered keys + latents: a temporary "
        f"history buffer per layer and chunk vs two history buffers (chunk {args.prefill_chunk})")
    run_prefill(2 * args.prefill_chunk, args, device, heads_attn, warmup=True)  # Triton compiles
    for ctx in contexts:
        if over_time(args, f"prefill ctx {ctx}"):
            break
        run_prefill(ctx, args, device, heads_attn)
        save(args)
    RESULT["meta"]["seconds"] = time.perf_counter() - T0
    save(args)


if __name__ == "__main__":
    sys.exit(main())
