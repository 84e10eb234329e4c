"""Exact row-wise top-k (indices only, unsorted, -1 padded): multi-CTA radix select for any rows, a
one-program-per-row single-pass variant, and a sampled-cutoff variant with several programs per row
for decode rows."""

from hearth.kernels.topk.radix import topk_indices
from hearth.kernels.topk.sampled import topk_indices_sampled
from hearth.kernels.topk.single_pass import topk_indices_single_pass

__all__ = ["topk_indices", "topk_indices_sampled", "topk_indices_single_pass"]
