"""Engine-side glue for expert offload: plan where the routed experts live before anything is
loaded, build the host expert store + device expert cache, and give the model and the runahead
decoder what they need (the MoE backend, and a ``Residency`` view of the cache whose eviction follows
the decoder's plan)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.engine.api import CheckpointError, EngineConfig, HearthError
from hearth.engine.config import ModelConfig
from hearth.engine.loader import tensor_bytes
from hearth.engine.models import fused_experts
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.kernels.moe import fused_moe, moe_reference
from hearth.offload.expert_cache import POLICIES, EvictionPolicy, ExpertCache, ExpertLease, Key
from hearth.offload.expert_store import ExpertLayout, ExpertStore, Mxfp4Packing
from hearth.offload.experts import OffloadedExperts
from hearth.offload.fetch_plan import MISSING
from hearth.offload.planner import (
    MemoryPlan,
    MemoryPlanError,
    ModelFootprint,
    footprint_from_stacked_experts,
    footprint_from_tensor_bytes,
    plan_memory,
    probe_memory,
)


@dataclass(frozen=True)
class Placement:
    """Decision for the routed experts: offloaded (with slots per layer) or not, and why."""

    offload: bool
    slots_per_layer: int | None
    description: str


def _footprint(path: str | Path, config: ModelConfig, engine: EngineConfig, device: torch.device) -> ModelFootprint:
    if config.model_type == "gpt_oss":  # stacked experts: MXFP4 stays MXFP4 in the store and the GPU slots,
        # and when all are resident if the fused kernel (which reads it) runs them
        auto = torch.bfloat16 if device.type == "cuda" else torch.float32  # "auto"
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(engine.dtype, auto)
        layout = ExpertLayout(config.hidden_size, config.moe_intermediate_size, dtype, bias=True)
        sizes = tensor_bytes(path)
        slot, resident = layout.record_bytes, None
        if any(name.endswith("experts.gate_up_proj_blocks") for name in sizes):
            slot = Mxfp4Packing(layout).record_bytes
            if not (fused_experts.applies(device) and engine.use_kernels == "auto"):  # as RunnerFeatures.decide
                resident = layout.record_bytes  # all resident without the fused kernel: dequantised at load
        return footprint_from_stacked_experts(sizes, config.num_experts_per_tok, config.n_routed_experts, slot,
                                              resident_expert_bytes=resident)
    return footprint_from_tensor_bytes(tensor_bytes(path), config.num_experts_per_tok, config.num_hidden_layers)


def plan_placement(path: str | Path, model_config: ModelConfig, config: EngineConfig, device: torch.device,
                   kv_cache_bytes: int) -> Placement:
    """Decide before loading. Raises HearthError with the numbers if the model cannot fit."""
    if not model_config.n_routed_experts or config.offload == "never":
        return Placement(False, None, "experts stay with the model")
    if config.offload == "always" and config.expert_cache_slots is not None:
        return Placement(True, config.expert_cache_slots, f"offload forced: {config.expert_cache_slots} slots/layer")
    footprint = _footprint(path, model_config, config, device)
    try:
        plan: MemoryPlan = plan_memory(
            footprint, kv_cache_bytes, probe_memory(), gpu_memory_gib=config.gpu_memory_gib,
            expert_cache_gib=config.expert_cache_gib, host_memory_gib=config.host_memory_gib)
    except MemoryPlanError as exc:
        raise HearthError(f"the model does not fit this machine: {exc}") from None
    if device.type == "cpu" and config.offload != "always":
        return Placement(False, None, plan.describe())
    slots = config.expert_cache_slots or plan.slots_per_layer
    offload = config.offload == "always" or plan.experts == "offload"
    return Placement(offload, min(slots, model_config.n_routed_experts) if offload else None, plan.describe())


class EvictionPlan:
    """Which resident experts the runahead decoder still expects to use, per layer: expert -> tier
    (see hearth.engine.runahead). Empty for the other schedulers, so their eviction is the base policy's."""

    def __init__(self) -> None:
        self.tiers: dict[int, dict[int, int]] = {}

    def tier(self, key: Key) -> int:
        return self.tiers.get(key[0], {}).get(key[1], 0)

    def policy(self, base: str | Callable[[], EvictionPolicy]) -> Callable[[], EvictionPolicy]:
        """A factory of ``base`` policies that evict by tier first (the cache builds one per pool)."""
        make_base = POLICIES[base] if isinstance(base, str) else base
        return lambda: PlannedEviction(make_base(), self)


