"""Routed-experts backends for the model's MoE layer.

Both implement ``backend(layer_idx, x [T, D], topk_ids [T, K], topk_weights [T, K] fp32) -> [T, D]``
= sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with SwiGLU experts, accumulated in fp32, returned in x.dtype.

- :class:`ResidentExperts`: every expert of every layer on one device.
- :class:`OffloadedExperts`: experts in the host store, a device :class:`ExpertCache` in front. Per
  call: look the needed experts up, start copies of the missing ones on the copy stream (largest
  first), compute the resident ones meanwhile, then each fetched expert (or small group) as soon as
  its own copy lands, so what is left after the last copy is one expert's compute. A missed expert
  may instead be computed on the host when that is measured to be faster (:mod:`cpu_experts`).
  When a call needs more experts than the pool holds (long prompts), they stream through the two
  halves of the pool: round i+1 is copied while round i computes.

OffloadedExperts computes every (token, k) pair into its own fp32 row and sums over k at the end, as
the fused kernel does within one launch, so which experts were resident and how they were grouped
does not change the result: it equals the resident output bit for bit whenever the kernel computes a
pair's row independently of the other pairs of its launch.
"""

from __future__ import annotations

import torch

from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.cpu_experts import HOST_POLICIES, HostSpeeds, choose_host_experts, host_expert, measure_host_speeds
from hearth.offload.expert_cache import ExpertCache, ExpertLease
from hearth.offload.expert_store import ExpertStore, ExpertWeights
from hearth.offload.fetch_plan import (
    IN_FLIGHT,
    MIN_GROUP_BYTES,
    MISSING,
    RESIDENT,
    round_groups,
    serving_order,
    split_rounds,
)


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
    ``host_experts``: compute missed experts on the host when measured faster (``auto``; the speeds are
    measured here unless ``host_speeds`` is given), always (``on``) or never (``off``). ``auto`` is off
    on a host-memory cache (nothing crosses a link). ``group_bytes``: fetched experts are computed in
    groups of about this many bytes of copies (one DeepSeek-V3 expert each by default).
    """

    def __init__(self, cache: ExpertCache, use_kernel: bool | None = None, overlap: bool = True,
                 host_experts: str = "auto", host_speeds: HostSpeeds | None = None,
                 group_bytes: int = MIN_GROUP_BYTES):
        if host_experts not in HOST_POLICIES:
            raise ValueError(f"host_experts must be one of {HOST_POLICIES}, got {host_experts!r}")
        self.cache = cache
        self.num_experts = cache.store.num_experts
        self.use_kernel = cache.is_cuda if use_kernel is None else use_kernel
        self.overlap = overlap
        self.group_bytes = group_bytes
        self.host_experts = "off" if host_experts == "auto" and not cache.is_cuda else host_experts
        self.host_speeds = host_speeds
        if self.host_experts == "auto" and host_speeds is None:
            self.host_speeds = measure_host_speeds(cache.store, cache.device)

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_call(x, topk_ids, topk_weights)
        t, k = topk_ids.shape
        if t == 0:
            return torch.zeros_like(x)
        flat = topk_ids.reshape(-1).long()  # (TK,)
        counts_dev = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts_dev.scatter_add_(0, flat, torch.ones_like(flat))  # (E,) scatter_add: bincount would sync twice
        # NOTE: the one host sync of the layer: which experts to fetch is a scheduling decision.
        counts = counts_dev.tolist()
        needed = [e for e, c in enumerate(counts) if c]
        states = dict(zip(needed, self.cache.lookup(layer_idx, needed)))
        order = [needed[i] for i in serving_order([counts[e] for e in needed], [states[e] for e in needed])]
        missing = [e for e in order if states[e] == MISSING]
        on_host = {e for e, h in zip(missing, choose_host_experts(
            [counts[e] for e in missing], self.host_speeds, self.host_experts)) if h}
        order = [e for e in order if e not in on_host] + [e for e in order if e in on_host]
        rounds = split_rounds(len(order) - len(on_host), self.cache.capacity(layer_idx))
        held: list[ExpertLease] = []
        try:
            if rounds:  # copies start before anything else is queued
                held.append(self.cache.acquire(layer_idx, order[:rounds[0]]))
            # Pairs sorted by their expert's serving position: each expert's pairs are one slice.
            rank = [len(order)] * self.num_experts
            for pos, e in enumerate(order):
                rank[e] = pos
            pair_order = torch.argsort(self._to_device(rank, x.device)[flat], stable=True)  # (TK,)
            bounds = [0]
            for e in order:
                bounds.append(bounds[-1] + counts[e])
            x_sorted = x[pair_order // k]  # (TK, D): the token of each sorted pair
            w_sorted = topk_weights.reshape(-1)[pair_order].unsqueeze(1)  # (TK, 1)
            y_sorted = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=x.device)  # (TK, D)
            host_rows = None
            if on_host:  # activations to the host now, before anything queued waits for a copy
                start = bounds[len(order) - len(on_host)]
                host_rows = (x_sorted[start:].cpu(), w_sorted[start:].cpu())
            pos = 0
            for r, size in enumerate(rounds):
                if r + 1 < len(rounds):  # the next round's copies start now, into the other half
                    held.append(self.cache.acquire(layer_idx, order[pos + size:pos + size + rounds[r + 1]]))
                lease = held.pop(0)
                try:
                    planned = [states[e] for e in order[pos:pos + size]]
                    self._compute_round(lease, planned, flat, pair_order, bounds[pos:pos + size + 1], x_sorted,
                                        w_sorted, y_sorted)
                finally:
                    self.cache.release(lease)
                pos += size
            if host_rows is not None:
                self._compute_on_host(layer_idx, order[pos:], bounds[pos:], host_rows, y_sorted)
        finally:
            for lease in held:
                self.cache.release(lease)
        out = torch.empty_like(y_sorted)
        out[pair_order] = y_sorted
        return out.view(t, k, -1).sum(1).to(x.dtype)  # (TK, D) -> (T, K, D) -> (T, D)

    def _to_device(self, values: list[int], device: torch.device) -> torch.Tensor:
        """A small int32 host list on ``device`` without a stream sync (pinned staging on CUDA)."""
        host = torch.tensor(values, dtype=torch.int32, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def _compute_round(self, lease: ExpertLease, planned: list[int], flat: torch.Tensor, pair_order: torch.Tensor,
                       bounds: list[int], x_sorted: torch.Tensor, w_sorted: torch.Tensor,
                       y_sorted: torch.Tensor) -> None:
        """Queue the round's experts (``lease.experts``, serving order, ``planned`` their states when
        the call was planned; their pairs are the sorted rows ``bounds[0]:bounds[-1]``) group by
        group, each group after its own copies."""
        lut = [-1] * self.num_experts
        for expert, slot in zip(lease.experts, lease.slots):
            lut[expert] = slot
        lo, hi = bounds[0], bounds[-1]
        slots = self._to_device(lut, flat.device)[flat[pair_order[lo:hi]]].unsqueeze(1)  # (n, 1)
        # Resident when planned and still (it may have been evicted by an earlier round); on a CPU
        # cache copies are synchronous, so fetched experts still form their groups (waits are no-ops).
        states = [RESIDENT if ready and p == RESIDENT else IN_FLIGHT for ready, p in zip(lease.ready, planned)]
        w = self.cache.weights
        for group in round_groups(states, self.cache.buffer.shape[1], self.overlap, self.group_bytes):
            if group.wait:
                if self.overlap:
                    lease.wait_for(range(group.start, group.stop))
                else:
                    lease.wait()
            a, b = bounds[group.start], bounds[group.stop]
            _experts_into(y_sorted[a:b], x_sorted[a:b], slots[a - lo:b - lo], w_sorted[a:b], w, self.use_kernel)

    def _compute_on_host(self, layer: int, experts: list[int], bounds: list[int],
                         host_rows: tuple[torch.Tensor, torch.Tensor], y_sorted: torch.Tensor) -> None:
        """Missed ``experts`` on the host from the store; their pairs are the sorted rows of ``bounds``,
        whose activations and routing weights ``host_rows`` already holds (rows from ``bounds[0]``)."""
        x_host, w_host = host_rows
        weights = self.cache.store.weights(layer)
        y = torch.empty((bounds[-1] - bounds[0], y_sorted.shape[1]), dtype=torch.float32,
                        pin_memory=y_sorted.is_cuda)  # (n, D)
        for i, expert in enumerate(experts):
            a, b = bounds[i] - bounds[0], bounds[i + 1] - bounds[0]
            y[a:b] = host_expert(x_host[a:b], weights, expert) * w_host[a:b]
        y_sorted[bounds[0]:bounds[-1]].copy_(y, non_blocking=True)
        self.cache.count_cpu_computed(layer, len(experts))
