"""Benchmark Hearth's DSA kernels (indexer + top-k, sparse MLA; decode and prefill) on one GPU against
plain-torch baselines of the same math, measured in the same run, after a correctness check.

    python bench/bench_dsa.py [--out DIR] [--quick] [--sweep] [--only decode_indexer,decode_mla,prefill]
    TRITON_INTERPRET=1 python bench/bench_dsa.py --dry-run   (no GPU: the decode indexer and sparse MLA
                                                              rows at tiny shapes, checks only)

Prints one line per result (median time, GB/s or TFLOP/s, % of ceiling, torch time, ratio) and writes
`dsa_bench.md` (a markdown table) and `dsa_bench.jsonl` into --out (default: $OUT or .). Decode
indexer logits time the persistent kernel (the default) and the tiled one in the same run,
GB/s counting the key bytes read (132 per token), plus a few persistent configs at batch >= 8 x 128K
(more with --sweep), and report the persistent / tiled ratio per shape; decode indexer + top-k and
top-k alone with the radix select (the default), the sampled one and the one-launch one, and a closing
table of one-launch / radix per shape (with the finishing path each row took). Decode sparse MLA runs at
batch 1, 8 and 64 with a bf16 cache (the one-wave launch plan, the default, and the earlier H200 plan)
and an FP8 cache on the old per-element path and the tile path, and reports FP8 / bf16 TFLOP/s ratios per batch.
Ceilings from docs/benchmarks.md: 4.28 TB/s copy, ~790 TFLOP/s bf16 matmul.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from hearth.kernels._utils import FP8_E4M3
from hearth.kernels.indexer import (
    indexer_decode_topk,
    indexer_prefill_topk,
    lightning_indexer_decode,
    lightning_indexer_prefill,
)
from hearth.kernels.indexer.decode_persistent import sm_count
from hearth.kernels.indexer.reference import gather_request_keys, indexer_logits_ref
from hearth.kernels.sparse_mla import quantize_latent_fp8, sparse_mla_decode, sparse_mla_prefill
from hearth.kernels.sparse_mla.reference import sparse_mla_ref
from hearth.kernels.topk import topk_indices, topk_indices_one_launch
from hearth.kernels.topk.one_launch import HEADER, PATH, SAMPLE_SIGMAS, new_one_launch_workspace, one_launch_plan
from hearth.kernels.topk.reference import check_topk
from hearth.kernels.topk.sampled import new_sampled_workspace, sampled_plan, sampled_topk_launch

BW = 4.28e12
TFLOPS = 790e12
BS = 64
K = 2048
ROWS: list[dict] = []
RATIOS: list[dict] = []  # decode sparse MLA: FP8 cache TFLOP/s over bf16 cache TFLOP/s, per batch
IDX_RATIOS: list[dict] = []  # decode indexer logits: the persistent kernel against the tiled one, per shape
HIST_SIGMAS: list[float] = [SAMPLE_SIGMAS]  # the sampled first histogram's band half-widths (--hist-sigmas)
TOPK_RATIOS: list[dict] = []  # decode top-k: the one-launch select against the radix select, per shape
DEVICE = "cuda"


def emit(what: str, shape: str, t_s: float, base_s: float | None, nbytes: float = 0, flops: float = 0, **extra):
    gbs = nbytes / t_s / 1e9 if nbytes else None
    tfs = flops / t_s / 1e12 if flops else None
    pct = 100 * max((nbytes / t_s) / BW if nbytes else 0, (flops / t_s) / TFLOPS if flops else 0)
    row = dict(
        what=what,
        shape=shape,
        us=t_s * 1e6,
        gbs=gbs,
        tflops=tfs,
        pct=pct,
        torch_us=base_s * 1e6 if base_s else None,
        speedup=(base_s / t_s) if base_s else None,
        **extra,
    )
    ROWS.append(row)
    rate = f"{gbs:8.0f} GB/s" if gbs else f"{tfs:8.1f} TF/s"
    base = f"torch {base_s * 1e6:10.1f} us  x{base_s / t_s:6.1f}" if base_s else "torch        n/a"
    print(f"{what:34s} {shape:28s} {t_s * 1e6:10.1f} us {rate} {pct:5.1f}%  {base}", flush=True)


def bench(fn, graph: bool = False, rep: int = 60) -> float:
    """Median seconds; decode paths are replayed from a CUDA graph like the engine's decode step."""
    fn()
    torch.cuda.synchronize()
    ms = do_bench_cudagraph(fn, rep=rep, return_mode="median") if graph else do_bench(fn, rep=rep, return_mode="median")
    return ms * 1e-3


