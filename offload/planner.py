"""Memory planning: decide, before anything is loaded, where the weights, the KV cache and the routed
experts go, from byte counts and the free memory of the GPU and the host.

``plan_memory`` is a pure function of its inputs (``probe_memory`` reads the machine), so every case
is testable without a GPU. It returns a frozen :class:`MemoryPlan` or raises :class:`MemoryPlanError`
whose message gives the numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import psutil
import torch

GiB = 1 << 30
DEFAULT_GPU_RESERVE = 2 * GiB  # CUDA context, allocator fragmentation, kernels' scratch
DEFAULT_HOST_RESERVE = 4 * GiB  # the OS, the app, the tokenizer
_ROUTED = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class MemoryPlanError(RuntimeError):
    """The model cannot be placed in the memory available; the message says by how much."""


@dataclass(frozen=True)
class ModelFootprint:
    """Byte counts of a checkpoint, split into routed experts and everything else."""

    dense_bytes: int  # attention, dense MLPs, shared experts, routers, norms, embeddings, head
    # One routed expert as stored: in the host store, over the link and in a GPU cache slot (gate + up +
    # down, with FP8 scales; gpt-oss's MXFP4 records, which the fused MoE kernel reads directly).
    expert_bytes: int
    num_moe_layers: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    # One routed expert as held on the GPU when all are resident, when not ``expert_bytes`` (gpt-oss's
    # MXFP4 dequantised at load when the fused kernel does not run them).
    resident_expert_bytes: int | None = None

    @property
    def routed_bytes(self) -> int:
        """All routed experts as stored (the host store; offload's cache slots hold them so)."""
        return self.expert_bytes * self.num_experts * self.num_moe_layers

    @property
    def resident_routed_bytes(self) -> int:
        """All routed experts resident on the GPU, as held there."""
        per_expert = self.expert_bytes if self.resident_expert_bytes is None else self.resident_expert_bytes
        return per_expert * self.num_experts * self.num_moe_layers


_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:gate_up_proj|down_proj)")


def footprint_from_stacked_experts(tensor_bytes: Mapping[str, int], top_k: int, num_experts: int, expert_bytes: int,
                                   resident_expert_bytes: int | None = None) -> ModelFootprint:
    """gpt-oss: each layer's experts stacked in a few tensors (MXFP4 in the release). One expert's
    bytes come from the store's record layouts, not from the files: ``expert_bytes`` as stored (in
    RAM, fetched, in a cache slot; MXFP4 when the store keeps it), ``resident_expert_bytes`` held on
    the GPU when all are resident, if not that (float when the fused kernel does not run them)."""
    layers = {int(m.group(1)) for name in tensor_bytes if (m := _STACKED.match(name))}
    dense = sum(n for name, n in tensor_bytes.items() if not _STACKED.match(name))
    return ModelFootprint(dense, expert_bytes, len(layers), num_experts if layers else 0, top_k,
                          resident_expert_bytes)


def footprint_from_tensor_bytes(tensor_bytes: Mapping[str, int], top_k: int,
                                num_layers: int | None = None) -> ModelFootprint:
    """Split checkpoint tensor sizes (name -> bytes) into routed experts and the rest. With
    ``num_layers``, tensors of later layers (the multi-token-prediction layers DeepSeek and GLM-4.5
    ship, a whole MoE layer each, which the engine never loads) are left out."""
    dense, routed, experts, layers = 0, 0, set(), set()
    for name, nbytes in tensor_bytes.items():
        layer = _LAYER.search(name)
        if num_layers is not None and layer is not None and int(layer.group(1)) >= num_layers:
            continue
        match = _ROUTED.search(name)
        if match is None:
            dense += nbytes
            continue
        routed += nbytes
        experts.add(int(match.group(1)))
        layers.add(int(layer.group(1)))
    num_experts, num_layers = len(experts), len(layers)
    expert_bytes = routed // (num_experts * num_layers) if routed else 0
    return ModelFootprint(dense, expert_bytes, num_layers, num_experts, top_k)


@dataclass(frozen=True)
class DeviceMemory:
    """What the machine offers now. ``gpu_free_bytes`` None: no usable GPU."""

    gpu_free_bytes: int | None
    host_available_bytes: int


def probe_memory() -> DeviceMemory:
    """Free memory of the current CUDA device (``torch.cuda.mem_get_info``) and available host RAM."""
    gpu_free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    return DeviceMemory(gpu_free, psutil.virtual_memory().available)


