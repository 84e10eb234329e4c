"""Paged caches (plain-PyTorch path) and the per-step forward context.

Two caches share one block table per request: the MLA latent cache (``kv_lora_rank + rope`` values
per token and layer: the normalised latent, then the roped shared key) and, for DSA models, the
indexer-key cache (``index_head_dim`` values per token, only for layers that run an indexer).
A token at logical position ``p`` of a request lives at slot ``block_table[p // bs] * bs + p % bs``.

The ``ForwardContext`` describes one step's flattened batch: which tokens belong to which request,
their positions and slots, and the full slot list of each request's context, so attention can
read any request's whole history — a prefill may start at any position (chunked prefill, a
conversation's reused prefix) and any subset of requests may run a layer together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hearth.engine.config import ModelConfig


class PagedCache:
    """Per-layer cache tensors: latent ``[num_slots, latent_dim]`` and index keys
    ``[num_slots, index_head_dim]`` (``num_slots = num_blocks * block_size``)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, index_fp8: bool = False, key_tiers=None, latent_tiers=None,
                 histories=None, table_width: int | None = None) -> None:
        """index_fp8: store indexer keys in the kernels' 132-byte FP8 paged layout
        (uint8 [num_blocks, block_size * 132]) instead of one float row per slot.
        key_tiers / latent_tiers: tier stores (hearth.engine.tiers); indexer keys / latents then live
        there, per request, instead of here. histories: the kernel path's prefill history buffers of
        those tiers (hearth.engine.tiers.PrefillHistories), or None. table_width: the pages every decode
        step's block tables are padded to (`decode_tables`; the kernel path gives the CUDA graphs' width,
        a context's pages at the longest context), or None: the step's widest table."""
        self.num_blocks = num_blocks
        self.table_width = table_width
        self.block_size = block_size
        self.index_fp8 = index_fp8
        num_slots = num_blocks * block_size
        self.latent_tiers = latent_tiers
        self.histories = histories
        self.latent: list[torch.Tensor | None] = [
            None if latent_tiers is not None else torch.zeros(num_slots, config.latent_dim, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)
        ]
        def index_cache() -> torch.Tensor:
            if index_fp8:
                return torch.zeros(num_blocks, block_size * (config.index_head_dim + 4), dtype=torch.uint8,
                                   device=device)
            return torch.zeros(num_slots, config.index_head_dim, dtype=dtype, device=device)

        self.key_tiers = key_tiers
        self.index_keys: list[torch.Tensor | None] = [
            index_cache() if config.runs_indexer(layer) and key_tiers is None else None
            for layer in range(config.num_hidden_layers)
        ]

    # ---- whole pages, for the prefix cache's host / disk tiers (hearth.engine.prefix_store) ----

    def _page_views(self) -> list[torch.Tensor]:
        """Every per-layer tensor seen as ``[num_blocks, bytes of one page]`` uint8: a page is one
        row of each (latents, or GQA keys then values; indexer keys in whichever layout they use)."""
        tensors = [t for t in self.latent + self.index_keys if t is not None]
        return [t.view(self.num_blocks, -1).view(torch.uint8) for t in tensors]

    @property
    def page_bytes(self) -> int:
        return sum(view.shape[1] for view in self._page_views())

    @property
    def page_device(self) -> torch.device:
        return self._page_views()[0].device

    def read_pages(self, block_ids: list[int], pin: bool) -> torch.Tensor:
        """The pages ``block_ids`` of every layer as host bytes ``[len(block_ids), page_bytes]``.
        The pages are gathered on the device first, so the copy to the host is one contiguous
        transfer; on CUDA it is issued on the current stream into pinned memory (``pin``) without
        waiting, and the caller synchronises before it reads the bytes."""
        views = self._page_views()
        device = views[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        gathered = torch.empty(len(block_ids), sum(v.shape[1] for v in views), dtype=torch.uint8, device=device)
        offset = 0
        for view in views:
            width = view.shape[1]
            gathered[:, offset:offset + width] = _wide(view)[0].index_select(0, index).view(torch.uint8)
            offset += width
        if device.type == "cpu":
            return gathered
        out = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=pin)
        out.copy_(gathered, non_blocking=pin)
        return out

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Fill the pages ``block_ids`` of every layer from bytes laid out as ``read_pages`` returns
        them, on the host or already on the device (from the host: one copy, non-blocking from
        pinned memory, so stream order puts it before the next step)."""
        views = self._page_views()
        index = torch.tensor(block_ids, dtype=torch.long, device=views[0].device)
        pages = pages.to(views[0].device, non_blocking=pages.is_pinned())
        offset = 0
        for view in views:
            width = view.shape[1]
            dst, src = _wide(view, pages[:, offset:offset + width])
            dst.index_copy_(0, index, src)
            offset += width

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        per_token = config.latent_dim * config.num_hidden_layers
        if config.has_indexer:
            per_token += config.index_head_dim * sum(
                config.runs_indexer(layer) for layer in range(config.num_hidden_layers))
        return per_token * block_size * itemsize


def _wide(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """uint8 ``[rows, bytes]`` views seen through the widest integer type all of them allow: row
    gathers and scatters go element by element, and on the CPU 8-byte elements are ~10x faster."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return tuple(view.view(dtype) for view in views)
        except RuntimeError:  # a width, stride or offset that is not a multiple of the type's size
            continue
    return views


