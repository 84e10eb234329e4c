"""Per-layer expert-cache counters, exposed as plain dicts (no tensors, no CUDA objects)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LayerCacheStats:
    """Counters of one MoE layer. ``copy_ms`` is copy-stream busy time measured with CUDA events."""

    requests: int = 0  # distinct experts asked for, summed over acquire calls
    hits: int = 0  # resident and ready
    merged: int = 0  # resident but still in flight from an earlier request: no second copy
    misses: int = 0  # fetched from host memory
    evictions: int = 0
    bytes_fetched: int = 0
    copy_ms: float = 0.0
    cpu_computed: int = 0  # missed experts computed on the host instead of fetched (not in requests)

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.merged) / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def summarize(per_layer: dict[int, LayerCacheStats]) -> dict[str, float]:
    """All layers added up, with the overall hit rate."""
    total = LayerCacheStats()
    for s in per_layer.values():
        for name, value in asdict(s).items():
            setattr(total, name, getattr(total, name) + value)
    return total.as_dict()
