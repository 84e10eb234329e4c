"""K2 item 1: the one-launch decode top-k (`hearth.kernels.topk.one_launch`) by programs per row.

The kernel splits each row over grid axis 1 and its default is two programs per SM over all rows, rounded
down (`_programs_per_row`): 128 per row at b1 x 128K (1,024 keys each), 4 per row at b64 x 128K (~32K keys
each). Nothing in the kernel needs its programs resident together (the last to arrive on a row finishes it),
so more programs per row only adds waves, and a count that leaves some SMs a third program leaves the others
idle at the end. This times the
first histogram (`fine_hist_launch`, what the fused indexer adds) plus the selection for each
programs-per-row count, checks every result against torch (`check_topk`), and prints the best.

    python bench/bench_one_launch.py [--rows 1 8 64] [--n 131072] [--programs 0 8 16 32 64 128]
        [--warps 8 4] [--scans 0 1 2] [--blocks 1024 4096] [--samples 1 8] [--hist-blocks 0 4096] [--pdl 1 0]
        [--out DIR]   (programs / warps / hist blocks 0: the default; --pdl: the two launches with programmatic
        dependent launch on / off, `hearth.kernels._utils.PDL`)
    python bench/bench_one_launch.py --trace [--rows 1 8 64]   (GPU: where the default select's time goes)

Without a GPU it runs on the CPU under TRITON_INTERPRET=1 (tests, small --n): the same checks, wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

from hearth.kernels import _utils
from hearth.kernels.topk.one_launch import (
    HEADER,
    NBINS,
    PATH,
    SAMPLE_MIN_PER_K,
    _programs_per_row,
    _segment,
    default_sample,
    fine_hist_launch,
    new_one_launch_workspace,
    one_launch_plan,
    one_launch_topk_launch,
)
from hearth.kernels.topk.reference import check_topk, fine_bin_ref, order_key_ref, sample_positions_ref

K = 2048


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def median_us(fn) -> float:
    """Median microseconds of CUDA-graph replays (on the CPU: of three wall-timed calls)."""
    fn()
    if DEVICE == "cpu":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[1] * 1e6
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def run(kind: str, rows: int, n: int, programs: list[int], warps: list[int], scans: list[int],
        blocks: list[int], samples: list[int] = (1,), sigmas: list[float] = (6.0,),
        pdl: list[int] = (1,)) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    scores = torch.randn(rows, n, device=DEVICE, generator=g)
    if kind == "relu":
        scores = torch.relu(scores - 2.5)
    lengths = torch.full((rows,), n, dtype=torch.int32, device=DEVICE)
    out = torch.empty(rows, K, dtype=torch.int32, device=DEVICE)
    plan = one_launch_plan(K)
    ws = new_one_launch_workspace(rows, plan, scores.device)
    t_hist = median_us(lambda: (fine_hist_launch(scores, lengths, K, ws), ws[:, :256].zero_()))
    t_zero = median_us(lambda: ws[:, :256].zero_())
    results = []
    variants = [(p, w, sc, b, sa, sg, pd) for p in programs for w in warps for sc in scans for b in blocks
                for sa in samples for sg in (sigmas if sa > 1 else sigmas[:1]) for pd in pdl]
    for p, w, sc, b, sa, sg, pd in variants:
        per_row = p or _programs_per_row(rows, n, b, scores.device)
        _utils.PDL = bool(pd)

        def both(per_row=per_row, w=w, sc=sc, b=b, sa=sa, sg=sg) -> None:
            fine_hist_launch(scores, lengths, K, ws, sample=sa)
            one_launch_topk_launch(scores, lengths, out, ws, plan, programs=per_row, num_warps=w or None, scan=sc,
                                   block=b, sample=sa, sample_sigmas=sg)

        both()
        check_topk(out, scores, lengths, K)
        t = median_us(both)
        both()
        check_topk(out, scores, lengths, K)  # the workspace came out of the replays reusable
        paths = sorted(set(ws[:, HEADER + PATH].tolist()))  # the finishing paths of the last call
        select = t - (t_hist - t_zero)
        results.append(dict(kind=kind, rows=rows, n=n, programs_per_row=per_row, default=p == 0, warps=w,
                            scan=sc, block=b, sample=sa, sigmas=sg, pdl=pd, paths=paths, hist_plus_select_us=t,
                            select_us=select))
        print(f"{kind:5s} {rows:3d} x {n:6d}  programs/row {per_row:4d}{' (default)' if p == 0 else '':10s} "
              f"warps {w:2d} scan {sc} block {b:4d} sample {sa} sigmas {sg:g} pdl {pd}: histogram + select "
              f"{t:7.1f} us, select ~{select:7.1f} us (exact histogram), paths {paths}", flush=True)
    best = min(results, key=lambda r: r["hist_plus_select_us"])
    base = next((r for r in results if r["default"] and r["warps"] == warps[0] and r["scan"] == scans[0]
                 and r["block"] == blocks[0]), None)
    gain = f", {base['hist_plus_select_us'] / best['hist_plus_select_us']:.2f}x the default" if base else ""
    print(f"{kind:5s} {rows:3d} x {n:6d}  best: {best['programs_per_row']} programs/row, {best['warps']} warps, "
          f"scan {best['scan']}, block {best['block']}, pdl {best['pdl']}: {best['hist_plus_select_us']:.1f} us{gain}",
          flush=True)
    _utils.PDL = True
    return results


def timeline(rows: int, n: int) -> dict:
    """`timeline_of` randn rows."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    scores = torch.randn(rows, n, device=DEVICE, generator=g)
    return timeline_of(scores, torch.full((rows,), n, dtype=torch.int32, device=DEVICE), "randn")


