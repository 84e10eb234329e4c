"""Tiered MLA latents of one request and layer (HiSparse-style hot buffer over a host pool).

The host pool (pinned on CUDA) holds every latent row ever written (``width`` values per token,
e.g. 576 bf16 = 512 latent + 64 rope, or 656 uint8 bytes of the FP8 format), indexed by position.
The device keeps ``hot_rows`` rows keyed by position. ``gather(positions)`` returns the rows of
one decode step's selection: resident rows are reused, missing ones are gathered on the host into
a pinned staging buffer and copied in one transfer (on a side stream, ordered by an event), into
slots freed by LRU eviction that never evicts a row selected in the same step. ``append`` backs
new rows up to the host as they are written and also places them in the hot buffer (a new token
is very likely selected by the next steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth.offload.coarse_index import new_stream, to_device
from hearth.offload.parked import ParkedRows, grown_capacity


@dataclass(frozen=True)
class LatentTierConfig:
    """Per (request, layer) tiering of MLA latent rows."""

    width: int = 576
    dtype: torch.dtype = torch.bfloat16
    hot_rows: int = 4096  # device rows; must hold one step's selection (index_topk) plus new rows

    def __post_init__(self) -> None:
        if self.width < 1 or self.hot_rows < 1:
            raise ValueError(f"width and hot_rows must be >= 1, got {self.width}, {self.hot_rows}")

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def device_bytes(self) -> int:
        return self.hot_rows * self.row_bytes

    @classmethod
    def from_budget(cls, device_bytes: int, width: int = 576, dtype: torch.dtype = torch.bfloat16) -> LatentTierConfig:
        """As many hot rows as device_bytes holds."""
        return cls(width=width, dtype=dtype, hot_rows=max(1, device_bytes // (width * dtype.itemsize)))


class TieredLatents:
    """Latent rows of one request and layer across a device hot buffer and a host pool."""

    def __init__(self, config: LatentTierConfig, device: torch.device, initial_rows: int = 4096) -> None:
        c = self.config = config
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.host = torch.zeros(initial_rows, c.width, dtype=c.dtype, pin_memory=self._cuda)  # (cap, W)
        self.hot = torch.zeros(c.hot_rows, c.width, dtype=c.dtype, device=self.device)  # (S, W)
        self._staging = torch.zeros(c.hot_rows, c.width, dtype=c.dtype, pin_memory=self._cuda)
        self._slot_of_pos = torch.full((initial_rows,), -1, dtype=torch.long)
        self._pos_of_slot = torch.full((c.hot_rows,), -1, dtype=torch.long)
        self._last_used = torch.full((c.hot_rows,), -1, dtype=torch.long)
        self._copy_stream = new_stream(self.device)
        self._copied = torch.cuda.Event() if self._cuda else None  # staging -> hot buffer copy done
        self._written = torch.cuda.Event() if self._cuda else None  # backups to the host pool done
        self.num_tokens = 0
        self._step = 0
        self._counts = {"steps": 0, "lookups": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes_h2d": 0,
                        "bytes_d2h": 0}

    def _grow(self, rows: int) -> None:
        if rows <= self.host.shape[0]:
            return
        cap = grown_capacity(rows)
        self._sync()
        host = torch.zeros(cap, self.config.width, dtype=self.config.dtype, pin_memory=self._cuda)
        host[: self.num_tokens] = self.host[: self.num_tokens]
        self.host = host
        slot = torch.full((cap,), -1, dtype=torch.long)
        slot[: self._slot_of_pos.shape[0]] = self._slot_of_pos
        self._slot_of_pos = slot

    def append(self, rows: torch.Tensor) -> None:
        """Write the next n tokens' rows (n, W) (device): backed up to the host, kept hot."""
        n = rows.shape[0]
        if n == 0:
            return
        first = self.num_tokens
        self._grow(first + n)
        self.host[first:first + n].copy_(rows, non_blocking=True)  # ordered on the current stream
        if self._written is not None:
            self._written.record()
        self._counts["bytes_d2h"] += n * self.config.row_bytes
        self.num_tokens = first + n
        keep = min(n, self.config.hot_rows)
        positions = torch.arange(first + n - keep, first + n)
        slots = self._claim(positions, protected=torch.zeros(0, dtype=torch.long))
        self.hot[to_device(slots, self.device)] = rows[n - keep:].to(self.config.dtype)

    def park(self, num_tokens: int) -> ParkedRows:
        """The first num_tokens rows as a host-only state (the host pool as it is); this object is
        dropped afterwards."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot park {num_tokens} rows of {self.num_tokens}")
        self._sync()  # a later owner gathers rows from the pool on the host: its writes must have landed
        return ParkedRows(self.host, num_tokens)

    def resume(self, parked: ParkedRows, num_tokens: int) -> None:
        """Continue from a parked state's first num_tokens rows in this new object: the host pool
        becomes this object's; the hot buffer starts empty (a step's misses come from the pool)."""
        if self.num_tokens or num_tokens > parked.rows:
            raise RuntimeError(f"cannot resume {num_tokens} of {parked.rows} parked rows in a used latent tier")
        self.host = parked.host
        self._slot_of_pos = torch.full((self.host.shape[0],), -1, dtype=torch.long)
        self.num_tokens = num_tokens

    def _claim(self, positions: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """Slots for new positions (host int64), evicting least recently used unprotected rows."""
        age = self._last_used.clone()
        age[protected] = torch.iinfo(torch.long).max
        n_free = int((age < torch.iinfo(torch.long).max).sum())
        if positions.numel() > n_free:
            raise ValueError(f"hot buffer of {self.config.hot_rows} rows cannot hold {positions.numel()} more rows "
                             f"next to {protected.numel()} in use: raise hot_rows above index_topk")
        slots = torch.topk(age, positions.numel(), largest=False).indices
        old = self._pos_of_slot[slots]
        self._counts["evictions"] += int((old >= 0).sum())
        self._slot_of_pos[old[old >= 0]] = -1
        self._slot_of_pos[positions] = slots
        self._pos_of_slot[slots] = positions
        self._last_used[slots] = self._step
        return slots

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of one step's selection: positions (k,) int64 (-1 = none) -> (rows (k, W) on the
        device, zero where -1; positions (k,) on the device). Misses are fetched (one host sync)."""
        slots = self.slots(positions)
        rows = torch.where((slots >= 0)[:, None], self.hot[slots.clamp(min=0)],
                           torch.zeros((), dtype=self.config.dtype, device=self.device))
        return rows, positions.to(self.device)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Hot-buffer slots of one step's selection, fetching misses: positions (k,) int64 (-1 =
        none) -> (k,) int64 slots on the device (-1 where -1), valid until the next call. A kernel can
        read ``hot`` through them directly (no copy of the selected rows). One host sync (positions)."""
        pos = positions.long().cpu()
        valid = pos >= 0
        if bool((pos[valid] >= self.num_tokens).any()):
            raise ValueError(f"position past the {self.num_tokens} written tokens")
        wanted = torch.unique(pos[valid])
        slot = self._slot_of_pos[wanted]
        hit = slot >= 0
        misses = wanted[~hit]
        self._counts["lookups"] += wanted.numel()
        self._counts["hits"] += int(hit.sum())
        self._counts["misses"] += misses.numel()
        self._last_used[slot[hit]] = self._step
        if misses.numel():
            self._fetch(misses, self._claim(misses, protected=slot[hit]))
        slots = torch.where(valid, self._slot_of_pos[pos.clamp(min=0)], -1)
        self._counts["steps"] += 1
        self._step += 1
        return to_device(slots, self.device)

    def _fetch(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One host gather into pinned staging + one copy into the hot buffer on the side stream,
        which the compute stream then waits for."""
        n = positions.numel()
        if self._cuda:
            self._written.synchronize()  # the host pool holds every backed-up row
            self._copied.synchronize()  # the staging buffer's previous copy has finished
        staged = self._staging[:n]
        torch.index_select(self.host, 0, positions, out=staged)
        self._counts["bytes_h2d"] += n * self.config.row_bytes
        if self._copy_stream is None:
            self.hot[slots] = staged.to(self.device)
            return
        dst = to_device(slots, self.device)
        dst.record_stream(self._copy_stream)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # evicted slots no longer read
        with torch.cuda.stream(self._copy_stream):
            self.hot[dst] = staged.to(self.device, non_blocking=True)
            self._copied.record()
        torch.cuda.current_stream(self.device).wait_event(self._copied)

    def _sync(self) -> None:
        """Backups and the previous staging copy must finish before the host pool / staging is used."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
            self._copied.synchronize()

    def read(self, positions: torch.Tensor) -> torch.Tensor:
        """Exact rows of any written positions (n,) from the host pool: (n, W) on the device."""
        self._sync()
        return self.host[positions.long().cpu()].to(self.device)

    def stats(self) -> dict[str, float]:
        """Counters as a plain dict."""
        s = dict(self._counts)
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["device_bytes"] = self.config.device_bytes
        s["host_bytes"] = self.num_tokens * self.config.row_bytes
        return s
