"""The engine's public vocabulary: sampling parameters, engine configuration and the plain
dataclass events that ``Engine.step()`` / ``Engine.generate()`` return.

Everything here is frozen, validated at construction, and free of tensors and Qt types, so the GUI,
the CLI, the HTTP server and the benchmarks can all share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class HearthError(Exception):
    """An error the user caused or can fix (bad file, unsupported model, prompt too long...).

    Its message is one clear line meant for people; front ends print it without a traceback.
    """


class UnsupportedModelError(HearthError):
    """The checkpoint's architecture, or a config value that changes the math, is not supported."""


class CheckpointError(HearthError):
    """A weight file is missing, truncated, corrupt, or holds a tensor of the wrong name/shape."""


class RequestError(HearthError):
    """A request cannot be served as asked (prompt longer than the context, bad parameters...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy decoding.

    ``top_k == 0``, ``top_p == 1``, ``min_p == 0`` and penalties of 1/0/0 switch those filters off.
    ``seed`` makes a request reproducible regardless of what else runs in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. ``None`` and ``"auto"`` mean "decide from the machine".

    device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".
    max_model_len: the longest prompt + answer a request may hold (default: the model's limit,
        capped at 8192 until the user asks for more).
    max_num_seqs: requests running at once; more wait in the queue.
    max_num_batched_tokens: prompt tokens one step may process (longer prompts are chunked).
    block_size: tokens per page of the paged caches.
    num_cache_blocks: pages per cache; None sizes it for max_num_seqs full-length requests.
    keep_fp8: keep FP8 checkpoint weights in FP8 with their block scales (dequantised on the fly)
        instead of expanding them at load; None = keep on CUDA, expand on CPU.
    faithful: reproduce the official DeepSeek inference rounding: Hadamard + FP8 (ue8m0) on
        indexer q/k and an FP8 round trip of the latent cache. Off = exact bf16/fp32 math.
    use_kernels: run the Triton DSA kernels on CUDA ("auto"), or force plain PyTorch ("never").
    cuda_graphs: capture decode steps in CUDA graphs (one per batch-size bucket up to
        max_num_seqs, captured on first use) where the step allows: the DSA kernel path with every
        request decoding one token, routed experts resident on the GPU, no tiers, MLI off.
    offload: where routed experts live. "auto": on the GPU when they fit, else in host RAM behind
        a GPU expert cache sized by the memory planner; "always": host RAM + cache (also on CPU,
        mainly for tests); "never": with the rest of the model.
    expert_cache_slots: experts per MoE layer held in the cache (None: the planner decides).
    expert_cache_policy: "lru" or "lfu" eviction.
    host_experts: with offloaded experts, compute a missed expert on the CPU instead of fetching it:
        "auto" when the start-up probe of link and CPU speed says it finishes sooner, "on", "off".
    gpu_memory_gib / expert_cache_gib / host_memory_gib: caps for the memory planner.
    mli: Multi-layer Indexer: a layer attends the selection of the previous indexer layer while its
        own indexer feeds the next layers (on CUDA it runs on a side stream, overlapping the
        layer's attention). Changes the math slightly (selections shift by one indexer layer).
    index_topk_freq / index_skip_topk_offset / index_topk_pattern: IndexCache retention for models
        that do not ship it (keep an indexer on every freq-th layer, or an F/S pattern).
    index_key_hot_pages: tier the indexer keys (plain-PyTorch path): keep this many recent pages
        per request and layer on the device, the rest in host RAM behind a compact per-page summary
        (coarse-to-fine selection, hearth.offload.tiered_keys). None = all keys on the device.
    index_key_candidate_pages / index_key_cache_pages: cold pages scored exactly per decode step,
        and the device page cache that keeps fetched pages across steps. None: 8 x index_topk /
        block_size candidates (256 for DeepSeek-V3.2 at 64-token pages; top-k recall >= 0.99 on
        clustered keys, docs/benchmarks.md) and a cache as large.
    index_key_exact: fetch every page a per-page bound cannot rule out (selection always exact).
    index_key_lagged_fetch: a decode step scores the previous step's candidate pages (already in the
        device page cache) and fetches its own for the next step, so no step reads its own candidate ids
        back to the host; needs the cache to hold the candidates; exact mode stays exact.
    latent_hot_rows: tier the MLA latents (DSA models): all rows in host RAM, this many per request
        and layer on the device; decode gathers the selected rows (misses copied from the host).
    scheduler: "sync" advances every running request through the same layer together;
        "runahead" lets requests whose experts are resident run ahead to later layers while
        others wait for expert fetches (see hearth.engine.runahead); "prefetch" is "sync" plus a
        prediction prefetcher of the next layer's experts (a baseline for measurements).
    """

    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    block_size: int = 64
    num_cache_blocks: int | None = None
    keep_fp8: bool | None = None
    faithful: bool = False
    use_kernels: Literal["auto", "never"] = "auto"
    cuda_graphs: bool = True
    offload: Literal["auto", "always", "never"] = "auto"
    expert_cache_slots: int | None = None
    expert_cache_policy: Literal["lru", "lfu"] = "lru"
    host_experts: Literal["auto", "on", "off"] = "auto"
    gpu_memory_gib: float | None = None
    expert_cache_gib: float | None = None
    host_memory_gib: float | None = None
    mli: bool = False
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    index_topk_pattern: str | None = None
    index_key_hot_pages: int | None = None
    index_key_candidate_pages: int | None = None
    index_key_cache_pages: int | None = None
    index_key_exact: bool = False
    index_key_lagged_fetch: bool = False
    latent_hot_rows: int | None = None
    scheduler: Literal["sync", "runahead", "prefetch"] = "sync"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise HearthError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise HearthError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise HearthError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.host_experts not in ("auto", "on", "off"):
            raise HearthError(f"host_experts must be auto, on or off, not {self.host_experts!r}")
        if self.offload not in ("auto", "always", "never"):
            raise HearthError(f"offload must be auto, always or never, not {self.offload!r}")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise HearthError("expert_cache_slots must be >= 1")
        if self.scheduler not in ("sync", "runahead", "prefetch"):
            raise HearthError(f"scheduler must be sync, runahead or prefetch, not {self.scheduler!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise HearthError("max_model_len must be >= 2")


@dataclass(frozen=True)
class RequestStats:
    """Timing of one request: time to first token and decode speed."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    time_to_first_token_s: float | None
    total_time_s: float

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.time_to_first_token_s is None or self.completion_tokens < 2:
            return None
        decode_time = self.total_time_s - self.time_to_first_token_s
        return (self.completion_tokens - 1) / decode_time if decode_time > 0 else None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request and the text they complete (never a broken UTF-8 sequence;
    text that could still become a stop string is held back until it cannot)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    """A request ended. ``text`` is the whole answer (stop string excluded)."""

    request_id: str
    reason: FinishReason
    text: str
    stats: RequestStats
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for status bars and the /stats endpoint."""

    running: int
    waiting: int
    cache_blocks_total: int
    cache_blocks_free: int
    generated_tokens: int
    decode_tokens_per_s: float
    extra: dict[str, float] = field(default_factory=dict)


Event = TokenDelta | Finished
