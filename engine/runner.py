"""ModelRunner: owns the model and its paged caches and turns a step's requests into one flat
batch (token ids, positions, slots) for the model. Knows nothing about scheduling or sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth.engine.api import EngineConfig, HearthError
from hearth.engine.config import ModelConfig
from hearth.engine.cuda_graphs import DecodeGraphs
from hearth.engine.kv_cache import PagedCache, build_context
from hearth.engine.loader import load_checkpoint
from hearth.engine.models import dsa_kernels, fused_experts
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.offload_setup import Placement, attach_offload, plan_placement
from hearth.engine.tiers import KeyTiers, LatentTiers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class StepInput:
    """One request's share of a step: the tokens at positions [first_position, +len(token_ids))."""

    block_table: list[int]
    first_position: int
    token_ids: list[int]
    seq_id: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HearthError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    """Loads the checkpoint and sizes the caches; ``run`` executes one forward step."""

    def __init__(self, path: str, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        keep_fp8 = config.keep_fp8 if config.keep_fp8 is not None else self.device.type == "cuda"
        self.model_config = ModelConfig.from_file(path).with_index_retention(
            config.index_topk_freq, config.index_skip_topk_offset, config.index_topk_pattern)
        self._size_caches(config)
        # Decide where the experts go before loading anything, so a model that cannot fit fails fast.
        self.placement = plan_placement(path, self.model_config, config, self.device, self.kv_bytes)
        self.model: DeepseekForCausalLM = load_checkpoint(
            path, self.device, self.dtype, keep_fp8, config.faithful, skip_routed_experts=self.placement.offload,
            config=self.model_config)
        self._setup(path, config)

    @classmethod
    def from_model(cls, model: DeepseekForCausalLM, config: EngineConfig) -> ModelRunner:
        """A runner around a model built in memory (benchmarks: full-size shapes with random weights
        and no checkpoint on disk). Everything stays where the model's parameters are."""
        runner = cls.__new__(cls)
        param = next(model.parameters())
        runner.device, runner.dtype = param.device, resolve_dtype(config.dtype, param.device)
        runner.model_config = model.config
        runner._size_caches(config)
        runner.placement = Placement(False, None, "experts stay with the model")
        runner.model = model
        runner._setup(None, config)
        return runner

    def _size_caches(self, config: EngineConfig) -> None:
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN), limit)
        self.block_size = config.block_size
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.num_blocks = config.num_cache_blocks or blocks_per_seq * config.max_num_seqs
        self.kv_bytes = PagedCache.bytes_per_block(self.model_config, self.block_size, self.dtype) * self.num_blocks

    def _setup(self, path: str | None, config: EngineConfig) -> None:
        """Caches, kernels, expert backends and CUDA graphs around the loaded model."""
        for layer in self.model.layers:
            layer.self_attn.mli = config.mli
        self.use_kernels = config.use_kernels == "auto" and dsa_kernels.kernels_apply(
            self.model_config, self.block_size, self.device, self.dtype)
        self.key_tiers = None
        if config.index_key_hot_pages is not None and self.model_config.has_indexer:
            self.use_kernels = False  # tiered keys run on the plain-PyTorch indexer path
            self.key_tiers = KeyTiers(self.model_config, config, self.block_size, self.dtype, self.device)
        self.latent_tiers = None
        if config.latent_hot_rows is not None:
            if not self.model_config.has_indexer:
                raise HearthError("latent_hot_rows needs a sparse-attention (DSA) model: dense MLA reads every latent")
            self.use_kernels = False  # tiered latents run on the plain-PyTorch attention path
            self.latent_tiers = LatentTiers(self.model_config, config.latent_hot_rows, self.dtype, self.device)
        # One page more than the block manager hands out: the scratch page of CUDA-graph padding rows.
        self.cache = PagedCache(self.model_config, self.num_blocks + 1, self.block_size, self.dtype, self.device,
                                index_fp8=self.use_kernels, key_tiers=self.key_tiers, latent_tiers=self.latent_tiers)
        if self.use_kernels:
            dsa_kernels.enable(self.model)
        self.expert_cache = None
        self.residency = None  # the expert cache as the runahead decoder sees it (when offloaded)
        if self.placement.offload:
            self.expert_cache, self.residency = attach_offload(
                self.model, path, self.placement, self.device, self.dtype, config.expert_cache_policy,
                prefetch=config.scheduler == "prefetch", host_experts=config.host_experts)
        elif self.device.type == "cuda" and config.use_kernels == "auto":
            fused_experts.enable(self.model)  # resident experts: one grouped kernel, no host sync
        self.graphs: DecodeGraphs | None = None
        if (config.cuda_graphs and self.use_kernels and not self.placement.offload and not config.mli
                and config.scheduler == "sync"):
            self.graphs = DecodeGraphs(self.model, self.cache, config.max_num_seqs, self.max_model_len,
                                       scratch_block=self.num_blocks, device=self.device)

    def forget(self, seq_id: str) -> None:
        """Drop per-request state outside the paged cache (tiered indexer keys)."""
        for tiers in (self.key_tiers, self.latent_tiers):
            if tiers is not None:
                tiers.drop(seq_id)

    def expert_stats(self) -> dict:
        """Expert-cache counters (hits, misses, bytes fetched, copy time), empty when not offloaded."""
        return self.expert_cache.stats()["total"] if self.expert_cache is not None else {}

    @torch.inference_mode()
    def run(self, inputs: list[StepInput], all_logits: bool = False) -> torch.Tensor:
        """Forward the step; returns fp32 logits of each request's last token (B, vocab), or of
        every token (N, vocab) with all_logits."""
        graphs = self.graphs
        if graphs is not None and not all_logits and all(len(s.token_ids) == 1 for s in inputs):
            tables = [s.block_table for s in inputs]
            if graphs.fits(len(inputs), tables):
                return graphs.run(tables, [s.first_position for s in inputs], [s.token_ids[0] for s in inputs])
        ctx = build_context(self.cache, [(s.block_table, s.first_position, len(s.token_ids)) for s in inputs],
                            self.device, [s.seq_id for s in inputs])
        ids = torch.tensor([t for s in inputs for t in s.token_ids], dtype=torch.long, device=self.device)
        return self.model(ids, ctx, all_logits=all_logits)
