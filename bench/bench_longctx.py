"""Long context on a small GPU: decode cost per layer of tiered indexer keys + tiered latents
against everything on the device, at DeepSeek-V3.2 shapes (64 indexer heads x 128, k 2048,
576-wide bf16 latents), after a correctness check in the same run.

    python bench/bench_longctx.py [--out DIR] [--contexts 32768,131072,524288] [--steps 40]
    python bench/bench_longctx.py --small        # CPU smoke test (small shapes, torch baseline)

Per context and budget it prints, in the bench.md format: what, shape, median time per layer and
decode step, GB/s (device bytes read / time), % of the 4,278 GB/s ceiling, the all-on-device
baseline's time in the same run and the ratio; then device bytes per request (one layer and x61
layers), recall of the coarse-to-fine top-k against the exact one, page-cache reuse, latent hit
rate and bytes copied from the host per step.

Keys are clustered synthetic data (runs of 32..511 tokens around 1 of 256 centroids, random-walk
drift, noise 0.5; FP8 e4m3 with ue8m0 per-token scales); decode queries sit near 4 centroids and
drift slightly from step to step, so consecutive steps select mostly the same pages.
Baseline (a): on CUDA the Triton indexer + radix top-k over the full FP8 paged cache
(`indexer_decode_topk`) and a gather of 2048 latent rows; on the CPU the plain-torch exact scores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.offload.coarse_index import PagePool, TopkMerger, exact_scores
from hearth.offload.tiered_keys import KeyTierConfig, TieredKeys
from hearth.offload.tiered_latents import LatentTierConfig, TieredLatents

BW = 4.278e12  # device copy ceiling, bytes/s (bench.md)
LAYERS = 61  # DeepSeek-V3.2 layers, each with an indexer
ROWS: list[dict] = []


def emit(what: str, shape: str, t_s: float, base_s: float | None, nbytes: float, **extra) -> None:
    gbs = nbytes / t_s / 1e9
    row = dict(what=what, shape=shape, us=t_s * 1e6, gbs=gbs, pct=100 * gbs * 1e9 / BW,
               base_us=base_s * 1e6 if base_s else None, ratio=base_s / t_s if base_s else None, **extra)
    ROWS.append(row)
    base = f"base {base_s * 1e6:10.1f} us  x{base_s / t_s:6.2f}" if base_s else "base         n/a"
    print(f"{what:30s} {shape:34s} {t_s * 1e6:10.1f} us {gbs:8.1f} GB/s {row['pct']:5.1f}%  {base}", flush=True)


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
    return ((q0 + drift) / 128**0.5).to(device), w.to(device)


def exact_topk(q: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-torch exact selection over all keys (Indexer._select order), chunked over tokens."""
    merger = TopkMerger(1, min(k, k8.shape[0]), q.device)
    for i in range(0, k8.shape[0], 1 << 16):
        pos = torch.arange(i, min(i + (1 << 16), k8.shape[0]), device=q.device)
        merger.update(exact_scores(q[None], w[None], k8[i:i + (1 << 16)], ks[i:i + (1 << 16)]), pos)
    return merger.positions()[0]


def timed(fn, device: torch.device, *args):
    """(result, seconds) of one synchronised call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def decode_step(tiers: TieredKeys, lat: TieredLatents, k8: torch.Tensor, ks: torch.Tensor, row: torch.Tensor,
                q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One layer of one decode step: write the new key and latent, select, gather the latent rows."""
    tiers.append(k8, ks)
    lat.append(row)
    sel = tiers.select(q, w)
    lat.gather(sel[0])
    return sel


