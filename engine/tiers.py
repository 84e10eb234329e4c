"""Per-request tiers for long contexts on a small GPU, plain-PyTorch path.

Indexer keys (``KeyTiers``):

With ``EngineConfig.index_key_hot_pages`` set, an indexer layer keeps each request's keys in a
``hearth.offload.tiered_keys.TieredKeys``: recent pages on the device, the whole history in host
RAM, a compact summary per page on the device. Decode selects coarse-to-fine (summaries, then the
original keys of candidate pages); prefill chunks read the history back and score it exactly. With
``index_key_lagged_fetch`` a decode step scores the previous step's candidates (already in the page
cache) and fetches its own for the next step, so it never waits for its candidate ids.
Latents (``LatentTiers``, HiSparse-style): every MLA latent row of a request lives in host RAM; the
device keeps a hot buffer of rows; a decode step gathers only the rows its top-k selected (hits reused
across steps, misses copied from the host). Prefill chunks read the history back.
A finished request's tiers are parked in host RAM (``park``, ``hearth.engine.tier_cache``) and the
next turn of its chat resumes them (``resume``) instead of computing the conversation again.

On the DSA kernel path (``planned=True``) the tiers are ``hearth.offload.planned_tiers``'s: the same
layout, but a decode step's coarse stage, candidate selection, page and row residency, fetches from
pinned host memory, fine indexer and sparse MLA all run as kernels, with no host synchronisation:
a decode token's host bookkeeping (room in the host pools, the token counts) runs before the step
(``DecodeTiers``), so the step itself only launches and is captured whole in a CUDA graph per set
of decoding requests (``hearth.engine.cuda_graphs.DecodeGraphs``), or, with offloaded experts or MLI,
as pieces whose attention pieces are captured per set of requests (``hearth.engine.piecewise``).
Their prefill chunks stream each layer's history through the runner's two reusable device buffers
(``PrefillHistories``, ``hearth.offload.history_buffers``), so admitting a long prompt needs no
device memory beyond its decode's and the two buffers: 2 x one layer's history at max_model_len,
``2 x ceil(max_model_len / block_size) x block_size x (132 B of FP8 keys + latent_dim x dtype bytes)``
(DeepSeek-V3.2 at 128K, bf16 latents: 2 x (16.5 + 144) MiB = 321 MiB), planned with the KV cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from hearth.engine.api import EngineConfig, HearthError
from hearth.engine.config import ModelConfig
from hearth.engine.kv_cache import ForwardContext, SeqSlice
from hearth.offload.history_buffers import HistoryBuffers, LayerSources
from hearth.offload.planned_tiers import PlannedKeyConfig, PlannedKeys, PlannedLatentConfig, PlannedLatents
from hearth.offload.tiered_keys import CANDIDATE_FACTOR, KeyTierConfig, TieredKeys
from hearth.offload.tiered_latents import LatentTierConfig, TieredLatents


class _PerRequestTiers:
    """Tier objects keyed by (request id, layer), created on first use and dropped with the request.

    A request's tiers start with host room for the tokens ``reserve`` named (its prompt and some
    answer): a 64K prompt read into pools that double from a few pages pinned and copied about four
    times its size, a fifth of its prefill on the H200."""

    what = "tiers"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tiers: dict[tuple[str, int], Any] = {}
        self._reserved: dict[str, int] = {}  # request -> tokens its new tiers have room for

    def _new(self, tokens: int) -> Any:
        raise NotImplementedError

    def reserve(self, seq_id: str, tokens: int) -> None:
        """Tiers the request creates from now on start with host room for ``tokens`` tokens."""
        self._reserved[seq_id] = tokens

    def get(self, seq_id: str | None, layer: int) -> Any:
        if seq_id is None:
            raise RuntimeError(f"{self.what} need a request id in the forward context")
        key = (seq_id, layer)
        if key not in self.tiers:
            self.tiers[key] = self._new(self._reserved.get(seq_id, 0))
        return self.tiers[key]

    def drop(self, seq_id: str) -> None:
        self._reserved.pop(seq_id, None)
        for key in [k for k in self.tiers if k[0] == seq_id]:
            del self.tiers[key]

    def held(self, seq_id: str) -> dict[int, int]:
        """Tokens each layer's tiers of the request hold (layers it has used)."""
        return {layer: tiers.num_tokens for (sid, layer), tiers in self.tiers.items() if sid == seq_id}

    def park(self, seq_id: str, num_tokens: int) -> dict[int, Any]:
        """The request's first num_tokens tokens of every layer as host-only states
        (hearth.offload.parked), by layer; its tiers are dropped."""
        parked = {layer: tiers.park(num_tokens) for (sid, layer), tiers in self.tiers.items() if sid == seq_id}
        self.drop(seq_id)
        return parked

    def resume(self, seq_id: str, parked: dict[int, Any], num_tokens: int) -> None:
        """New tiers of the request, by layer, continuing from parked states' first num_tokens tokens.
        They are made with the least host room: a resumed object takes the parked state's host pool
        (which has its own room), so a pool sized for the request would be pinned and dropped at once
        (~0.1 s of a 64K chat's follow-up)."""
        for layer, state in parked.items():
            key = (seq_id, layer)
            if key not in self.tiers:
                self.tiers[key] = self._new(0)
            self.tiers[key].resume(state, num_tokens)

    def stats(self) -> dict[str, float]:
        """Every request's counters added up."""
        total: dict[str, float] = {}
        for tiers in self.tiers.values():
            for name, value in tiers.stats().items():
                total[name] = total.get(name, 0.0) + float(value)
        return total


