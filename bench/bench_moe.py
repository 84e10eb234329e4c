"""Benchmark the fused routed-expert MoE (hearth.kernels.moe.fused_moe) on one GPU at decode and small
batch sizes, after a correctness check against the torch reference, beside the old launch (grouped
tl.dot, BLOCK_M 16, BLOCK_N 64, 4 warps, 3 stages) measured in the same run.

    python bench/bench_moe.py [--out DIR] [--sweep] [--budget SECONDS] [--tokens 1,4,8,32,128]

Shapes: T tokens, top-8 over S=64 cache slots (distinct random slots per token), D=7168, I=2048, FP8
e4m3 with 128x128 block scales and bf16 weights. Each line: median time replayed from a CUDA graph (as
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
from hearth.kernels.moe.fused_moe import MoeLaunch, TileConfig, default_launch, fused_moe_launch

BW = 4.28e12
S, TOPK, D, I = 64, 8, 7168, 2048
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


def time_launch(args, launch: MoeLaunch, graph: bool = True) -> float:
    """Median seconds of one fused_moe call with ``launch`` (CUDA-graph replay, or eager)."""
    out = torch.zeros((args[0].shape[0], D), dtype=torch.float32, device=DEVICE)

    def fn():
        fused_moe_launch(*args, out, launch=launch)

    fn()
    if DEVICE == "cpu":  # --dry-run: one call, wall clock
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e-3
    return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e-3


def check(args, want: torch.Tensor, launch: MoeLaunch) -> float:
    got = fused_moe_launch(*args, None, launch=launch)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also try a few launches per shape; print BEST")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds since start after which the sweep stops")
    ap.add_argument("--tokens", default="1,4,8,32,128")
    ap.add_argument("--dtypes", default="fp8,bf16")
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
    dtypes = opts.dtypes.split(",")
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
            launch, base = default_launch(ids.numel(), S, fp8), old_launch(fp8)
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
