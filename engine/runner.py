"""ModelRunner: owns the model and its paged caches and turns a step's requests into one flat
batch (token ids, positions, slots) for the model. Knows nothing about scheduling or sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hearth.engine.api import EngineConfig, HearthError
from hearth.engine.config import ModelConfig
from hearth.engine.cuda_graphs import DecodeGraphs
from hearth.engine.kv_cache import PagedCache, build_context, decode_table_width
from hearth.engine.loader import load_checkpoint
from hearth.engine.models import dsa_kernels, fused_experts, gqa_kernels
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.mla import SELECT_BYTES_PER_PAIR, AttentionPaths
from hearth.engine.offload_setup import CacheResidency, Placement, PrefetchingExperts, attach_offload, plan_placement
from hearth.engine.piecewise import PiecewiseDecode, Row
from hearth.engine.tiers import DecodeTiers, KeyTiers, LatentTiers, PrefillHistories
from hearth.kernels.indexer import PREFILL_LOGITS_BUDGET
from hearth.offload.expert_cache import ExpertCache
from hearth.offload.expert_store import ExpertStore
from hearth.offload.experts import OffloadedExperts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class StepInput:
    """One request's share of a step: the tokens at positions [first_position, +len(token_ids))."""

    block_table: Sequence[int]
    first_position: int
    token_ids: Sequence[int]  # (with ``run(input_ids=...)`` only their count matters)
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


