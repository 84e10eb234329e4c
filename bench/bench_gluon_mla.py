"""Time the Gluon sparse MLA kernels (kernels/sparse_mla/gluon_kernels.py: "seesaw" and "simple") beside the
Triton kernel (`sparse_mla_decode` / `sparse_mla_prefill` with config {"gluon": False}: its default launch plan)
on one Hopper GPU, decode and prefill.

    python3 bench/bench_gluon_mla.py [--batches 1,8,64] [--prefill 4096] [--variants seesaw,simple] [--events]
    python3 bench/bench_gluon_mla.py --fp8 [--fp8-configs 'default;regs=240;prefetch=0'] [--batches ..] [--prefill ..]

Shapes: batch 1, 8, 64 x 128 heads x top-k 2048 of a 32K-token context (random distinct positions per
request), bf16 latent cache in 64-token pages. Each kernel is first checked against `sparse_mla_decode_ref`
(max abs error of out and lse on every row), then timed: median of CUDA-graph replays
(triton.testing.do_bench_cudagraph, as bench/bench_dsa.py times decode) or, with --events, the median of
torch.cuda.Event pairs around single launches. TFLOP/s counts batch * heads * k * (576 + 512) * 2 FLOPs, as
bench_dsa.py's decode_mla rows. A watchdog (faulthandler) dumps the stacks and ends the process (exit status 1)
if one step (compile, check, timing) takes longer than --timeout seconds (a hung mbarrier protocol in a variant
being changed). Prefill rows (--prefill): bench_dsa.py's prefill_mla shape, the first and last 8 queries checked.
H200, 2026-12-04: see gluon_kernels.py's module doc.

--fp8: the same shapes over an FP8 cache (`quantize_latent_fp8` of the bf16 latents, whose four 128-value groups get
distinct gains, so rows carry four scales), instead of the bf16 rows: the Triton kernel's FP8 tile path
(`config={"gluon": False}`), the Gluon FP8 seesaw (`sparse_mla_decode_gluon` on the uint8 cache, whatever
gluon_kernels.FP8 says) under each of --fp8-configs (`SEESAW_FP8` overrides: "default", or key=value pairs joined
by commas, e.g. "regs=240,prefetch=0"), and the Gluon bf16 seesaw on the dequantised cache (the same values in bf16:
the speed the FP8 variant is to match). All checked against the reference on the FP8 cache."""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from hearth.kernels.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from hearth.kernels.sparse_mla.gluon_kernels import GLUON_ERROR, VARIANTS, gluon_launch, sparse_mla_decode_gluon
from hearth.kernels.sparse_mla.reference import (
    dequantize_latent_fp8,
    quantize_latent_fp8,
    sparse_mla_decode_ref,
    sparse_mla_prefill_ref,
)

BS = 64
SM_SCALE = 0.1352


def problem(batch: int, heads: int, ctx_len: int, k: int):
    max_blocks = ctx_len // BS
    cache = torch.randn(batch * max_blocks, BS, 576, device="cuda").to(torch.bfloat16)
    table = torch.randperm(batch * max_blocks, device="cuda").int().view(batch, max_blocks)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 576, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(ctx_len, device="cuda")[:k] for _ in range(batch)]).int()
    return q, cache, idx, table, ctx


def fp8_latents(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 cache of `cache`'s latents, its four 128-value groups scaled by distinct gains first (four scales a
    row), and its dequantised bf16 copy (the values the kernels see)."""
    gain = torch.tensor([0.25, 1.0, 4.0, 2.0], device=cache.device).repeat_interleave(128)
    lat = cache.float()
    lat[..., :512] *= gain
    fp8 = quantize_latent_fp8(lat.to(torch.bfloat16))
    return fp8, dequantize_latent_fp8(fp8).to(torch.bfloat16)


def parse_fp8_configs(text: str) -> list[tuple[str, dict]]:
    """--fp8-configs: ';'-separated entries, each "default" or comma-joined key=value (ints, 0/1 for flags)."""
    out = []
    for entry in (e.strip() for e in text.split(";") if e.strip()):
        cfg = {} if entry == "default" else {k: int(v) for k, v in (kv.split("=") for kv in entry.split(","))}
        cfg = {k: bool(v) if k in ("prefetch", "proxy_fence") else v for k, v in cfg.items()}
        out.append((entry, cfg))
    return out


def time_events(fn, rep: int = 100) -> float:
    """Median seconds of `rep` launches, each between two CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2] * 1e-3