@dataclass(frozen=True)
class MemoryPlan:
    """Where things go. ``experts``: 'gpu' (all resident), 'offload' (host store + GPU cache of
    ``slots_per_layer`` experts per MoE layer) or 'cpu' (no GPU: everything in host memory)."""

    device: Literal["cuda", "cpu"]
    experts: Literal["gpu", "offload", "cpu"]
    slots_per_layer: int  # experts per MoE layer held on the device (all of them unless offloading)
    gpu_bytes: int  # dense + KV + expert slots (0 on CPU)
    host_bytes: int  # expert store (offload), or everything (cpu)
    cache_bytes: int  # the device's expert slots
    gpu_budget_bytes: int
    host_budget_bytes: int

    @property
    def expert_cache_slots(self) -> int:
        """Slots per layer; multiply by the MoE layer count for a global pool."""
        return self.slots_per_layer

    def describe(self) -> str:
        g = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731 - a local formatter reads best inline
        if self.experts == "cpu":
            return f"CPU only: {g(self.host_bytes)} in host memory of {g(self.host_budget_bytes)}"
        return (f"GPU {g(self.gpu_bytes)} of {g(self.gpu_budget_bytes)} (expert slots {g(self.cache_bytes)}, "
                f"{self.slots_per_layer} experts/layer); host {g(self.host_bytes)} of "
                f"{g(self.host_budget_bytes)}; experts: {self.experts}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _host_budget(memory: DeviceMemory, host_memory_gib: float | None, reserve: int) -> int:
    budget = max(0, memory.host_available_bytes - reserve)
    return budget if host_memory_gib is None else min(budget, int(host_memory_gib * GiB))


def _plan_cpu(fp: ModelFootprint, kv_cache_bytes: int, host_budget: int) -> MemoryPlan:
    need = fp.dense_bytes + fp.routed_bytes + kv_cache_bytes
    if need > host_budget:
        raise MemoryPlanError(
            f"does not fit in host memory (no GPU): weights {_gib(fp.dense_bytes + fp.routed_bytes)} + "
            f"KV cache {_gib(kv_cache_bytes)} = {_gib(need)} > {_gib(host_budget)} available")
    return MemoryPlan("cpu", "cpu", fp.num_experts, 0, need, 0, 0, host_budget)


def plan_memory(
    footprint: ModelFootprint,
    kv_cache_bytes: int,
    memory: DeviceMemory,
    *,
    gpu_memory_gib: float | None = None,
    expert_cache_gib: float | None = None,
    host_memory_gib: float | None = None,
    gpu_reserve_bytes: int = DEFAULT_GPU_RESERVE,
    host_reserve_bytes: int = DEFAULT_HOST_RESERVE,
) -> MemoryPlan:
    """Place dense weights + KV cache on the GPU, then the routed experts: all on the GPU when they
    fit (and no ``expert_cache_gib`` is forced), else in host memory with a GPU cache filling the
    rest of the budget (or ``expert_cache_gib``). Overrides cap the GPU and host budgets."""
    fp = footprint
    host_budget = _host_budget(memory, host_memory_gib, host_reserve_bytes)
    if memory.gpu_free_bytes is None:
        return _plan_cpu(fp, kv_cache_bytes, host_budget)
    gpu_budget = max(0, memory.gpu_free_bytes - gpu_reserve_bytes)
    if gpu_memory_gib is not None:
        gpu_budget = min(gpu_budget, int(gpu_memory_gib * GiB))
    fixed = fp.dense_bytes + kv_cache_bytes
    if fixed > gpu_budget:
        raise MemoryPlanError(
            f"does not fit on the GPU: dense weights {_gib(fp.dense_bytes)} + KV cache "
            f"{_gib(kv_cache_bytes)} = {_gib(fixed)} > GPU budget {_gib(gpu_budget)} "
            f"({_gib(memory.gpu_free_bytes)} free - {_gib(gpu_reserve_bytes)} reserve"
            + (f", capped at gpu_memory_gib={gpu_memory_gib}" if gpu_memory_gib is not None else "") + ")")
    spare = gpu_budget - fixed
    resident = fp.resident_routed_bytes
    if expert_cache_gib is None and resident <= spare:
        return MemoryPlan("cuda", "gpu", fp.num_experts, fixed + resident, 0, resident, gpu_budget, host_budget)
    cache_bytes = spare if expert_cache_gib is None else int(expert_cache_gib * GiB)
    if cache_bytes > spare:
        raise MemoryPlanError(
            f"expert_cache_gib={expert_cache_gib} does not fit: GPU budget {_gib(gpu_budget)} - dense "
            f"{_gib(fp.dense_bytes)} - KV cache {_gib(kv_cache_bytes)} leaves {_gib(spare)}")
    per_layer = min(fp.num_experts, cache_bytes // (fp.expert_bytes * fp.num_moe_layers))
    if per_layer == fp.num_experts and resident <= cache_bytes:
        return MemoryPlan("cuda", "gpu", fp.num_experts, fixed + resident, 0, resident, gpu_budget, host_budget)
    if per_layer < fp.top_k:
        raise MemoryPlanError(
            f"expert cache too small: {_gib(cache_bytes)} holds {per_layer} experts per MoE layer "
            f"({fp.num_moe_layers} layers x {_gib(fp.expert_bytes)} per expert); at least top_k={fp.top_k} "
            f"are needed, i.e. {_gib(fp.top_k * fp.num_moe_layers * fp.expert_bytes)}")
    if fp.routed_bytes > host_budget:
        raise MemoryPlanError(
            f"routed experts do not fit in host memory: {_gib(fp.routed_bytes)} > {_gib(host_budget)} "
            f"available ({_gib(memory.host_available_bytes)} - {_gib(host_reserve_bytes)} reserve"
            + (f", capped at host_memory_gib={host_memory_gib}" if host_memory_gib is not None else "") + ")")
    used_cache = per_layer * fp.num_moe_layers * fp.expert_bytes
    return MemoryPlan("cuda", "offload", per_layer, fixed + used_cache, fp.routed_bytes, used_cache,
                      gpu_budget, host_budget)