@dataclass
class SeqSlice:
    """One request's part of the step: tokens ``[start, start + q_len)`` of the flat batch,
    at positions ``[context_len - q_len, context_len)`` of the request."""

    start: int
    q_len: int
    context_len: int
    slots: torch.Tensor  # (context_len,) int64 physical slots of positions 0..context_len-1
    block_table: torch.Tensor | None = None  # (num_blocks,) int32 pages of the request (for the kernels)
    seq_id: str | None = None  # the request, for per-request state such as tiered indexer keys

    @property
    def first_position(self) -> int:
        return self.context_len - self.q_len


@dataclass
class DecodeMeta:
    """A step where every request decodes one token (token i of the batch is request i), described
    by device tensors only, so the kernel path reads no per-request Python state and the step can be
    captured in a CUDA graph (``hearth.engine.cuda_graphs``)."""

    block_tables: torch.Tensor  # (B, max_blocks) int32, unused entries any valid page
    context_lens: torch.Tensor  # (B,) int32, this step's token included
    max_context: int  # upper bound on context_lens (sizes the rope table without a host sync)


@dataclass
class ForwardContext:
    """Metadata of one forward step over a flat batch of ``N`` tokens from several requests."""

    positions: torch.Tensor  # (N,) int64
    slot_mapping: torch.Tensor  # (N,) int64 where each new token's cache entries go
    seqs: list[SeqSlice]
    cache: PagedCache
    # Per request (index into seqs): top-k of the most recent layer that ran its indexer, reused
    # by IndexCache "shared" layers. (q_len, k) int64, -1 = no token.
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    decode: DecodeMeta | None = None  # set when the whole step is single-token decodes (kernel path)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat batch of each request's last token (where logits are needed)."""
        idx = [s.start + s.q_len - 1 for s in self.seqs]
        return torch.tensor(idx, dtype=torch.long, device=self.positions.device)


def slots_for(block_table: Sequence[int], num_tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Physical slots of logical positions 0..num_tokens-1 given a block table."""
    pos = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.tensor(block_table, dtype=torch.long)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)


def build_context(cache: PagedCache, requests: list[tuple[Sequence[int], int, int]],
                  device: torch.device, seq_ids: list[str | None] | None = None) -> ForwardContext:
    """Build the context for requests given as (block_table, first_position, q_len)."""
    seqs, positions, slot_mapping = [], [], []
    start = 0
    seq_ids = seq_ids or [None] * len(requests)
    for (block_table, first, q_len), seq_id in zip(requests, seq_ids):
        context_len = first + q_len
        slots = slots_for(block_table, context_len, cache.block_size, device)
        table = torch.tensor(block_table, dtype=torch.int32, device=device)
        seqs.append(SeqSlice(start=start, q_len=q_len, context_len=context_len, slots=slots, block_table=table,
                             seq_id=seq_id))
        positions.append(torch.arange(first, context_len, dtype=torch.long, device=device))
        slot_mapping.append(slots[first:context_len])
        start += q_len
    return ForwardContext(
        positions=torch.cat(positions), slot_mapping=torch.cat(slot_mapping), seqs=seqs, cache=cache,
        decode=_decode_meta(requests, device, cache.table_width),
    )


def _decode_meta(requests: list[tuple[Sequence[int], int, int]], device: torch.device,
                 table_width: int | None) -> DecodeMeta | None:
    """The DecodeMeta of a step whose every request decodes one token, else None: the kernel path
    then scores and attends for all requests in one launch each, as in a CUDA graph, instead of
    copying per-layer row lists to the device."""
    if not requests or any(q_len != 1 for _, _, q_len in requests):
        return None
    widest = max(len(table) for table, _, _ in requests)
    tables = torch.tensor([[*table] + [0] * (widest - len(table)) for table, _, _ in requests], dtype=torch.int32)
    tables = tables.to(device)
    if table_width is not None and table_width > widest:  # (`decode_tables`'s note)
        # padded on the device: in the host's lists, 8 x 2,560 pages cost 1.1 ms a step (runahead builds many)
        tables = torch.nn.functional.pad(tables, (0, table_width - widest))
    lens = [first + 1 for _, first, _ in requests]
    return DecodeMeta(tables, torch.tensor(lens, dtype=torch.int32).to(device), max(lens))


def decode_table_width(max_model_len: int, block_size: int) -> int:
    """Pages of a decode step's block tables: a context's at the longest context. The CUDA graphs' tables have
    this width, and on the kernel path so does every eager step's (`PagedCache.table_width`, `decode_tables`)."""
    return -(-max_model_len // block_size)


def decode_tables(ctx: ForwardContext, rows: list[int]) -> torch.Tensor:
    """[len(rows), width] int32 block tables of the requests ``rows`` of a step (padded with page 0), width
    the cache's ``table_width`` where it has one, else the widest of them.

    NOTE: a fixed width keeps the decode kernels' arguments (table and logit strides, the top-k's slices)
    the same at every context length, as in the CUDA graphs: a width that followed the context made
    Triton compile a new variant of each decode kernel whenever it crossed a divisibility class or a
    top-k slice size, mid-request (the H200's sync TTFT at 2K: 1.17 s against 0.42 s, 2026-12-04)."""
    widest = max(ctx.seqs[i].block_table.shape[0] for i in rows)
    table = torch.zeros(len(rows), max(widest, ctx.cache.table_width or 0), dtype=torch.int32,
                        device=ctx.positions.device)
    for r, i in enumerate(rows):
        bt = ctx.seqs[i].block_table
        table[r, : bt.shape[0]] = bt
    return table
