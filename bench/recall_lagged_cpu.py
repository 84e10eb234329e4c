"""Top-k recall of the lagged candidate fetch against the synchronous one, on the CPU, at the default
tiered-key budget (bench_longctx's synthetic clustered keys, 128K context, k 2048, 64-token pages).

    PYTHONPATH=. python bench/recall_lagged_cpu.py [--steps 12] [--seeds 131072 132072]

Prints, per key set, the min / mean recall over decode steps 2.. for both modes (step 1 of the lagged
mode is synchronous by design).
"""

from __future__ import annotations

import argparse
import types

import torch

import bench.bench_longctx as longctx
from hearth.offload.tiered_keys import KeyTierConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[131072, 132072])
    parser.add_argument("--context", type=int, default=131072)
    opts = parser.parse_args()
    args = types.SimpleNamespace(steps=opts.steps, heads=64, page_size=64)
    cpu = torch.device("cpu")
    ops = longctx.Ops(cpu, 64, 2048)
    for seed in opts.seeds:
        row = {}
        for lagged in (False, True):
            recall = longctx.tiered_recall(opts.context, KeyTierConfig(page_size=64, topk=2048, lagged_fetch=lagged),
                                           seed, args, cpu, ops)[1:]
            row["lagged" if lagged else "synchronous"] = f"{min(recall):.4f} / {sum(recall) / len(recall):.4f}"
        print(f"key set {seed}: min / mean recall over steps 2..: {row}", flush=True)


if __name__ == "__main__":
    main()
