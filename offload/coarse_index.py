"""Coarse-to-fine indexer scoring: key pages in their original format, compact page summaries,
their safe upper bounds, exact scores and a running exact top-k with the engine's tie-break.

Compact form (``summarize_pages``): the mean key of every ``group`` tokens (default 16: four bf16
rows, 1 KB per page of 64 tokens against 8448 B of FP8 keys) ranks pages by the best score of their
means; ``quantize_means`` stores them as e4m3 with one fp32 scale per mean (528 B per page: 16x
smaller than the page, and it ranks as well as bf16 on the long-context bench's clustered keys).
Optionally a per-page per-dimension box gives an exact-safe bound (below).

Page format (``PagePool``): "fp8" pages are the 132-byte-per-token paged indexer-cache layout of
``hearth.kernels.indexer`` (``page_size * 128`` e4m3 bytes token-major, then ``page_size`` fp32
scales), so a pool row is one kernel cache block; "bf16" / "fp32" pages hold plain keys (scale 1).

Bound. Indexer score of a token (DSA, ``Indexer._select``): ``I(t) = s_t * sum_h w_h * relu(q_h . k_t)``
with ``s_t > 0`` the key's FP8 scale (1 for bf16/fp32 keys). For a page whose dequantised keys
``x_t = s_t * k_t`` lie in a per-dimension box ``[lo, hi]``, ``q_h . x`` over the box is at most
``u_h = q+_h . hi + q-_h . lo`` and at least ``l_h = q+_h . lo + q-_h . hi`` (``q+``/``q-`` the
positive/negative parts), so ``I(t) <= sum_h max(w_h, 0) relu(u_h) + min(w_h, 0) relu(l_h)``.
Boxes are stored in bf16 rounded outward and a relative slack covers fp32 rounding, so the bound
is never below a computed exact score: pages whose bound is below the k-th exact score cannot
hold a selected token (that is how a selection is certified exact). Measured: in 128 dimensions the
box is loose, so the bound ranks pages far worse than the means and rarely certifies long contexts.

Selection order (matches ``Indexer._select``): score descending, ties toward earlier positions,
causally masked keys never selected, ``-1`` padding. Implemented with one int64 key per token,
``order(score) << 32 | (2^32 - 1 - position)``, so ``torch.topk`` on it is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

KEY_FORMATS = ("fp8", "bf16", "fp32")
_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_INVALID = torch.iinfo(torch.int64).min
_POS_MASK = 0xFFFFFFFF
_BOUND_SLACK = 1e-4  # relative to sum_h |w_h| sum_d |q_hd| max|x_d|: far above fp32 rounding
_SCORE_BUDGET = 1 << 24  # elements of one (queries, heads, tokens) score block


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A side stream for copies on CUDA; None elsewhere (copies are then synchronous)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a stream sync: a pageable copy would wait for the stream,
    so on CUDA it goes through a pinned block of the caching host allocator (reused only once the
    copy has finished)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class PagePool:
    """``num_pages`` pages of keys in their original format in one tensor ``buf`` (one row a page)."""

    def __init__(self, num_pages: int, page_size: int, head_dim: int, fmt: str, device: torch.device,
                 pin: bool = False) -> None:
        self.page_size, self.head_dim, self.fmt = page_size, head_dim, fmt
        self.buf = self._alloc(num_pages, torch.device(device), pin)

    @staticmethod
    def bytes_per_page(page_size: int, head_dim: int, fmt: str) -> int:
        if fmt == "fp8":
            return page_size * (head_dim + 4)
        return page_size * head_dim * _PLAIN_DTYPES[fmt].itemsize

    def _alloc(self, num_pages: int, device: torch.device, pin: bool) -> torch.Tensor:
        if self.fmt == "fp8":
            shape, dtype = (num_pages, self.page_size * (self.head_dim + 4)), torch.uint8
        else:
            shape, dtype = (num_pages, self.page_size * self.head_dim), _PLAIN_DTYPES[self.fmt]
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    @property
    def num_pages(self) -> int:
        return int(self.buf.shape[0])

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def grow(self, num_pages: int) -> None:
        """Reallocate to num_pages pages, keeping the content."""
        new = self._alloc(num_pages, self.buf.device, self.buf.is_pinned())
        new[: self.num_pages] = self.buf
        self.buf = new

    def _raw(self) -> torch.Tensor:
        """(P, page_size, D) key storage (uint8 bytes of the e4m3 values for fp8)."""
        p, ps, d = self.num_pages, self.page_size, self.head_dim
        if self.fmt != "fp8":
            return self.buf.view(p, ps, d)
        return self.buf.as_strided((p, ps, d), (ps * (d + 4), d, 1))

    def _scales(self) -> torch.Tensor:
        """(P, page_size) fp32 scales of an fp8 pool (a view into buf)."""
        ps, row = self.page_size, self.page_size * (self.head_dim + 4) // 4
        words = self.buf.view(torch.float32)  # (buf may be a view of whole pages: keep its offset)
        return words.as_strided((self.num_pages, ps), (row, 1), words.storage_offset() + ps * self.head_dim // 4)

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              scales: torch.Tensor | None) -> None:
        """Store tokens: pages/offsets (n,) int64, keys (n, D) stored dtype, scales (n,) for fp8."""
        if self.fmt == "fp8":
            self._raw()[pages, offsets] = keys.view(torch.uint8)
            self._scales()[pages, offsets] = scales.float()
        else:
            self._raw()[pages, offsets] = keys.to(self.buf.dtype)

    def write_run(self, page: int, offset: int, keys: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Store n consecutive tokens from offset within one page (slices: no index tensors)."""
        n = keys.shape[0]
        if self.fmt == "fp8":
            self._raw()[page, offset:offset + n] = keys.view(torch.uint8)
            self._scales()[page, offset:offset + n] = scales.float()
        else:
            self._raw()[page, offset:offset + n] = keys.to(self.buf.dtype)

    def tokens(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys of whole pages (n,) int64: ((n * page_size, D) stored dtype, (n * page_size,) or None)."""
        keys = self._raw()[pages].reshape(-1, self.head_dim)
        if self.fmt != "fp8":
            return keys, None
        return keys.view(torch.float8_e4m3fn), self._scales()[pages].reshape(-1)

    def token_at(self, pages: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys of single tokens: ((n, D), (n,) or None)."""
        keys = self._raw()[pages, offsets]
        if self.fmt != "fp8":
            return keys, None
        return keys.view(torch.float8_e4m3fn), self._scales()[pages, offsets]

    def dequantized(self, pages: torch.Tensor) -> torch.Tensor:
        """(n, page_size, D) fp32 keys times their scales."""
        keys, scales = self.tokens(pages)
        x = keys.float() if scales is None else keys.float() * scales[:, None]
        return x.view(-1, self.page_size, self.head_dim)


def summarize_pages(x: torch.Tensor, group: int, bounds: bool) -> torch.Tensor:
    """Compact form of full pages: x (P, page_size, D) dequantised keys -> (P, R, D) bf16 with
    R = 2 * bounds + page_size // group rows: [lo, hi] (rounded outward, so the box still holds
    every key) when bounds, then the mean key of each run of ``group`` tokens."""
    xf = x.float()
    n_pages, ps, dim = xf.shape
    means = xf.view(n_pages, ps // group, group, dim).mean(dim=2).to(torch.bfloat16)  # (P, G, D)
    if not bounds:
        return means
    lo, hi = xf.amin(dim=1), xf.amax(dim=1)  # (P, D)
    lo_b, hi_b = lo.to(torch.bfloat16), hi.to(torch.bfloat16)
    lo_b = torch.where(lo_b.float() > lo, torch.nextafter(lo_b, torch.full_like(lo_b, -float("inf"))), lo_b)
    hi_b = torch.where(hi_b.float() < hi, torch.nextafter(hi_b, torch.full_like(hi_b, float("inf"))), hi_b)
    return torch.cat((lo_b[:, None], hi_b[:, None], means), dim=1)


def quantize_means(means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 compact form of group means: (P, G, D) float -> ((P, G, D) e4m3, (P, G) fp32 scales),
    one absmax scale per mean (its largest entry maps to 448, the e4m3 maximum)."""
    mf = means.float()
    scale = mf.abs().amax(dim=-1).clamp(min=1e-30) / 448.0  # (P, G)
    return (mf / scale[..., None]).to(torch.float8_e4m3fn), scale


def page_upper_bounds(q: torch.Tensor, w: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """Upper bound of every token's score per page: q (H, D), w (H,), summary (P, R, D) with the
    box in rows 0 and 1 -> (P,) fp32."""
    qf, wf = q.float(), w.float()
    lo, hi = summary[:, 0].float(), summary[:, 1].float()  # (P, D)
    qp, qn = qf.clamp(min=0), qf.clamp(max=0)  # (H, D)
    upper = hi @ qp.T + lo @ qn.T  # (P, H) max of q_h . x over the box
    lower = lo @ qp.T + hi @ qn.T  # (P, H) min
    bound = upper.relu() @ wf.clamp(min=0) + lower.relu() @ wf.clamp(max=0)  # (P,)
    mag = torch.maximum(lo.abs(), hi.abs()) @ qf.abs().T @ wf.abs()  # (P,)
    return bound + _BOUND_SLACK * mag


def page_estimates(q: torch.Tensor, w: torch.Tensor, means: torch.Tensor,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """Estimated best score of each page (a ranking, not a bound): the best indexer score of its
    group means. q (H, D), w (H,), means (P, G, D) any float dtype, scales (P, G) fp32 of
    ``quantize_means`` or None -> (P,) fp32."""
    n_pages, groups, dim = means.shape
    s = (means.reshape(-1, dim).float() @ q.float().T).relu() @ w.float()  # (P * G,)
    if scales is not None:  # relu(s x) = s relu(x) for s > 0: the scale applies after the head sum
        s = s * scales.reshape(-1)
    return s.view(n_pages, groups).amax(dim=1)


def exact_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Exact indexer scores, the op order of ``Indexer._select`` (then times the FP8 scale).

    q (Q, H, D), w (Q, H) fp32, keys (T, D) any float dtype (raw e4m3 values when scaled),
    scales (T,) fp32 or None -> (Q, T) fp32."""
    kf = keys.float()
    qf = q.float()
    n_q, heads = qf.shape[0], qf.shape[1]
    chunk = max(1, _SCORE_BUDGET // max(1, heads * kf.shape[0]))
    out = torch.cat([
        torch.einsum("qhd,td->qht", qf[i:i + chunk], kf).relu_().mul_(w[i:i + chunk, :, None]).sum(1)
        for i in range(0, n_q, chunk)
    ])  # (Q, T)
    return out if scales is None else out * scales[None, :]


def order_keys(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """int64 keys whose descending order is (score desc, position asc): scores (Q, T) fp32,
    positions (T,) int64 < 2^32, valid (Q, T) bool or None -> (Q, T) int64; invalid = int64 min."""
    # NOTE: + 0.0 turns -0.0 into +0.0: sort treats them as equal, the bit order would not
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)
    okey = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # signed order == float order
    key = (okey << 32) | (_POS_MASK - positions.long())[None, :]
    return key if valid is None else key.masked_fill(~valid, _INVALID)


def key_positions(keys: torch.Tensor) -> torch.Tensor:
    """Positions of order keys (-1 for invalid): same shape, int64."""
    pos = _POS_MASK - (keys & _POS_MASK)
    return torch.where(keys == _INVALID, torch.full_like(pos, -1), pos)


def key_scores(keys: torch.Tensor) -> torch.Tensor:
    """Scores of order keys (-inf for invalid): same shape, fp32."""
    okey = (keys >> 32).int()
    bits = okey ^ ((okey >> 31) & 0x7FFFFFFF)
    s = bits.view(torch.float32)
    return torch.where(keys == _INVALID, torch.full_like(s, -float("inf")), s)


class TopkMerger:
    """Running exact top-k of Q queries over token chunks (the partition-merge top-k): keeps (Q, k)
    int64 order keys, so only one chunk of scores exists at a time."""

    def __init__(self, num_queries: int, k: int, device: torch.device) -> None:
        self.k = k
        self.keys = torch.full((num_queries, k), _INVALID, dtype=torch.int64, device=device)  # (Q, k)

    def update(self, scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Merge a chunk: scores (Q, T), positions (T,) int64, valid (Q, T) bool or None."""
        if scores.shape[1] == 0 or self.k == 0:
            return
        both = torch.cat((self.keys, order_keys(scores, positions, valid)), dim=1)  # (Q, k + T)
        self.keys = torch.topk(both, self.k, dim=1, sorted=True).values

    def threshold(self) -> torch.Tensor:
        """(Q,) fp32 score of the k-th entry; -inf while fewer than k valid entries are held."""
        if self.k == 0:
            return torch.full((self.keys.shape[0],), -float("inf"), device=self.keys.device)
        return key_scores(self.keys[:, -1])

    def positions(self) -> torch.Tensor:
        """(Q, k) int64 selected positions, best first, -1 padded."""
        return key_positions(self.keys)


@dataclass
class KeyChunk:
    """A run of one layer's key history: positions ``[first_position, first_position + n)``."""

    layer: int  # index into the sources given to the streamer
    first_position: int
    keys: torch.Tensor  # (n, D) stored dtype (raw e4m3 values for FP8 keys)
    scales: torch.Tensor | None  # (n,) fp32, None for bf16/fp32 keys
    last: bool = True  # the layer's last chunk


def select_prefill(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor | None,
                   first_position: int, topk: int, history: Iterable[KeyChunk]) -> torch.Tensor:
    """Exact top-k of a prefill chunk over streamed history plus the chunk's own keys.

    q (T, H, D), w (T, H) fp32, keys (T, D) / scales (T,) the chunk's keys (already part of the
    request, query i at position first_position + i), history: chunks covering positions
    [0, first_position). Returns (T, min(topk, first_position + T)) int64 as ``Indexer._select``."""
    n_q = q.shape[0]
    merger = TopkMerger(n_q, min(topk, first_position + n_q), q.device)
    for chunk in history:
        n = chunk.keys.shape[0]
        pos = torch.arange(chunk.first_position, chunk.first_position + n, device=q.device)
        merger.update(exact_scores(q, w, chunk.keys, chunk.scales), pos)  # all before every query
    pos = torch.arange(first_position, first_position + n_q, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # (T, T)
    merger.update(exact_scores(q, w, keys, scales), pos, causal)
    return merger.positions()
