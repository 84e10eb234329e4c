"""Will this model run here? A verdict from the weights' size, the config and this machine.

The estimate, per request of ``context_length`` tokens:
- caches: every layer keeps the MLA latent (``kv_lora_rank + qk_rope_head_dim`` = 576 values, bf16)
  per token, and DSA models (DeepSeek-V3.2, GLM-5) also the indexer key (132 bytes: 128 FP8 values +
  one fp32 scale) per token;
- grouped-query attention models (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss) keep K and V of every KV head instead;
- routed experts: MoE layers x ``n_routed_experts`` x 3 matrices x ``hidden_size`` x
  ``moe_intermediate_size`` x bytes per parameter (1 for FP8 checkpoints, else the config's dtype);
  the rest of the weights (attention, dense layers, shared experts, embeddings) is "dense"; gpt-oss's
  MXFP4 experts download at 4.25 bits per weight (4-bit codes + one scale byte per 32) and stay so in
  RAM and in the expert cache's slots when offloaded and on the GPU when all are resident (the fused
  MoE kernel reads MXFP4), but are bf16 on the CPU path;
- multi-token-prediction layers (``num_nextn_predict_layers``: DeepSeek-V3/V3.2, GLM-4.5, GLM-5) are
  in the download but never loaded: their routed experts, the bulk of each, are left out.

- runtime: a fixed allowance for the engine host itself (measured: the demo model's host used
  0.56 GiB of RAM, nearly all of it Python and PyTorch; the CUDA context takes a few hundred MB of
  GPU memory) plus activations, which grow with the hidden size (a 2,048-token prefill chunk with
  ``ACTIVATION_BUFFERS`` fp32 hidden-size buffers per token; an allowance, not a measurement).
  Small models thus need little more than their weights, not a multi-GB constant.

Verdicts: everything on the GPU; dense weights + caches + an expert cache on the GPU with the
experts in (pinned) RAM; CPU only when there is no CUDA device; or does not fit.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

from hearth.app.hub.catalog import RepoDetails
from hearth.app.hub.context import HubContext
from hearth.app.hub.units import GIB, format_bytes
from hearth.app.store.settings import Settings
from hearth.engine.config import DSA_MODEL_TYPES, GQA_MODEL_TYPES

MIB = 1024**2
GPU_RUNTIME_BYTES = 512 * MIB  # CUDA context and allocator slack
HOST_RUNTIME_BYTES = 640 * MIB  # the engine host's Python + PyTorch (measured 0.56 GiB with the demo model)
PREFILL_CHUNK_TOKENS = 2048  # EngineConfig.max_num_batched_tokens
ACTIVATION_BUFFERS = 16  # fp32 hidden-size buffers alive per token of a prefill chunk
LATENT_VALUES_PER_TOKEN = 576  # MLA default: kv_lora_rank 512 + qk_rope_head_dim 64
INDEXER_KEY_BYTES_PER_TOKEN = 132
CACHE_VALUE_BYTES = 2  # bf16
MXFP4_BITS_PER_WEIGHT = 4.25  # hearth.kernels.moe.mxfp4.BITS_PER_VALUE (not imported: that pulls in torch)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


class Verdict(StrEnum):
    GPU = "runs on the GPU"
    EXPERTS_IN_RAM = "runs with experts in RAM"
    CPU_ONLY = "runs on the CPU only (slow)"
    DOES_NOT_FIT = "does not fit"


@dataclass(frozen=True)
class Machine:
    """Memory Hearth may use. ``gpu_bytes`` None = no CUDA device."""

    gpu_bytes: int | None
    ram_bytes: int
    disk_free_bytes: int


@dataclass(frozen=True)
class Footprint:
    """A model's memory needs, independent of the machine."""

    weights_bytes: int
    experts_bytes: int
    num_layers: int
    cache_bytes_per_token: int
    num_moe_layers: int
    hidden_size: int = 0
    # The experts as stored (MXFP4), if not experts_bytes: so in RAM and in the GPU's cache slots when
    # offloaded, and on the GPU when all are resident (the fused MoE kernel reads MXFP4 directly).
    stored_experts_bytes: int | None = None

    @property
    def experts_in_ram_bytes(self) -> int:
        return self.experts_bytes if self.stored_experts_bytes is None else self.stored_experts_bytes

    @property
    def resident_gpu_weights_bytes(self) -> int:
        """All weights on the GPU: the experts as stored."""
        return self.dense_bytes + self.experts_in_ram_bytes

    @property
    def activation_bytes(self) -> int:
        return PREFILL_CHUNK_TOKENS * self.hidden_size * 4 * ACTIVATION_BUFFERS

    @property
    def dense_bytes(self) -> int:
        return self.weights_bytes - self.experts_bytes

    def cache_bytes(self, context_length: int) -> int:
        return self.cache_bytes_per_token * context_length


