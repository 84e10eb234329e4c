"""Tiered indexer keys of one request and one indexer layer (LeanSparse-style coarse-to-fine).

Tiers: the ``hot_pages`` most recent pages live on the device (a ring; the partial tail page is
always hot); every full page is also written through to (pinned, on CUDA) host memory in its
original format, so the host holds the whole history and demotion costs nothing. For each full
page the device keeps a compact summary (``coarse_index.summarize_pages``): the mean key of every
``summary_group`` tokens, in e4m3 with an fp32 scale per mean (``summary_format="fp8"``, 528 B per
page of 64 tokens against 8448 B of FP8 keys) or in bf16 (1 KB), plus, with ``bounds=True``, a
per-dimension box (512 B, bf16) that bounds every key's score from above.

Device memory per request and layer: (hot_pages + cache_pages) pages + one summary per page + the
last selection (topk int64, kept for the overlap counter). The summaries grow with the context (by
1/16 at a time, so they hold at most about 6% spare rows); the pools do not. DeepSeek-V3.2 shapes at
128K (2048 pages, FP8 keys 16.5 MiB): defaults 260 pages 2.09 MiB + fp8 summaries 1.03 MiB + 16 KiB
= 3.14 MiB, 5.25x less (bf16 summaries: 4.11 MiB, 4.0x). Per-step temporaries (estimates, scores,
top-k) are freed after the step.

Default budgets: ``candidate_pages`` = 8 x topk / page_size (256 pages at k 2048, page 64) and
``cache_pages`` = candidate_pages. The candidates must cover the pages holding the exact top-k,
which depends on k and on how the keys cluster, not on the context length: on the bench's
clustered keys those are 50-175 pages at 16K..512K, and 99% recall needed up to 241 candidates
(128K, 10 data seeds), so a fraction of the context would overspend at long contexts.

Decode (``select``): rank every cold page by the best score of its group means, take the best
``candidate_pages`` pages (all of them when that budget covers every cold page, or when the
context holds at most ``topk`` tokens: then the result is exact), bring their original keys into
a device page cache (LRU, persists across steps), score them exactly with the hot pages and keep
the top-k (``Indexer._select`` order). With bounds, a page whose bound is at least the k-th exact
score could still hold a selected token: ``exact=True`` fetches and scores those too (one extra
round suffices, the threshold only rises), otherwise the step is counted as uncertified.
Candidates and hot pages are scored in one pass (one gather, one top-k), in plain torch or, with
``fine_kernel``, by the Triton paged indexer reading the device pool as its cache. A step syncs with
the host once (the candidate page ids, needed to fetch misses from host RAM); misses are gathered on
the host into pinned staging and copied on a side stream; index tensors go up through pinned memory.

Lagged fetch (``lagged_fetch``): a decode step scores the hot pages and every page resident in the
page cache, a set the host already knows, so the step never waits for its own candidates. Their ids
go to the host without blocking (pinned buffer + event) and are fetched at the start of the next
step (``prefetch``, called by ``append`` and ``select``; the copy overlaps that step's coarse
stage), so step t's fine stage scores step t-1's candidates plus the page that left the hot ring
(copied into the cache on the device). The first step after a prefill or bulk append (or after a
step where every cold page was a candidate) runs the synchronous path. With ``exact`` the pages the
bound leaves open are still fetched and scored in the same step (one sync), so it stays exact.

Prefill (``KeyStreamer``): walks layers' key histories through two reusable device buffers; the
host part of chunk i+1 is copied on a side stream while chunk i is scored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hearth.offload.coarse_index import (
    KEY_FORMATS,
    KeyChunk,
    PagePool,
    TopkMerger,
    exact_scores,
    new_stream,
    page_estimates,
    page_upper_bounds,
    quantize_means,
    summarize_pages,
    to_device,
)
from hearth.offload.parked import ParkedPages, grown_capacity, whole_pages

CANDIDATE_FACTOR = 8  # default candidate pages: page_size tokens each, for 8x the selected tokens


@dataclass(frozen=True)
class KeyTierConfig:
    """Per (request, indexer layer) tiering of indexer keys."""

    page_size: int = 64
    head_dim: int = 128
    key_format: str = "fp8"  # "fp8" (e4m3 + fp32 scale, 132 B/token) | "bf16" | "fp32"
    hot_pages: int = 4  # most recent pages resident on the device (>= 1: holds the partial page)
    cache_pages: int | None = None  # device page cache for fetched cold pages (None: candidate_pages)
    candidate_pages: int | None = None  # cold pages scored exactly per decode step (None: 8 x topk / page_size)
    topk: int = 2048
    summary_group: int = 16  # tokens per mean key in the compact form
    summary_format: str = "fp8"  # group means in "fp8" (e4m3 + fp32 scale per mean) | "bf16"
    bounds: bool = False  # also keep a per-page box (512 B): certifies steps, needed for ranking/exact
    ranking: str = "mean"  # candidate order: "mean" (best group mean) | "bound" (box upper bound)
    exact: bool = False  # also fetch every page the bound cannot rule out (always exact)
    # Fine stage through the Triton paged indexer + radix top-k (hearth.kernels.indexer) instead of
    # plain torch: CUDA and "fp8" only; positions come back unsorted and exact ties break arbitrarily.
    fine_kernel: bool = False
    # Score last step's candidates (already in the page cache) instead of this step's: no host sync
    # on the candidate ids (see the module doc). Needs candidate_pages <= cache_pages.
    lagged_fetch: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # NOTE: budgets left as None are resolved here, once; the fields are ints from then on
        if self.candidate_pages is None:
            object.__setattr__(self, "candidate_pages", CANDIDATE_FACTOR * math.ceil(self.topk / self.page_size))
        if self.cache_pages is None:
            object.__setattr__(self, "cache_pages", self.candidate_pages)
        if self.summary_format not in ("fp8", "bf16"):
            raise ValueError(f"summary_format must be 'fp8' or 'bf16', got {self.summary_format!r}")
        if self.key_format not in KEY_FORMATS:
            raise ValueError(f"key_format must be one of {KEY_FORMATS}, got {self.key_format!r}")
        if self.ranking not in ("mean", "bound"):
            raise ValueError(f"ranking must be 'mean' or 'bound', got {self.ranking!r}")
        if self.summary_group < 1 or self.page_size % self.summary_group:
            raise ValueError(f"summary_group must divide page_size, got {self.summary_group}")
        if (self.ranking == "bound" or self.exact) and not self.bounds:
            raise ValueError("ranking='bound' and exact=True need bounds=True")
        if self.fine_kernel and (self.key_format != "fp8" or self.exact or self.head_dim != 128):
            raise ValueError("fine_kernel needs key_format='fp8', head_dim 128 and exact=False")
        if self.lagged_fetch and self.candidate_pages > self.cache_pages:
            raise ValueError(f"lagged_fetch needs candidate_pages ({self.candidate_pages}) <= cache_pages "
                             f"({self.cache_pages}): a step's candidates must all stay resident")
        for name in ("page_size", "head_dim", "hot_pages", "cache_pages", "candidate_pages", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def page_bytes(self) -> int:
        return PagePool.bytes_per_page(self.page_size, self.head_dim, self.key_format)

    @property
    def summary_groups(self) -> int:
        return self.page_size // self.summary_group

    @property
    def summary_bytes(self) -> int:
        """Device bytes of one page's summary (box + means + mean scales)."""
        box = 2 * self.bounds * self.head_dim * 2  # bf16
        if self.summary_format == "bf16":
            return box + self.summary_groups * self.head_dim * 2
        return box + self.summary_groups * (self.head_dim + 4)

    def device_bytes(self, num_tokens: int) -> int:
        """Device bytes at a context of num_tokens (pools, summaries of every page, last selection)."""
        pages = math.ceil(num_tokens / self.page_size)
        return (self.hot_pages + self.cache_pages) * self.page_bytes + pages * self.summary_bytes + 8 * self.topk

    @classmethod
    def from_budget(cls, device_bytes: int, max_tokens: int, **kwargs) -> KeyTierConfig:
        """The largest page cache that fits device_bytes at max_tokens (candidates capped by it)."""
        base = cls(**kwargs)
        left = device_bytes - base.device_bytes(max_tokens) + base.cache_pages * base.page_bytes
        cache = left // base.page_bytes
        if cache < 1:
            raise ValueError(f"{device_bytes} B cannot hold {base.hot_pages} hot pages, one cached page and "
                             f"the summaries of {max_tokens} tokens")
        return cls(**{**kwargs, "cache_pages": int(cache), "candidate_pages": min(base.candidate_pages, int(cache))})