def timeline_of(scores: torch.Tensor, lengths: torch.Tensor, label: str) -> dict:
    """Where the default select's time goes (GPU only): each program's global-timer stamps (`trace`) after the
    histogram launch, as offsets in us from the first program's start, medians over programs and the row's
    finish; the last of 5 eager calls, with the finishing paths it took."""
    rows, n = scores.shape
    out = torch.empty(rows, K, dtype=torch.int32, device=DEVICE)
    plan = one_launch_plan(K)
    ws = new_one_launch_workspace(rows, plan, scores.device)
    programs = triton.cdiv(n, _segment(rows, n, 1024, None, scores.device))  # the launch's grid axis 1
    trace = torch.zeros(rows, programs, 8, dtype=torch.int64, device=DEVICE)
    sample = default_sample(rows, n)
    for _ in range(5):
        trace.zero_()
        fine_hist_launch(scores, lengths, K, ws, sample=sample)
        one_launch_topk_launch(scores, lengths, out, ws, plan, sample=sample, trace=trace)
    torch.cuda.synchronize()
    check_topk(out, scores, lengths, K)
    paths = ws[:, HEADER + PATH].tolist()
    t0 = trace[..., 0].min().double()
    t = (trace[..., :4].double() - t0) / 1e3
    end = (trace[..., 4].max(dim=1).values.double() - t0) / 1e3  # each row's finish
    arrived = t[..., 3].max(dim=1).values
    sub, done = ((trace[..., j].max(dim=1).values.double() - t0) / 1e3 - arrived for j in (5, 6))
    res = dict(label=label, rows=rows, n=n, paths={p: paths.count(p) for p in sorted(set(paths))},
               programs_per_row=programs, start_spread_us=float(t[..., 0].max()),
               band_us=float((t[..., 1] - t[..., 0]).median()), scan_us=float((t[..., 2] - t[..., 1]).median()),
               scan_max_us=float((t[..., 2] - t[..., 1]).max()), arrive_us=float((t[..., 3] - t[..., 2]).median()),
               last_arrival_us=float(t[..., 3].max()), finish_us=float((end - t[..., 3].max(dim=1).values).median()),
               end_us=float(end.max()), finish_sub_bin_us=float(sub.median()), finish_path_us=float(done.median()))
    print(f"trace {label} {rows:3d} x {n:6d}  paths {res['paths']}, {programs} programs/row: starts spread over "
          f"{res['start_spread_us']:.2f} us; "
          f"per program (median) band {res['band_us']:.2f}, slice {res['scan_us']:.2f} (max {res['scan_max_us']:.2f}),"
          f" arrival {res['arrive_us']:.2f}; last arrival at {res['last_arrival_us']:.2f}, finish "
          f"{res['finish_us']:.2f} (median row: sub-bin picked at {res['finish_sub_bin_us']:.2f}, path done at "
          f"{res['finish_path_us']:.2f}), end at {res['end_us']:.2f} us", flush=True)
    return res


