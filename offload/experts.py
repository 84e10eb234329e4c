"""Routed-experts backends for the model's MoE layer.

Both implement ``backend(layer_idx, x [T, D], topk_ids [T, K], topk_weights [T, K] fp32) -> [T, D]``
= sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with SwiGLU experts, accumulated in fp32, returned in x.dtype.

- :class:`ResidentExperts`: every expert of every layer on one device.
- :class:`OffloadedExperts`: experts in the host store, a device :class:`ExpertCache` in front. Per
  call: look the needed experts up, start copies of the missing ones on the copy stream, compute the
  resident ones meanwhile, then the fetched ones, and combine. When a call needs more experts than
  the pool holds (long prompts), they stream through the two halves of the pool: round i+1 is
  copied while round i computes.
"""

from __future__ import annotations

import torch

from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.expert_cache import ExpertCache, ExpertLease
from hearth.offload.expert_store import ExpertStore, ExpertWeights


def _experts_into(
    out: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor, topk_weights: torch.Tensor,
    w: ExpertWeights, use_kernel: bool,
) -> None:
    """out [T, D] fp32 += the routed experts of x [T, D] at slots slot_ids [T, K] (-1 = skip)."""
    if use_kernel:
        fused_moe(x, slot_ids, topk_weights, w.w13, w.w2, w.s13, w.s2, out=out)
    else:
        out += moe_reference(x, slot_ids, topk_weights, w.w13, w.w2, w.s13, w.s2)


def _check_call(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [T, D], topk_ids/topk_weights [T, K]; got {tuple(x.shape)}, "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")


class ResidentExperts:
    """All routed experts of ``store`` copied to ``device``; the fused kernel on CUDA, torch on CPU."""

    def __init__(self, store: ExpertStore, device: torch.device | str, use_kernel: bool | None = None):
        self.device = torch.device(device)
        self.use_kernel = self.device.type == "cuda" if use_kernel is None else use_kernel
        self._weights = {}
        for layer in store.layers:
            if self.device.type == "cpu":
                buf = store.layer_buffer(layer)  # (E, record_bytes): no copy
            else:
                buf = store.to_device(layer, self.device)
            self._weights[layer] = store.layout.views(buf)

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_call(x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        _experts_into(out, x, topk_ids, topk_weights, self._weights[layer_idx], self.use_kernel)
        return out.to(x.dtype)


class OffloadedExperts:
    """Experts served from ``cache`` (filled from its host store on demand).

    ``overlap=False`` waits for every fetch before computing anything (the no-overlap baseline).
    """

    def __init__(self, cache: ExpertCache, use_kernel: bool | None = None, overlap: bool = True):
        self.cache = cache
        self.num_experts = cache.store.num_experts
        self.use_kernel = cache.is_cuda if use_kernel is None else use_kernel
        self.overlap = overlap

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_call(x, topk_ids, topk_weights)
        # NOTE: the one host sync of the layer: which experts to fetch is a scheduling decision.
        needed = list(dict.fromkeys(topk_ids.flatten().tolist()))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        capacity = self.cache.capacity(layer_idx)
        if len(needed) <= capacity:
            lease = self.cache.acquire(layer_idx, needed)
            try:
                self._compute(lease, out, x, topk_ids, topk_weights)
            finally:
                self.cache.release(lease)
        else:
            self._stream(layer_idx, needed, capacity, out, x, topk_ids, topk_weights)
        return out.to(x.dtype)

    def _stream(self, layer: int, needed: list[int], capacity: int, out: torch.Tensor, x: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """More distinct experts than the pool holds (prefill, large batches): stream them through
        two halves of the pool, so the copies of round i+1 run while round i computes."""
        size = max(1, capacity // 2)
        rounds = [needed[i:i + size] for i in range(0, len(needed), size)]
        current = self.cache.acquire(layer, rounds[0])
        try:
            for nxt in rounds[1:] + [None]:
                upcoming = self.cache.acquire(layer, nxt) if nxt is not None else None  # copies start now
                try:
                    self._compute(current, out, x, topk_ids, topk_weights)
                finally:
                    self.cache.release(current)
                current = upcoming
        finally:
            if current is not None:
                self.cache.release(current)

    def _slot_ids(self, lease: ExpertLease, topk_ids: torch.Tensor, want_ready: bool) -> torch.Tensor | None:
        """[T, K] slot per pair for the lease's experts whose readiness is ``want_ready``, -1 elsewhere."""
        lut = [-1] * self.num_experts
        for expert, slot, ready in zip(lease.experts, lease.slots, lease.ready):
            if ready == want_ready:
                lut[expert] = slot
        if all(s < 0 for s in lut):
            return None
        lut_t = torch.tensor(lut, dtype=torch.int32).to(topk_ids.device, non_blocking=True)
        return lut_t[topk_ids]  # (T, K)

    def _compute(
        self, lease: ExpertLease, out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        if not self.overlap:
            lease.wait()
            lease.ready = [True] * len(lease.ready)
        w = self.cache.weights
        resident = self._slot_ids(lease, topk_ids, want_ready=True)
        if resident is not None:
            _experts_into(out, x, resident, topk_weights, w, self.use_kernel)
        fetched = self._slot_ids(lease, topk_ids, want_ready=False)
        if fetched is not None:
            lease.wait()
            _experts_into(out, x, fetched, topk_weights, w, self.use_kernel)