class KeyTiers(_PerRequestTiers):
    """All requests' indexer-key tiers (hearth.offload.tiered_keys.TieredKeys)."""

    what = "tiered indexer keys"

    def __init__(self, model_config: ModelConfig, config: EngineConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device, planned: bool = False) -> None:
        super().__init__(device)
        self.planned = planned
        if planned:  # the kernel path: FP8 keys, decode planned on the device
            cand = config.index_key_candidate_pages or CANDIDATE_FACTOR * -(-model_config.index_topk // block_size)
            cache = config.index_key_cache_pages or cand
            if cache < cand:
                raise HearthError(f"index_key_cache_pages ({cache}) must be >= index_key_candidate_pages ({cand}) "
                                  "on the kernel path")
            self.config = PlannedKeyConfig(page_size=block_size, hot_pages=max(1, config.index_key_hot_pages),
                                           candidate_pages=cand, cache_pages=cache, topk=model_config.index_topk)
            return
        # None budgets take KeyTierConfig's defaults: 8 x index_topk / block_size candidate pages, a
        # page cache of as many, e4m3 page summaries (see hearth.offload.tiered_keys)
        self.config = KeyTierConfig(
            page_size=block_size, head_dim=model_config.index_head_dim,
            key_format="fp32" if dtype == torch.float32 else "bf16",
            hot_pages=max(1, config.index_key_hot_pages), cache_pages=config.index_key_cache_pages,
            candidate_pages=config.index_key_candidate_pages, topk=model_config.index_topk,
            bounds=config.index_key_exact, exact=config.index_key_exact,
            lagged_fetch=config.index_key_lagged_fetch)

    def _new(self, tokens: int) -> TieredKeys | PlannedKeys:
        pages = max(8, -(-tokens // self.config.page_size))
        if self.planned:
            return PlannedKeys(self.config, self.device, initial_pages=pages)
        return TieredKeys(self.config, self.device, initial_pages=pages)

    def device_bytes(self) -> int:
        return sum(t.device_bytes() for t in self.tiers.values())

    def prefetch(self) -> None:
        """Start every request's lagged fetch (index_key_lagged_fetch) now, e.g. at the start of a
        decode step, so layer l's copy overlaps layers 0..l-1 (each layer's append does it anyway)."""
        if self.planned:
            return
        for tiers in self.tiers.values():
            tiers.prefetch()


class LatentTiers(_PerRequestTiers):
    """All requests' latent tiers (hearth.offload.tiered_latents.TieredLatents)."""

    what = "tiered latents"

    def __init__(self, model_config: ModelConfig, hot_rows: int, dtype: torch.dtype, device: torch.device,
                 block_size: int | None = None) -> None:
        """block_size: the kernel path (planned tiers read as pages of block_size rows); None: plain path."""
        if hot_rows <= model_config.index_topk:
            raise HearthError(f"latent_hot_rows ({hot_rows}) must exceed index_topk ({model_config.index_topk}): "
                              "one decode step's selection has to fit in the hot buffer")
        super().__init__(device)
        self.planned = block_size is not None
        if block_size is not None:  # one block of recent rows + the cache, whole blocks
            self.config = PlannedLatentConfig.from_hot_rows(max(hot_rows, model_config.index_topk + block_size),
                                                            model_config.index_topk, block_size,
                                                            width=model_config.latent_dim, dtype=dtype)
            return
        self.config = LatentTierConfig(width=model_config.latent_dim, dtype=dtype, hot_rows=hot_rows)

    def _new(self, tokens: int) -> TieredLatents | PlannedLatents:
        rows = max(256, tokens)
        if self.planned:
            return PlannedLatents(self.config, self.device, initial_rows=rows)
        return TieredLatents(self.config, self.device, initial_rows=rows)


class DecodeTiers:
    """The host phase of the kernel path's tiered decode tokens, run before the step (outside any
    captured graph): every layer's tiers of each decoding request make room for the token and count
    it (``PlannedKeys.reserve`` / ``PlannedLatents.reserve``); the step itself then only launches
    (``decode_write`` / ``decode_append`` / ``select`` / ``slots``), its values read from the step's
    device inputs. ``prepare`` returns the step's tier layout, which changes whenever a tier buffer
    the step reads was reallocated or a request's tiers were dropped: a decode graph captured for
    another layout is stale (``hearth.engine.cuda_graphs``)."""

    def __init__(self, model_config: ModelConfig, key_tiers: KeyTiers | None, latent_tiers: LatentTiers | None) -> None:
        self.key_tiers, self.latent_tiers = key_tiers, latent_tiers
        self.key_layers = [layer for layer in range(model_config.num_hidden_layers) if model_config.runs_indexer(layer)]
        self.num_layers = model_config.num_hidden_layers
        self.epoch = 0

    def prepare(self, decodes: Sequence[tuple[str | None, int]]) -> tuple[int, ...]:
        """Reserve the decode tokens [(request id, position)]. Returns the step's tier layout (``layout``)."""
        for seq_id, position in decodes:
            for tiers in self._tiers_of(seq_id):
                tiers.reserve(position)
        return self.layout([seq_id for seq_id, _ in decodes])

    def layout(self, seq_ids: Sequence[str | None]) -> tuple[int, ...]:
        """The tier layout of a step of these requests (their tokens reserved): the drop epoch and
        every tier's buffer version (equal layouts: the same buffers, so a graph captured for one
        replays the other)."""
        return (self.epoch, *(tiers.version for seq_id in seq_ids for tiers in self._tiers_of(seq_id)))

    def _tiers_of(self, seq_id: str | None) -> list[PlannedKeys | PlannedLatents]:
        keys = [self.key_tiers.get(seq_id, layer) for layer in self.key_layers] if self.key_tiers is not None else []
        latents = [self.latent_tiers.get(seq_id, layer) for layer in range(self.num_layers)] \
            if self.latent_tiers is not None else []
        return keys + latents

    def drop(self, seq_id: str) -> None:
        """A request's tiers were released: graphs that read them are stale."""
        del seq_id
        self.epoch += 1


class PrefillHistories:
    """The runner's two prefill history buffers and each step's plan: which requests stream (those
    with a prefill chunk, in the step's order, as far as the buffers hold them) and which layers
    (every layer's latents, the indexer layers' keys)."""

    def __init__(self, model_config: ModelConfig, key_tiers: KeyTiers | None, latent_tiers: LatentTiers | None,
                 max_model_len: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.key_tiers, self.latent_tiers = key_tiers, latent_tiers
        self.num_layers = model_config.num_hidden_layers
        self.key_layers = {layer for layer in range(self.num_layers) if model_config.runs_indexer(layer)}
        self.buffers = HistoryBuffers(max_model_len, block_size, device, keys=key_tiers is not None,
                                      latent_width=model_config.latent_dim if latent_tiers is not None else None,
                                      latent_dtype=dtype)
        self._ctx: weakref.ref[ForwardContext] | None = None

    @staticmethod
    def bytes_for(model_config: ModelConfig, max_model_len: int, block_size: int, dtype: torch.dtype, *,
                  keys: bool, latents: bool) -> int:
        """Device bytes of the two buffers (the module doc's formula)."""
        row = model_config.latent_dim * dtype.itemsize if latents else 0
        return HistoryBuffers.bytes_for(max_model_len, block_size, keys and model_config.has_indexer, row)

    def begin(self, ctx: ForwardContext) -> None:
        """Plan the step of ctx (any step: one without a prefill chunk just clears the last plan)."""
        prefill = [s for s in ctx.seqs if s.q_len > 1 and s.seq_id is not None]
        self._ctx = weakref.ref(ctx)
        if not prefill:  # (a decode step: no per-layer plan to build)
            self.buffers.begin([], [])
            return
        layers = [LayerSources(
            layer,
            keys={s.seq_id: self.key_tiers.get(s.seq_id, layer) for s in prefill}
            if self.key_tiers is not None and layer in self.key_layers else {},
            latents={s.seq_id: self.latent_tiers.get(s.seq_id, layer) for s in prefill}
            if self.latent_tiers is not None else {}) for layer in range(self.num_layers)]
        self.buffers.begin([(s.seq_id, s.first_position, s.q_len) for s in prefill], layers)

    def _planned(self, ctx: ForwardContext) -> bool:
        return self._ctx is not None and self._ctx() is ctx

    def keys(self, ctx: ForwardContext, layer: int, seq: SeqSlice) -> torch.Tensor | None:
        """The request's key history buffer of the layer for this step (HistoryBuffers.keys), or None
        when it is not streamed (then PlannedKeys.history reads it into a temporary buffer)."""
        return self.buffers.keys(layer, seq.seq_id) if self._planned(ctx) else None

    def latents(self, ctx: ForwardContext, layer: int, seq: SeqSlice) -> torch.Tensor | None:
        """The request's latent history of the layer (HistoryBuffers.latents), or None as ``keys``."""
        return self.buffers.latents(layer, seq.seq_id) if self._planned(ctx) else None
