"""Two reusable device buffers through which prefill streams the layer histories of tiered requests
(LeanSparse's prefill), so a long prompt needs no device memory beyond its decode's and these two.

A prefill chunk of a request with tiered indexer keys (``PlannedKeys``) and latents
(``PlannedLatents``) needs, in every layer, the request's whole history of that layer on the device:
the key pages for the prefill indexer kernel, the latent rows for sparse MLA prefill. Instead of a
temporary buffer per layer and chunk, the runner holds two buffers, each one layer's history at the
engine's max context (keys in the indexer-cache layout, ``pages x page_size * 132`` bytes; latents
``pages * page_size x width``), allocated once. Layer ``j`` of a step (counting the layers that
stream anything) uses buffer ``j % 2``; when it starts, layer ``j + 1``'s history is copied into the
other buffer on a copy stream (host pages and rows from the pinned pools, the partial key page from
the device ring), so the copy overlaps layer ``j``'s computation; the compute stream waits for a
buffer's copy (an event) before it reads the buffer. The chunk's new rows go to the tiers as before
and also into the buffer: keys are written there by the cache-write kernel (then ``commit_chunk``
sends full pages to the host), latents by ``PlannedLatents.append`` into the view ``stage`` gave it.

Several requests of one step share each buffer: request ``r`` gets pages ``[offset_r, offset_r +
pages_r)`` (and the same pages' rows of the latent buffer), in the order given, as long as they fit;
a request that does not fit is not staged (its caller reads its history back into a temporary
buffer, the old path). One request at the max context always fits.

On the CPU there is no copy stream and copies are synchronous; ``schedule`` records what happened in
the current step (``("load", layer, buffer)`` when a copy is issued, ``("use", layer, buffer)`` when
a layer first reads its buffer), so the double-buffering is testable without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hearth.offload.coarse_index import PagePool, new_stream
from hearth.offload.planned_tiers import HEAD_DIM, PlannedKeys, PlannedLatents


@dataclass(frozen=True)
class LayerSources:
    """What one layer streams for a step: its tiers per request id (an empty mapping: nothing of
    that kind, e.g. the keys of a layer that shares another layer's top-k)."""

    layer: int
    keys: Mapping[str, PlannedKeys] = field(default_factory=dict)
    latents: Mapping[str, PlannedLatents] = field(default_factory=dict)


@dataclass(frozen=True)
class Staged:
    """A request's place in both buffers for one step: pages [page, page + pages) of the key buffer
    and rows [page * page_size, (page + pages) * page_size) of the latent buffer, position p at
    page/row p from there; ``first`` tokens come from its tiers, the step writes the rest."""

    page: int
    pages: int
    first: int


class HistoryBuffers:
    """Two device buffers of one layer's history at ``max_tokens`` (see the module doc)."""

    def __init__(self, max_tokens: int, page_size: int, device: torch.device, *, keys: bool,
                 latent_width: int | None, latent_dtype: torch.dtype = torch.bfloat16) -> None:
        """keys: stream FP8 indexer keys; latent_width: stream latent rows of that width (None: no)."""
        if not keys and latent_width is None:
            raise ValueError("history buffers need keys, latents or both")
        self.device = torch.device(device)
        self.page_size = page_size
        self.num_pages = math.ceil(max_tokens / page_size)
        self.key_buffers = [PagePool(self.num_pages, page_size, HEAD_DIM, "fp8", self.device).buf
                            for _ in range(2)] if keys else None
        self.latent_buffers = [torch.zeros(self.num_pages * page_size, latent_width, dtype=latent_dtype,
                                           device=self.device) for _ in range(2)] if latent_width else None
        self._copy_stream = new_stream(self.device)
        cuda = self.device.type == "cuda"
        self._ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._layers: list[LayerSources] = []
        self._index: dict[int, int] = {}  # layer -> its place in _layers (which buffer: place % 2)
        self._entered = -1  # the place of the last layer that started using its buffer
        self._staged: dict[str, Staged] = {}
        self._staged_latents: list[PlannedLatents] = []
        self.schedule: list[tuple[str, int, int]] = []

    @staticmethod
    def bytes_for(max_tokens: int, page_size: int, keys: bool, latent_row_bytes: int) -> int:
        """Device bytes of the two buffers: 2 x (pages x page_size x (132 B of keys if keys +
        latent_row_bytes)), pages = ceil(max_tokens / page_size)."""
        tokens = math.ceil(max_tokens / page_size) * page_size
        key_bytes = PagePool.bytes_per_page(page_size, HEAD_DIM, "fp8") // page_size if keys else 0
        return 2 * tokens * (key_bytes + latent_row_bytes)

    @property
    def nbytes(self) -> int:
        held = (self.key_buffers or []) + (self.latent_buffers or [])
        return sum(t.numel() * t.element_size() for t in held)

    # ---- one step ---------------------------------------------------------------------------------
    def begin(self, requests: Sequence[tuple[str, int, int]], layers: Sequence[LayerSources]) -> list[str]:
        """Plan a step: requests [(id, first position, new tokens)] in the order they get buffer
        space, layers in the order the model runs them. Stages each staged request's latent tiers
        of every layer into its buffer, starts copying the first layer's history. Returns the ids
        staged (the others do not fit)."""
        for latents in self._staged_latents:  # a step that stopped early leaves stages behind
            latents.stage(None)
        self._staged_latents = []
        self.schedule = []
        self._staged = {}
        used = 0
        for seq_id, first, n_new in requests:
            pages = math.ceil((first + n_new) / self.page_size)
            if used + pages <= self.num_pages:
                self._staged[seq_id] = Staged(used, pages, first)
                used += pages
        self._layers = [s for s in layers if self._streams(s)]
        self._index = {s.layer: j for j, s in enumerate(self._layers)}
        self._entered = -1
        for j, sources in enumerate(self._layers):
            for seq_id, latents in sources.latents.items():
                if seq_id in self._staged:
                    latents.stage(self._latent_rows(j % 2, self._staged[seq_id]))
                    self._staged_latents.append(latents)
        if self._layers:
            self._load(0)
        return list(self._staged)

    def _streams(self, sources: LayerSources) -> bool:
        return any(s in self._staged for s in (*sources.keys, *sources.latents))

    def keys(self, layer: int, seq_id: str) -> torch.Tensor | None:
        """The request's key history of the layer [pages, page_size * 132] uint8 (page p at row p:
        the pages before the step's first token and that page's written part), for the step's keys
        to be written into and scored; None if the request or layer is not streamed this step."""
        staged = self._use(layer, seq_id, self.key_buffers)
        if staged is None:
            return None
        b = self._index[layer] % 2
        return self.key_buffers[b][staged.page:staged.page + staged.pages]

    def latents(self, layer: int, seq_id: str) -> torch.Tensor | None:
        """The request's latent history of the layer as a paged cache [pages, page_size, width]
        (position p at row p), this step's rows included; None if not streamed this step."""
        staged = self._use(layer, seq_id, self.latent_buffers)
        if staged is None:
            return None
        rows = self._latent_rows(self._index[layer] % 2, staged)
        return rows.view(staged.pages, self.page_size, rows.shape[1])

    def _latent_rows(self, b: int, staged: Staged) -> torch.Tensor:
        ps = self.page_size
        return self.latent_buffers[b][staged.page * ps:(staged.page + staged.pages) * ps]

    def _use(self, layer: int, seq_id: str, buffers: list[torch.Tensor] | None) -> Staged | None:
        """The staged request about to read the layer's buffer (starting layers up to it), or None."""
        if buffers is None or seq_id not in self._staged or layer not in self._index:
            return None
        place = self._index[layer]
        if place < self._entered:
            raise RuntimeError(f"layer {layer}'s history was read after a later layer's: its buffer is reused")
        while self._entered < place:
            self._enter(self._entered + 1)
        if self._ready[place % 2] is not None:  # the reading stream (MLI: maybe a side stream) waits
            torch.cuda.current_stream(self.device).wait_event(self._ready[place % 2])
        return self._staged[seq_id]

    def _enter(self, place: int) -> None:
        """Layer ``place`` starts: the next layer's copy is issued first, so it overlaps this layer."""
        if place + 1 < len(self._layers):
            self._load(place + 1)
        self.schedule.append(("use", self._layers[place].layer, place % 2))
        self._entered = place

    def _load(self, place: int) -> None:
        """Copy layer ``place``'s history (the tokens before the step) of every staged request into
        buffer place % 2, on the copy stream once the compute stream's earlier work is done (it
        read the buffer two layers ago, and wrote these pools' write-through copies)."""
        b, sources = place % 2, self._layers[place]
        self.schedule.append(("load", sources.layer, b))
        if self._copy_stream is None:
            self._copy(b, sources, non_blocking=False)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy(b, sources, non_blocking=True)
            self._ready[b].record()

    def _copy(self, b: int, sources: LayerSources, non_blocking: bool) -> None:
        ps = self.page_size
        for seq_id, tiers in sources.keys.items():
            staged = self._staged.get(seq_id)
            if staged is None or self.key_buffers is None:
                continue
            dst, p0 = self.key_buffers[b][staged.page:staged.page + staged.pages], staged.first // ps
            if p0:
                dst[:p0].copy_(tiers.host.buf[:p0], non_blocking=non_blocking)
            if staged.first % ps:  # the partial page lives in the device ring
                dst[p0].copy_(tiers.dev.buf[p0 % tiers.config.hot_pages], non_blocking=non_blocking)
        for seq_id, tiers in sources.latents.items():
            staged = self._staged.get(seq_id)
            if staged is None or self.latent_buffers is None or not staged.first:
                continue
            dst = self._latent_rows(b, staged)
            dst[:staged.first].copy_(tiers.host[:staged.first], non_blocking=non_blocking)