def baseline(ctx: int, q: torch.Tensor, w: torch.Tensor, k8, ks, latents, k: int, ps: int, reps: int) -> float:
    """All on the device: indexer + top-k over every key, then a gather of the selected latent rows."""
    dev = q.device
    if dev.type != "cuda":
        return statistics.median(timed(lambda: latents[exact_topk(q[0], w, k8, ks, k)], dev)[1] for _ in range(reps))
    from triton.testing import do_bench

    from hearth.kernels.indexer import indexer_decode_topk

    pool = PagePool(ctx // ps, ps, 128, "fp8", dev)
    idx = torch.arange(ctx, device=dev)
    pool.write(idx // ps, idx % ps, k8, ks)
    table = torch.arange(ctx // ps, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
    qb, wb = q[0][None, None].to(torch.bfloat16), w[None, None].float()

    def step() -> None:
        sel = indexer_decode_topk(qb, wb, pool.buf, table, lens, ps, k)
        latents[sel.view(-1).long()]

    return do_bench(step, rep=100, return_mode="median") * 1e-3


def check(device: torch.device, ps: int) -> None:
    """Correctness first: with every page a candidate the tiered selection equals the exact one, and
    tiered latents return the rows of an in-memory gather."""
    n, heads = 3000, 64
    x = clustered_keys(n, device, seed=99)
    k8, ks = act_quant_ue8m0(x)
    q, w = queries(heads, 3, device, seed=99)
    tiers = TieredKeys(KeyTierConfig(page_size=ps, hot_pages=2, cache_pages=8, candidate_pages=10**6), device)
    tiers.append(k8[:1000], ks[:1000])
    tiers.append(k8[1000:], ks[1000:])
    got = tiers.select(q[0], w)[0]
    want = exact_topk(q[0], w, k8, ks, 2048)
    assert torch.equal(got, want), "tiered selection differs from the exact selection"
    rows = torch.randn(n, 576, device=device).to(torch.bfloat16)
    lat = TieredLatents(LatentTierConfig(hot_rows=2100), device)
    lat.append(rows)
    for _ in range(3):
        out, _ = lat.gather(want)
        assert torch.equal(out, rows[want]), "tiered latents differ from the in-memory gather"
        want = torch.randperm(n, device=device)[:2048]
    print(f"  check ok: tiered keys == exact top-k (ctx {n}, page {ps}); tiered latents == gather", flush=True)


def run_context(ctx: int, budgets: list[tuple[int, int]], args, device: torch.device) -> None:
    ps, k, heads = args.page_size, args.topk, args.heads
    x = clustered_keys(ctx + args.steps, device, seed=ctx)
    k8, ks = act_quant_ue8m0(x)  # (n, 128) e4m3, (n,) fp32
    del x
    latents = torch.randn(ctx + args.steps, 576, device=device).to(torch.bfloat16)
    q, w = queries(heads, args.steps, device, seed=ctx)
    shape = f"ctx{ctx // 1024}K H{heads} k{k} page{ps}"
    t_base = baseline(ctx, q, w, k8[:ctx], ks[:ctx], latents[:ctx], k, ps, reps=3)
    full_bytes = ctx * 132 + ctx * 1152  # FP8 keys + bf16 latents, one layer
    emit("(a) all on device", shape, t_base, None, nbytes=ctx * 132 + k * 1152,
         device_mb=full_bytes / 2**20, request_gb=full_bytes * LAYERS / 2**30)
    for cand, hot_rows in budgets:
        kcfg = KeyTierConfig(page_size=ps, cache_pages=2 * cand, candidate_pages=cand, topk=k)
        tiers = TieredKeys(kcfg, device)
        tiers.append(k8[:ctx], ks[:ctx])
        lat = TieredLatents(LatentTierConfig(hot_rows=hot_rows), device)
        lat.append(latents[:ctx])
        times, recalls = [], []
        for s in range(args.steps):
            p = ctx + s
            sel, dt = timed(decode_step, device, tiers, lat, k8[p:p + 1], ks[p:p + 1], latents[p:p + 1], q[s], w)
            times.append(dt)
            if s % max(1, args.steps // 8) == 0 or s == args.steps - 1:
                ref = exact_topk(q[s], w, k8[:p + 1], ks[:p + 1], k)
                recalls.append(float(torch.isin(sel[0], ref).float().mean()))
        warm = times[len(times) // 4:]
        ksx, lsx = tiers.stats(), lat.stats()
        dev_bytes = tiers.device_bytes() + lat.config.device_bytes
        read = kcfg.summary_bytes * tiers.num_cold_pages + (cand + kcfg.hot_pages) * kcfg.page_bytes + k * 1152
        emit(f"(b) tiered c{cand} hot{hot_rows}", shape, statistics.median(warm), t_base, nbytes=read,
             device_mb=dev_bytes / 2**20, request_gb=dev_bytes * LAYERS / 2**30, recall=min(recalls),
             recall_mean=sum(recalls) / len(recalls), page_reuse=ksx["page_reuse_rate"],
             latent_hit=lsx["hit_rate"], h2d_kb_step=(ksx["bytes_h2d"] + lsx["bytes_h2d"]) / args.steps / 1024,
             selection_overlap=ksx["selection_overlap"])
        r = ROWS[-1]
        print(f"    device {r['device_mb']:.1f} MB/layer ({r['request_gb']:.2f} GB/request, all-on-device "
              f"{full_bytes / 2**20:.1f} MB/layer); recall min {r['recall']:.4f} mean {r['recall_mean']:.4f}; "
              f"page reuse {r['page_reuse']:.3f}; latent hit {r['latent_hit']:.3f}; "
              f"h2d {r['h2d_kb_step']:.0f} KB/step; selection overlap {r['selection_overlap']:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--small", action="store_true", help="CPU-sized smoke test")
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--budgets", default="128:4096,256:6144,512:8192", help="candidate_pages:hot_rows,...")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if args.small:
        args.contexts, args.budgets, args.steps, args.topk = "8192,16384", "64:1024,128:2048", 6, 512
    budgets = [tuple(int(v) for v in b.split(":")) for b in args.budgets.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {name} torch {torch.__version__}", flush=True)
    check(device, args.page_size)
    for ctx in (int(c) for c in args.contexts.split(",")):
        run_context(ctx, budgets, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "longctx_bench.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