def hist_variants(rows: int, n: int, blocks: list[int], samples: list[int] = (1,)) -> list[dict]:
    """The first histogram alone (`fine_hist_launch`) by block, prefetch, warps and sample (the sampled rows'
    loop has no prefetch), checked against torch. Block 0: the default (`_hist_block`)."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    scores = torch.randn(rows, n, device=DEVICE, generator=g)
    lengths = torch.full((rows,), n, dtype=torch.int32, device=DEVICE)
    ws = new_one_launch_workspace(rows, one_launch_plan(K), scores.device)
    t_zero = median_us(lambda: ws[:, :NBINS].zero_())
    results = []
    for sa in samples:
        at = sample_positions_ref(n, sa if n >= SAMPLE_MIN_PER_K * K else 1).to(scores.device)
        want = torch.stack([torch.bincount(fine_bin_ref(order_key_ref(r[at])).long(), minlength=NBINS)
                            for r in scores])
        for b in blocks:
            for prefetch in (False, True) if sa == 1 else (False,):
                for w in (8, 4):
                    ws[:, :NBINS].zero_()
                    fine_hist_launch(scores, lengths, K, ws, block=b or None, prefetch=prefetch, num_warps=w, sample=sa)
                    assert torch.equal(ws[:, :NBINS].long(), want), "histogram differs from torch"
                    t = median_us(lambda b=b, p=prefetch, w=w, sa=sa: (
                        fine_hist_launch(scores, lengths, K, ws, block=b or None, prefetch=p, num_warps=w, sample=sa),
                        ws[:, :NBINS].zero_()))
                    results.append(dict(rows=rows, n=n, block=b, prefetch=prefetch, warps=w, sample=sa,
                                        hist_us=t - t_zero))
                    print(f"hist  {rows:3d} x {n:6d}  block {b:4d} prefetch {int(prefetch)} warps {w} sample {sa}: "
                          f"{t - t_zero:7.1f} us ({rows * n * 4 / (t - t_zero) / 1e3:.0f} GB/s)", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--programs", type=int, nargs="+", default=[0, 8, 16, 32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 4], help="0: the default (8)")
    ap.add_argument("--scans", type=int, nargs="+", default=[0], help="_scan_slice's SCAN variants (0 1 2)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024], help="keys per step of a selection program")
    ap.add_argument("--kinds", nargs="+", default=["randn", "relu"], choices=["randn", "relu"])
    ap.add_argument("--hist-blocks", type=int, nargs="*", default=[],
                    help="also time the first histogram alone at these block sizes (prefetch on / off, 8 / 4 warps;"
                    " 0: the default block)")
    ap.add_argument("--sigmas", type=float, nargs="+", default=[6.0], help="sampled bands' half-widths (sample > 1)")
    ap.add_argument("--samples", type=int, nargs="+", default=[1],
                    help="first histograms from one key in every sample (1: every key; rows of >= 32 k keys only)")
    ap.add_argument("--pdl", type=int, nargs="+", default=[1], help="programmatic dependent launch on (1) / off (0)")
    ap.add_argument("--trace", action="store_true", help="only the default select's timeline per --rows (GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.trace:
        traced = [timeline(rows, args.n) for rows in args.rows]
        Path(args.out, "one_launch_trace.json").write_text(json.dumps(traced, indent=1))
        return
    if args.hist_blocks:
        hist = [r for rows in args.rows for r in hist_variants(rows, args.n, args.hist_blocks, args.samples)]
        Path(args.out, "one_launch_hist.json").write_text(json.dumps(hist, indent=1))
    results = [r for kind in args.kinds for rows in args.rows
               for r in run(kind, rows, args.n, args.programs, args.warps, args.scans, args.blocks, args.samples,
                            args.sigmas, args.pdl)]
    Path(args.out, "one_launch_programs.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
