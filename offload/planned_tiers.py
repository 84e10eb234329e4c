"""Tiered indexer keys and MLA latents of one request and layer for the DSA kernel path, with every
decision of a decode step made on the device (no host synchronisation: the step can be captured in
a CUDA graph).

Keys (``PlannedKeys``, LeanSparse-style coarse-to-fine): the ``hot_pages`` most recent pages live in
a device ring (the partial tail page always); every page is written through to pinned host memory
when it fills, and its compact summary (the mean key of every 16 tokens, e4m3 with an fp32 scale) is
stored on the device in the indexer-cache layout, so the lightning indexer kernel scores summaries as
it scores keys. A decode step (``select``), every count (pages, cold pages, the fine table's tokens)
derived inside the kernels from the context length on the device:

1. coarse: the indexer kernel over the summaries of the cold pages, writing each page's score (its
   best mean);
2. one program (``hearth.kernels.tiered.coarse_step``): the ``candidate_pages`` best cold pages by
   that score (``candidate_topk``: the row sorted in registers, or the single-pass select), the fine
   page table [candidates | hot pages] and its residency (``hearth.kernels.tiered``): candidates
   already in the device page cache are hits, misses take cache slots no hit of this step holds,
   hot pages map to their ring slots;
3. the misses copied from the mapped host pool by a gather kernel;
4. fine: the indexer kernel + radix top-k over the table, whose last pass writes token positions
   (the logical positions read through the table's pages).

Every cold page is a candidate when ``candidate_pages`` covers the cold pages (then the selection
equals the full-cache one up to ties); beyond that a page whose best mean ranks outside the
candidates is never scored (recall < 1 by design).

Latents (``PlannedLatents``, HiSparse-style): every row is written through to pinned host memory;
the device holds a ring of the ``ring_rows`` most recent rows and ``cache_rows`` cached rows. A decode
step maps its selection to device rows with the same residency plan (rows of the ring need nothing;
misses are gathered from host memory), and sparse MLA reads the device buffer through them. A
decode read (select + slots) is seven launches with the one-launch fine top-k (eleven with the radix
select) and no torch op
(tests/offload/test_planned_tiers_launches.py).

Prefill chunks run the prefill kernels over the request's whole history of the layer on the device:
streamed through the runner's two reusable buffers (``hearth.offload.history_buffers``: keys are
written into the buffer, latents also into the view ``PlannedLatents.stage`` names), or, for a
request that does not fit them, read back into a temporary buffer (``history``: keys the host pages
plus the partial ring page; latents the host rows).
Appends launch copies only (the host knows every position); growing a host pool waits for the
write-through copies in flight (once per doubling). A decode token runs in two phases: ``reserve``
on the host before the step (room, counts; bumps ``version`` when a buffer moves, which makes a
captured graph stale), then launches only, every index computed inside the kernels from the
token's position on the device, so the same launches replay from a CUDA graph at every position:
``decode_write`` is two (the cache-write kernel into the key's ring slot; ``write_through_page``:
the page, once the token fills it, to the pinned host pool and its summary), ``decode_append`` one
(``write_row``: the ring row and the host row), with no torch op (tests/offload/test_planned_tiers_launches.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from hearth.kernels.indexer import lightning_indexer_decode
from hearth.kernels.tiered import (
    CANDIDATE_TOPKS,
    CandidateTopk,
    ResidencyPlan,
    coarse_step,
    gather_misses,
    plan_residency,
    sort_fits,
    write_row,
    write_through_page,
)
from hearth.kernels.topk.one_launch import (
    new_one_launch_workspace,
    one_launch_plan,
    one_launch_topk_launch,
)
from hearth.kernels.topk.radix import new_workspace, radix_topk_launch
from hearth.kernels.topk.single_pass import new_scratch
from hearth.offload.coarse_index import PagePool, quantize_means
from hearth.offload.parked import ParkedPages, ParkedRows, grown_capacity, whole_pages

MEAN_GROUP = 16  # tokens per summary mean; also the block size of the summary pool (kernel layout)
HEAD_DIM = 128


@dataclass(frozen=True)
class PlannedKeyConfig:
    """Per (request, indexer layer) tiering of FP8 indexer keys on the kernel path."""

    page_size: int = 64
    hot_pages: int = 4  # device ring of the most recent pages (>= 1: holds the partial page)
    candidate_pages: int = 256  # cold pages scored exactly per decode step
    cache_pages: int = 256  # device cache of fetched cold pages (>= candidate_pages)
    topk: int = 2048
    # candidate pages' top-k (hearth.kernels.tiered.coarse_step): "sort", "select", "narrow" or "hist" (the
    # page scores in registers, up to 4096 pages; past that "single_pass" runs) or "single_pass". "narrow"
    # (bisection of the row's own key range, stopping at an exact count): on the H200 at 128K the coarse
    # step took 11.9 us against 14.8 with "select", the planned read 57.0 against 59.6 us (one run, 2026-12-02)
    candidate_topk: CandidateTopk = "narrow"
    # the fine top-k over the fine table's keys: "one_launch" (the fine indexer adds its first histogram, one
    # select launch writing token positions through the table's pages; on the H200 at 128K the planned read
    # took 66.2 us against 73.8 with "radix", CUDA graphs back to back, 2026-12-02) or "radix" (four
    # histogram passes and a gather, writing token positions through the table's pages)
    fine_topk: Literal["radix", "one_launch"] = "one_launch"

    def __post_init__(self) -> None:
        if self.page_size < MEAN_GROUP or self.page_size % MEAN_GROUP or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= {MEAN_GROUP}, got {self.page_size}")
        for name in ("hot_pages", "candidate_pages", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_pages < self.candidate_pages:
            raise ValueError(f"cache_pages ({self.cache_pages}) must be >= candidate_pages ({self.candidate_pages})")
        if self.fine_topk not in ("radix", "one_launch"):
            raise ValueError(f"fine_topk must be radix or one_launch, got {self.fine_topk!r}")
        if self.candidate_topk not in CANDIDATE_TOPKS:
            raise ValueError(f"candidate_topk must be one of {CANDIDATE_TOPKS}, got {self.candidate_topk!r}")

    @property
    def page_bytes(self) -> int:
        return PagePool.bytes_per_page(self.page_size, HEAD_DIM, "fp8")

    @property
    def groups(self) -> int:
        return self.page_size // MEAN_GROUP

    def device_bytes(self, num_tokens: int) -> int:
        """Device bytes at a context of num_tokens: pools, summaries (whole 16-mean blocks), residency."""
        pages = math.ceil(num_tokens / self.page_size)
        mean_blocks = math.ceil(pages * self.groups / MEAN_GROUP)
        plan = 4 * (pages + 3 * self.cache_pages + 3 * self.candidate_pages + self.hot_pages + 3)
        return ((self.hot_pages + self.cache_pages) * self.page_bytes
                + mean_blocks * MEAN_GROUP * (HEAD_DIM + 4) + plan)


class PlannedKeys:
    """FP8 indexer keys of one request and layer across a device ring, a device page cache and a
    pinned host pool (see the module doc)."""

    def __init__(self, config: PlannedKeyConfig, device: torch.device, initial_pages: int = 64) -> None:
        c = self.config = config
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        pages = max(1, initial_pages)
        self.host = PagePool(pages, c.page_size, HEAD_DIM, "fp8", torch.device("cpu"), pin=self._cuda)
        self.dev = PagePool(c.hot_pages + c.cache_pages, c.page_size, HEAD_DIM, "fp8", self.device)
        self.means = PagePool(self._mean_blocks(pages), MEAN_GROUP, HEAD_DIM, "fp8", self.device)
        # the plan names the fine table: the candidates (cold) and the hot pages (its ring)
        self.plan = ResidencyPlan.new(pages, c.cache_pages, c.candidate_pages, c.hot_pages, self.device,
                                      ring_entries=c.hot_pages)
        self._mean_table = torch.arange(self.means.num_pages, dtype=torch.int32, device=self.device)[None]
        self._topk_scratch = new_scratch(1, c.candidate_pages, self.device)
        # a step's buffers, allocated once in the dtype the kernels take (fixed addresses for CUDA graphs):
        # the fine table's pages [candidates | hot pages | -1], its token count, the fine top-k's
        # workspace (zeroed by the coarse step) and the selection
        self._pages = torch.full((1, c.candidate_pages + c.hot_pages), -1, dtype=torch.int32, device=self.device)
        self._candidates = self._pages[:, :c.candidate_pages]  # the first min(cold pages, candidate_pages)
        self._fine_len = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._fine_ws = new_workspace(1, self.device)
        self._selection = torch.full((1, c.topk), -1, dtype=torch.int32, device=self.device)
        self._one_launch = None  # the one-launch fine top-k's plan and workspace (left clean by every select)
        if c.fine_topk == "one_launch":
            plan = one_launch_plan(c.topk)
            ws = new_one_launch_workspace(1, plan, self.device)
            self._one_launch = (plan, ws)
        self.num_tokens = 0
        self.version = 0  # bumped whenever a buffer a decode step reads is reallocated (captured graphs go stale)

    def _mean_blocks(self, pages: int) -> int:
        return math.ceil(pages * self.config.groups / MEAN_GROUP)

    @property
    def num_pages(self) -> int:
        return math.ceil(self.num_tokens / self.config.page_size)

    def device_bytes(self) -> int:
        held = [self.dev.buf, self.means.buf, self._mean_table, self._topk_scratch, self._pages, self._fine_len,
                self._fine_ws, self._selection, *(self._one_launch[1:] if self._one_launch else ())]
        return sum(t.numel() * t.element_size() for t in held) + self.plan.device_bytes()

    def _grow(self, pages: int) -> None:
        """Room for pages pages (host pool, summaries, residency table): the next power of two
        (``parked.grown_capacity``); the host pool's copy waits for the write-through copies in flight."""
        if pages <= self.host.num_pages:
            return
        cap = grown_capacity(pages)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.host.grow(cap)
        self.means.grow(self._mean_blocks(cap))
        self._mean_table = torch.arange(self.means.num_pages, dtype=torch.int32, device=self.device)[None]
        self.plan.grow(cap)
        self.version += 1

    # ---- writes -------------------------------------------------------------------------------
    def ring_slot(self, position: int) -> int:
        """Slot of the device pool (block * page_size + offset) where the key of position goes in a
        decode step (the caller's cache-write kernel writes it there, then calls ``commit``)."""
        ps = self.config.page_size
        return (position // ps) % self.config.hot_pages * ps + position % ps

    def commit(self) -> None:
        """One token was written at ring_slot(num_tokens): count it; a page it fills goes to host
        memory and gets its summary."""
        ps = self.config.page_size
        page = self.num_tokens // ps
        self._grow(page + 1)
        self.num_tokens += 1
        if self.num_tokens % ps == 0:
            row = self.dev.buf[page % self.config.hot_pages: page % self.config.hot_pages + 1]
            self._store_full(row, page)

    # ---- a decode token in two phases: host bookkeeping, then launches only (capturable) ----------
    def reserve(self, position: int) -> None:
        """Host phase of the decode token at position (= num_tokens): room for its page, counted.
        Runs before the step (outside a captured graph); ``version`` changes if a buffer moved."""
        if position + 1 == self.num_tokens:  # reserved already (a runahead token's sync step)
            return
        if position != self.num_tokens:
            raise RuntimeError(f"tiered keys hold {self.num_tokens} tokens, the decode token is at {position}")
        self._grow(position // self.config.page_size + 1)
        self.num_tokens = position + 1

    def decode_write(self, k_raw: torch.Tensor, position: torch.Tensor, write) -> None:
        """Device phase of the decode token at position ((1,) int32/int64 on the device, reserved):
        two launches. write(k_raw, position, pool, page_size, positions=position, ring_pages=hot_pages)
        (the cache-write kernel, ``hearth.kernels.indexer.indexer_k_cache_write``) stores its key in
        the ring, the kernel mapping the position to its ring slot; then, if the token fills its page,
        ``write_through_page`` stores the page to the host pool and writes its summary (a partial
        page's copy and summary would never be read: cold pages are full). No host sync, no host value."""
        c = self.config
        write(k_raw, position, self.dev.buf, c.page_size, positions=position, ring_pages=c.hot_pages)
        write_through_page(self.dev.buf, self.host.buf, self.means.buf, position, c.page_size, c.hot_pages,
                           MEAN_GROUP)

    def history(self, n_new: int) -> torch.Tensor:
        """A device buffer of every page of the request once n_new more tokens are written (pages
        below the first new token's page from host memory, that page's written part from the ring):
        [pages, page_size * 132] uint8 in the indexer-cache layout, page p at row p. The caller writes
        the new keys at slot = position, scores, then calls ``commit_chunk``."""
        ps, first = self.config.page_size, self.num_tokens
        total = math.ceil((first + n_new) / ps)
        buf = torch.empty(total, self.dev.buf.shape[1], dtype=torch.uint8, device=self.device)
        p0 = first // ps
        if p0:
            buf[:p0].copy_(self.host.buf[:p0], non_blocking=True)  # stream-ordered after the write-through
        if first % ps:
            buf[p0] = self.dev.buf[p0 % self.config.hot_pages]
        return buf

    def commit_chunk(self, buf: torch.Tensor, n_new: int) -> None:
        """n_new tokens were written into history(n_new)'s buffer: full pages to host memory with
        their summaries, the most recent pages into the ring."""
        c, first = self.config, self.num_tokens
        last = first + n_new
        self._grow(math.ceil(last / c.page_size))
        p0, p_full, p_end = first // c.page_size, last // c.page_size, math.ceil(last / c.page_size)
        if p_full > p0:
            self._store_full(buf[p0:p_full], p0)
        for page in range(max(p0, p_end - c.hot_pages), p_end):
            self.dev.buf[page % c.hot_pages] = buf[page]
        self.num_tokens = last

    def _store_full(self, rows: torch.Tensor, first_page: int) -> None:
        """Full pages rows [n, page_bytes] (device) of pages first_page.. -> host pool + summaries."""
        n, c = rows.shape[0], self.config
        self.host.buf[first_page:first_page + n].copy_(rows, non_blocking=True)
        pool = PagePool(n, c.page_size, HEAD_DIM, "fp8", self.device)
        pool.buf = rows
        keys = pool.dequantized(torch.arange(n, device=self.device))  # (n, ps, D) fp32
        means, scales = quantize_means(keys.view(n, c.groups, MEAN_GROUP, HEAD_DIM).mean(dim=2))
        idx = torch.arange(first_page * c.groups, (first_page + n) * c.groups, device=self.device)
        self.means.write(idx // MEAN_GROUP, idx % MEAN_GROUP, means.reshape(-1, HEAD_DIM), scales.reshape(-1))

    # ---- between turns (hearth.offload.parked) ----------------------------------------------------
    def park(self, num_tokens: int) -> ParkedPages:
        """The first num_tokens tokens (whole pages) as a host-only state: the host pool as it is and
        a host copy of those pages' summary blocks. This object is dropped afterwards."""
        pages = whole_pages(num_tokens, self.config.page_size, self.num_tokens)
        means = self.means.buf[: self._mean_blocks(pages)].to("cpu")  # (stream-ordered after their writes)
        return ParkedPages(self.host, pages, (means,))

    def resume(self, parked: ParkedPages, num_tokens: int) -> None:
        """Continue from a parked state's first num_tokens tokens (whole pages, at most its own) in
        this new object: the host pool becomes this object's, the summaries and the hot ring's pages
        go back to the device; the page cache starts empty."""
        c = self.config
        pages = whole_pages(num_tokens, c.page_size, parked.pages * c.page_size)
        if self.num_tokens:
            raise RuntimeError("only a new tiered-key object can resume a parked state")
        self.host = parked.host
        cap = self.host.num_pages
        if self._mean_blocks(cap) > self.means.num_pages:
            self.means.grow(self._mean_blocks(cap))
            self._mean_table = torch.arange(self.means.num_pages, dtype=torch.int32, device=self.device)[None]
        blocks = self._mean_blocks(pages)
        self.means.buf[:blocks] = parked.summaries[0][:blocks].to(self.device, non_blocking=True)
        self.plan.grow(cap)
        ring = torch.arange(max(0, pages - c.hot_pages), pages)
        self.dev.buf[(ring % c.hot_pages).to(self.device)] = self.host.buf[ring].to(self.device)
        self.num_tokens = pages * c.page_size
        self.version += 1

    # ---- decode selection -------------------------------------------------------------------------
    def select(self, q: torch.Tensor, w: torch.Tensor, context_len: torch.Tensor) -> torch.Tensor:
        """Top-k token positions of one decode query: q (H, 128) e4m3 or bf16, w (H,) fp32 (q scale
        and softmax scales folded in), both contiguous, context_len (1,) int32 on the device
        (= num_tokens, this step's key written). Returns (1, topk) int32, -1 padded: the keys' own
        buffer, rewritten by the next select. Five launches and the fine top-k's (the radix select: four
        histograms, one gather; the one-launch select: one, which writes token positions through the
        table's pages), every count derived on the device from context_len: no host sync."""
        c, ps = self.config, self.config.page_size
        qb, wb = q[None, None], w[None, None]
        # 1. coarse: the cold pages' scores (the best summary of each page)
        page_scores, _ = lightning_indexer_decode(qb, wb, self.means.buf, self._mean_table, context_len, MEAN_GROUP,
                                                  cold_pages=(ps, c.hot_pages, c.groups))
        # 2-3. candidates, the fine table [candidates | hot pages] and its residency plan (one program);
        # misses copied from the host pool
        method = c.candidate_topk if sort_fits(page_scores) else "single_pass"
        coarse_step(page_scores, context_len, self.plan, self._pages[0], self._fine_len, self._fine_ws,
                    self._topk_scratch, ps, c.candidate_pages, method)
        gather_misses(self.plan, self.host.buf, self.dev.buf)
        # 4. fine: the indexer over the table (plan.slot: its pages' device slots), the radix top-k
        # writing token positions through the table's pages
        if self._one_launch is None:
            logits, lengths = lightning_indexer_decode(qb, wb, self.dev.buf, self.plan.slot[None], self._fine_len, ps)
            radix_topk_launch(logits, lengths, c.topk, self._selection, self._fine_ws, page_map=(self._pages, ps))
            return self._selection
        plan, ws = self._one_launch
        logits, lengths = lightning_indexer_decode(qb, wb, self.dev.buf, self.plan.slot[None], self._fine_len, ps,
                                                   workspace=ws, fine_hist=True)
        one_launch_topk_launch(logits, lengths, self._selection, ws, plan, page_map=(self._pages[0], ps))
        return self._selection

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every written key (tests): ((num_tokens, 128) e4m3, (num_tokens,) fp32) on the device."""
        buf = self.history(0)
        pool = PagePool(buf.shape[0], self.config.page_size, HEAD_DIM, "fp8", self.device)
        pool.buf = buf
        keys, scales = pool.tokens(torch.arange(buf.shape[0], device=self.device))
        return keys[: self.num_tokens], scales[: self.num_tokens]


@dataclass(frozen=True)
class PlannedLatentConfig:
    """Per (request, layer) tiering of MLA latent rows on the kernel path."""

    width: int = 576
    dtype: torch.dtype = torch.bfloat16
    ring_rows: int = 64  # most recent rows, always on the device
    cache_rows: int = 4096  # device cache of fetched rows (>= topk)
    topk: int = 2048
    block: int = 64  # the device buffer is read as pages of block rows (ring + cache a multiple of it)

    def __post_init__(self) -> None:
        if self.ring_rows < 1 or self.cache_rows < self.topk:
            raise ValueError(f"need ring_rows >= 1 and cache_rows ({self.cache_rows}) >= topk ({self.topk})")
        if (self.ring_rows + self.cache_rows) % self.block:
            raise ValueError(f"ring_rows + cache_rows must be a multiple of block ({self.block})")

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def device_bytes(self) -> int:
        return (self.ring_rows + self.cache_rows) * self.row_bytes

    @classmethod
    def from_hot_rows(cls, hot_rows: int, topk: int, block: int, **kwargs) -> PlannedLatentConfig:
        """Split a device budget of hot_rows rows (rounded up to whole blocks) into a one-block ring
        and the cache."""
        total = math.ceil(hot_rows / block) * block
        return cls(ring_rows=block, cache_rows=total - block, topk=topk, block=block, **kwargs)


class PlannedLatents:
    """Latent rows of one request and layer across a device ring + cache and a pinned host pool."""

    def __init__(self, config: PlannedLatentConfig, device: torch.device, initial_rows: int = 4096) -> None:
        c = self.config = config
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        rows = max(1, initial_rows)
        self.host = torch.zeros(rows, c.width, dtype=c.dtype, pin_memory=self._cuda)
        self.dev = torch.zeros(c.ring_rows + c.cache_rows, c.width, dtype=c.dtype, device=self.device)
        self.plan = ResidencyPlan.new(rows, c.cache_rows, c.topk, c.ring_rows, self.device)
        n_blocks = self.dev.shape[0] // c.block
        self.table = torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None]
        self.lens = torch.full((1,), self.dev.shape[0], dtype=torch.int32, device=self.device)
        self.num_tokens = 0
        self.version = 0  # bumped whenever a buffer a decode step reads is reallocated
        self._stage: torch.Tensor | None = None

    def device_bytes(self) -> int:
        return self.config.device_bytes + self.plan.device_bytes()

    def _grow(self, rows: int) -> None:
        if rows <= self.host.shape[0]:
            return
        cap = grown_capacity(rows)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        host = torch.zeros(cap, self.config.width, dtype=self.config.dtype, pin_memory=self._cuda)
        host[: self.num_tokens] = self.host[: self.num_tokens]
        self.host = host
        self.plan.grow(cap)
        self.version += 1

    def append(self, rows: torch.Tensor) -> None:
        """The next n rows (n, width) on the device: to host memory, the last ones into the ring."""
        n, c, first = rows.shape[0], self.config, self.num_tokens
        if n == 0:
            return
        self._grow(first + n)
        rows = rows.to(c.dtype)
        self.host[first:first + n].copy_(rows, non_blocking=True)
        pos = first + n - min(n, c.ring_rows)
        while pos < first + n:  # at most two runs: the ring wraps once
            row = pos % c.ring_rows
            run = min(first + n - pos, c.ring_rows - row)
            self.dev[row:row + run] = rows[pos - first:pos - first + run]
            pos += run
        if self._stage is not None:
            self._stage[first:first + n] = rows
            self._stage = None
        self.num_tokens = first + n

    def reserve(self, position: int) -> None:
        """Host phase of the decode row at position (= num_tokens): room for it, counted (before
        the step, outside a captured graph)."""
        if position + 1 == self.num_tokens:  # reserved already (a runahead token's sync step)
            return
        if position != self.num_tokens:
            raise RuntimeError(f"tiered latents hold {self.num_tokens} rows, the decode row is at {position}")
        self._grow(position + 1)
        self.num_tokens = position + 1

    def decode_append(self, row: torch.Tensor, position: torch.Tensor) -> None:
        """Device phase of the decode row (1, width) at position ((1,) int32/int64 on the device,
        reserved): into the ring and through to the host pool, one launch (``write_row``; a row in
        another dtype or layout is converted first)."""
        write_row(row.to(self.config.dtype).contiguous(), position, self.dev, self.config.ring_rows, self.host)

    def stage(self, history: torch.Tensor | None) -> None:
        """The next append also writes its rows into history (rows, width) on the device, position p
        at row p: a prefill history buffer that holds the rows before them (None: no longer)."""
        self._stage = history

    def slots(self, selection: torch.Tensor, context_len: torch.Tensor) -> torch.Tensor:
        """Device rows of one decode step's selection: selection (topk,) int32 positions (-1 = none),
        context_len (1,) int32 on the device (= num_tokens). Misses are copied from host memory.
        Returns (topk,) int32 rows of ``dev`` (-1 where -1), read through ``table``/``lens``. No host sync."""
        slots = plan_residency(self.plan, selection.to(torch.int32).contiguous(), written=context_len)
        gather_misses(self.plan, self.host, self.dev)
        return slots

    def park(self, num_tokens: int) -> ParkedRows:
        """The first num_tokens rows as a host-only state (the host pool as it is); this object is
        dropped afterwards."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot park {num_tokens} rows of {self.num_tokens}")
        return ParkedRows(self.host, num_tokens)

    def resume(self, parked: ParkedRows, num_tokens: int) -> None:
        """Continue from a parked state's first num_tokens rows in this new object: the host pool
        becomes this object's and the ring is refilled from it; the row cache starts empty."""
        c = self.config
        if self.num_tokens or num_tokens > parked.rows:
            raise RuntimeError(f"cannot resume {num_tokens} of {parked.rows} parked rows in a used latent tier")
        self.host = parked.host
        self.plan.grow(self.host.shape[0])
        ring = torch.arange(max(0, num_tokens - c.ring_rows), num_tokens)
        self.dev[(ring % c.ring_rows).to(self.device)] = self.host[ring].to(self.device)
        self.num_tokens = num_tokens
        self.version += 1

    def paged(self) -> torch.Tensor:
        """The device buffer as a paged latent cache [blocks, block, width] (rows through ``table``)."""
        return self.dev.view(-1, self.config.block, self.config.width)

    def history(self) -> torch.Tensor:
        """Every written row as a paged cache [blocks, block, width] on the device (prefill), position
        p at row p; stream-ordered after the write-through copies."""
        c = self.config
        blocks = math.ceil(self.num_tokens / c.block)
        buf = torch.zeros(blocks * c.block, c.width, dtype=c.dtype, device=self.device)
        buf[: self.num_tokens].copy_(self.host[: self.num_tokens], non_blocking=True)
        return buf.view(blocks, c.block, c.width)