def time_graph(fn, rep: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3


def time_kernels(kernels, shape: str, flops: int, checked, ref_out, ref_lse, args, timer, rep: int) -> None:
    """Run each (name, fn) once, compare `checked(out, lse)` with the reference (max abs errors), time it; one line
    each, the first kernel (Triton's) the ratios' base. A kernel that fails to compile or launch is reported and
    the others timed; one that hangs longer than `args.timeout` ends the process with its stacks."""
    t_base = None
    for name, fn in kernels:
        faulthandler.dump_traceback_later(args.timeout, exit=True)
        try:
            out, lse = checked(*fn())
            torch.cuda.synchronize()
            err_o = float((out.float() - ref_out).abs().max())
            err_l = float((lse - ref_lse).abs().max())
            t = timer(fn, rep)
        except Exception as e:  # noqa: BLE001 - report it, time the others
            print(f"{name:16s} {shape:26s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
        t_base = t if t_base is None and name == kernels[0][0] else t_base
        ratio = f"x{t_base / t:5.2f}" if t_base else ""
        print(f"{name:16s} {shape:26s} {t * 1e6:9.1f} {flops / t / 1e12:8.1f} {err_o:10.2e} {err_l:10.2e}  {ratio}",
              flush=True)


def run_batch(batch: int, args, variants: list[str], timer) -> None:
    """Check, then time, the Triton kernel and each gluon variant at one batch size; one line each."""
    torch.manual_seed(batch)
    q, cache, idx, table, ctx = problem(batch, args.heads, args.ctx, args.k)
    ref_out, ref_lse = sparse_mla_decode_ref(q, cache, idx, table, ctx, SM_SCALE)
    flops = batch * args.heads * args.k * (576 + 512) * 2
    shape = f"B{batch} H{args.heads} k{args.k} ctx{args.ctx}"
    kernels = [("triton", lambda: sparse_mla_decode(q, cache, idx, table, ctx, SM_SCALE, config={"gluon": False}))]
    for v in variants:
        kernels.append((f"gluon {v}", lambda v=v: sparse_mla_decode_gluon(q, cache, idx, table, ctx, SM_SCALE,
                                                                          variant=v)))
    time_kernels(kernels, shape, flops, lambda out, lse: (out, lse), ref_out, ref_lse, args, timer, args.rep)


def run_batch_fp8(batch: int, args, timer) -> None:
    """The FP8 rows at one batch size: Triton's FP8 tile path, the Gluon FP8 seesaw under each --fp8-configs entry,
    the Gluon bf16 seesaw on the dequantised cache."""
    torch.manual_seed(batch)
    q, cache, idx, table, ctx = problem(batch, args.heads, args.ctx, args.k)
    fp8, deq = fp8_latents(cache)
    del cache
    ref_out, ref_lse = sparse_mla_decode_ref(q, fp8, idx, table, ctx, SM_SCALE)
    flops = batch * args.heads * args.k * (576 + 512) * 2
    shape = f"B{batch} H{args.heads} k{args.k} ctx{args.ctx}"
    kernels = [("triton fp8", lambda: sparse_mla_decode(q, fp8, idx, table, ctx, SM_SCALE, config={"gluon": False}))]
    if GLUON_ERROR is None:
        for name, cfg in parse_fp8_configs(args.fp8_configs):
            kernels.append((f"gluon fp8 {name}", lambda cfg=cfg: sparse_mla_decode_gluon(
                q, fp8, idx, table, ctx, SM_SCALE, config=cfg or None)))
        kernels.append(("gluon bf16 deq", lambda: sparse_mla_decode_gluon(q, deq, idx, table, ctx, SM_SCALE)))
    time_kernels(kernels, shape, flops, lambda out, lse: (out, lse), ref_out, ref_lse, args, timer, args.rep)


def prefill_problem(n_q: int, args):
    """A prefill chunk of `n_q` queries at the end of an `args.ctx`-token bf16 cache, each selecting `args.k`
    earlier positions, with the rows checked against the reference (the first and last 8) and its FLOPs."""
    torch.manual_seed(n_q)
    blocks = args.ctx // BS
    cache = torch.randn(blocks, BS, 576, device="cuda").to(torch.bfloat16)
    table = torch.randperm(blocks, device="cuda").int()
    q = torch.randn(n_q, args.heads, 576, device="cuda").to(torch.bfloat16)
    pos = (args.ctx - n_q + torch.arange(n_q, device="cuda")).int()
    idx = torch.randint(0, args.ctx - n_q, (n_q, args.k), device="cuda").int()
    rows = torch.cat([torch.arange(8), torch.arange(n_q - 8, n_q)]).cuda()
    flops = n_q * args.heads * args.k * (576 + 512) * 2
    return cache, table, q, pos, idx, rows, flops, f"T{n_q} H{args.heads} k{args.k} ctx{args.ctx}"


def gluon_prefill(q, cache, idx, table, pos, variant: str = "seesaw"):
    """The prefill chunk on a Gluon kernel directly (one shared table, each query's position its limit)."""
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device="cuda")
    return gluon_launch(q, cache, idx, table, 0, pos, 0, SM_SCALE, out, lse, variant=variant)


def run_prefill_fp8(n_q: int, args, timer) -> None:
    """`run_prefill`'s chunk over an FP8 cache: Triton's FP8 tile path, the Gluon FP8 seesaw (its default
    settings), the Gluon bf16 seesaw on the dequantised cache."""
    cache, table, q, pos, idx, rows, flops, shape = prefill_problem(n_q, args)
    fp8, deq = fp8_latents(cache)
    del cache
    ref_out, ref_lse = sparse_mla_prefill_ref(q[rows], fp8, idx[rows], table, pos[rows], SM_SCALE)
    kernels = [("triton fp8 pf", lambda: sparse_mla_prefill(q, fp8, idx, table, pos, SM_SCALE,
                                                            config={"gluon": False}))]
    if GLUON_ERROR is None:
        for name, lat in (("gluon fp8", fp8), ("gluon bf16 deq", deq)):
            kernels.append((name, lambda lat=lat: gluon_prefill(q, lat, idx, table, pos)))
    time_kernels(kernels, shape, flops, lambda out, lse: (out[rows], lse[rows]), ref_out, ref_lse, args, timer,
                 max(args.rep // 5, 10))


def run_prefill(n_q: int, args, variants: list[str], timer) -> None:
    """A prefill chunk of `n_q` queries at the end of an `args.ctx`-token context, each selecting `args.k` earlier
    positions (bench_dsa.py's prefill_mla shape): the Triton kernel, then each Gluon variant; the first and last 8
    queries checked against the reference (all of them would gather n_q x k latent rows)."""
    cache, table, q, pos, idx, rows, flops, shape = prefill_problem(n_q, args)
    ref_out, ref_lse = sparse_mla_prefill_ref(q[rows], cache, idx[rows], table, pos[rows], SM_SCALE)
    kernels = [("triton prefill", lambda: sparse_mla_prefill(q, cache, idx, table, pos, SM_SCALE,
                                                             config={"gluon": False}))]
    for v in variants:
        kernels.append((f"gluon {v}", lambda v=v: gluon_prefill(q, cache, idx, table, pos, v)))
    time_kernels(kernels, shape, flops, lambda out, lse: (out[rows], lse[rows]), ref_out, ref_lse, args, timer,
                 max(args.rep // 5, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="4096", help="prefill chunk sizes (queries), comma-separated; '' for none")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"gluon variants among {VARIANTS}")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--events", action="store_true", help="CUDA-event medians instead of CUDA-graph replay")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=240.0, help="watchdog seconds per step (compile included)")
    ap.add_argument("--fp8", action="store_true", help="FP8-cache rows instead (Triton FP8, Gluon FP8, Gluon bf16)")
    ap.add_argument("--fp8-configs", default="default;regs=240;prefetch=0",
                    help="';'-separated SEESAW_FP8 overrides for the Gluon FP8 rows ('default': none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if GLUON_ERROR is not None:
        print(f"# gluon unavailable: {GLUON_ERROR}; timing the Triton kernel only", flush=True)
    variants = [v for v in args.variants.split(",") if v] if GLUON_ERROR is None else []
    timer = time_events if args.events else time_graph
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"triton {triton.__version__}; {'cuda events' if args.events else 'cuda graph'} medians", flush=True)
    print(f"{'kernel':16s} {'shape':26s} {'us':>9s} {'TFLOP/s':>8s} {'max|dout|':>10s} {'max|dlse|':>10s}  x triton",
          flush=True)
    for batch in map(int, args.batches.split(",")):
        if args.fp8:
            run_batch_fp8(batch, args, timer)
        else:
            run_batch(batch, args, variants, timer)
        torch.cuda.empty_cache()
    for n_q in (int(n) for n in args.prefill.split(",") if n):
        if args.fp8:
            run_prefill_fp8(n_q, args, timer)
        else:
            run_prefill(n_q, args, variants, timer)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
