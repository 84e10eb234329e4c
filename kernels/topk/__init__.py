"""Exact row-wise top-k (indices only, unsorted, -1 padded): multi-CTA radix select for any rows, a
one-program-per-row single-pass variant, a sampled-cutoff variant with several programs per row
for decode rows, a one-launch variant that finishes from the decode indexer's histogram, and a sort in
registers for short rows (sorted output)."""

from hearth.kernels.topk.one_launch import topk_indices_one_launch
from hearth.kernels.topk.radix import topk_indices
from hearth.kernels.topk.sampled import topk_indices_sampled
from hearth.kernels.topk.short_row import topk_indices_short
from hearth.kernels.topk.single_pass import topk_indices_single_pass

__all__ = [
    "topk_indices",
    "topk_indices_one_launch",
    "topk_indices_sampled",
    "topk_indices_short",
    "topk_indices_single_pass",
]
