"""CUDA graphs for decode steps.

A decode step of a small model is mostly launch overhead: a few hundred small kernels per token
(projections, norms, rope, the FP8 indexer-key write, the lightning indexer and its radix top-k,
sparse MLA, router, fused experts), each a few microseconds of GPU work. Replaying a captured graph
launches them all at once.

One graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs``), captured the
first time a step of that size runs. All graphs read the same static input buffers (token ids,
positions, cache slots, block tables, context lengths); a step of ``n`` requests fills the first
``n`` rows and pads the bucket with dummy requests that read and write only a scratch page no
request owns. Block tables are as wide as ``max_model_len`` needs, so any context fits.

What can be captured is what the kernel path runs when every request decodes one token
(``ForwardContext.decode``): no per-request Python, no host synchronisation, experts resident on the
GPU through the fused MoE kernel. Other steps (prefill chunks, mixed steps) run eagerly.

Staging a step's inputs (``DecodeInputs``) is on the host's critical path, so it is one pinned
buffer filled through NumPy and one upload: ids, positions, slots and context lengths of every row,
then only the block-table entries that changed since the row was last written, scattered on the
device. A request's table only grows while it lives, so in steady decoding that part is empty
except when a table grows a page. The ids may instead come from the device (overlapped decode:
the previous step's sampled tokens, never read back to the host first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hearth.engine.kv_cache import DecodeMeta, ForwardContext, PagedCache, SeqSlice, decode_table_width

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TIER_GRAPHS = 4  # decode graphs kept for steps with per-request tiers (one per set of requests)


def capturing(graph: torch.cuda.CUDAGraph, pool: object | None) -> torch.cuda.graph:
    """``torch.cuda.graph`` capturing into ``pool``, refusing unsafe CUDA calls of this thread only.

    The default ("global") makes a call that may synchronise from *any* thread during a capture fail
    and invalidate the capture: a warm-start thread pinning host memory for files it reads
    (``cudaHostAlloc``) while the engine captures a decode graph then kills the warm-up (seen on the
    H200) and its file reads fail. Those threads never touch the capturing stream, so their calls are
    safe here; this thread's own unsafe calls still fail the capture."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: the standard buckets below max_batch, then max_batch itself."""
    return [b for b in _BUCKETS if b < max_batch] + [max_batch]


