"""A request's tiered keys or latents of one layer, parked in host RAM between two turns of a chat.

When a tiered request ends, its tier objects (``tiered_keys.TieredKeys``, ``tiered_latents.TieredLatents``
and the kernel path's ``planned_tiers.PlannedKeys`` / ``PlannedLatents``) give up their device
buffers; what the next turn needs to continue is already in host RAM: the host pool, written
through as tokens arrive. Parking keeps that pool (the same pinned tensor, no copy) and copies the
small device-only part that cannot be rebuilt cheaply, the key pages' summaries, to the host. A new
tier object then ``resume``s from it: the pool becomes its own, the summaries go back to the
device, the hot ring is refilled from the pool, and its device caches start empty.

States cover whole pages only: the partial last page of keys lives in the device ring, and a
chat's next prompt usually re-tokenises the end of the last answer anyway, so the at most
``page_size - 1`` tokens after the last full page are computed again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth.offload.coarse_index import PagePool


def grown_capacity(needed: int) -> int:
    """The capacity a tier's host pool grows to when it must hold ``needed`` rows (pages or tokens):
    the next power of two. From a power of two that is doubling; a pool resumed from a chat file
    (its exact size plus ``headroom``) lands back on a power of two. Powers of two matter beyond the
    amortised copies: the planned tiers' coarse step is compiled per power of two of the pool's pages,
    so an odd capacity is a kernel compiled (seconds) on some request's path and wider rows scored."""
    return 1 << max(0, needed - 1).bit_length()


def headroom(used: int) -> int:
    """Rows (pages or tokens) a state read from a chat file is given beyond its ``used`` ones, so that
    the next turn's tokens fit without growing the pool (a copy of the whole pool, pinned anew, on
    the request path: 0.37 s for a 64K chat of three layers on the H200): an eighth more, at least one."""
    return max(used // 8, 1)


def _nbytes(tensors: tuple[torch.Tensor | None, ...]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


@dataclass(frozen=True)
class ParkedPages:
    """Key pages of one request and layer: the host pool (its first ``pages`` pages are the keys)
    and host copies of those pages' device summaries, in the layout of the tier that parked them."""

    host: PagePool
    pages: int
    summaries: tuple[torch.Tensor | None, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes held: the pool's whole allocation (it grows to powers of two, and a chat read
        from its file has an eighth more room) and the summaries."""
        return _nbytes((self.host.buf, *self.summaries))


@dataclass(frozen=True)
class ParkedRows:
    """Latent rows of one request and layer: the host pool, its first ``rows`` rows written."""

    host: torch.Tensor
    rows: int

    @property
    def nbytes(self) -> int:
        return _nbytes((self.host,))


def whole_pages(num_tokens: int, page_size: int, held: int) -> int:
    """num_tokens as a page count: parked key states cover whole pages, of the held tokens."""
    if num_tokens % page_size or not 0 <= num_tokens <= held:
        raise ValueError(f"a parked key state covers whole pages of {page_size} tokens of the {held} held, "
                         f"not {num_tokens}")
    return num_tokens // page_size
