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
"""

from __future__ import annotations

import torch

from hearth.engine.kv_cache import DecodeMeta, ForwardContext, PagedCache, SeqSlice

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: the standard buckets below max_batch, then max_batch itself."""
    return [b for b in _BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` over ``cache`` (see the module doc)."""

    def __init__(self, model, cache: PagedCache, max_batch: int, max_model_len: int, scratch_block: int,
                 device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.block_size = cache.block_size
        self.max_context = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_block = scratch_block
        self.sizes = batch_buckets(max_batch)
        self.max_batch = self.sizes[-1]
        b = self.max_batch
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.ones(b, dtype=torch.int32, device=device)
        # Host staging of one step's inputs: [ids, positions, slots, lens, tables...] per row.
        self._host = torch.zeros(b, 4 + self.max_blocks, dtype=torch.long, pin_memory=True)
        self._staged: torch.cuda.Event | None = None  # the last upload from _host (reused next step)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0

    def fits(self, num_requests: int, block_tables: list[list[int]]) -> bool:
        return num_requests <= self.max_batch and all(len(t) <= self.max_blocks for t in block_tables)

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, block_tables: list[list[int]], positions: list[int], token_ids: list[int]) -> torch.Tensor:
        """One decode step: request i has token ``token_ids[i]`` at ``positions[i]``. Returns fp32
        logits (n, vocab), a view into the graph's output (valid until the next step)."""
        n = len(token_ids)
        b = self.bucket(n)
        self._stage(block_tables, positions, token_ids, b)
        entry = self.graphs.get(b)
        if entry is None:
            entry = self.graphs[b] = self._capture(b)
        entry[0].replay()
        self.replays += 1
        return entry[1][:n]

    def _stage(self, block_tables: list[list[int]], positions: list[int], token_ids: list[int], b: int) -> None:
        bs, scratch = self.block_size, self.scratch_block
        if self._staged is not None:  # the previous step's non-blocking upload must have read _host
            self._staged.synchronize()
        host = self._host[:b]
        host[:, 0] = 0  # padding rows: token 0 at position 0 in the scratch page
        host[:, 1] = 0
        host[:, 2] = scratch * bs
        host[:, 3] = 1
        host[:, 4:] = scratch
        for i, (table, pos, tok) in enumerate(zip(block_tables, positions, token_ids)):
            row = host[i]
            row[0], row[1], row[2], row[3] = tok, pos, table[pos // bs] * bs + pos % bs, pos + 1
            row[4:4 + len(table)] = torch.tensor(table, dtype=torch.long)
        staged = host.to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        self.ids[:b].copy_(staged[:, 0])
        self.positions[:b].copy_(staged[:, 1])
        self.slots[:b].copy_(staged[:, 2])
        self.lens[:b].copy_(staged[:, 3])
        self.tables[:b].copy_(staged[:, 4:])

    def _forward(self, b: int) -> torch.Tensor:
        seqs = [SeqSlice(start=i, q_len=1, context_len=1, slots=self.slots[i:i + 1]) for i in range(b)]
        ctx = ForwardContext(positions=self.positions[:b], slot_mapping=self.slots[:b], seqs=seqs, cache=self.cache,
                             decode=DecodeMeta(self.tables[:b], self.lens[:b], self.max_context))
        return self.model(self.ids[:b], ctx)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks algorithms): nothing that
        # allocates or synchronises may run for the first time inside the capture. The inputs are
        # this step's real ones, so the cache writes are the ones the replay repeats.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)
        self._pool = graph.pool()
        return graph, out