class TieredKeys:
    """Indexer keys of one request and layer across device and host memory (see the module doc)."""

    def __init__(self, config: KeyTierConfig, device: torch.device, initial_pages: int = 64) -> None:
        c = self.config = config
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.host = PagePool(initial_pages, c.page_size, c.head_dim, c.key_format, torch.device("cpu"), self._cuda)
        self.dev = PagePool(c.hot_pages + c.cache_pages, c.page_size, c.head_dim, c.key_format, self.device)
        self.box: torch.Tensor | None = None  # (P, 2, D) bf16 [lo, hi] with bounds
        self.means = torch.zeros(0)  # (P, G, D) bf16 or e4m3
        self.mean_scales: torch.Tensor | None = None  # (P, G) fp32 with summary_format "fp8"
        self._grow_summary(initial_pages)
        self.num_tokens = 0
        self._slot_of_page = torch.full((initial_pages,), -1, dtype=torch.long)  # cache slot or -1
        self._page_of_slot = torch.full((c.cache_pages,), -1, dtype=torch.long)
        self._last_used = torch.full((c.cache_pages,), -1, dtype=torch.long)  # use stamp (_stamp) per slot
        self._staging = PagePool(c.cache_pages, c.page_size, c.head_dim, c.key_format, torch.device("cpu"), self._cuda)
        self._copy_stream = new_stream(self.device)
        self._fetched = torch.cuda.Event() if self._cuda else None  # staging -> device copy done
        self._written = torch.cuda.Event() if self._cuda else None  # write-through copies done
        self._step = 0
        self._counts = {"steps": 0, "lookups": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes_h2d": 0,
                        "bytes_d2h": 0, "refined_pages": 0, "candidate_reads": 0, "lagged_steps": 0,
                        "demoted_pages": 0}
        # lagged_fetch: the cache holds a recent candidate set (a lagged step may score it), the
        # number of candidate ids of the last step in flight to _pending_ids (None: nothing pending),
        # and whether the compute stream still has to wait for a fetch on the copy stream
        self._lag_ready = False
        self._pending: int | None = None
        self._pending_ids = torch.zeros(c.candidate_pages if c.lagged_fetch else 0, dtype=torch.long,
                                        pin_memory=self._cuda)
        self._posted = torch.cuda.Event() if self._cuda else None  # candidate ids copied to _pending_ids
        self._fetch_unawaited = False
        self._uncertified = torch.zeros((), dtype=torch.long, device=self.device)
        self._overlap = torch.zeros((), dtype=torch.long, device=self.device)
        self._prev: torch.Tensor | None = None

    # ---- layout -----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return math.ceil(self.num_tokens / self.config.page_size)

    @property
    def num_cold_pages(self) -> int:
        return max(0, self.num_pages - self.config.hot_pages)

    def device_bytes(self) -> int:
        """Bytes this object holds on the device now (pools, summaries, last selection)."""
        held = [self.dev.buf, self.box, self.means, self.mean_scales, self._prev, self._uncertified, self._overlap]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def _grow_summary(self, pages: int) -> None:
        """Summary rows for at least pages pages: exact at first, then 1/16 more at a time (a decode
        step adds one page per page_size tokens; a doubling would hold up to 2x the summaries)."""
        have = self.means.shape[0] if self.means.dim() == 3 else 0
        if pages <= have:
            return
        cap = pages if have == 0 else max(pages, have + max(16, have // 16))
        c, dev = self.config, self.device

        def grown(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            new = torch.zeros(cap, *shape, dtype=dtype, device=dev)
            if old is not None and have:
                new[:have] = old
            return new

        if c.bounds:
            self.box = grown(self.box, (2, c.head_dim), torch.bfloat16)
        fp8 = c.summary_format == "fp8"
        self.means = grown(self.means if have else None, (c.summary_groups, c.head_dim),
                           torch.float8_e4m3fn if fp8 else torch.bfloat16)
        if fp8:
            self.mean_scales = grown(self.mean_scales, (c.summary_groups,), torch.float32)

    def _grow(self, pages: int) -> None:
        if pages <= self.host.num_pages:
            return
        cap = grown_capacity(pages)
        self._sync()  # write-through copies into the old pool must land before it is copied
        self.host.grow(cap)
        slot = torch.full((cap,), -1, dtype=torch.long)
        slot[: self._slot_of_page.shape[0]] = self._slot_of_page
        self._slot_of_page = slot

    # ---- writes -----------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Add the next n tokens: keys (n, D) in the stored dtype (e4m3 values for "fp8"),
        scales (n,) fp32 for "fp8" (None otherwise), on the device."""
        n, ps, hot = keys.shape[0], self.config.page_size, self.config.hot_pages
        if n == 0:
            return
        old, new = self.num_tokens, self.num_tokens + keys.shape[0]
        p0, p1 = old // ps, math.ceil(new / ps)
        if self.config.lagged_fetch:
            self._lagged_append(n, old, p1)
        self._grow(p1)
        self._grow_summary(new // ps)  # summaries of full pages only
        if new % ps and p1 - p0 == 1:  # decode: the tokens stay in the partial page, only the ring changes
            self.dev.write_run(p0 % hot, old - p0 * ps, keys, scales)
            self.num_tokens = new
            return
        span = PagePool(p1 - p0, ps, self.config.head_dim, self.config.key_format, self.device)  # touched pages
        if old % ps:
            span.buf[0] = self.dev.buf[p0 % hot]  # earlier tokens of the partial page
        pos = torch.arange(old, new, device=self.device) - p0 * ps
        span.write(pos // ps, pos % ps, keys, scales)
        full = new // ps - p0  # touched pages that are now full
        if full > 0:
            self.host.buf[p0:p0 + full].copy_(span.buf[:full], non_blocking=True)
            if self._written is not None:
                self._written.record()
            dq = span.dequantized(torch.arange(full, device=self.device))  # (full, ps, D)
            self._summarize(p0, summarize_pages(dq, self.config.summary_group, self.config.bounds))
            self._counts["bytes_d2h"] += full * self.config.page_bytes
        first_hot = max(p0, p1 - hot)
        ring = torch.arange(first_hot, p1, device=self.device)
        self.dev.buf[ring % hot] = span.buf[ring - p0]
        self.num_tokens = new

    def _lagged_append(self, n: int, old: int, p1: int) -> None:
        """Before n tokens join (lagged_fetch): start last step's fetch, and copy the page that leaves
        the hot ring into the page cache (it was never a candidate: it was hot). A bulk append drops
        the lag: the next step runs the synchronous path."""
        if n > 1 or not self._lag_ready:
            self._lag_ready, self._pending = False, None
            return
        self.prefetch()  # first: the demoted page then takes a slot no candidate of last step needs
        hot, old_pages = self.config.hot_pages, math.ceil(old / self.config.page_size)
        leaving = old_pages - hot  # the oldest hot page: cold once the token opens page old_pages
        if p1 == old_pages or leaving < 0:
            return
        victim = int(torch.argmin(self._last_used))
        self._evict(torch.tensor([victim]))
        self._slot_of_page[leaving], self._page_of_slot[victim] = victim, leaving
        self._last_used[victim] = self._stamp(self.config.cache_pages + 1)
        self._await_fetch()  # an in-flight fetch may target the victim slot
        self.dev.buf[hot + victim].copy_(self.dev.buf[leaving % hot])
        self._counts["demoted_pages"] += 1

    def _summarize(self, p0: int, rows: torch.Tensor) -> None:
        """Store summarize_pages rows (P, 2 * bounds + G, D) bf16 of pages p0.. in the summary format."""
        c, n = self.config, rows.shape[0]
        if c.bounds:
            self.box[p0:p0 + n] = rows[:, :2]
            rows = rows[:, 2:]
        if c.summary_format == "bf16":
            self.means[p0:p0 + n] = rows
        else:
            self.means[p0:p0 + n], self.mean_scales[p0:p0 + n] = quantize_means(rows)

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored keys of positions (n,) from whichever tier holds them: ((n, D), (n,) or None)."""
        pos = positions.long().cpu()
        page, off = pos // self.config.page_size, pos % self.config.page_size
        hot = page >= self.num_cold_pages
        self._sync()
        keys, scales = self.host.token_at(page.clamp(max=self.host.num_pages - 1), off)
        hot_keys, hot_scales = self.dev.token_at(page[hot].to(self.device) % self.config.hot_pages,
                                                 off[hot].to(self.device))
        keys = keys.to(self.device)
        keys.view(torch.uint8)[hot.to(self.device)] = hot_keys.view(torch.uint8)
        if scales is None:
            return keys, None
        scales = scales.to(self.device)
        scales[hot.to(self.device)] = hot_scales
        return keys, scales

    # ---- between turns (hearth.offload.parked) ------------------------------------------------
    def park(self, num_tokens: int) -> ParkedPages:
        """The first num_tokens tokens (whole pages) as a host-only state: the host pool as it is and
        host copies of those pages' summaries (means, mean scales, boxes). This object is dropped
        afterwards."""
        pages = whole_pages(num_tokens, self.config.page_size, self.num_tokens)
        self._sync()  # a later owner gathers pages from the pool on the host: its writes must have landed
        summaries = tuple(None if t is None else t[:pages].to("cpu") for t in (self.means, self.mean_scales, self.box))
        return ParkedPages(self.host, pages, summaries)

    def resume(self, parked: ParkedPages, num_tokens: int) -> None:
        """Continue from a parked state's first num_tokens tokens (whole pages, at most its own) in
        this new object: the host pool becomes this object's, the summaries and the hot pages go back
        to the device; the page cache starts empty."""
        c = self.config
        pages = whole_pages(num_tokens, c.page_size, parked.pages * c.page_size)
        if self.num_tokens:
            raise RuntimeError("only a new tiered-key object can resume a parked state")
        self.host = parked.host
        self._slot_of_page = torch.full((self.host.num_pages,), -1, dtype=torch.long)
        self._grow_summary(pages)
        for mine, saved in zip((self.means, self.mean_scales, self.box), parked.summaries):
            if mine is not None and saved is not None:
                mine[:pages] = saved[:pages].to(self.device)
        ring = torch.arange(max(0, pages - c.hot_pages), pages)
        self.dev.buf[(ring % c.hot_pages).to(self.device)] = self.host.buf[ring].to(self.device)
        self.num_tokens = pages * c.page_size

    # ---- decode -----------------------------------------------------------------------------
    def select(self, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Top-k of one decode query at position num_tokens - 1 (its key already appended).

        q (H, D) float, w (H,) fp32 (scales folded in) -> (1, min(topk, num_tokens)) int64 positions,
        best first, ties toward earlier positions (unsorted with ``fine_kernel``).

        Host syncs: one (the candidate page ids) when the candidates are a subset of the cold pages,
        none when every cold page is a candidate or in a lagged step (``lagged_fetch``); ``exact``
        adds one for the pages left open."""
        c = self.config
        n_cold = self.num_cold_pages
        hot_pages = torch.arange(n_cold, self.num_pages)  # host
        slots = None
        if c.lagged_fetch and self._lag_ready and not self._every_page_a_candidate(n_cold):
            cand, slots, chosen, bound = self._lagged_candidates(q, w, n_cold)
        else:
            cand, chosen, bound = self._candidates(q, w, n_cold)
            self._lag_ready = c.lagged_fetch and not self._every_page_a_candidate(n_cold)
            self._pending = None
        if c.fine_kernel and cand.numel() <= c.cache_pages:  # every candidate resident at once
            sel = self._fine_kernel(q, w, cand, hot_pages, slots)
        else:
            merger = TopkMerger(1, min(c.topk, self.num_tokens), self.device)
            if cand.numel() <= c.cache_pages:  # one pass over candidates and hot pages together
                self._score_pages(q, w, merger, cand, hot_pages, slots)
            else:
                self._score_pages(q, w, merger, torch.zeros(0, dtype=torch.long), hot_pages)
                for i in range(0, cand.numel(), c.cache_pages):
                    self._score_pages(q, w, merger, cand[i:i + c.cache_pages], None)
            if chosen is not None and bound is not None:
                open_pages = ~chosen & (bound >= merger.threshold()[0])  # could still hold a selected token
                if c.exact:
                    extra = open_pages.nonzero().flatten().cpu()
                    self._counts["refined_pages"] += extra.numel()
                    for i in range(0, extra.numel(), c.cache_pages):
                        self._score_pages(q, w, merger, extra[i:i + c.cache_pages], None)
                else:
                    self._uncertified += open_pages.any()
            sel = merger.positions()
        if self._prev is not None and self._prev.shape == sel.shape:
            self._overlap += torch.isin(sel, self._prev).sum()
        self._prev = sel
        self._counts["steps"] += 1
        self._step += 1
        return sel

    def _candidates(self, q: torch.Tensor, w: torch.Tensor,
                    n_cold: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(candidate cold pages (host int64, ascending), chosen mask (P,) bool on the device or None
        when every cold page is a candidate, page bounds (P,) or None)."""
        c = self.config
        if n_cold == 0:
            return torch.zeros(0, dtype=torch.long), None, None
        bound = page_upper_bounds(q, w, self.box[:n_cold]) if c.bounds else None  # (P,)
        if self._every_page_a_candidate(n_cold):
            return torch.arange(n_cold), None, None
        top = self._top_pages(q, w, n_cold, bound)
        return torch.sort(self._read_back(top)).values, self._chosen(top, n_cold, bound), bound

    def _every_page_a_candidate(self, n_cold: int) -> bool:
        """Whether a step scores every cold page (then the selection is exact and needs no sync)."""
        return n_cold == 0 or self.config.candidate_pages >= n_cold or self.num_tokens <= self.config.topk

    def _top_pages(self, q: torch.Tensor, w: torch.Tensor, n_cold: int,
                   bound: torch.Tensor | None) -> torch.Tensor:
        """(C,) device int64: the candidate_pages best cold pages by the coarse ranking, best first."""
        c = self.config
        scales = None if self.mean_scales is None else self.mean_scales[:n_cold]
        rank = bound if c.ranking == "bound" else page_estimates(q, w, self.means[:n_cold], scales)
        return torch.topk(rank, c.candidate_pages).indices

    def _chosen(self, pages: torch.Tensor, n_cold: int, bound: torch.Tensor | None) -> torch.Tensor | None:
        """(P,) bool device mask of the cold pages a step scores exactly (None without bounds)."""
        if bound is None:
            return None
        chosen = torch.zeros(n_cold, dtype=torch.bool, device=self.device)
        chosen[pages] = True
        return chosen

    def _read_back(self, top: torch.Tensor) -> torch.Tensor:
        """This step's candidate ids on the host: the one sync of a synchronous decode step."""
        self._counts["candidate_reads"] += 1
        return top.cpu()

    def _lagged_candidates(self, q: torch.Tensor, w: torch.Tensor,
                           n_cold: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A lagged step: (resident cold pages (host int64), their device slots (host int64), chosen
        mask or None, bounds or None). Ranks the cold pages for the next step and posts the ids to
        the host without waiting for them."""
        self.prefetch()  # no-op when append already did it
        bound = page_upper_bounds(q, w, self.box[:n_cold]) if self.config.bounds else None
        self._post(self._top_pages(q, w, n_cold, bound))
        resident = (self._page_of_slot >= 0).nonzero().flatten()  # host
        pages = self._page_of_slot[resident]
        self._counts["lagged_steps"] += 1
        chosen = self._chosen(to_device(pages, self.device), n_cold, bound) if bound is not None else None
        return pages, resident + self.config.hot_pages, chosen, bound

    def _post(self, top: torch.Tensor) -> None:
        """Start copying candidate ids (device, best first) to the pinned buffer; read next step."""
        self._pending_ids[: top.numel()].copy_(top, non_blocking=self._cuda)
        if self._posted is not None:
            self._posted.record()
        self._pending = top.numel()

    def prefetch(self) -> None:
        """lagged_fetch: fetch the last step's candidates into the page cache (misses from host RAM
        on the side stream; the compute stream waits only before the fine stage). The host waits
        for the last step's id copy, not for any work of the current step."""
        if self._pending is None:
            return
        if self._posted is not None:
            self._posted.synchronize()
        pages = self._pending_ids[: self._pending].clone()  # best first
        self._pending = None
        rank_bonus = torch.arange(pages.numel(), 0, -1)  # among equal steps, evict the worst-ranked first
        self._ensure_resident(pages, rank_bonus, lagged=True)

    def _table(self, cold: torch.Tensor, hot_pages: torch.Tensor | None,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device (slots, pages) int64 of cold pages (made resident unless their slots are given)
        followed by the hot pages: one copy."""
        if slots is None:
            slots = self._ensure_resident(cold) if cold.numel() else cold
        self._await_fetch()  # a lagged fetch lands before any cold slot is read
        pages = cold
        if hot_pages is not None and hot_pages.numel():
            slots = torch.cat((slots, hot_pages % self.config.hot_pages))
            pages = torch.cat((pages, hot_pages))
        both = to_device(torch.stack((slots, pages)), self.device)  # (2, n)
        return both[0], both[1]

    def _score_pages(self, q: torch.Tensor, w: torch.Tensor, merger: TopkMerger, cold: torch.Tensor,
                     hot_pages: torch.Tensor | None, cold_slots: torch.Tensor | None = None) -> None:
        """Score cold pages (host int64, at most cache_pages, through the page cache, or resident in
        cold_slots) and hot pages exactly in one pass."""
        ps = self.config.page_size
        slots, pages = self._table(cold, hot_pages, cold_slots)
        if slots.numel() == 0:
            return
        keys, scales = self.dev.tokens(slots)
        pos = (pages[:, None] * ps + torch.arange(ps, device=self.device)).flatten()  # (n * ps,)
        valid = (pos < self.num_tokens)[None] if hot_pages is not None and hot_pages.numel() else None
        merger.update(exact_scores(q[None], w[None], keys, scales), pos, valid)

    def _fine_kernel(self, q: torch.Tensor, w: torch.Tensor, cold: torch.Tensor, hot_pages: torch.Tensor,
                     cold_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Fine stage with the Triton paged indexer: the device pool is a kernel cache, the table
        lists candidate slots then hot slots (the partial page last), so logical position j of the
        table is token j % page_size of page table[j // page_size]."""
        from hearth.kernels.indexer import indexer_decode_topk

        c, ps = self.config, self.config.page_size
        k = min(c.topk, self.num_tokens)
        slots, pages = self._table(cold, hot_pages, cold_slots)
        n_table = cold.numel() * ps + self.num_tokens - self.num_cold_pages * ps
        lens = torch.full((1,), n_table, dtype=torch.int32, device=self.device)
        qb = q.to(torch.bfloat16).reshape(1, 1, *q.shape).contiguous()  # (1, 1, H, D)
        wb = w.float().reshape(1, 1, -1).contiguous()  # (1, 1, H)
        logical = indexer_decode_topk(qb, wb, self.dev.buf, slots.int()[None], lens, ps, k).view(1, k).long()
        real = pages[(logical // ps).clamp(min=0)] * ps + logical % ps
        return torch.where(logical >= 0, real, torch.full_like(real, -1))

    def _stamp(self, bonus: torch.Tensor | int = 0) -> torch.Tensor | int:
        """Use stamp of a slot used now: later steps above earlier ones, bonus (0..cache_pages + 1)
        orders the slots of one step (eviction takes the lowest stamp)."""
        return self._step * (self.config.cache_pages + 2) + bonus

    def _evict(self, victims: torch.Tensor) -> None:
        """Forget the pages held in slots victims (host int64)."""
        evicted = self._page_of_slot[victims]
        self._counts["evictions"] += int((evicted >= 0).sum())
        self._slot_of_page[evicted[evicted >= 0]] = -1
        self._page_of_slot[victims] = -1

    def _ensure_resident(self, pages: torch.Tensor, bonus: torch.Tensor | None = None,
                         lagged: bool = False) -> torch.Tensor:
        """Device slots holding pages (host int64, at most cache_pages of them), fetching misses (LRU)."""
        hot = self.config.hot_pages
        slot = self._slot_of_page[pages]
        hit = slot >= 0
        miss_pages = pages[~hit]
        self._counts["lookups"] += pages.numel()
        self._counts["hits"] += int(hit.sum())
        self._counts["misses"] += miss_pages.numel()
        if miss_pages.numel():
            age = self._last_used.clone()
            age[slot[hit]] = torch.iinfo(torch.long).max  # never evict what this chunk uses
            victims = torch.topk(age, miss_pages.numel(), largest=False).indices
            self._evict(victims)
            self._fetch(miss_pages, victims + hot, lagged)
            self._slot_of_page[miss_pages] = victims
            self._page_of_slot[victims] = miss_pages
            slot[~hit] = victims
        self._last_used[slot] = self._stamp(0 if bonus is None else bonus)
        return slot + hot

    def _fetch(self, pages: torch.Tensor, slots: torch.Tensor, lagged: bool = False) -> None:
        """Copy host pages into device slots: one host gather into pinned staging + one copy on the
        side stream, which the compute stream then waits for (no host sync unless the staging
        buffer's previous copy or a write-through copy of these pages is still in flight). A lagged
        fetch leaves the wait to _await_fetch, and skips the write-through wait: its pages were cold
        when the last step posted their ids, after their write-through on the same stream."""
        n = pages.numel()
        if self._cuda:
            if not lagged:
                self._written.synchronize()  # the host pool holds the pages
            self._fetched.synchronize()  # the staging buffer's previous copy has finished
        staged = self._staging.buf[:n]
        torch.index_select(self.host.buf, 0, pages, out=staged)
        self._counts["bytes_h2d"] += n * self.config.page_bytes
        if self._copy_stream is None:
            self.dev.buf[slots] = staged.to(self.device)
            return
        dst = to_device(slots, self.device)
        dst.record_stream(self._copy_stream)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # slots no longer read
        with torch.cuda.stream(self._copy_stream):
            self.dev.buf[dst] = staged.to(self.device, non_blocking=True)
            self._fetched.record()
        self._fetch_unawaited = True
        if not lagged:
            self._await_fetch()

    def _await_fetch(self) -> None:
        """Make the compute stream wait for the last fetch (no host wait)."""
        if self._fetch_unawaited:
            torch.cuda.current_stream(self.device).wait_event(self._fetched)
            self._fetch_unawaited = False

    def _sync(self) -> None:
        """Wait for write-through copies before the host reads its pool."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def stats(self) -> dict[str, float]:
        """Counters as a plain dict (reads two device counters: one sync)."""
        s = dict(self._counts)
        s["page_reuse_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["uncertified_steps"] = int(self._uncertified) if self.config.bounds else -1  # -1: not tracked
        k = min(self.config.topk, self.num_tokens)
        s["selection_overlap"] = int(self._overlap) / (k * max(1, s["steps"] - 1)) if k else 0.0
        s["device_bytes"] = self.device_bytes()
        s["host_bytes"] = self.num_pages * self.config.page_bytes
        return s


class KeyStreamer:
    """Two reusable device buffers of chunk_pages pages through which prefill walks key histories."""

    def __init__(self, config: KeyTierConfig, chunk_pages: int, device: torch.device) -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        self.buffers = [PagePool(chunk_pages, c.page_size, c.head_dim, c.key_format, self.device) for _ in range(2)]
        self.chunk_pages = chunk_pages
        self._copy_stream = new_stream(self.device)
        cuda = self.device.type == "cuda"
        self._ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._free = [torch.cuda.Event() if cuda else None for _ in range(2)]

    @property
    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def layers(self, sources: Sequence[tuple[TieredKeys, int]]) -> Iterator[Iterator[KeyChunk]]:
        """Per source [(tiers, history_tokens), ...] an iterator over its history chunks; consume
        each fully before the next. Loads run one chunk ahead, across layer boundaries too."""
        chunks = self._stream(sources)
        for _ in sources:
            yield _until_last(chunks)

    def _stream(self, sources: Sequence[tuple[TieredKeys, int]]) -> Iterator[KeyChunk]:
        # NOTE: a chunk's tensors stay valid until the chunk after it is requested. Which tier a
        # page comes from is decided when it is loaded, so appends between layers are fine.
        tasks = [(i, p) for i, (t, n) in enumerate(sources)
                 for p in range(0, max(1, math.ceil(n / t.config.page_size)), self.chunk_pages)]
        if tasks:
            self._load_host(sources, tasks[0], 0)
        for j, task in enumerate(tasks):
            if j + 1 < len(tasks):
                self._load_host(sources, tasks[j + 1], (j + 1) % 2)  # overlaps the scoring of chunk j
            last = j + 1 == len(tasks) or tasks[j + 1][0] != task[0]
            yield self._finish(sources, task, j % 2, last)
            if self._free[j % 2] is not None:
                self._free[j % 2].record()

    def _pages(self, sources, task) -> tuple[TieredKeys, int, int, int]:
        i, p0 = task
        tiers, n = sources[i]
        p1 = min(p0 + self.chunk_pages, math.ceil(n / tiers.config.page_size))
        return tiers, p0, p1, min(p1, max(p0, tiers.num_cold_pages))

    def _load_host(self, sources, task, b: int) -> None:
        """Copy the chunk's cold pages (contiguous, pinned) to buffer b on the side stream."""
        tiers, p0, _, p_hot = self._pages(sources, task)
        dst = self.buffers[b].buf[: p_hot - p0]
        if self._copy_stream is None:
            dst.copy_(tiers.host.buf[p0:p_hot])
            return
        self._copy_stream.wait_event(self._free[b])
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # write-through copies done
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(tiers.host.buf[p0:p_hot], non_blocking=True)
            self._ready[b].record()

    def _finish(self, sources, task, b: int, last: bool) -> KeyChunk:
        """Wait for buffer b's host part, add its hot pages from the device ring, return the chunk."""
        tiers, p0, p1, p_hot = self._pages(sources, task)
        if self._ready[b] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready[b])
        buf = self.buffers[b]
        if p1 > p_hot:
            ring = torch.arange(p_hot, p1, device=self.device) % tiers.config.hot_pages
            buf.buf[p_hot - p0:p1 - p0] = tiers.dev.buf[ring]
        n = max(0, min(p1 * tiers.config.page_size, sources[task[0]][1]) - p0 * tiers.config.page_size)
        keys, scales = buf.tokens(torch.arange(p1 - p0, device=self.device))
        return KeyChunk(task[0], p0 * tiers.config.page_size, keys[:n], None if scales is None else scales[:n], last)


def _until_last(chunks: Iterator[KeyChunk]) -> Iterator[KeyChunk]:
    for chunk in chunks:
        yield chunk
        if chunk.last:
            return