@dataclass(frozen=True)
class FitReport:
    verdict: Verdict
    gpu_needed_bytes: int
    gpu_bytes: int | None
    ram_needed_bytes: int
    ram_bytes: int
    cache_bytes: int
    download_bytes: int
    disk_free_bytes: int

    @property
    def fits_on_disk(self) -> bool:
        return self.download_bytes <= self.disk_free_bytes

    @property
    def summary(self) -> str:
        gpu = format_bytes(self.gpu_bytes) if self.gpu_bytes is not None else "no CUDA GPU"
        line = (f"{self.verdict}: needs {format_bytes(self.gpu_needed_bytes)} GPU (has {gpu}) and "
                f"{format_bytes(self.ram_needed_bytes)} RAM (has {format_bytes(self.ram_bytes)}); "
                f"caches {format_bytes(self.cache_bytes)}")
        if not self.fits_on_disk:
            line += (f"; download {format_bytes(self.download_bytes)} but only "
                     f"{format_bytes(self.disk_free_bytes)} free on disk")
        return line


def footprint_from_config(config: dict[str, Any] | None, weights_bytes: int) -> Footprint:
    """Estimate the experts' share and the per-token cache size; no config = all dense."""
    config = config or {}
    num_layers = int(config.get("num_hidden_layers", 0))
    latent = int(config.get("kv_lora_rank", 512)) + int(config.get("qk_rope_head_dim", 64))
    per_layer = (latent if "kv_lora_rank" in config else LATENT_VALUES_PER_TOKEN) * CACHE_VALUE_BYTES
    if config.get("model_type") in GQA_MODEL_TYPES:  # grouped-query attention: K and V per KV head
        heads = int(config.get("num_attention_heads") or 1)
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
        per_layer = 2 * int(config.get("num_key_value_heads") or heads) * head_dim * CACHE_VALUE_BYTES
    if config.get("model_type") in DSA_MODEL_TYPES:
        per_layer += INDEXER_KEY_BYTES_PER_TOKEN
    moe_layers = _num_moe_layers(config, num_layers)
    stacked = config.get("model_type") in ("mixtral", "gpt_oss")  # experts as wide as intermediate_size
    inter = int(config.get("intermediate_size" if stacked else "moe_intermediate_size", 0) or 0)
    per_expert = 3 * int(config.get("hidden_size", 0)) * inter
    n_experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0
    layer_experts = int(n_experts) * per_expert * _param_bytes(config)
    if moe_layers:
        weights_bytes = max(weights_bytes - int(config.get("num_nextn_predict_layers") or 0) * layer_experts, 0)
    experts = min(moe_layers * layer_experts, int(weights_bytes * 0.98))
    stored = None
    if _is_mxfp4(config):
        # The download holds the experts at 4.25 bits per weight, as the offload store, its GPU slots
        # and resident experts on the GPU do; the CPU path computes them in bf16.
        params = moe_layers * int(n_experts) * per_expert
        stored = min(int(params * MXFP4_BITS_PER_WEIGHT / 8), int(weights_bytes * 0.98))
        experts = params * 2
        weights_bytes += experts - stored
    return Footprint(
        weights_bytes=weights_bytes,
        experts_bytes=experts,
        num_layers=num_layers,
        cache_bytes_per_token=per_layer * num_layers,
        num_moe_layers=moe_layers,
        hidden_size=int(config.get("hidden_size", 0)),
        stored_experts_bytes=stored,
    )