class PlannedEviction(EvictionPolicy):
    """``base``'s order, stably re-sorted by the plan's tier: experts nobody expects go first."""

    def __init__(self, base: EvictionPolicy, plan: EvictionPlan) -> None:
        self.base = base
        self.plan = plan

    def advance(self) -> None:
        self.base.advance()

    def touch(self, key: Key) -> None:
        self.base.touch(key)

    def remove(self, key: Key) -> None:
        self.base.remove(key)

    def victims(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        if not self.plan.tiers:
            return self.base.victims(n, evictable)
        ranked = self.base.victims(sys.maxsize, evictable)  # every evictable key, best victim first
        return sorted(ranked, key=self.plan.tier)[:n]


FETCH_AHEAD_BYTES = 384 << 20  # copies kept queued by the runahead decoder: about 7 ms at 55 GB/s


class CacheResidency:
    """The runahead decoder's view of an ExpertCache (see hearth.engine.runahead.Residency). A handle
    is a one-expert :class:`ExpertLease`."""

    def __init__(self, cache: ExpertCache, use_kernel: bool, plan: EvictionPlan | None = None) -> None:
        self.cache = cache
        self.use_kernel = use_kernel
        self.eviction_plan = plan or EvictionPlan()  # the cache's policy must read this same plan

    def plan(self, layer: int, tiers: dict[int, int]) -> None:
        if tiers:
            self.eviction_plan.tiers[layer] = tiers
        else:  # an empty plan leaves the layer to the base policy (and the cache's fast path when all are empty)
            self.eviction_plan.tiers.pop(layer, None)

    def copies(self) -> int:
        return self.cache.copies

    def fetch_depth(self) -> int:
        return max(2, -(-FETCH_AHEAD_BYTES // self.cache.store.record_bytes))

    def is_free(self, layer: int, experts: list[int]) -> list[bool]:
        return [state != MISSING for state in self.cache.lookup(layer, experts)]

    def acquire(self, layer: int, experts: list[int]) -> list[ExpertLease]:
        lease = self.cache.acquire(layer, experts)  # CacheFullError is a RuntimeError
        events = lease.expert_events or [None] * len(experts)
        # NOTE: the cache releases a lease by its slots, so one lease per expert lets each expert go
        # back as soon as its last pair is computed; the parent lease is never released itself.
        return [ExpertLease(layer, [e], [slot], [ready], [event] if event is not None else [], [event])
                for e, slot, ready, event in zip(lease.experts, lease.slots, lease.ready, events)]

    def has_landed(self, handle: ExpertLease) -> bool:
        event = handle.expert_events[0]
        if handle.ready[0] or event is None or event.query():
            handle.ready[0] = True
            return True
        return False

    def wait_any(self, handles: list[ExpertLease]) -> None:
        for handle in handles:
            if not handle.ready[0] and handle.expert_events[0] is not None:
                handle.expert_events[0].synchronize()
                return

    def release(self, handle: ExpertLease) -> None:
        self.cache.release(handle)

    def compute(self, layer: int, x: torch.Tensor, handles: list[ExpertLease], weights: torch.Tensor) -> torch.Tensor:
        del layer  # the slots say where the experts are
        self.wait_landed(handles)
        slots = torch.tensor(self.slots(handles), dtype=torch.int32, pin_memory=x.is_cuda)
        return self.compute_slots(x, slots.to(x.device, non_blocking=True), weights)

    @property
    def capturable(self) -> bool:
        """Can :meth:`compute_slots` run inside a CUDA graph (the fused kernel on the GPU: no host sync)?"""
        return self.cache.is_cuda and self.use_kernel

    def slots(self, handles: list[ExpertLease]) -> list[int]:
        """The cache slot of each handle's expert."""
        return [h.slots[0] for h in handles]

    def wait_landed(self, handles: list[ExpertLease]) -> None:
        """Make the current stream wait for the handles' copies (a no-op once landed)."""
        for handle in handles:
            handle.wait()

    def compute_slots(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(P, D) fp32: row p is weights[p] * the expert at cache slot slots[p] (int32, -1: zero) of x[p]."""
        slot_ids = slots.to(torch.int32).unsqueeze(1)  # (P, 1)
        w = self.cache.weights
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (P, D)
        if self.use_kernel:
            fused_moe(x, slot_ids, weights.unsqueeze(1), w.w13, w.w2, w.s13, w.s2, out=out, extras=w.kernel_extras)
        else:
            out += moe_reference(x, slot_ids, weights.unsqueeze(1), w.w13, w.w2, w.s13, w.s2, **w.reference_kwargs())
        return out


class PrefetchingExperts:
    """Baseline for the runahead scheduler: layer-synchronous offload plus a *prediction*
    prefetcher. After a layer's experts are queued, the next MoE layer's router is applied to this
    layer's MoE input (the hidden state one layer early, as mixtral-offloading and FATE do) and
    the predicted experts are fetched ahead; a wrong guess costs link time and cache room. Guesses
    take only slots nobody holds. ``active`` False makes it the plain backend (``--scheduler auto``
    switches it per step)."""

    def __init__(self, backend: OffloadedExperts, model: DeepseekForCausalLM) -> None:
        self.backend = backend
        self.cache = backend.cache
        self.active = True
        layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
        self._next = dict(zip(layers, layers[1:]))
        self._gates = {i: model.layers[i].mlp.gate for i in layers}
        self.predicted = 0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = self.backend(layer, x, ids, weights)
        self.predict(layer, x)
        return out

    def predict(self, layer: int, x: torch.Tensor) -> None:
        """Fetch the experts the next MoE layer's router picks for ``x``, ``layer``'s MoE input."""
        nxt = self._next.get(layer)
        if nxt is not None and self.active:
            guess = list(dict.fromkeys(self._gates[nxt](x)[0].flatten().tolist()))
            guess = guess[: self.cache.available(nxt)]  # slots held elsewhere are not the guess's to take
            if guess:
                self.cache.release(self.cache.acquire(nxt, guess))  # copies run on; slots stay evictable
                self.predicted += len(guess)


def _host_store(path: Path, config: ModelConfig, layers: list[int], dtype: torch.dtype) -> ExpertStore:
    """The routed experts of ``layers`` read from the checkpoint into host RAM; a tensor missing or
    malformed there is a CheckpointError naming it."""
    try:
        if config.model_type == "gpt_oss":  # stacked (MXFP4 or float) experts with biases, clamped SwiGLU
            return ExpertStore.from_stacked_safetensors(path, layers, dtype, config.swiglu_limit, config.swiglu_alpha)
        fp8 = config.quantization is not None
        return ExpertStore.from_safetensors(path, layers, config.n_routed_experts, dtype=None if fp8 else dtype,
                                            module=config.moe_module, proj_names=config.expert_proj_names)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: routed experts: {str(exc).strip(chr(39))}") from None


def attach_offload(model: DeepseekForCausalLM, path: str | Path | None, placement: Placement,
                   device: torch.device, dtype: torch.dtype, policy: str, prefetch: bool = False,
                   store: ExpertStore | None = None,
                   host_experts: str = "auto",
                   ) -> tuple[ExpertCache, CacheResidency, OffloadedExperts, PrefetchingExperts | None]:
    """Fill the host store from the checkpoint (or use ``store``), put a device cache in front,
    route every MoE layer through it (the returned backend; through the prediction prefetcher when
    ``prefetch``, returned last so its ``active`` can be switched). host_experts: compute missed experts
    on the CPU when measured faster ("auto"), always ("on"), never ("off") — see hearth.offload.cpu_experts."""
    config = model.config
    layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    if store is None:
        store = _host_store(Path(path), config, layers, dtype)
    plan = EvictionPlan()
    cache = ExpertCache(store, device, slots_per_layer=placement.slots_per_layer, policy=plan.policy(policy))
    backend = OffloadedExperts(cache, host_experts=host_experts)
    prefetcher = PrefetchingExperts(backend, model) if prefetch else None
    for i in layers:
        model.layers[i].mlp.backend = prefetcher or backend
    return cache, CacheResidency(cache, use_kernel=backend.use_kernel, plan=plan), backend, prefetcher
