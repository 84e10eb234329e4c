"""Benchmark the decode top-k on one GPU: the sampled kernel (several programs per row, one launch)
and the single-pass kernel (one program per row) against the multi-CTA radix select and `torch.topk`,
measured in the same run after a correctness check.

    python bench/bench_topk.py [--out DIR] [--sweep] [--prefill]

Rows are fp32 scores of full length (b1 / b8 / b64 x 8K..128K, k = 2048) drawn two ways: `randn` and
`relu` (relu(randn - 2.5): ~0.6% positive, so the k-th largest is a 0 tied thousands of times; from 32K
on the zeros outgrow the survivor buffer and every row takes the single-pass kernel's fallback, while
the sampled kernel takes its ties path). --prefill adds 4096 x 32K and 1024 x 128K randn rows. Times
are medians of CUDA-graph replays (decode runs in a graph) except torch.topk's; the sampled kernel
runs on a workspace allocated once (no memset), the radix select allocates and zeroes its own per
call (as the engine does). `overflow` counts the rows whose cutoff bin outgrew the single-pass survivor
buffer, `sampled paths` the sampled kernel's rows per path (candidates / ties / fallback). Writes
`topk_bench.md` and `topk_bench.jsonl` into --out (default: $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from hearth.kernels.topk import topk_indices
from hearth.kernels.topk.reference import check_topk
from hearth.kernels.topk.sampled import (
    PATH_CANDIDATES,
    PATH_FALLBACK,
    PATH_TIES,
    new_sampled_workspace,
    sampled_plan,
    sampled_topk_launch,
)
from hearth.kernels.topk.single_pass import SCRATCH_PER_K, new_scratch, single_pass_topk_launch

K = 2048


def bench(fn, graph: bool = True) -> float:
    """Median microseconds."""
    fn()
    torch.cuda.synchronize()
    ms = do_bench_cudagraph(fn, rep=60, return_mode="median") if graph else do_bench(fn, rep=60, return_mode="median")
    return ms * 1e3


def overflow_rows(scores: torch.Tensor, k: int) -> int:
    """Rows whose top-digit cutoff bin holds more than SCRATCH_PER_K * k keys (full-length rows)."""
    bits = scores.view(torch.int32)
    top = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> 24
    cut = top.topk(k, dim=1).values[:, -1:]
    return int(((top == cut).sum(dim=1) > SCRATCH_PER_K * k).sum())


def scores_for(kind: str, batch: int, n: int) -> torch.Tensor:
    s = torch.randn(batch, n, device="cuda")
    return torch.relu(s - 2.5) if kind == "relu" else s


def best_of(name: str, configs: list[tuple[int, int]], make, check) -> tuple[float, int, int]:
    """(median us, block, warps) of the fastest config; each config is checked before it is timed and
    again after (the sampled kernel's workspace must come out of the graph replays reusable)."""
    best = None
    for block, warps in configs:
        fn = make(block, warps)
        fn()
        check()
        t = bench(fn)
        fn()
        check()
        if len(configs) > 1:
            print(f"    sweep {name} block={block} warps={warps}: {t:.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, block, warps)
    assert best is not None
    return best


def run_case(kind: str, batch: int, n: int, configs: list[tuple[int, int]], single_pass: bool) -> dict:
    scores = scores_for(kind, batch, n)
    lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, K, dtype=torch.int32, device="cuda")

    def check() -> None:
        check_topk(out, scores, lengths, K)

    plan = sampled_plan(n, K)
    ws = new_sampled_workspace(batch, plan, scores.device)
    t_sa, sa_block, sa_warps = best_of(
        "sampled",
        configs,
        lambda block, warps: lambda: sampled_topk_launch(scores, lengths, out, ws, plan, block=block, num_warps=warps),
        check,
    )
    paths = [int((ws[:, 3] == p).sum()) for p in (PATH_CANDIDATES, PATH_TIES, PATH_FALLBACK)]
    t_sp = sp_block = sp_warps = None
    if single_pass:
        scratch = new_scratch(batch, K, scores.device)
        t_sp, sp_block, sp_warps = best_of(
            "single-pass",
            configs,
            lambda block, warps: (
                lambda: single_pass_topk_launch(scores, lengths, K, out, scratch, block=2 * block, num_warps=warps)
            ),
            check,
        )
    check_topk(topk_indices(scores, lengths, K), scores, lengths, K)
    t_radix = bench(lambda: topk_indices(scores, lengths, K))
    t_torch = bench(lambda: torch.topk(scores, K, dim=-1), graph=False)
    row = dict(
        kind=kind,
        shape=f"{batch}x{n}",
        sampled_us=t_sa,
        single_pass_us=t_sp,
        radix_us=t_radix,
        torch_us=t_torch,
        overflow=overflow_rows(scores, K),
        sampled_paths=paths,
        sampled_cfg=f"{sa_block}, {sa_warps}",
        single_pass_cfg=f"{sp_block}, {sp_warps}" if single_pass else "-",
    )
    sp = f"{t_sp:8.1f}" if t_sp is not None else "       -"
    print(
        f"{kind:6s} {row['shape']:>11s}  sampled {t_sa:8.1f} us  single-pass {sp} us  radix {t_radix:8.1f} us  "
        f"torch {t_torch:8.1f} us  sampled paths {paths}  overflow rows {row['overflow']}/{batch}  "
        f"(sampled {row['sampled_cfg']}; single-pass {row['single_pass_cfg']})",
        flush=True,
    )
    return row


def fmt(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also sweep block sizes and warps")
    ap.add_argument("--prefill", action="store_true", help="add prefill-sized randn cases")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {triton.__version__}",
        flush=True,
    )
    # (block, warps): the single-pass kernel runs blocks twice as long (its default is 2048, 16)
    configs = [(b, w) for b in (512, 1024, 2048) for w in (8, 16)] if args.sweep else [(1024, 16)]
    torch.manual_seed(0)
    lengths = (8192, 32768, 65536, 131072)
    cases = [(kind, batch, n) for kind in ("randn", "relu") for batch in (1, 8, 64) for n in lengths]
    if args.prefill:
        cases += [("randn", 4096, 32768), ("randn", 1024, 131072)]
    # the single-pass kernel is skipped where one program per row is known to take milliseconds
    rows = [run_case(kind, batch, n, configs, single_pass=batch <= 64) for kind, batch, n in cases]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "topk_bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = [
        "| scores | rows x cols | sampled µs | single-pass µs | radix µs | torch.topk µs | sampled paths "
        "(cand / ties / fallback) | overflow rows (single-pass) | sampled block, warps | single-pass block, warps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kind']} | {r['shape']} | {fmt(r['sampled_us'])} | {fmt(r['single_pass_us'])} | {fmt(r['radix_us'])} | "
        f"{fmt(r['torch_us'])} | {' / '.join(map(str, r['sampled_paths']))} | {r['overflow']} | {r['sampled_cfg']} | "
        f"{r['single_pass_cfg']} |"
        for r in rows
    ]
    (out / "topk_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
