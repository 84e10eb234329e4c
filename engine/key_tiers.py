"""Per-request tiered indexer keys for the plain-PyTorch indexer (issue C1).

With ``EngineConfig.index_key_hot_pages`` set, an indexer layer keeps each request's keys in a
``hearth.offload.tiered_keys.TieredKeys``: recent pages on the device, the whole history in host
RAM, a compact summary per page on the device. Decode selects coarse-to-fine (summaries, then the
original keys of candidate pages); prefill chunks read the history back and score it exactly.
Prefix caching is off in this mode (a reused page would have no keys in the request's tiers).
"""

from __future__ import annotations

import torch

from hearth.engine.api import EngineConfig
from hearth.engine.config import ModelConfig
from hearth.offload.tiered_keys import KeyTierConfig, TieredKeys


class KeyTiers:
    """All requests' tiers, keyed by (request id, layer)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = device
        self.config = KeyTierConfig(
            page_size=block_size, head_dim=model_config.index_head_dim,
            key_format="fp32" if dtype == torch.float32 else "bf16",
            hot_pages=max(1, config.index_key_hot_pages), cache_pages=config.index_key_cache_pages,
            candidate_pages=config.index_key_candidate_pages, topk=model_config.index_topk,
            bounds=config.index_key_exact, exact=config.index_key_exact)
        self.tiers: dict[tuple[str, int], TieredKeys] = {}

    def get(self, seq_id: str | None, layer: int) -> TieredKeys:
        if seq_id is None:
            raise RuntimeError("tiered indexer keys need a request id in the forward context")
        key = (seq_id, layer)
        if key not in self.tiers:
            self.tiers[key] = TieredKeys(self.config, self.device, initial_pages=8)
        return self.tiers[key]

    def drop(self, seq_id: str) -> None:
        for key in [k for k in self.tiers if k[0] == seq_id]:
            del self.tiers[key]

    def device_bytes(self) -> int:
        return sum(t.device_bytes() for t in self.tiers.values())

    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for tiers in self.tiers.values():
            for name, value in tiers.stats().items():
                total[name] = total.get(name, 0.0) + float(value)
        return total
