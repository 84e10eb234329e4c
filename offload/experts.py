"""Routed-experts backends for the model's MoE layer.

Both implement ``backend(layer_idx, x [T, D], topk_ids [T, K], topk_weights [T, K] fp32) -> [T, D]``
= sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with SwiGLU experts, accumulated in fp32, returned in x.dtype.

- :class:`ResidentExperts`: every expert of every layer on one device.
- :class:`OffloadedExperts`: experts in the host store, a device :class:`ExpertCache` in front. Per
  call: look the needed experts up, start copies of the missing ones on the copy stream (largest
  first), compute the resident ones meanwhile, then each fetched expert (or small group) as soon as
  its own copy lands, so what is left after the last copy is one expert's compute. A missed expert
  may instead be computed on the host when that is measured to be faster (:mod:`cpu_experts`).
  When a call needs more experts than the pool has room for (long prompts), they stream through
  that room in rounds (:class:`~hearth.offload.fetch_plan.StreamPlan`): by default (``streaming="ring"``)
  through ``ring_depth`` smaller rounds, each computed in one launch, the copies of the next ones queued
  meanwhile; with ``streaming="halves"`` through its two halves, round i+1 copied while round i computes,
  group by group (on the H200 the host's launches then paced the copies: a 4K / 16K-token prefill
  streamed at 55% / 52% of the link floor against 97% / 94% with the ring, bench_offload.py
  --prefill-variants, 2026-12-02). Either
  way a round's copies are queued right after the compute of the round whose slots they reuse, and
  wait for nothing else. The room is the slots no other
  lease holds (the runahead decoder may hold some between steps); a call never asks for more, so it
  never meets a full cache. With one slot of room the experts go through it one by one; with none,
  the experts other leases hold are computed on the device and the rest on the host.

The host path before the first copy is what delays the whole link schedule, so it is kept short: one
host sync (a decode call reads its routing back directly, with no kernel queued before the read), the
serving order, then the copies; only then are the pairs sorted (on the host for decode, with every
index the call needs going up in one pinned upload) and the compute queued.

OffloadedExperts computes every (token, k) pair into its own fp32 row and sums over k at the end, as
the fused kernel does within one launch, so which experts were resident and how they were grouped
does not change the result: it equals the resident output bit for bit whenever the kernel computes a
pair's row independently of the other pairs of its launch.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import torch

from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.cpu_experts import HOST_POLICIES, HostSpeeds, choose_host_experts, host_expert, measure_host_speeds
from hearth.offload.expert_cache import CacheFullError, ExpertCache, ExpertLease
from hearth.offload.expert_store import ExpertStore, ExpertWeights
from hearth.offload.fetch_plan import (
    ACQUIRE,
    COMPUTE,
    IN_FLIGHT,
    MIN_GROUP_BYTES,
    MISSING,
    RESIDENT,
    RING,
    RING_DEPTH,
    STREAMING,
    plan_stream,
    round_groups,
    serving_order,
    sort_pairs,
)

# Up to this many (token, k) pairs (decode) the routing itself is read back and the pairs are sorted on the
# host; beyond (prefill) per-expert counts are read back and the pairs sorted on the device.
HOST_SORT_MAX_PAIRS = 256


def _experts_into(
    out: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor, topk_weights: torch.Tensor,
    w: ExpertWeights, use_kernel: bool,
) -> None:
    """out [T, D] fp32 += the routed experts of x [T, D] at slots slot_ids [T, K] (-1 = skip)."""
    if use_kernel:
        fused_moe(x, slot_ids, topk_weights, w.w13, w.w2, w.s13, w.s2, out=out, extras=w.kernel_extras)
    else:
        out += moe_reference(x, slot_ids, topk_weights, w.w13, w.w2, w.s13, w.s2, **w.reference_kwargs())


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
            self._weights[layer] = store.layout.views(store.float_records(layer, self.device))

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_call(x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        _experts_into(out, x, topk_ids, topk_weights, self._weights[layer_idx], self.use_kernel)
        return out.to(x.dtype)


class _SortedPairs:
    """The call's (token, k) pairs in serving order (each expert's pairs one slice): x [TK, D] and
    w [TK, 1] gathered in that order, y [TK, D] their fp32 rows (zeros), and the way back to pair order.

    Sorted on the host when the routing was read back whole (decode: one upload of every index the call
    needs), else on the device from the per-expert counts (prefill: no Python loop over the pairs).
    """

    def __init__(self, x: torch.Tensor, topk_weights: torch.Tensor, order: list[int], counts: dict[int, int],
                 ids: list[int] | None, topk_ids: torch.Tensor, first: ExpertLease | None, num_experts: int):
        t, k = topk_ids.shape
        device = x.device
        self.ids = ids
        if ids is not None:
            self.host_order = pair_order = sort_pairs(ids, order)
            inverse = [0] * len(pair_order)
            for i, pair in enumerate(pair_order):
                inverse[pair] = i
            first_slots = [] if first is None else self.host_slots(first, 0, sum(counts[e] for e in first.experts))
            tk = len(pair_order)
            # (3 TK + n0,): sorted pair -> pair, sorted pair -> token, pair -> sorted pair, round 0's slots
            staged = _to_device(pair_order + [p // k for p in pair_order] + inverse + first_slots, device)
            self.pair_order, token_of, self.inverse = staged[:tk], staged[tk:2 * tk], staged[2 * tk:3 * tk]
            self.first_slots = staged[3 * tk:].unsqueeze(1)  # (n0, 1)
        else:
            self.flat = topk_ids.reshape(-1).long()  # (TK,)
            position = [len(order)] * num_experts
            for pos, e in enumerate(order):
                position[e] = pos
            self.pair_order = torch.argsort(_to_device(position, device)[self.flat], stable=True)  # (TK,)
            token_of = self.pair_order // k
            self.inverse = self.first_slots = None
        self.x = x.index_select(0, token_of)  # (TK, D): the token of each sorted pair
        self.w = topk_weights.reshape(-1).index_select(0, self.pair_order).unsqueeze(1)  # (TK, 1)
        self.y = torch.zeros((t * k, x.shape[1]), dtype=torch.float32, device=device)  # (TK, D)

    def host_slots(self, lease: ExpertLease, lo: int, hi: int) -> list[int]:
        """Slot of each sorted pair ``lo:hi`` (all of them served by ``lease``)."""
        slot_of = dict(zip(lease.experts, lease.slots))
        return [slot_of[self.ids[pair]] for pair in self.host_order[lo:hi]]

    def round_slots(self, r: int, lease: ExpertLease, lo: int, hi: int, num_experts: int) -> torch.Tensor:
        """(hi - lo, 1) int32 device slots of the sorted pairs ``lo:hi``, round ``r`` (served by ``lease``)."""
        if self.ids is not None:
            return self.first_slots if r == 0 else _to_device(self.host_slots(lease, lo, hi), self.y.device)[:, None]
        lut = [-1] * num_experts
        for expert, slot in zip(lease.experts, lease.slots):
            lut[expert] = slot
        return _to_device(lut, self.y.device)[self.flat[self.pair_order[lo:hi]]].unsqueeze(1)

    def unsorted(self) -> torch.Tensor:
        """y back in pair order, (TK, D)."""
        if self.inverse is not None:
            return self.y.index_select(0, self.inverse)
        out = torch.empty_like(self.y)
        out[self.pair_order] = self.y
        return out


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int32 host list on ``device`` without a stream sync (pinned staging on CUDA)."""
    host = torch.tensor(values, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class OffloadedExperts:
    """Experts served from ``cache`` (filled from its host store on demand).

    ``overlap=False`` waits for every fetch before computing anything (the no-overlap baseline).
    ``host_experts``: compute missed experts on the host when measured faster (``auto``; the speeds are
    measured here unless ``host_speeds`` is given), always (``on``) or never (``off``). ``auto`` is off
    on a host-memory cache (nothing crosses a link). ``group_bytes``: fetched experts are computed in
    groups of about this many bytes of copies (one DeepSeek-V3 expert each by default).
    ``streaming``: how a call needing more experts than the room streams (:func:`plan_stream`): ``ring``
    (the default: ``ring_depth`` rounds, each computed in one call: far fewer host launches per layer,
    copies queued ``ring_depth - 1`` rounds ahead) or ``halves`` (two rounds of half the room, each
    computed group by group).
    """

    def __init__(self, cache: ExpertCache, use_kernel: bool | None = None, overlap: bool = True,
                 host_experts: str = "auto", host_speeds: HostSpeeds | None = None,
                 group_bytes: int = MIN_GROUP_BYTES, streaming: str = RING, ring_depth: int = RING_DEPTH):
        if host_experts not in HOST_POLICIES:
            raise ValueError(f"host_experts must be one of {HOST_POLICIES}, got {host_experts!r}")
        if streaming not in STREAMING or ring_depth < 1:
            raise ValueError(f"streaming must be one of {STREAMING} and ring_depth >= 1, got {streaming!r}, "
                             f"{ring_depth}")
        self.streaming = streaming
        self.ring_depth = ring_depth
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
        ids, counts = self._read_routing(topk_ids)
        room = self.cache.available(layer_idx)
        order, states, num_on_host = self._serving_order(layer_idx, counts, room)
        num_on_device = len(order) - num_on_host
        # NOTE: without room only experts other leases hold stay on the device: acquiring them takes no slot.
        plan = plan_stream(num_on_device, room or max(1, num_on_device), self.streaming, self.ring_depth)
        starts = list(accumulate(plan.rounds, initial=0))
        leases: dict[int, ExpertLease] = {}

        def acquire(r: int) -> None:
            leases[r] = self.cache.acquire(layer_idx, order[starts[r]:starts[r + 1]])

        try:
            steps = plan.steps()
            if steps:  # round 0's copies start before anything else is planned or queued
                acquire(steps.pop(0)[1])
            bounds = list(accumulate((counts[e] for e in order), initial=0))
            pairs = _SortedPairs(x, topk_weights, order, counts, ids, topk_ids, leases.get(0), self.num_experts)
            host_rows = None
            if num_on_host:  # activations to the host now, before anything queued waits for a copy
                start = bounds[num_on_device]
                host_rows = (pairs.x[start:].cpu(), pairs.w[start:].cpu())
            for step, r in steps:
                if step == ACQUIRE:
                    acquire(r)
                elif step == COMPUTE:
                    lo, hi = starts[r], starts[r + 1]
                    slots = pairs.round_slots(r, leases[r], bounds[lo], bounds[hi], self.num_experts)
                    self._compute_round(leases[r], [states[e] for e in order[lo:hi]], slots, bounds[lo:hi + 1],
                                        pairs, plan.max_groups)
                else:
                    self.cache.release(leases.pop(r))
            if host_rows is not None:
                self._compute_on_host(layer_idx, order[num_on_device:], bounds[num_on_device:], host_rows, pairs.y)
        finally:
            for lease in leases.values():
                self.cache.release(lease)
        return pairs.unsorted().view(t, k, -1).sum(1).to(x.dtype)  # (TK, D) -> (T, K, D) -> (T, D)

    @property
    def capturable(self) -> bool:
        """Can :meth:`compute_slots` run inside a CUDA graph (the fused kernel: no host sync)?"""
        return self.cache.is_cuda and self.use_kernel

    def acquire_all(self, layer: int, ids: list[int]) -> ExpertLease | None:
        """One lease on every expert of the flattened routing ``ids`` (copies of missing ones queued,
        largest first), for computing them all in one launch through their slots; None when the pool
        has no room for all of them at once or the host-experts policy computes some on the host (then
        the call goes through ``__call__``, which streams them)."""
        counts = dict(sorted(Counter(ids).items()))
        if counts and (min(counts) < 0 or max(counts) >= self.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.num_experts}), got {min(counts)}..{max(counts)}")
        needed = list(counts)
        state_list = self.cache.lookup(layer, needed)
        states = dict(zip(needed, state_list))
        if self._host_choice(needed, states, counts):
            return None
        order = [needed[i] for i in serving_order([counts[e] for e in needed], state_list)]
        try:
            return self.cache.acquire(layer, order)
        except CacheFullError:
            return None

    def compute_slots(self, out: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> None:
        """out [T, D] fp32 += the experts at cache slots ``slot_ids`` [T, K] (-1 = skip) of x [T, D]."""
        _experts_into(out, x, slot_ids, weights, self.cache.weights, self.use_kernel)

    def _read_routing(self, topk_ids: torch.Tensor) -> tuple[list[int] | None, dict[int, int]]:
        """(the flattened routing when read back whole, else None; pairs per needed expert, by expert id).

        NOTE: the one host sync of the layer: which experts to fetch is a scheduling decision. Up to
        HOST_SORT_MAX_PAIRS pairs the ids themselves come back (one copy, no kernel before it);
        beyond, per-expert counts (scatter_add: bincount would sync twice).
        """
        if topk_ids.numel() <= HOST_SORT_MAX_PAIRS:
            ids = topk_ids.reshape(-1).tolist()  # (TK,)
            counts = dict(sorted(Counter(ids).items()))
            if ids and (min(counts) < 0 or max(counts) >= self.num_experts):
                raise ValueError(f"expert ids must be in [0, {self.num_experts}), got {min(counts)}..{max(counts)}")
            return ids, counts
        flat = topk_ids.reshape(-1).long()  # (TK,)
        counts_dev = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts_dev.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
        return None, {e: c for e, c in enumerate(counts_dev.tolist()) if c}

    def _serving_order(self, layer: int, counts: dict[int, int], room: int
                       ) -> tuple[list[int], dict[int, int], int]:
        """(needed experts in serving order, those computed on the host last; their states; how many
        of them are computed on the host). ``room``: slots no other lease holds."""
        needed = list(counts)  # ascending ids
        state_list = self.cache.lookup(layer, needed)
        order = [needed[i] for i in serving_order([counts[e] for e in needed], state_list)]
        states = dict(zip(needed, state_list))
        on_host = self._host_choice(order, states, counts)
        if room == 0:  # every slot is held elsewhere: the host computes what those leases do not hold
            on_host |= {e for e in order if self.cache.refcount(layer, e) == 0}
        if not on_host:
            return order, states, 0
        order = [e for e in order if e not in on_host] + [e for e in order if e in on_host]
        return order, states, len(on_host)

    def _host_choice(self, order: list[int], states: dict[int, int], counts: dict[int, int]) -> set[int]:
        """The missing experts the host-experts policy computes on the host."""
        if self.host_experts == "off":
            return set()
        missing = [e for e in order if states[e] == MISSING]
        if not self._host_may_win(len(missing)):
            return set()
        return {e for e, h in zip(missing, choose_host_experts(
            [counts[e] for e in missing], self.host_speeds, self.host_experts)) if h}

    def _host_may_win(self, num_missing: int) -> bool:
        """False when :func:`choose_host_experts` surely keeps every one of ``num_missing`` misses on the
        link: even one expert of one token on the host takes as long as all the copies."""
        if num_missing == 0:
            return False
        s = self.host_speeds
        if self.host_experts != "auto" or s is None or s.cpu_ms_per_token < 0 or s.cpu_ms(1) < 0:
            return True
        return s.transfer_ms + s.cpu_ms(1) < num_missing * s.link_ms_per_expert

    def _compute_round(self, lease: ExpertLease, planned: list[int], slots: torch.Tensor, bounds: list[int],
                       pairs: _SortedPairs, max_groups: int) -> None:
        """Queue the round's experts (``lease.experts``, serving order, ``planned`` their states when
        the call was planned; their pairs are the sorted rows ``bounds[0]:bounds[-1]``, whose slots are
        ``slots`` (n, 1)): the resident ones at its head in one group, the others in at most
        ``max_groups`` groups, each group after its own copies."""
        lo = bounds[0]
        x_sorted, w_sorted, y_sorted = pairs.x, pairs.w, pairs.y
        # Resident when planned and still (it may have been evicted by an earlier round); on a CPU
        # cache copies are synchronous, so fetched experts still form their groups (waits are no-ops).
        states = [RESIDENT if ready and p == RESIDENT else IN_FLIGHT for ready, p in zip(lease.ready, planned)]
        w = self.cache.weights
        for group in round_groups(states, self.cache.store.record_bytes, self.overlap, self.group_bytes,
                                  max_groups):
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
        store = self.cache.store
        y = torch.empty((bounds[-1] - bounds[0], y_sorted.shape[1]), dtype=torch.float32,
                        pin_memory=y_sorted.is_cuda)  # (n, D)
        for i, expert in enumerate(experts):
            a, b = bounds[i] - bounds[0], bounds[i + 1] - bounds[0]
            y[a:b] = host_expert(x_host[a:b], store.expert_weights(layer, expert)) * w_host[a:b]
        y_sorted[bounds[0]:bounds[-1]].copy_(y, non_blocking=True)
        self.cache.count_cpu_computed(layer, len(experts))
