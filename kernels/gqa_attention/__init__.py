"""Paged grouped-query attention decode (sliding window, learned sinks, split-K) over the GQA cache."""

from hearth.kernels.gqa_attention.kernel import gqa_decode
from hearth.kernels.gqa_attention.reference import gqa_decode_ref

__all__ = ["gqa_decode", "gqa_decode_ref"]
