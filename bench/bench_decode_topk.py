"""K2 item 1 on the path the engine runs: the decode indexer + top-k (`indexer_decode_topk` with its defaults),
with programmatic dependent launch on and off (`hearth.kernels._utils.PDL`), beside the indexer's logits alone
and the top-k alone on them (a workspace kept across calls, as the engine keeps one), and the select's timeline
and finishing paths on those logits (`bench_one_launch.timeline_of`).

Each row is a CUDA-graph replay median (the engine replays its decode step from a graph), after a check of the
selection against torch on the same logits. The issue's targets: b1 x 128K indexer + top-k <= 15 us, 64 x 128K
top-k <= 100 us.

    python bench/bench_decode_topk.py [--batches 1 8 64] [--contexts 8192 32768 131072] [--finish-blocks 1024 16]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dsa import BS, random_indexer_cache  # noqa: E402
from bench_one_launch import timeline_of  # noqa: E402

from hearth.kernels import _utils  # noqa: E402
from hearth.kernels._utils import FP8_E4M3  # noqa: E402
from hearth.kernels.indexer import indexer_decode_topk, lightning_indexer_decode  # noqa: E402
from hearth.kernels.topk import one_launch, topk_indices_one_launch  # noqa: E402
from hearth.kernels.topk.one_launch import new_one_launch_workspace, one_launch_plan  # noqa: E402
from hearth.kernels.topk.reference import check_topk  # noqa: E402

K = 2048
FINISH_BLOCKS = [one_launch.FINISH_BLOCK]  # --finish-blocks: survivors the finish loads beside its header


def median_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def rows_for(batch: int, ctx_len: int, heads: int = 64) -> list[dict]:
    max_blocks = ctx_len // BS
    cache = random_indexer_cache(batch * max_blocks)
    table = torch.randperm(batch * max_blocks, device="cuda").int().view(batch, max_blocks)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, 1, heads, 128, device="cuda") * 2).to(FP8_E4M3)
    w = torch.randn(batch, 1, heads, device="cuda") * 0.05
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx, BS)
    out = torch.empty(batch, K, dtype=torch.int32, device="cuda")
    ws = new_one_launch_workspace(batch, one_launch_plan(K), q.device)  # kept across calls, as the engine's
    t_logits = median_us(lambda: lightning_indexer_decode(q, w, cache, table, ctx, BS))
    rows = []
    for fblock, pdl in ((fb, pd) for fb in FINISH_BLOCKS for pd in (True, False)):
        _utils.PDL = pdl
        one_launch.FINISH_BLOCK = fblock
        check_topk(indexer_decode_topk(q, w, cache, table, ctx, BS, K)[:, 0], logits, lengths, K)
        t_full = median_us(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K))
        check_topk(topk_indices_one_launch(logits, lengths, K, out=out, workspace=ws), logits, lengths, K)
        t_topk = median_us(lambda: topk_indices_one_launch(logits, lengths, K, out=out, workspace=ws))
        rows.append(dict(batch=batch, context=ctx_len, pdl=pdl, finish_block=fblock, indexer_logits_us=t_logits,
                         indexer_topk_us=t_full, topk_only_us=t_topk))
        print(f"B{batch:<3d} {ctx_len // 1024:4d}K  pdl {int(pdl)} finish block {fblock:4d}: indexer + top-k "
              f"{t_full:7.1f} us, top-k alone {t_topk:7.1f} us (indexer logits alone {t_logits:6.1f} us)", flush=True)
    _utils.PDL, one_launch.FINISH_BLOCK = True, FINISH_BLOCKS[0]
    rows[0]["trace"] = timeline_of(logits, lengths, "logits")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--finish-blocks", type=int, nargs="+", default=FINISH_BLOCKS,
                    help="one_launch.FINISH_BLOCK values to time side by side (powers of two)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    FINISH_BLOCKS[:] = args.finish_blocks
    rows = [r for b in args.batches for c in args.contexts for r in rows_for(b, c)]
    Path(args.out, "decode_topk.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
