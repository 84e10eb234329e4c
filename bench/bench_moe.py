"""Benchmark the fused routed-expert MoE (hearth.kernels.moe.fused_moe) on one GPU at decode and small
batch sizes, after a correctness check against the torch reference, beside the old launch (grouped
tl.dot, BLOCK_M 16, BLOCK_N 64, 4 warps, 3 stages) measured in the same run.

    python bench/bench_moe.py [--out DIR] [--sweep] [--budget SECONDS] [--tokens 1,4,8,32,128]

Shapes: T tokens, top-8 over S=64 cache slots (distinct random slots per token), D=7168, I=2048, FP8
e4m3 with 128x128 block scales and bf16 weights. ``--dtypes mxfp4``: gpt-oss-120b's experts instead
(D = I = 2880, 128 slots, top-4, MXFP4 with biases, the clamped SwiGLU and interleaved gate/up rows),
three rows a shape: the bits decode (the default), the first arithmetic decode, and the same experts dequantised
to bf16, with the ratios new/old and new/bf16 (``--sweep``: GEMV tiles for the bits decode).
Each line: median time replayed from a CUDA graph (as
the engine's decode step runs) and eager, GB/s of the weight bytes touched (distinct slots x expert
bytes) and % of 4.28 TB/s, TFLOP/s, the old launch's time and the ratio. --sweep also tries a few
launches per shape (rows per block, tile, warps, stages, K splits; coordinate-wise, within --budget
seconds of the whole run) and prints ``BEST`` per shape. Writes moe_bench.jsonl into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

from hearth.kernels.moe import moe_reference
from hearth.kernels.moe.fused_moe import ExpertExtras, MoeLaunch, TileConfig, default_launch, fused_moe_launch
from hearth.kernels.moe.mxfp4 import BITS_PER_VALUE, dequantize_mxfp4, quantize_mxfp4

BW = 4.28e12
S, TOPK, D, I = 64, 8, 7168, 2048
GPT_OSS = dict(S=128, TOPK=4, D=2880, I=2880)  # gpt-oss-120b's experts
SWIGLU_LIMIT = 7.0
DEVICE = "cuda"
ROWS: list[dict] = []
START = time.monotonic()


def old_launch(fp8: bool) -> MoeLaunch:
    tile = TileConfig(block_n=64, block_k=128 if fp8 else 64, num_warps=4, num_stages=3)
    return MoeLaunch(gemv=False, block_m=16, gate_up=tile, down=tile)


def make_weights(fp8: bool, seed: int = 0):
    """Random experts for S slots; FP8 codes with power-of-two block scales (no NaN codes)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n_i, n_d = I // 128, D // 128
    if fp8:
        w13 = torch.empty((S, 2 * I, D), dtype=torch.float8_e4m3fn, device=DEVICE)
        w2 = torch.empty((S, D, I), dtype=torch.float8_e4m3fn, device=DEVICE)
        for s in range(S):  # one slot at a time keeps the fp32 temporaries small
            w13[s] = (torch.randn((2 * I, D), generator=g, device=DEVICE) * 8).to(torch.float8_e4m3fn)
            w2[s] = (torch.randn((D, I), generator=g, device=DEVICE) * 8).to(torch.float8_e4m3fn)
        s13 = torch.exp2(torch.randint(-10, -7, (S, 2 * n_i, n_d), generator=g, device=DEVICE).float())
        s2 = torch.exp2(torch.randint(-10, -7, (S, n_d, n_i), generator=g, device=DEVICE).float())
        return w13, w2, s13, s2
    w13 = torch.empty((S, 2 * I, D), dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.empty((S, D, I), dtype=torch.bfloat16, device=DEVICE)
    for s in range(S):
        w13[s] = torch.randn((2 * I, D), generator=g, device=DEVICE) * 0.02
        w2[s] = torch.randn((D, I), generator=g, device=DEVICE) * 0.02
    return w13, w2, None, None


def make_routing(t: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn((t, D), generator=g, device=DEVICE).bfloat16()
    ids = torch.rand((t, S), generator=g, device=DEVICE).argsort(dim=1)[:, :TOPK].int()  # distinct per token
    weights = torch.rand((t, TOPK), generator=g, device=DEVICE).softmax(-1)
    return x, ids, weights


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def time_launch(args, launch: MoeLaunch, graph: bool = True, extras: ExpertExtras | None = None) -> float:
    """Median seconds of one fused_moe call with ``launch`` (CUDA-graph replay, or eager)."""
    out = torch.zeros((args[0].shape[0], D), dtype=torch.float32, device=DEVICE)
    extras = extras or ExpertExtras()

    def fn():
        fused_moe_launch(*args, out, launch=launch, extras=extras)

    fn()
    if DEVICE == "cpu":  # --dry-run: one call, wall clock
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e-3
    return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e-3


def check(args, want: torch.Tensor, launch: MoeLaunch, extras: ExpertExtras | None = None) -> float:
    got = fused_moe_launch(*args, None, launch=launch, extras=extras or ExpertExtras())
    return rel_err(got, want)


def emit(what: str, shape: str, t_s: float, eager_s: float | None, base_s: float, nbytes: int, flops: int, **extra):
    gbs, tfs = nbytes / t_s / 1e9, flops / t_s / 1e12
    pct = 100 * nbytes / t_s / BW
    row = dict(what=what, shape=shape, us=t_s * 1e6, eager_us=eager_s * 1e6 if eager_s else None, gbs=gbs,
               pct_bw=pct, tflops=tfs, old_us=base_s * 1e6, speedup=base_s / t_s, floor_us=nbytes / BW * 1e6,
               **extra)  # fmt: skip
    ROWS.append(row)
    eager = f"eager {eager_s * 1e6:8.1f}" if eager_s else "eager      n/a"
    floor = nbytes / BW * 1e6
    print(
        f"{what:5s} {shape:26s} {t_s * 1e6:8.1f} us  {eager} us  {gbs:6.0f} GB/s {pct:5.1f}%  {tfs:6.1f} TF/s  "
        f"floor {floor:6.1f} us  old {base_s * 1e6:8.1f} us  x{base_s / t_s:5.2f}  {extra.get('launch', '')}",
        flush=True,
    )


def gemv_tiles() -> list[TileConfig]:
    """GEMV tiles to try, most promising first (the sweep may stop part way)."""
    return [
        TileConfig(16, 512, 4, 2),
        TileConfig(32, 256, 4, 2),
        TileConfig(16, 256, 4, 3),
        TileConfig(32, 512, 8, 2),
        TileConfig(8, 512, 2, 2),
        TileConfig(16, 512, 4, 1),
        TileConfig(64, 128, 4, 2),
    ]


def fits(block_m: int, tile: TileConfig) -> bool:
    """Skip GEMV tiles whose fp32 broadcast product would need over 128 registers a thread."""
    return block_m * tile.block_n * tile.block_k <= 128 * 32 * tile.num_warps


def sweep(args, want, fp8: bool, t: int, base: MoeLaunch, base_s: float, deadline: float) -> tuple[float, MoeLaunch]:
    """Coordinate-wise search from the default: rows per block, then the gate/up tile, then the down
    tile and K split; the tl.dot path beside it for larger T. Stops trying at ``deadline`` (monotonic
    seconds). Returns the best (seconds, launch)."""
    results: dict[MoeLaunch, float] = {base: base_s}
    skipped = []

    def trial(launch: MoeLaunch) -> float:
        if launch in results:
            return results[launch]
        if time.monotonic() > deadline:
            if not skipped:
                print("    sweep: this shape's time is spent; the rest is skipped", flush=True)
            skipped.append(launch)
            return float("inf")
        try:
            err = check(args, want, launch)
            sec = time_launch(args, launch) if err < 2e-2 else float("inf")
            note = "" if err < 2e-2 else f"  WRONG rel err {err:.2e}"
        except Exception as e:  # a config that does not compile or fit must not end the sweep
            sec, note = float("inf"), f"  failed: {type(e).__name__}: {str(e)[:80]}"
        results[launch] = sec
        print(f"    sweep {launch.describe():60s} {sec * 1e6:9.1f} us{note}", flush=True)
        return sec

    best = (trial(base), base)
    if t <= 32:
        for block_m in (1, 2, 4, 8):
            if block_m > 2 * t or (t >= 32 and block_m == 1):
                continue
            cand = dataclasses.replace(best[1], gemv=True, block_m=block_m)
            if not best[1].gemv:
                cand = dataclasses.replace(cand, gate_up=TileConfig(16, 256), down=TileConfig(16, 256))
            if fits(block_m, cand.gate_up) and fits(block_m, cand.down):
                best = min(best, (trial(cand), cand), key=lambda r: r[0])
        # gate/up moves 2/3 of the bytes: its tile first, then the down tile, then K splits of down
        if best[1].gemv:
            for tile in gemv_tiles():
                if fits(best[1].block_m, tile):
                    cand = dataclasses.replace(best[1], gate_up=tile)
                    best = min(best, (trial(cand), cand), key=lambda r: r[0])
            for tile in gemv_tiles():
                if fits(best[1].block_m, tile):
                    cand = dataclasses.replace(best[1], down=dataclasses.replace(tile, split_k=best[1].down.split_k))
                    best = min(best, (trial(cand), cand), key=lambda r: r[0])
            for split in (2, 4):
                cand = dataclasses.replace(best[1], down=dataclasses.replace(best[1].down, split_k=split))
                best = min(best, (trial(cand), cand), key=lambda r: r[0])
    if t >= 32:
        bk = 128 if fp8 else 64
        for block_m, tile in (
            (16, TileConfig(64, bk, 4, 3)),
            (16, TileConfig(128, bk, 8, 3)),
            (16, TileConfig(128, bk, 4, 4)),
            (32, TileConfig(128, bk, 8, 3)),
            (16, TileConfig(64, bk, 4, 5)),
        ):
            cand = MoeLaunch(gemv=False, block_m=block_m, gate_up=tile, down=tile)
            best = min(best, (trial(cand), cand), key=lambda r: r[0])
    return best


def make_mxfp4_experts(s: int, d: int, inter: int, seed: int = 0):
    """gpt-oss-like experts for ``s`` slots: MXFP4 codes of random weights (quantised one slot at a time),
    biases, and the same experts dequantised to bf16 (the bf16 rows)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks13 = torch.empty((s, 2 * inter, d // 32, 16), dtype=torch.uint8, device=DEVICE)
    scales13 = torch.empty((s, 2 * inter, d // 32), dtype=torch.uint8, device=DEVICE)
    blocks2 = torch.empty((s, d, inter // 32, 16), dtype=torch.uint8, device=DEVICE)
    scales2 = torch.empty((s, d, inter // 32), dtype=torch.uint8, device=DEVICE)
    for i in range(s):
        w13 = torch.randn((2 * inter, d), generator=g, device=DEVICE) * 0.02
        blocks13[i], scales13[i] = quantize_mxfp4(w13)
        w2 = torch.randn((d, inter), generator=g, device=DEVICE) * 0.02
        blocks2[i], scales2[i] = quantize_mxfp4(w2)
    f13 = dequantize_mxfp4(blocks13, scales13, torch.bfloat16)
    f2 = dequantize_mxfp4(blocks2, scales2, torch.bfloat16)
    extras = ExpertExtras(
        b13=(torch.randn((s, 2 * inter), generator=g, device=DEVICE) * 0.1).bfloat16(),
        b2=(torch.randn((s, d), generator=g, device=DEVICE) * 0.1).bfloat16(),
        swiglu_limit=SWIGLU_LIMIT, interleaved=True,
    )
    return (blocks13, blocks2, scales13, scales2), (f13, f2), extras


def mxfp4_tiles() -> list[TileConfig]:
    """GEMV tiles for the MXFP4 bits decode (block_k >= 32), most promising first."""
    return [
        TileConfig(8, 512, 2, 2),
        TileConfig(16, 512, 4, 2),
        TileConfig(8, 256, 2, 2),
        TileConfig(16, 256, 4, 2),
        TileConfig(8, 1024, 4, 2),
        TileConfig(32, 256, 4, 2),
        TileConfig(32, 512, 8, 2),
        TileConfig(4, 512, 1, 2),
        TileConfig(16, 512, 4, 3),
    ]


def sweep_mxfp4(args, want, extras, t: int, results: dict, deadline: float) -> tuple[float, MoeLaunch]:
    """GEMV launches of the bits decode: rows per block, then the tile (gate/up and down alike), then
    K splits of down; stops trying at ``deadline``. ``results`` holds what is measured already."""

    def trial(launch: MoeLaunch) -> float:
        if launch in results:
            return results[launch]
        if time.monotonic() > deadline:
            return float("inf")
        try:
            err = check(args, want, launch, extras)
            sec = time_launch(args, launch, extras=extras) if err < 2e-2 else float("inf")
            note = "" if err < 2e-2 else f"  WRONG rel err {err:.2e}"
        except Exception as e:  # a config that does not compile or fit must not end the sweep
            sec, note = float("inf"), f"  failed: {type(e).__name__}: {str(e)[:80]}"
        results[launch] = sec
        print(f"    sweep {launch.describe():60s} {sec * 1e6:9.1f} us{note}", flush=True)
        return sec

    best = min(((sec, cfg) for cfg, sec in results.items() if cfg.mxfp4_decode == "bits"), key=lambda r: r[0])
    base_tile = TileConfig(8, 512, 2, 2)
    for block_m in (1, 2, 4, 8):
        if block_m <= max(1, t * TOPK // 8):
            cand = MoeLaunch(gemv=True, block_m=block_m, gate_up=base_tile, down=base_tile, mxfp4_decode="bits")
            best = min(best, (trial(cand), cand), key=lambda r: r[0])
    block_m = best[1].block_m if best[1].gemv else 1
    for tile in mxfp4_tiles():
        if 2 * block_m * tile.block_n * tile.block_k <= 128 * 32 * tile.num_warps:  # registers a thread
            cand = MoeLaunch(gemv=True, block_m=block_m, gate_up=tile, down=tile, mxfp4_decode="bits")
            best = min(best, (trial(cand), cand), key=lambda r: r[0])
    if best[1].gemv:
        for split in (2, 4):
            cand = dataclasses.replace(best[1], down=dataclasses.replace(best[1].down, split_k=split))
            best = min(best, (trial(cand), cand), key=lambda r: r[0])
    return best


def bench_mxfp4(tokens: list[int], opts, best_lines: list[str]) -> None:
    """gpt-oss's MXFP4 experts: the bits decode, the arithmetic decode and bf16 weights, per T."""
    global S, TOPK, D, I
    S, TOPK, D, I = (12, 4, 256, 128) if DEVICE == "cpu" else tuple(GPT_OSS.values())
    print(f"mxfp4: S={S} slots, top-{TOPK}, D={D}, I={I}, gpt-oss extras (biases, limit {SWIGLU_LIMIT}, "
          "interleaved gate/up)", flush=True)
    mx, bf, extras = make_mxfp4_experts(S, D, I)
    values = 3 * D * I
    bias_bytes = (2 * I + D) * 2
    mx_bytes, bf_bytes = int(values * BITS_PER_VALUE / 8) + bias_bytes, values * 2 + bias_bytes
    for t in tokens:
        x, ids, weights = make_routing(t, seed=t)
        want = moe_reference(x, ids, weights, *bf, b13=extras.b13, b2=extras.b2, swiglu_limit=SWIGLU_LIMIT,
                             interleaved=True)  # fmt: skip
        distinct = int(ids.unique().numel())
        shape = f"mxfp4 T={t} slots={distinct}"
        new = default_launch(ids.numel(), S, "mxfp4")
        old = dataclasses.replace(new, mxfp4_decode="arith")
        runs = (("bits", (x, ids, weights, *mx), new), ("arith", (x, ids, weights, *mx), old),
                ("bf16", (x, ids, weights, *bf, None, None), default_launch(ids.numel(), S, "float")))  # fmt: skip
        times = {}
        for name, args, launch in runs:
            err = check(args, want, launch, extras)
            if not err < 2e-2:
                raise SystemExit(f"{name} {launch.describe()} wrong at {shape}: rel err {err:.2e}")
            times[name] = time_launch(args, launch, extras=extras)
        for name, nbytes in (("bits", mx_bytes), ("arith", mx_bytes), ("bf16", bf_bytes)):
            sec, touched = times[name], distinct * nbytes
            row = dict(what=f"mxfp4-{name}", shape=shape, us=sec * 1e6, gbs=touched / sec / 1e9,
                       pct_bw=100 * touched / sec / BW, new_over_old=times["bits"] / times["arith"],
                       new_over_bf16=times["bits"] / times["bf16"], launch=new.describe())  # fmt: skip
            ROWS.append(row)
            print(f"{name:5s} {shape:26s} {row['us']:8.1f} us  {row['gbs']:6.0f} GB/s {row['pct_bw']:5.1f}%  "
                  f"new/old {row['new_over_old']:5.2f}  new/bf16 {row['new_over_bf16']:5.2f}  {new.describe()}",
                  flush=True)  # fmt: skip
        if opts.sweep:
            now = time.monotonic()
            deadline = now + max(0.0, START + opts.budget - now) / (len(tokens) - tokens.index(t))
            results = {new: times["bits"]}
            sec, cfg = sweep_mxfp4((x, ids, weights, *mx), want, extras, t, results, deadline)
            ROWS.append(dict(what="mxfp4-best", shape=shape, us=sec * 1e6, launch=cfg.describe(),
                             gbs=distinct * mx_bytes / sec / 1e9))  # fmt: skip
            default_us = times["bits"] * 1e6
            best_lines.append(f"BEST {shape:26s} {sec * 1e6:8.1f} us  {cfg.describe()}  (default {default_us:.1f} us)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also try a few launches per shape; print BEST")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds since start after which the sweep stops")
    ap.add_argument("--tokens", default="1,4,8,32,128")
    ap.add_argument("--dtypes", default="fp8,bf16", help="any of fp8, bf16, mxfp4 (gpt-oss shapes)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): a smoke test")
    opts = ap.parse_args()
    if opts.dry_run:
        global S, D, I, DEVICE
        S, D, I, DEVICE = 12, 256, 128, "cpu"
    tokens = [int(v) for v in opts.tokens.split(",")]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"{gpu}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    print(f"S={S} slots, top-{TOPK}, D={D}, I={I}; ceiling {BW / 1e12:.2f} TB/s; times are medians", flush=True)
    best_lines = []
    dtypes = [d for d in opts.dtypes.split(",") if d != "mxfp4"]
    shapes_left = len(dtypes) * len(tokens)
    for dname in dtypes:
        fp8 = dname == "fp8"
        w13, w2, s13, s2 = make_weights(fp8)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        if fp8:
            expert_bytes += (s13[0].numel() + s2[0].numel()) * 4
        for t in tokens:
            x, ids, weights = make_routing(t, seed=t)
            args = (x, ids, weights, w13, w2, s13, s2)
            want = moe_reference(*args)
            distinct = int(ids.unique().numel())
            nbytes, flops = distinct * expert_bytes, 6 * t * TOPK * D * I
            shape = f"{dname} T={t} slots={distinct}"
            launch, base = default_launch(ids.numel(), S, "fp8" if fp8 else "float"), old_launch(fp8)
            for name, cfg in (("new", launch), ("old", base)):
                err = check(args, want, cfg)
                if not err < 2e-2:
                    raise SystemExit(f"{name} launch {cfg.describe()} wrong at {shape}: rel err {err:.2e}")
            t_new, t_old = time_launch(args, launch), time_launch(args, base)
            emit("fused", shape, t_new, time_launch(args, launch, graph=False), t_old, nbytes, flops,
                 launch=launch.describe())  # fmt: skip
            shapes_left -= 1
            if opts.sweep:
                now = time.monotonic()
                deadline = now + max(0.0, START + opts.budget - now) / (shapes_left + 1)
                sec, cfg = sweep(args, want, fp8, t, launch, t_new, deadline)
                emit("best", shape, sec, None, t_old, nbytes, flops, launch=cfg.describe())
                default_us = t_new * 1e6
                best = f"BEST {shape:26s} {sec * 1e6:8.1f} us  {cfg.describe()}"
                best_lines.append(f"{best}  (default {default_us:.1f} us)")
        del w13, w2, s13, s2
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if "mxfp4" in opts.dtypes.split(","):
        bench_mxfp4(tokens, opts, best_lines)
    for line in best_lines:
        print(line)
    print(f"total {time.monotonic() - START:.0f} s")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "moe_bench.jsonl", "w") as f:
        for row in ROWS:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
