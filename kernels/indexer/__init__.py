"""DSA lightning indexer: the fused FP8 indexer-key cache write and the paged indexer logits
(decode and prefill), each also fused with the exact radix top-k."""

from hearth.kernels.indexer.cache_write import indexer_k_cache_write
from hearth.kernels.indexer.lightning import (
    PREFILL_LOGITS_BUDGET,
    indexer_decode_topk,
    indexer_prefill_topk,
    lightning_indexer_decode,
    lightning_indexer_prefill,
)

__all__ = [
    "PREFILL_LOGITS_BUDGET",
    "indexer_decode_topk",
    "indexer_k_cache_write",
    "indexer_prefill_topk",
    "lightning_indexer_decode",
    "lightning_indexer_prefill",
]