def dry_bench(fn, graph: bool = False, rep: int = 60) -> float:
    """--dry-run stand-in for `bench`: one call, wall-clock seconds (the interpreter's, not a GPU's)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_indexer_cache(num_blocks: int) -> torch.Tensor:
    """Random FP8 keys (no NaN codes) and power-of-two scales in the paged layout."""
    cache = torch.randint(0, 256, (num_blocks, BS * 132), dtype=torch.uint8, device=DEVICE)
    data = cache[:, : BS * 128]
    data[(data & 0x7F) == 0x7F] = 0x10
    scales = torch.exp2(torch.randint(-10, -4, (num_blocks, BS), device=DEVICE).float())
    cache[:, BS * 128 :] = scales.view(torch.uint8).view(num_blocks, BS * 4)
    return cache


def torch_indexer_topk(q, w, cache, table, ctx_len: int, k: int):
    """Plain torch decode indexer + torch.topk (all requests share ctx_len): gather, bf16 GEMM, relu,
    head-weighted sum, scale, topk."""
    nb = cache.shape[0]
    pages = cache.view(FP8_E4M3).as_strided((nb, BS, 128), (BS * 132, 128, 1))
    scales = cache.view(torch.float32).as_strided((nb, BS), (BS * 33, 1), storage_offset=BS * 32)
    t = torch.arange(ctx_len, device=cache.device)
    page, off = table.long()[:, t // BS], t % BS  # (B, n)
    k_b = pages[page, off].to(torch.bfloat16)  # (B, n, 128)
    s = torch.einsum("bhd,bnd->bhn", q[:, 0].to(torch.bfloat16), k_b).float().relu_()
    logits = torch.einsum("bhn,bh->bn", s, w[:, 0]) * scales[page, off]
    return torch.topk(logits, min(k, ctx_len), dim=-1).indices


def indexer_sweep(batch: int, ctx_len: int, full: bool) -> list[dict]:
    """Persistent-kernel configs timed beside its default: a few at the K2 target shapes (batch >= 8,
    128K) in every run, more with --sweep. Chunk tokens x pipeline stages x programs per SM x warps."""
    sms = sm_count(torch.device(DEVICE))
    if batch < 8:  # few requests: fewer, longer or shallower work items may start sooner (--sweep only)
        picks = [(64, 5, 2, 4), (64, 7, 2, 4), (64, 9, 2, 4), (128, 5, 2, 4), (128, 9, 2, 4), (128, 7, 1, 4),
                 (128, 7, 1, 8), (256, 7, 1, 8), (256, 5, 1, 8), (64, 7, 1, 4), (32, 7, 2, 4), (32, 11, 2, 4)]
        return [
            {"kernel": "persistent", "block_t": bt, "num_stages": ns, "programs": per_sm * sms, "num_warps": nw}
            for bt, ns, per_sm, nw in picks
        ] if full else []
    if ctx_len < 131072 and not full:
        return []
    # num_stages 5 / 7 / 9 / 11 give the keys 2 / 3 / 4 / 5 buffers (the page-id load takes two stages)
    # (the sm_90 builds fit two programs of 4 warps or one of 8 per SM: 180-210 registers a thread)
    picks = [(128, 5, 2, 4), (128, 9, 2, 4), (64, 11, 2, 4), (64, 7, 2, 4), (256, 7, 1, 8), (128, 7, 1, 4)]
    if full:
        picks += [(128, 11, 2, 4), (64, 9, 2, 4), (256, 9, 1, 8), (256, 5, 1, 8), (128, 7, 3, 4), (64, 5, 2, 4)]
    return [
        {"kernel": "persistent", "block_t": bt, "num_stages": ns, "programs": per_sm * sms, "num_warps": nw}
        for bt, ns, per_sm, nw in picks
    ]


def decode_indexer(
    batch: int, ctx_len: int, heads: int = 64, k: int = K, sweep: bool = False, check: bool = False
) -> None:
    """Decode indexer logits with the persistent kernel (the default) and the tiled one on
    the same inputs, GB/s counting the key bytes read (132 per token; the 4-byte logit write aside),
    then indexer + top-k and the top-k alone on the default kernel."""
    max_blocks = ctx_len // BS
    cache = random_indexer_cache(batch * max_blocks)
    table = torch.randperm(batch * max_blocks, device=DEVICE).int().view(batch, max_blocks)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device=DEVICE)
    q = (torch.randn(batch, 1, heads, 128, device=DEVICE) * 2).to(FP8_E4M3)
    w = torch.randn(batch, 1, heads, device=DEVICE) * 0.05
    shape = f"B{batch} ctx{ctx_len // 1024}K H{heads} k{k}"
    kernels = {"tiled": {"kernel": "tiled"}, "persistent": {"kernel": "persistent"}}
    if check:
        kk, ks = gather_request_keys(cache, table[0], ctx_len, BS)
        last = torch.tensor([ctx_len - 1], device=DEVICE)
        ref = indexer_logits_ref(q[0], w[0], kk, ks, last)[0]
        mag = indexer_logits_ref(q[0].float().abs(), w[0].abs(), kk.abs(), ks, last)[0]
        for name, cfg in kernels.items():
            logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx, BS, config=cfg)
            err = float(((logits[0, :ctx_len] - ref).abs() / (mag + 1e-6)).max())
            assert err < 1e-3, f"decode indexer ({name}) logits err {err} (relative to sum |w| |q||k| ks)"
            print(f"  check ok: decode indexer {name} {shape} (err {err:.1e})", flush=True)
        idx = indexer_decode_topk(q, w, cache, table, ctx, BS, k)
        check_topk(idx[:2, 0], logits[:2], lengths[:2], k)
    n_bytes_keys = batch * ctx_len * 132
    t_base = (
        bench(lambda: torch_indexer_topk(q, w, cache, table, ctx_len, k), rep=40)
        if batch * ctx_len <= 64 * 131072
        else None
    )

    def time_logits(cfg: dict) -> float:
        return bench(lambda: lightning_indexer_decode(q, w, cache, table, ctx, BS, config=cfg), graph=True)

    times = {name: time_logits(cfg) for name, cfg in kernels.items()}
    for name, cfg in kernels.items():
        emit(f"decode indexer logits ({name})", shape, times[name], None, nbytes=n_bytes_keys, cfg=str(cfg))
    best = (times["persistent"], kernels["persistent"])
    for cfg in indexer_sweep(batch, ctx_len, sweep):
        try:
            t = time_logits(cfg)
        except Exception as e:  # a config can exceed shared memory or registers on this GPU
            print(f"    sweep {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        print(f"    sweep {cfg}: {t * 1e6:.1f} us ({100 * n_bytes_keys / t / BW:.0f}% of HBM)", flush=True)
        best = min(best, (t, cfg), key=lambda b: b[0])
    if best[1] is not kernels["persistent"]:
        emit("decode indexer logits (persistent, best)", shape, best[0], None, nbytes=n_bytes_keys, cfg=str(best[1]))
    IDX_RATIOS.append(
        dict(
            shape=shape,
            tiled_us=times["tiled"] * 1e6,
            persistent_us=times["persistent"] * 1e6,
            best_us=best[0] * 1e6,
            speedup=times["tiled"] / times["persistent"],
            pct_hbm=100 * n_bytes_keys / times["persistent"] / BW,
            best_cfg=str(best[1]),
        )
    )
    print(f"  {shape}: persistent / tiled = x{times['tiled'] / times['persistent']:.2f}", flush=True)
    t_full = bench(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, k, fuse_hist=True), graph=True)
    emit("decode indexer+topk (fused hist)", shape, t_full, t_base, nbytes=n_bytes_keys)
    t_nf = bench(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, k, fuse_hist=False, topk="radix"), graph=True)
    emit("decode indexer+topk (radix, unfused)", shape, t_nf, t_base, nbytes=n_bytes_keys)
    # the sampled top-k keeps its workspace across calls (zeroed once, as a graph-captured caller would)
    ws = new_sampled_workspace(batch, sampled_plan(ctx_len, k), q.device)
    t_sa = bench(
        lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, k, topk="sampled", topk_workspace=ws),
        graph=True,
    )
    check_topk(
        indexer_decode_topk(q, w, cache, table, ctx, BS, k, topk="sampled", topk_workspace=ws)[:, 0],
        *lightning_indexer_decode(q, w, cache, table, ctx, BS),
        k,
    )
    emit("decode indexer+topk (sampled)", shape, t_sa, t_base, nbytes=n_bytes_keys)
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx, BS)
    t_tk = bench(lambda: topk_indices(logits, lengths, k), graph=True)
    t_tt = bench(lambda: torch.topk(logits, k, dim=-1))
    emit("decode topk only (radix)", f"{batch}x{ctx_len}", t_tk, t_tt, nbytes=batch * ctx_len * 4)
    out = torch.empty(batch, k, dtype=torch.int32, device=q.device)
    plan = sampled_plan(logits.shape[1], k)
    t_ts = bench(lambda: sampled_topk_launch(logits, lengths, out, ws, plan), graph=True)
    emit("decode topk only (sampled)", f"{batch}x{ctx_len}", t_ts, t_tt, nbytes=batch * ctx_len * 4)
    decode_one_launch(q, w, cache, table, ctx, k, shape, logits, lengths, t_base, t_tt, dict(full=t_nf, topk=t_tk))


def decode_one_launch(q, w, cache, table, ctx, k, shape, logits, lengths, t_base, t_tt, radix_us: dict) -> None:
    """The one-launch top-k after the fused indexer (one workspace kept across calls, as a
    graph-captured caller would), and on the same logits alone (its histogram launch + the select),
    against the default radix select's times of the same run (radix_us: "full" and "topk")."""
    batch, ctx_len = q.shape[0], int(logits.shape[1])
    ws = new_one_launch_workspace(batch, one_launch_plan(k), q.device)

    def full():
        return indexer_decode_topk(q, w, cache, table, ctx, BS, k, topk="one_launch", topk_workspace=ws)

    check_topk(full()[:, 0], logits, lengths, k)
    paths = ws[:, HEADER + PATH].tolist()  # the finishing path of each row (one_launch.PATH_*)
    t_full = bench(full, graph=True)
    emit("decode indexer+topk (one launch)", shape, t_full, t_base, nbytes=batch * ctx_len * 132)

    def separate():  # the indexer without the fused histogram, then its own histogram launch, then the select
        return indexer_decode_topk(q, w, cache, table, ctx, BS, k, topk="one_launch", fuse_hist=False,
                                   topk_workspace=ws)

    check_topk(separate()[:, 0], logits, lengths, k)
    t_sep = bench(separate, graph=True)
    emit("decode indexer+topk (one launch, separate histogram)", shape, t_sep, t_base, nbytes=batch * ctx_len * 132)

    out = torch.empty(batch, k, dtype=torch.int32, device=q.device)
    sampled = {}  # sigmas -> (indexer + top-k s, top-k alone s, paths)
    for sigmas in HIST_SIGMAS:
        def sampled_hist(sigmas=sigmas):  # a 1-in-8 first histogram (rows of >= 32 k keys; others count every key)
            return indexer_decode_topk(q, w, cache, table, ctx, BS, k, topk="one_launch", fuse_hist=False,
                                       topk_workspace=ws, hist_sample=8, hist_sigmas=sigmas)

        check_topk(sampled_hist()[:, 0], logits, lengths, k)
        s_paths = ws[:, HEADER + PATH].tolist()
        t_smp = bench(sampled_hist, graph=True)
        emit(f"decode indexer+topk (one launch, 1-in-8 histogram, band {sigmas:g} sigmas)", shape, t_smp, t_base,
             nbytes=batch * ctx_len * 132)
        t_smp_topk = bench(lambda sigmas=sigmas: topk_indices_one_launch(
            logits, lengths, k, out=out, workspace=ws, sample=8, sample_sigmas=sigmas), graph=True)
        check_topk(out, logits, lengths, k)
        emit(f"decode topk only (one launch, 1-in-8 histogram, band {sigmas:g} sigmas)", f"{batch}x{ctx_len}",
             t_smp_topk, t_tt, nbytes=batch * ctx_len * 4)
        sampled[sigmas] = (t_smp, t_smp_topk, {p: s_paths.count(p) for p in sorted(set(s_paths))})
        print(f"    1-in-8 histogram, band {sigmas:g} sigmas: indexer+topk {t_smp * 1e6:.1f} us, topk only "
              f"{t_smp_topk * 1e6:.1f} us, paths {sampled[sigmas][2]}", flush=True)
    t_smp = sampled[HIST_SIGMAS[0]][0]
    t_topk = bench(lambda: topk_indices_one_launch(logits, lengths, k, out=out, workspace=ws), graph=True)
    emit("decode topk only (one launch)", f"{batch}x{ctx_len}", t_topk, t_tt, nbytes=batch * ctx_len * 4)
    check_topk(out, logits, lengths, k)
    TOPK_RATIOS.append(
        dict(
            shape=shape,
            radix_full_us=radix_us["full"] * 1e6,
            one_launch_full_us=t_full * 1e6,
            full_speedup=radix_us["full"] / t_full,
            one_launch_separate_us=t_sep * 1e6,
            separate_speedup=radix_us["full"] / t_sep,
            one_launch_sampled_us=t_smp * 1e6,
            sampled_speedup=radix_us["full"] / t_smp,
            radix_topk_us=radix_us["topk"] * 1e6,
            one_launch_topk_us=t_topk * 1e6,
            topk_speedup=radix_us["topk"] / t_topk,
            paths={p: paths.count(p) for p in sorted(set(paths))},
            sampled={str(sg): dict(indexer_topk_us=v[0] * 1e6, topk_us=v[1] * 1e6, paths=v[2])
                     for sg, v in sampled.items()},
        )
    )
    print(
        f"  {shape}: one launch / radix: indexer+topk x{radix_us['full'] / t_full:.2f} "
        f"(separate histogram x{radix_us['full'] / t_sep:.2f}, 1-in-8 x{radix_us['full'] / t_smp:.2f}), "
        f"topk only x{radix_us['topk'] / t_topk:.2f}; paths {TOPK_RATIOS[-1]['paths']}",
        flush=True,
    )


