"""Benchmark the decode top-k on one GPU: the single-pass kernel (one program per row) against the
multi-CTA radix select and `torch.topk`, measured in the same run after a correctness check.

    python bench/bench_topk.py [--out DIR] [--sweep]

Rows are fp32 scores of full length (b1 / b8 / b64 x 8K..128K, k = 2048) drawn two ways: `randn` and
`relu` (relu(randn - 2.5): ~0.6% positive, so the k-th largest is a 0 tied thousands of times; from 32K
on the zeros outgrow the survivor buffer and every row takes the single-pass kernel's fallback). Times
are medians of CUDA-graph replays (decode runs in a graph) except torch.topk's. `overflow` counts the
rows whose cutoff bin outgrew the survivor buffer. Writes `topk_bench.md` and `topk_bench.jsonl` into
--out (default: $OUT or .).
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


def run_case(kind: str, batch: int, n: int, configs: list[tuple[int, int]]) -> dict:
    scores = scores_for(kind, batch, n)
    lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, K, dtype=torch.int32, device="cuda")
    scratch = new_scratch(batch, K, scores.device)
    best = None
    for block, warps in configs:

        def sp(block=block, warps=warps):
            single_pass_topk_launch(scores, lengths, K, out, scratch, block=block, num_warps=warps)

        sp()
        check_topk(out, scores, lengths, K)
        t = bench(sp)
        if len(configs) > 1:
            print(f"    sweep block={block} warps={warps}: {t:.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, block, warps)
    check_topk(topk_indices(scores, lengths, K), scores, lengths, K)
    t_sp, block, warps = best
    t_radix = bench(lambda: topk_indices(scores, lengths, K))
    t_torch = bench(lambda: torch.topk(scores, K, dim=-1), graph=False)
    row = dict(
        kind=kind,
        shape=f"{batch}x{n}",
        single_pass_us=t_sp,
        radix_us=t_radix,
        torch_us=t_torch,
        overflow=overflow_rows(scores, K),
        block=block,
        warps=warps,
    )
    print(
        f"{kind:6s} {row['shape']:>10s}  single-pass {t_sp:8.1f} us  radix {t_radix:8.1f} us  "
        f"torch {t_torch:8.1f} us  overflow rows {row['overflow']}/{batch}  (block {block}, {warps} warps)",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also sweep the single-pass block size and warps")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {triton.__version__}",
        flush=True,
    )
    configs = [(b, w) for b in (1024, 2048, 4096) for w in (8, 16)] if args.sweep else [(2048, 16)]
    torch.manual_seed(0)
    rows = [
        run_case(kind, batch, n, configs)
        for kind in ("randn", "relu")
        for batch in (1, 8, 64)
        for n in (8192, 32768, 65536, 131072)
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "topk_bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = [
        "| scores | rows x cols | single-pass µs | radix µs | torch.topk µs | overflow rows | block, warps |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kind']} | {r['shape']} | {r['single_pass_us']:.1f} | {r['radix_us']:.1f} | {r['torch_us']:.1f} | "
        f"{r['overflow']} | {r['block']}, {r['warps']} |"
        for r in rows
    ]
    (out / "topk_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