@dataclass(frozen=True)
class CachePlan:
    """The caches' size: decided from the model and the config before any weight loads (the memory
    planner needs ``kv_bytes``: the paged caches plus, on the kernel path with tiered keys or
    latents, the two prefill history buffers, ``history_bytes`` = 2 x one layer's history at
    max_model_len; see hearth.engine.tiers; plus, for a model with a DSA indexer, ``scratch_bytes``:
    the most a prefill chunk's indexer selection holds at once, see ``prefill_scratch_bytes``)."""

    max_model_len: int
    block_size: int
    num_blocks: int
    kv_bytes: int
    history_bytes: int = 0
    scratch_bytes: int = 0

    @classmethod
    def of(cls, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> CachePlan:
        limit = model_config.max_position_embeddings
        max_model_len = min(config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN), limit)
        blocks_per_seq = -(-max_model_len // config.block_size)
        num_blocks = config.num_cache_blocks or blocks_per_seq * config.max_num_seqs
        kv_bytes = PagedCache.bytes_per_block(model_config, config.block_size, dtype) * num_blocks
        # (the kernel path does not depend on where the experts go)
        features = RunnerFeatures.decide(config, model_config, config.block_size, device, dtype, offload=False)
        history_bytes = PrefillHistories.bytes_for(model_config, max_model_len, config.block_size, dtype,
                                                   keys=features.key_tiers, latents=features.latent_tiers) \
            if features.streams_histories else 0
        scratch_bytes = prefill_scratch_bytes(model_config, max_model_len, config.max_num_batched_tokens,
                                              features.attention.use_kernels)
        return cls(max_model_len, config.block_size, num_blocks, kv_bytes + history_bytes + scratch_bytes,
                   history_bytes, scratch_bytes)


def prefill_scratch_bytes(model_config: ModelConfig, max_model_len: int, chunk_tokens: int, use_kernels: bool) -> int:
    """The most a prefill chunk's indexer selection holds at once (a transient of every DSA layer, one
    layer at a time): the kernel path's fp32 logits, [queries, context] padded to 16 columns, or the plain
    path's scores, mask and sort (17 bytes a pair), for a chunk of up to ``chunk_tokens`` queries at up to
    max_model_len, capped by the budget the selection runs in row blocks under (PREFILL_LOGITS_BUDGET,
    256 MiB; 1 GiB unbounded at a 2,048-token chunk and 128K). 0 without an indexer."""
    if not model_config.has_indexer:
        return 0
    pair = 4 if use_kernels else SELECT_BYTES_PER_PAIR
    return min(PREFILL_LOGITS_BUDGET, min(chunk_tokens, max_model_len) * (-(-max_model_len // 16) * 16) * pair)


def decode_kernels_apply(model_config: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Triton kernels can run this model's attention (and so its decode steps in a CUDA graph):
    the DSA kernels for MLA models, the paged GQA decode kernel for the grouped-query families."""
    if model_config.is_mla:
        return dsa_kernels.kernels_apply(model_config, block_size, device, dtype)
    return gqa_kernels.kernels_apply(model_config, device, dtype)


@dataclass(frozen=True)
class RunnerFeatures:
    """The execution paths a runner composes, decided once from the config, the model and the machine.

    attention: how the model's attention layers are built (Triton kernels, MLI). The DSA kernels
        need CUDA, bf16 and their shapes; tiered keys and latents run on them (decode planned on the
        device, ``hearth.offload.planned_tiers``) except the plain path's exact / lagged key
        selection (``index_key_exact``, ``index_key_lagged_fetch``), which turns them off. The GQA
        decode kernel needs CUDA (see ``decode_kernels_apply``).
        offload: routed experts in host RAM behind a GPU cache.
    key_tiers / latent_tiers: long-context tiers (``index_key_hot_pages`` / ``latent_hot_rows``).
    fused_experts: resident experts on CUDA run as one grouped kernel (gpt-oss's MXFP4 experts load
        as MXFP4 for it).
    piecewise: decode steps run as pieces between the routed-expert calls (hearth.engine.piecewise):
        with offloaded experts, or MLI on the kernel path. With tiered keys / latents on the kernel
        path too (the attention pieces per set of requests); the plain path's tiers read their own
        host-synchronising selection, so tiered steps there run whole and eagerly.
    cuda_graphs: decode steps replayed from CUDA graphs (the kernel path): the whole step in one
        graph (hearth.engine.cuda_graphs), or each piece in its own graph when ``piecewise``; with
        every scheduler (the runahead decoder replays the same pieces). With tiered keys / latents
        the whole step is one graph per set of decoding requests (``DecodeGraphs.run``'s ``tiers``),
        and with offloaded experts or MLI each piece, the attention pieces captured per set of
        requests and tier layout (``PiecewiseDecode.run``'s ``tiers``).
    """

    attention: AttentionPaths
    offload: bool
    key_tiers: bool
    latent_tiers: bool
    fused_experts: bool
    piecewise: bool
    cuda_graphs: bool

    @property
    def streams_histories(self) -> bool:
        """Prefill streams tiered histories through two buffers (the kernel path's planned tiers)."""
        return self.attention.use_kernels and (self.key_tiers or self.latent_tiers)

    @classmethod
    def decide(cls, config: EngineConfig, model_config: ModelConfig, block_size: int, device: torch.device,
               dtype: torch.dtype, offload: bool) -> RunnerFeatures:
        key_tiers = config.index_key_hot_pages is not None and model_config.has_indexer
        latent_tiers = config.latent_hot_rows is not None
        if latent_tiers and not model_config.has_indexer:
            raise HearthError("latent_hot_rows needs a sparse-attention (DSA) model: dense MLA reads every latent")
        plain_only_tiers = key_tiers and (config.index_key_exact or config.index_key_lagged_fetch)
        use_kernels = (config.use_kernels == "auto" and not plain_only_tiers
                       and decode_kernels_apply(model_config, block_size, device, dtype))
        fused = not offload and fused_experts.applies(device) and config.use_kernels == "auto"
        tiers = key_tiers or latent_tiers
        # Tiered requests' attention reads their own tier buffers: whole steps and pieces are captured
        # per set of requests. Only the kernel path's tiers are planned on the device (capturable).
        piecewise = (offload or (config.mli and use_kernels)) and (use_kernels or not tiers)
        graphs = config.cuda_graphs and use_kernels
        return cls(AttentionPaths(use_kernels=use_kernels, mli=config.mli), offload, key_tiers, latent_tiers,
                   fused, piecewise, graphs)


class ModelRunner:
    """Owns a loaded model and its caches; ``run`` executes one forward step.

    ``ModelRunner.load(path, config)`` reads a checkpoint; ``ModelRunner.from_model(model, config)``
    wraps a model built in memory (benchmarks). Both decide the ``RunnerFeatures`` and the
    ``CachePlan`` first and hand everything to the constructor.
    """

    def __init__(self, model: DeepseekForCausalLM, config: EngineConfig, features: RunnerFeatures,
                 caches: CachePlan, placement: Placement, *, dtype: torch.dtype, checkpoint: str | None = None,
                 expert_store: ExpertStore | None = None) -> None:
        if model.attention != features.attention:
            raise HearthError(f"the model was built with {model.attention}, the runner needs {features.attention}")
        self.model = model
        self.model_config = model.config
        self.config = config
        self.checkpoint = checkpoint  # the model folder (None for a model built in memory)
        self.device = next(model.parameters()).device
        self.dtype = dtype
        self.features = features
        self.placement = placement
        self.max_model_len, self.block_size, self.num_blocks = caches.max_model_len, caches.block_size, \
            caches.num_blocks
        self.use_kernels = features.attention.use_kernels
        self.key_tiers = KeyTiers(self.model_config, config, self.block_size, dtype, self.device,
                                  planned=self.use_kernels) if features.key_tiers else None
        self.latent_tiers = LatentTiers(self.model_config, config.latent_hot_rows, dtype, self.device,
                                        block_size=self.block_size if self.use_kernels else None) \
            if features.latent_tiers and config.latent_hot_rows is not None else None
        # the host phase of tiered decode tokens on the kernel path (before each step, outside graphs)
        self.decode_tiers = DecodeTiers(self.model_config, self.key_tiers, self.latent_tiers) \
            if features.streams_histories else None
        self.histories = PrefillHistories(self.model_config, self.key_tiers, self.latent_tiers, self.max_model_len,
                                          self.block_size, dtype, self.device) if features.streams_histories else None
        # One page more than the block manager hands out: the scratch page of CUDA-graph padding rows.
        self.cache = PagedCache(self.model_config, self.num_blocks + 1, self.block_size, dtype, self.device,
                                index_fp8=self.use_kernels, key_tiers=self.key_tiers, latent_tiers=self.latent_tiers,
                                histories=self.histories,
                                table_width=decode_table_width(self.max_model_len, self.block_size) if self.use_kernels
                                else None)
        self.expert_cache: ExpertCache | None = None
        self.residency: CacheResidency | None = None  # the expert cache as the runahead decoder sees it
        self.prefetcher: PrefetchingExperts | None = None  # "prefetch", or "auto" (switched per step)
        self.expert_backend: OffloadedExperts | None = None  # the MoE layers' routed-experts backend
        if placement.offload:
            self.expert_cache, self.residency, self.expert_backend, self.prefetcher = attach_offload(
                model, checkpoint, placement, self.device, dtype, config.expert_cache_policy,
                prefetch=config.scheduler in ("prefetch", "auto"), store=expert_store,
                host_experts=config.host_experts)
            if self.prefetcher is not None and config.scheduler == "auto":
                self.prefetcher.active = False  # until the engine's auto rule picks it
        elif features.fused_experts:
            fused_experts.enable(model)  # resident experts: one grouped kernel, no host sync
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseDecode | None = None
        if features.piecewise:
            self.pieces = PiecewiseDecode(model, self.cache, config.max_num_seqs, self.max_model_len,
                                          scratch_block=self.num_blocks, device=self.device,
                                          capture=features.cuda_graphs)
        elif features.cuda_graphs:
            self.graphs = DecodeGraphs(model, self.cache, config.max_num_seqs, self.max_model_len,
                                       scratch_block=self.num_blocks, device=self.device)

    @classmethod
    def load(cls, path: str, config: EngineConfig) -> ModelRunner:
        """Load the checkpoint in ``path`` as ``config`` says (where the experts go is planned before
        anything loads, so a model that cannot fit fails fast)."""
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        keep_fp8 = config.keep_fp8 if config.keep_fp8 is not None else device.type == "cuda"
        model_config = ModelConfig.from_file(path).with_index_retention(
            config.index_topk_freq, config.index_skip_topk_offset, config.index_topk_pattern)
        caches = CachePlan.of(model_config, config, dtype, device)
        placement = plan_placement(path, model_config, config, device, caches.kv_bytes)
        features = RunnerFeatures.decide(config, model_config, caches.block_size, device, dtype, placement.offload)
        # gpt-oss's MXFP4 experts stay MXFP4 when resident and run by the fused kernel (it reads them).
        model = load_checkpoint(path, device, dtype, keep_fp8, config.faithful, skip_routed_experts=placement.offload,
                                config=model_config, attention=features.attention,
                                keep_mxfp4=features.fused_experts)
        return cls(model, config, features, caches, placement, dtype=dtype, checkpoint=path)

    @classmethod
    def from_model(cls, model: DeepseekForCausalLM, config: EngineConfig, *,
                   expert_store: ExpertStore | None = None, expert_cache_slots: int | None = None) -> ModelRunner:
        """A runner around a model built in memory (benchmarks: full-size shapes with random weights
        and no checkpoint on disk). Build the model with ``ModelRunner.features_for(...).attention``.
        With ``expert_store`` the routed experts are served from it behind a GPU cache of
        ``expert_cache_slots`` per layer; otherwise everything stays where the model's parameters are."""
        device = next(model.parameters()).device
        dtype = resolve_dtype(config.dtype, device)
        caches = CachePlan.of(model.config, config, dtype, device)
        placement = Placement(False, None, "experts stay with the model") if expert_store is None else \
            Placement(True, expert_cache_slots, f"experts from a store, {expert_cache_slots} slots per layer")
        features = RunnerFeatures.decide(config, model.config, caches.block_size, device, dtype, placement.offload)
        return cls(model, config, features, caches, placement, dtype=dtype, expert_store=expert_store)

    @staticmethod
    def features_for(model_config: ModelConfig, config: EngineConfig, device: torch.device,
                     offload: bool = False) -> RunnerFeatures:
        """The features ``from_model`` will choose for a model of ``model_config`` on ``device``."""
        return RunnerFeatures.decide(config, model_config, config.block_size, device,
                                     resolve_dtype(config.dtype, device), offload)

    def page_layout(self) -> dict[str, object]:
        """What a cache page's bytes depend on besides the checkpoint (the prefix store's fingerprint):
        its formats and the options that change the computed values."""
        keep_fp8 = self.config.keep_fp8 if self.config.keep_fp8 is not None else self.device.type == "cuda"
        return {"dtype": str(self.dtype), "block_size": self.block_size, "page_bytes": self.cache.page_bytes,
                "index_fp8": self.cache.index_fp8, "kernels": self.use_kernels, "mli": self.features.attention.mli,
                "faithful": self.config.faithful, "keep_fp8": keep_fp8, "device": self.device.type,
                "indexer_types": self.model_config.indexer_types}

    def forget(self, seq_id: str) -> None:
        """Drop per-request state outside the paged cache (tiered indexer keys)."""
        for tiers in (self.key_tiers, self.latent_tiers, self.decode_tiers):
            if tiers is not None:
                tiers.drop(seq_id)

    def expert_stats(self) -> dict[str, float]:
        """Expert-cache counters (hits, misses, bytes fetched, copy time), empty when not offloaded; with
        piecewise decode also its pieces: graph replays, pieces run eagerly (captures included) and MoE
        layer-steps that streamed through the backend because the pool had no room for them at once."""
        stats = dict(self.expert_cache.stats()["total"]) if self.expert_cache is not None else {}
        if self.pieces is not None and self.expert_cache is not None:
            stats.update(piece_replays=self.pieces.replays, eager_pieces=self.pieces.eager_pieces,
                         streamed_layer_steps=self.pieces.fallbacks)
        speeds = self.expert_backend.host_speeds if self.expert_backend is not None else None
        if speeds is not None:  # the start-up probe that decides which missed experts the host computes
            stats.update(host_link_per_expert_ms=speeds.link_ms_per_expert, host_cpu_fixed_ms=speeds.cpu_fixed_ms,
                         host_cpu_per_token_ms=speeds.cpu_ms_per_token, host_transfer_ms=speeds.transfer_ms)
        return stats

    def graph_stats(self) -> dict[str, float]:
        """Whole-step decode graphs captured since the load and the host time capturing them (a new
        batch size, or a new set of requests with per-request tiers, captures on the request path)."""
        if self.graphs is None:
            return {}
        return {"decode_graph_captures": float(self.graphs.captures), "decode_graph_capture_ms": self.graphs.capture_ms}

    def reset_stats(self) -> None:
        """Zero what ``expert_stats`` and ``graph_stats`` count (after the engine's warm-up: the counters
        describe users' work; the graphs the warm-up captured stay, and its time is ``warm_up_s``). The
        start-up probe's link and CPU speeds are measurements, not counters, and stay."""
        if self.expert_cache is not None:
            self.expert_cache.reset_stats()
        if self.graphs is not None:
            self.graphs.captures, self.graphs.capture_ms = 0, 0.0
        if self.pieces is not None:
            self.pieces.replays = self.pieces.eager_pieces = self.pieces.fallbacks = 0

    @torch.inference_mode()
    def run(self, inputs: list[StepInput], all_logits: bool = False, use_graphs: bool = True,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward the step; returns fp32 logits of each request's last token (B, vocab), or of
        every token (N, vocab) with all_logits. A decode step replays a CUDA graph where the runner
        has them (or runs it in pieces, see hearth.engine.piecewise), unless ``use_graphs`` is False
        (benchmarks compare both paths). ``input_ids``: the step's token ids already on the device (N,),
        in place of the inputs' ``token_ids`` values (overlapped decode feeds the previous step's samples
        without reading them back)."""
        tiers = None
        if self.decode_tiers is not None:  # tiered decode tokens: their host phase, before any launch
            layout = self.decode_tiers.prepare([(s.seq_id, s.first_position) for s in inputs if len(s.token_ids) == 1])
            tiers = ([s.seq_id for s in inputs], layout)
        decode = use_graphs and not all_logits and all(len(s.token_ids) == 1 for s in inputs)
        tables = [s.block_table for s in inputs]
        if decode and self.pieces is not None and self.pieces.fits(len(inputs), tables):
            rows = [Row(s.block_table, s.first_position, s.token_ids[0]) for s in inputs]
            return self.pieces.run(rows, input_ids, tiers)
        if decode and self.graphs is not None and self.graphs.fits(len(inputs), tables):
            ids = input_ids if input_ids is not None else [s.token_ids[0] for s in inputs]
            return self.graphs.run(tables, [s.first_position for s in inputs], ids, tiers)
        ctx = build_context(self.cache, [(s.block_table, s.first_position, len(s.token_ids)) for s in inputs],
                            self.device, [s.seq_id for s in inputs])
        if self.histories is not None:
            self.histories.begin(ctx)
        if input_ids is None:
            input_ids = torch.tensor([t for s in inputs for t in s.token_ids], dtype=torch.long, device=self.device)
        return self.model(input_ids, ctx, all_logits=all_logits)