def random_latent(num_blocks: int, fp8: bool) -> torch.Tensor:
    lat = torch.randn(num_blocks, BS, 576, device=DEVICE).to(torch.bfloat16)
    return quantize_latent_fp8(lat) if fp8 else lat


def torch_sparse_mla(q, cache, idx, table_rows, limits, sm_scale):
    """Plain torch gathered attention (bf16 GEMMs, fp32 softmax)."""
    lat = cache.flatten(0, 1)
    valid = (idx >= 0) & (idx <= limits[:, None])
    safe = torch.where(valid, idx, 0).long()
    slots = table_rows.long().gather(1, safe // BS) * BS + safe % BS
    kv = lat[slots]  # (R, topk, 576)
    s = torch.einsum("rhd,rnd->rhn", q, kv).float() * sm_scale
    s.masked_fill_(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).to(torch.bfloat16)
    return torch.einsum("rhn,rnd->rhd", p, kv[..., :512])


def old_mla_plan(batch: int, heads: int, k: int, fp8: bool) -> dict:
    """The sparse MLA launch before the FP8 tile path, for an A/B in one run: 64-head blocks, splits
    aiming at 264 programs, per-element FP8 dequantisation in one pipeline stage."""
    programs = batch * triton.cdiv(heads, 64)
    splits = 1 if programs >= 96 else min(triton.cdiv(k, 64), triton.cdiv(264, programs))
    return {"block_h": 64, "splits": splits} | ({"fp8_tile": False} if fp8 else {})


def mla_sweep(batch: int) -> list[dict]:
    """Configs tried with --sweep on the current (tile) path: head blocks x splits at small batch,
    tile depth x pipeline stages at large batch."""
    if batch <= 8:
        return [
            {"block_h": bh, "splits": sp, "block_n": bn}
            for bh in (16, 32, 64)
            for sp in ((8, 16, 32) if batch == 1 else (2, 4, 8))
            for bn in (32, 64)
        ]
    # The pipeliner prefetches a gathered tile (num_stages - 1) // 3 tiles ahead (the selection -> page -> latent
    # chain is three loads deep), so a deeper prefetch needs num_stages 7 (2 ahead), 10 (3), 13 (4); 64-row bf16
    # tiles fit 2 ahead at most in shared memory, 32- and 16-row tiles more.
    return [
        {"block_n": bn, "num_warps": nw, "num_stages": ns}
        for bn, ns, nw in ((64, 4, 8), (32, 4, 8), (32, 7, 8), (32, 10, 8), (32, 7, 16), (16, 10, 8), (16, 13, 8),
                           (16, 16, 8))
    ]


def decode_sparse_mla(batch: int, heads: int = 128, ctx_len: int = 32768, k: int = K, sweep: bool = False):
    """One batch size: bf16 cache (the one-wave plan, the engine's default, and the earlier H200 plan), FP8
    cache on the old path and on the tile path, all on the same latents (the FP8 cache quantises the
    bf16 one), then the ratios of the default launches; with `sweep` also the best config of the current
    plan for each cache."""
    max_blocks = ctx_len // BS
    lat = random_latent(batch * max_blocks, False)
    caches = {"bf16": lat, "fp8": quantize_latent_fp8(lat)}
    table = torch.randperm(batch * max_blocks, device=DEVICE).int().view(batch, max_blocks)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, heads, 576, device=DEVICE).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(ctx_len, device=DEVICE)[:k] for _ in range(batch)]).int()
    sm = 0.1352
    flops = batch * heads * k * (576 + 512) * 2
    variants = [  # (label, cache format, base config, sweep it)
        ("bf16", "bf16", None, False),  # the default: the Gluon kernel on sm_90 (gluon_kernels.py), else Triton's
        ("bf16 triton", "bf16", {"gluon": False}, True),  # the Triton kernel's one-wave plan (see launch_plan)
        ("bf16 h200 plan", "bf16", {"plan": "h200"}, batch <= 8),  # at batch 64 the same launch as the default
        ("fp8 old path", "fp8", old_mla_plan(batch, heads, k, True), False),
        ("fp8 tile path", "fp8", None, True),
    ]

    def time_mla(cache: torch.Tensor, cfg: dict | None) -> float:
        return bench(lambda: sparse_mla_decode(q, cache, idx, table, ctx, sm, config=cfg), graph=True)

    times = {}
    for label, fmt, base_cfg, swept in variants:
        cache = caches[fmt]
        shape = f"B{batch} H{heads} k{k} {fmt}"
        out, lse = sparse_mla_decode(q, cache, idx, table, ctx, sm, config=base_cfg)
        ro, rl = sparse_mla_ref(q[:4], cache, idx[:4], table[:4], ctx[:4] - 1, sm)
        err = float((out[:4].float() - ro).norm() / ro.norm())
        assert err < 1e-2 and float((lse[:4] - rl).abs().max()) < 1e-3, f"sparse MLA decode {label} err {err}"
        print(f"  check ok: sparse MLA decode {label} {shape} (rel err {err:.1e})", flush=True)
        nbytes = batch * k * (656 if fmt == "fp8" else 1152) + q.numel() * 2 + batch * heads * 512 * 2
        t_base = None
        if label == "bf16":
            t_base = bench(lambda cache=cache: torch_sparse_mla(q, cache, idx, table, ctx - 1, sm), rep=40)
        t = time_mla(cache, base_cfg)
        times[label] = t
        emit(f"decode sparse MLA ({label})", shape, t, t_base, flops=flops, nbytes=nbytes, cfg=str(base_cfg))
        if not (sweep and swept):
            continue
        best = (t, base_cfg)
        for cfg in mla_sweep(batch):
            try:
                t = time_mla(cache, cfg)
            except Exception as e:  # a config can exceed shared memory on this GPU
                print(f"    sweep {label} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            print(f"    sweep {label} {cfg}: {t * 1e6:.1f} us", flush=True)
            best = min(best, (t, cfg), key=lambda b: b[0])
        emit(f"decode sparse MLA ({label}, best)", shape, best[0], t_base, flops=flops, nbytes=nbytes, cfg=str(best[1]))
    ratio = times["bf16"] / times["fp8 tile path"]
    old_ratio = times["bf16"] / times["fp8 old path"]
    RATIOS.append(dict(batch=batch, fp8_tile_vs_bf16=ratio, fp8_old_vs_bf16=old_ratio))
    print(f"  B{batch}: FP8 tile path / bf16 = x{ratio:.2f} in TFLOP/s (old FP8 path x{old_ratio:.2f})", flush=True)


def prefill(ctx_len: int, n_q: int = 4096, sweep: bool = False, mla_fp8: bool = False, run_mla: bool = True,
            run_indexer: bool = True):
    heads = 64
    max_blocks = ctx_len // BS
    table = torch.randperm(max_blocks, device="cuda").int()
    if run_indexer:
        prefill_indexer(ctx_len, n_q, heads, max_blocks, table, sweep)
    if run_mla:
        prefill_mla(ctx_len, n_q, max_blocks, table, sweep, mla_fp8)


def prefill_indexer(ctx_len: int, n_q: int, heads: int, max_blocks: int, table: torch.Tensor, sweep: bool):
    cache = random_indexer_cache(max_blocks)
    q = (torch.randn(n_q, heads, 128, device="cuda") * 2).to(FP8_E4M3)
    w = torch.randn(n_q, heads, device="cuda") * 0.05
    pos = ctx_len - n_q + torch.arange(n_q, device="cuda")
    shape = f"T{n_q} ctx{ctx_len // 1024}K H{heads}"
    logits = lightning_indexer_prefill(q, w, cache, table, ctx_len, BS)
    kk, ks = gather_request_keys(cache, table, ctx_len, BS)
    ref = indexer_logits_ref(q[-64:], w[-64:], kk, ks, pos[-64:])
    mag = indexer_logits_ref(q[-64:].float().abs(), w[-64:].abs(), kk.abs(), ks, pos[-64:])
    fin = torch.isfinite(ref)
    err = float(((logits[-64:][fin] - ref[fin]).abs() / (mag[fin] + 1e-6)).max())
    assert err < 1e-3 and torch.equal(fin, torch.isfinite(logits[-64:])), f"prefill indexer err {err}"
    print(f"  check ok: prefill indexer {shape}", flush=True)
    flops = float(((pos + 1).sum()) * heads * 128 * 2)
    # torch baseline: dense bf16 logits, 512 queries at a time, then torch.topk
    keys_bf = kk.to(torch.bfloat16)

    def torch_prefill():
        for i in range(0, n_q, 512):
            s = torch.einsum("thd,nd->thn", q[i : i + 512].to(torch.bfloat16), keys_bf).float().relu_()
            lg = torch.einsum("thn,th->tn", s, w[i : i + 512]) * ks
            torch.topk(lg, K, dim=-1)

    t_base = bench(torch_prefill, rep=1) if ctx_len <= 32768 else None
    cfgs = [None]
    if sweep:
        cfgs += [
            {"block_q": bq, "block_t": bt, "num_warps": nw, "num_stages": ns}
            for bq, bt, nw, ns in ((64, 128, 8, 3), (128, 128, 4, 3), (64, 256, 4, 3))
        ]
        cfgs += [{"fp8_precise": True}]
    best = None
    for cfg in cfgs:
        t = bench(lambda cfg=cfg: lightning_indexer_prefill(q, w, cache, table, ctx_len, BS, config=cfg), rep=30)
        if sweep:
            print(f"    sweep {cfg}: {t * 1e3:.2f} ms", flush=True)
        if best is None or t < best[0]:
            best = (t, cfg)
    emit("prefill indexer logits (fp8)", shape, best[0], None, flops=flops, cfg=str(best[1]))
    t_full = bench(lambda: indexer_prefill_topk(q, w, cache, table, ctx_len, BS, K, config=best[1]), rep=30)
    emit("prefill indexer+topk", shape, t_full, t_base, flops=flops)
    lengths = (pos + 1).int()
    lg = logits.contiguous()
    t_tk = bench(lambda: topk_indices(lg, lengths, K), rep=30)
    emit(
        "prefill topk only (radix)",
        f"{n_q}x{ctx_len}",
        t_tk,
        bench(lambda: torch.topk(lg, K, dim=-1), rep=30),
        nbytes=float(lengths.sum()) * 4 * 4,
    )


def prefill_mla(ctx_len: int, n_q: int, max_blocks: int, table: torch.Tensor, sweep: bool, mla_fp8: bool):
    pos = ctx_len - n_q + torch.arange(n_q, device="cuda")
    mheads = 128
    lat = random_latent(max_blocks, mla_fp8)
    qm = torch.randn(n_q, mheads, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, ctx_len - n_q, (n_q, K), device="cuda").int()
    posi = pos.int()
    out, lse = sparse_mla_prefill(qm, lat, idx, table, posi, 0.1352)
    ro, rl = sparse_mla_ref(qm[-8:], lat, idx[-8:], table[None].expand(8, -1), posi[-8:], 0.1352)
    err = float((out[-8:].float() - ro).norm() / ro.norm())
    assert err < 1e-2, f"sparse MLA prefill err {err}"
    mflops = n_q * mheads * K * (576 + 512) * 2

    def torch_mla():
        for i in range(0, n_q, 256):
            torch_sparse_mla(
                qm[i : i + 256], lat, idx[i : i + 256], table[None].expand(256, -1), posi[i : i + 256], 0.1352
            )

    t_base = bench(torch_mla, rep=1) if not mla_fp8 else None
    # the default (the Gluon kernel on sm_90 with a bf16 cache), the Triton kernel's plan, and with `sweep` its configs
    cfgs = [None, {"gluon": False}] + (
        [{"block_n": 64, "num_warps": 8, "num_stages": 1}] + mla_sweep(4096) if sweep else [])
    best = None
    for cfg in cfgs:
        t = bench(lambda cfg=cfg: sparse_mla_prefill(qm, lat, idx, table, posi, 0.1352, config=cfg), rep=30)
        print(f"    prefill sparse MLA {cfg}: {t * 1e3:.2f} ms ({mflops / t / 1e12:.0f} TFLOP/s)", flush=True)
        if best is None or t < best[0]:
            best = (t, cfg)
    emit(
        "prefill sparse MLA",
        f"T{n_q} H{mheads} k{K} {'fp8' if mla_fp8 else 'bf16'}",
        best[0],
        t_base,
        flops=mflops,
        cfg=str(best[1]),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--sweep", action="store_true", help="also sweep kernel configs")
    ap.add_argument("--only", default="decode_indexer,decode_mla,prefill", help="also prefill_mla: its sparse MLA only")
    ap.add_argument("--mla-batches", default="1,8,64", help="decode sparse MLA batch sizes")
    ap.add_argument("--indexer-batches", default="1,8,64", help="decode indexer batch sizes")
    ap.add_argument("--hist-sigmas", type=float, nargs="+", default=[SAMPLE_SIGMAS],
                    help="half-widths of the 1-in-8 histogram's band, in standard deviations (one row each)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: decode indexer (batch 1, 8) and decode sparse MLA (batch 1, 3) at tiny shapes under "
        "TRITON_INTERPRET=1, checks only",
    )
    args = ap.parse_args()
    HIST_SIGMAS[:] = args.hist_sigmas
    only = set(args.only.split(","))
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1 in the environment (Triton reads it at import)")
        global DEVICE, bench
        DEVICE, bench, only = "cpu", dry_bench, only & {"decode_indexer", "decode_mla"}
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU interpreter (dry run)"
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {device_name} torch {torch.__version__} triton {triton.__version__}",
        flush=True,
    )
    t0 = time.time()
    jobs = []
    if "decode_indexer" in only and args.dry_run:  # both kernels, the checks and (batch 8) the sweep
        jobs += [(decode_indexer, (1, 1024), dict(heads=16, k=64, check=True))]
        jobs += [(decode_indexer, (8, 1024), dict(heads=16, k=64, sweep=True))]
    elif "decode_indexer" in only:
        for batch in map(int, args.indexer_batches.split(",")):
            for ctx_len in (131072,) if args.quick else (8192, 32768, 131072):
                check = ctx_len == 8192 or (args.quick and batch == 1)
                jobs.append(
                    (decode_indexer, (batch, ctx_len), dict(sweep=args.sweep and ctx_len == 131072, check=check))
                )
    if "decode_mla" in only:
        for batch in (1, 3) if args.dry_run else map(int, args.mla_batches.split(",")):
            shapes = dict(heads=16, ctx_len=1024, k=128) if args.dry_run else {}
            jobs.append((decode_sparse_mla, (batch,), dict(sweep=args.sweep) | shapes))
    if "prefill" in only:
        for ctx_len in (32768, 131072):
            jobs.append((prefill, (ctx_len,), dict(sweep=args.sweep and ctx_len == 32768, run_mla=ctx_len == 32768)))
    elif "prefill_mla" in only:
        jobs.append((prefill, (32768,), dict(sweep=args.sweep, run_indexer=False)))
    for fn, a, kw in jobs:
        try:  # one failing case must not hide the others' numbers
            fn(*a, **kw)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {fn.__name__}{a}", flush=True)
        torch.cuda.empty_cache()
    print(f"# total {time.time() - t0:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "dsa_bench.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    lines = [
        "| what | shape | median us | GB/s | TFLOP/s | % ceiling | torch us | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:

        def fmt(v, p):
            return "" if v is None else f"{v:.{p}f}"

        lines.append(
            f"| {r['what']} | {r['shape']} | {r['us']:.1f} | {fmt(r['gbs'], 0)} | {fmt(r['tflops'], 1)} | "
            f"{r['pct']:.1f} | {fmt(r['torch_us'], 1)} | {fmt(r['speedup'], 1)} |"
        )
    ratio_tables = (
        (IDX_RATIOS, "| decode indexer logits | tiled us | persistent us | persistent % of HBM (keys) | speedup "
         "| best us | best config |",
         lambda r: f"| {r['shape']} | {r['tiled_us']:.1f} | {r['persistent_us']:.1f} | {r['pct_hbm']:.0f}% | "
                   f"x{r['speedup']:.2f} | {r['best_us']:.1f} | {r['best_cfg']} |"),
        (TOPK_RATIOS, "| decode top-k | radix indexer+topk us | one launch us | speedup | one launch, separate "
         "histogram us | speedup | separate 1-in-8 histogram us | speedup | radix topk only us | one launch topk "
         "only us (hist + select) | speedup | one-launch paths (path: rows) |",
         lambda r: f"| {r['shape']} | {r['radix_full_us']:.1f} | {r['one_launch_full_us']:.1f} | "
                   f"x{r['full_speedup']:.2f} | {r['one_launch_separate_us']:.1f} | x{r['separate_speedup']:.2f} | "
                   f"{r['one_launch_sampled_us']:.1f} | x{r['sampled_speedup']:.2f} | "
                   f"{r['radix_topk_us']:.1f} | {r['one_launch_topk_us']:.1f} | "
                   f"x{r['topk_speedup']:.2f} | {r['paths']} |"),
        (RATIOS, "| decode sparse MLA batch | FP8 tile path / bf16 (TFLOP/s) | FP8 old path / bf16 |",
         lambda r: f"| {r['batch']} | {r['fp8_tile_vs_bf16']:.2f} | {r['fp8_old_vs_bf16']:.2f} |"),
    )
    for records, header, row in ratio_tables:  # each table also appended to the JSON lines
        if records:
            lines += ["", header, "|---" * header.count(" | ") + "|---|", *map(row, records)]
            with open(out / "dsa_bench.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    (out / "dsa_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
