"""Plain-torch reference and validity check for the row-wise top-k used by DSA (indices only, unsorted,
-1 padding when a row has fewer than k valid entries)."""

from __future__ import annotations

import torch

from hearth.kernels.topk.one_launch import FINE_LO


def topk_ref(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, N] float, lengths [R] int (entries t < lengths[r] are valid) -> int32 [R, k] indices
    of the k largest valid entries (torch.topk order), -1 where the row has fewer than k entries."""
    r, n = scores.shape
    t = torch.arange(n, device=scores.device)
    valid = t[None, :] < lengths[:, None].long()
    kk = min(k, n)
    key = scores.float().masked_fill(~valid, float("-inf"))
    _, idx = torch.sort(key, dim=1, descending=True, stable=True)
    # NOTE: a valid -inf entry must still rank before padding: stable re-sort on validity
    _, reorder = torch.sort((~valid.gather(1, idx)).to(torch.int8), dim=1, stable=True)
    idx = idx.gather(1, reorder)[:, :kk]
    out = torch.full((r, k), -1, dtype=torch.int32, device=scores.device)
    keep = torch.arange(kk, device=scores.device)[None, :] < lengths.long().clamp(0, kk)[:, None]
    out[:, :kk] = torch.where(keep, idx, -1).int()
    return out


def check_topk(idx: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Assert idx [R, k] is a valid exact top-k of scores [R, N] under lengths [R] (any tie order).

    Per row: exactly min(L, k) distinct indices in [0, L), the rest -1, and the multiset of their
    scores equals the min(L, k) largest valid scores."""
    assert idx.dtype == torch.int32 and idx.shape == (scores.shape[0], k), (idx.dtype, idx.shape)
    idx, scores, lengths = idx.cpu().long(), scores.cpu().float(), lengths.cpu().long()
    for r in range(scores.shape[0]):
        n_valid = min(int(lengths[r]), scores.shape[1])
        want = min(n_valid, k)
        row = idx[r]
        sel = row[row >= 0]
        assert sel.numel() == want, f"row {r}: {sel.numel()} indices, want {want}"
        assert int((row == -1).sum()) == k - want, f"row {r}: {int((row == -1).sum())} pads, want {k - want}"
        assert sel.unique().numel() == want, f"row {r}: duplicate indices"
        assert bool((sel < n_valid).all()), f"row {r}: index past the valid length {n_valid}"
        got = scores[r, sel].sort(descending=True).values
        ref = scores[r, :n_valid].sort(descending=True).values[:want]
        assert torch.equal(got, ref), f"row {r}: selected scores are not the top-{want}"


def order_key_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of `float_order_key`: int32 keys whose signed order is the float order (-0 before +0)."""
    bits = x.float().contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def fine_bin_ref(key: torch.Tensor) -> torch.Tensor:
    """Torch twin of the one-launch select's first digit `fine_bin` (of order keys)."""
    u = key >> 21
    mag = (torch.where(u >= 0, u, -1 - u) - FINE_LO).clamp(1, 127)
    mag = torch.where((key == 0) | (key == -1), 0, mag)  # +0 and -0 alone
    return torch.where(u >= 0, 128 + mag, 127 - mag)


def shares_prefix_ref(bins: torch.Tensor) -> torch.Tensor:
    """Torch twin of `one_launch._shares_prefix`: whether a bin holds one quarter binade (not an edge bin)."""
    mag = torch.where(bins >= 128, bins - 128, 127 - bins)
    return (mag > 1) & (mag < 127)


def sample_positions_ref(n: int, sample: int) -> torch.Tensor:
    """The row positions below n whose keys a 1-in-``sample`` first histogram counts (``one_launch.sample_position``):
    one of each run of ``sample``, at an offset from a multiplicative hash of the run's number."""
    j = torch.arange((n + sample - 1) // sample, dtype=torch.int64)
    h = (j * 0x9E3779B1) & 0xFFFFFFFF  # the kernel's wrapping int32 product, as unsigned bits
    pos = j * sample + ((h >> (32 - (sample.bit_length() - 1))) & (sample - 1))
    return pos[pos < n]