class DecodeInputs:
    """The static input buffers every decode graph reads, and their staging from the host (see the
    module doc). Works on any device: off CUDA nothing is pinned and every copy is synchronous."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.device, self.block_size, self.scratch_block = device, block_size, scratch_block
        b = max_batch
        self._meta = torch.zeros(3, b, dtype=torch.long, device=device)  # ids, positions, slots
        self.ids, self.positions, self.slots = self._meta[0], self._meta[1], self._meta[2]
        self.lens = torch.ones(b, dtype=torch.int32, device=device)
        self.tables = torch.full((b, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self._cuda = device.type == "cuda"
        # Two host buffers used in turn: one is filled while the other's upload may still read it.
        self._host = [self._buffer(4 * b + 3 * max_blocks) for _ in range(2)]
        self._uploads: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._pad: list[int] = [scratch_block]  # a padding row's table
        # What row i of ``tables`` holds: the first ``length`` entries of ``table`` (a list that
        # may have grown since; the rest of the row is stale but valid pages).
        self._rows: list[tuple[Sequence[int], int]] = [((), 0)] * b

    def _buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long, pin_memory=self._cuda)

    def stage(self, block_tables: Sequence[Sequence[int]], positions: Sequence[int],
              token_ids: Sequence[int] | torch.Tensor, b: int) -> None:
        """Fill rows [0, b): request i decodes ``token_ids[i]`` (a host list or a device tensor) at
        ``positions[i]``; rows from ``len(positions)`` on are padding that reads and writes only
        the scratch page."""
        n, bs = len(positions), self.block_size
        rows, cols, pages = self._table_changes(block_tables, b)
        k = len(rows)
        self._turn ^= 1
        upload = self._uploads[self._turn]
        if upload is not None:
            upload.synchronize()  # the upload from this buffer two steps ago (long done in practice)
        if self._host[self._turn].numel() < 4 * b + 3 * k:
            self._host[self._turn] = self._buffer(2 * (4 * b + 3 * k))
        host = self._host[self._turn][:4 * b + 3 * k]
        values = host.numpy()
        head = values[:4 * b].reshape(4, b)
        if not isinstance(token_ids, torch.Tensor):
            head[0, :n] = token_ids
        head[0, n:] = 0
        head[1, :n] = positions
        head[1, n:] = 0
        head[2, :n] = [table[pos // bs] * bs + pos % bs for table, pos in zip(block_tables, positions)]
        head[2, n:] = self.scratch_block * bs
        head[3, :n] = head[1, :n] + 1
        head[3, n:] = 1
        if k:
            values[4 * b:].reshape(3, k)[:] = (rows, cols, pages)
        staged = host.to(self.device, non_blocking=True)
        if self._cuda:
            event = self._uploads[self._turn] = self._uploads[self._turn] or torch.cuda.Event()
            event.record()
        staged_head = staged[:4 * b].view(4, b)
        self._meta[:, :b].copy_(staged_head[:3])
        if isinstance(token_ids, torch.Tensor):
            self.ids[:n].copy_(token_ids)
        self.lens[:b].copy_(staged_head[3])
        if k:
            triples = staged[4 * b:].view(3, k)
            self.tables.index_put_((triples[0], triples[1]), triples[2].to(torch.int32))

    def _table_changes(self, block_tables: Sequence[Sequence[int]],
                       b: int) -> tuple[list[int], list[int], list[int]]:
        """(row, column, page) of every table entry rows [0, b) need that the device lacks."""
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for i in range(b):
            table = block_tables[i] if i < len(block_tables) else self._pad
            old, length = self._rows[i]
            if old is table and len(table) >= length:
                start = length  # the same list, grown (or not) since
            elif len(table) >= length and table[:length] == old[:length]:
                start = length
            else:
                start = 0
            if start < len(table):
                rows.extend([i] * (len(table) - start))
                cols.extend(range(start, len(table)))
                pages.extend(table[start:])
            self._rows[i] = (table, len(table))
        return rows, cols, pages

    def context(self, model_cache: PagedCache, b: int, max_context: int,
                seq_ids: Sequence[str | None] = ()) -> ForwardContext:
        """The forward context of a step over rows [0, b) (what the graphs capture); ``seq_ids`` name
        the requests of rows whose per-request tiers the step reads."""
        ids = list(seq_ids) + [None] * (b - len(seq_ids))
        seqs = [SeqSlice(start=i, q_len=1, context_len=1, slots=self.slots[i:i + 1], seq_id=ids[i])
                for i in range(b)]
        return ForwardContext(positions=self.positions[:b], slot_mapping=self.slots[:b], seqs=seqs,
                              cache=model_cache, decode=DecodeMeta(self.tables[:b], self.lens[:b], max_context))


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` over ``cache`` (see the module doc)."""

    def __init__(self, model, cache: PagedCache, max_batch: int, max_model_len: int, scratch_block: int,
                 device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.block_size = cache.block_size
        self.max_context = max_model_len
        self.max_blocks = decode_table_width(max_model_len, self.block_size)
        self.sizes = batch_buckets(max_batch)
        self.max_batch = self.sizes[-1]
        self.inputs = DecodeInputs(self.max_batch, self.max_blocks, self.block_size, scratch_block, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.tier_graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self._pool = None
        self.replays = 0
        self.captures = 0
        self.capture_ms = 0.0  # host time capturing (its two warm-up forwards included)

    def fits(self, num_requests: int, block_tables: Sequence[Sequence[int]]) -> bool:
        return num_requests <= self.max_batch and all(len(t) <= self.max_blocks for t in block_tables)

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, block_tables: Sequence[Sequence[int]], positions: Sequence[int],
            token_ids: Sequence[int] | torch.Tensor, tiers: tuple[Sequence[str | None], tuple[int, ...]] | None = None,
            ) -> torch.Tensor:
        """One decode step: request i has token ``token_ids[i]`` (host list or device tensor) at
        ``positions[i]``. Returns fp32 logits (n, vocab), a view into the graph's output (valid
        until the next step).

        ``tiers``: (request ids, tier layout of ``hearth.engine.tiers.DecodeTiers.prepare``) when the
        requests keep per-request tiers: the step reads their own buffers, so its graph is captured
        per (requests, layout), without padding rows, the last ``TIER_GRAPHS`` kept."""
        n = len(positions)
        b = n if tiers is not None else self.bucket(n)
        self.inputs.stage(block_tables, positions, token_ids, b)
        if tiers is None:
            entry = self.graphs.get(b)
            if entry is None:
                entry = self.graphs[b] = self._capture(b)
        else:
            key = (tuple(tiers[0]), tiers[1])
            entry = self.tier_graphs.get(key)
            if entry is None:
                for k in [k for k in self.tier_graphs if k[1][0] != key[1][0]]:  # tiers were dropped since
                    del self.tier_graphs[k]
                while len(self.tier_graphs) >= TIER_GRAPHS:
                    self.tier_graphs.popitem(last=False)
                if not self.graphs and not self.tier_graphs:
                    # NOTE: the shared memory pool lives while a graph captured into it does; once the
                    # last is gone, capturing into it again fails an allocator assert (while its blocks,
                    # e.g. the last step's logits, are still held), so the next capture starts a new pool.
                    self._pool = None
                entry = self.tier_graphs[key] = self._capture(b, key[0])
            self.tier_graphs.move_to_end(key)
        entry[0].replay()
        self.replays += 1
        return entry[1][:n]

    def _forward(self, b: int, seq_ids: Sequence[str | None] = ()) -> torch.Tensor:
        return self.model(self.inputs.ids[:b], self.inputs.context(self.cache, b, self.max_context, seq_ids))

    def _capture(self, b: int, seq_ids: Sequence[str | None] = ()) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks algorithms): nothing that
        # allocates or synchronises may run for the first time inside the capture. The inputs are
        # this step's real ones, so the cache writes are the ones the replay repeats (a tiered step
        # repeats its ring and write-through writes and re-plans the same selection: all hits).
        self.captures += 1
        start = time.perf_counter()
        try:
            return self._warm_and_capture(b, seq_ids)
        finally:
            self.capture_ms += 1e3 * (time.perf_counter() - start)

    def _warm_and_capture(self, b: int, seq_ids: Sequence[str | None]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b, seq_ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            out = self._forward(b, seq_ids)
        self._pool = graph.pool()
        return graph, out
