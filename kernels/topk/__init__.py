"""Exact row-wise top-k (indices only, unsorted, -1 padded) by multi-CTA radix select."""

from hearth.kernels.topk.radix import topk_indices

__all__ = ["topk_indices"]