def assess_fit(footprint: Footprint, machine: Machine, *, context_length: int,
               expert_cache_bytes: int | None = None, download_bytes: int = 0) -> FitReport:
    """The best way this model runs on ``machine``, with the numbers behind the verdict."""
    cache = footprint.cache_bytes(context_length)
    gpu_runtime = GPU_RUNTIME_BYTES + footprint.activation_bytes
    all_on_gpu = footprint.resident_gpu_weights_bytes + cache + gpu_runtime
    if expert_cache_bytes is None:  # at least one MoE layer's experts resident
        expert_cache_bytes = footprint.experts_in_ram_bytes // max(footprint.num_moe_layers, 1)
    split_gpu = footprint.dense_bytes + cache + expert_cache_bytes + gpu_runtime
    split_ram = footprint.experts_in_ram_bytes + HOST_RUNTIME_BYTES
    cpu_ram = footprint.weights_bytes + cache + HOST_RUNTIME_BYTES + footprint.activation_bytes

    def report(verdict: Verdict, gpu_needed: int, ram_needed: int) -> FitReport:
        return FitReport(verdict, gpu_needed, machine.gpu_bytes, ram_needed, machine.ram_bytes, cache,
                         download_bytes, machine.disk_free_bytes)

    gpu = machine.gpu_bytes
    if gpu is None:
        verdict = Verdict.CPU_ONLY if cpu_ram <= machine.ram_bytes else Verdict.DOES_NOT_FIT
        return report(verdict, 0, cpu_ram)
    if all_on_gpu <= gpu:
        return report(Verdict.GPU, all_on_gpu, HOST_RUNTIME_BYTES)
    if footprint.experts_bytes > 0 and split_gpu <= gpu and split_ram <= machine.ram_bytes:
        return report(Verdict.EXPERTS_IN_RAM, split_gpu, split_ram)
    if footprint.experts_bytes > 0:
        return report(Verdict.DOES_NOT_FIT, split_gpu, split_ram)
    return report(Verdict.DOES_NOT_FIT, all_on_gpu, HOST_RUNTIME_BYTES)


def fit_for_repo(details: RepoDetails, settings: Settings, machine: Machine | None = None) -> FitReport:
    """The verdict for a Hub repo with the user's context length and expert cache size."""
    machine = machine or probe_machine(settings, HubContext.from_settings(settings).cache_dir)
    expert_cache = int(settings.engine.expert_cache_gib * GIB) if settings.engine.expert_cache_gib else None
    return assess_fit(footprint_from_config(details.config, details.weights_bytes), machine,
                      context_length=settings.context_length, expert_cache_bytes=expert_cache,
                      download_bytes=details.download_bytes())


def probe_machine(settings: Settings, disk_path: Path) -> Machine:
    """This machine's free GPU memory, available RAM and free disk, or the user's caps."""
    gpu = _probe_gpu_bytes()
    if settings.engine.gpu_memory_gib is not None and gpu is not None:
        gpu = int(settings.engine.gpu_memory_gib * GIB)
    ram = psutil.virtual_memory().available
    if settings.engine.host_memory_gib is not None:
        ram = int(settings.engine.host_memory_gib * GIB)
    return Machine(gpu_bytes=gpu, ram_bytes=ram, disk_free_bytes=free_disk_bytes(disk_path))


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would, once created)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _probe_gpu_bytes() -> int | None:
    import torch  # lazy: importing torch costs seconds, and most commands never need it

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def _is_mxfp4(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4"


def _num_moe_layers(config: dict[str, Any], num_layers: int) -> int:
    if config.get("model_type") in ("mixtral", "gpt_oss"):
        return num_layers
    if config.get("model_type") == "glm4_moe":  # dense first layers, then MoE (transformers' defaults)
        if not config.get("n_routed_experts", 128):
            return 0
        first_dense = config.get("first_k_dense_replace")
        return max(num_layers - (1 if first_dense is None else int(first_dense)), 0)
    if config.get("model_type") == "qwen3_moe":
        dense, step = set(config.get("mlp_only_layers") or []), int(config.get("decoder_sparse_step") or 1)
        return sum(1 for layer in range(num_layers) if layer not in dense and (layer + 1) % step == 0)
    if not config.get("n_routed_experts"):
        return 0
    first_dense = int(config.get("first_k_dense_replace") or 0)
    every = int(config.get("moe_layer_freq") or 1)
    return sum(1 for layer in range(first_dense, num_layers) if layer % every == 0)


def _param_bytes(config: dict[str, Any]) -> int:
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return 1
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return _DTYPE_BYTES.get(dtype, 2)
