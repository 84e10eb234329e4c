"""Group routed (token, k) pairs by expert slot on the device, padded to the kernel's block size.

No host synchronisation: every size is an upper bound known from the input shapes, and blocks past
the real end are marked with slot -1 so the kernel programs that get them exit at once.
"""

from __future__ import annotations

import torch


def max_blocks(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on sum_s ceil(count_s / block_m) over the slots in use."""
    return num_pairs // block_m + min(num_slots, num_pairs)


def group_by_slot(slot_ids: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened pairs of ``slot_ids`` [T, K] (values in [0, S) or -1 = skip) by slot.

    Returns ``sorted_pairs`` [NB * block_m] int32 (pair index t*K + k, or T*K for padding) and
    ``block_slot`` [NB] int32 (the slot of each block of ``block_m`` rows, -1 past the end), where
    NB = :func:`max_blocks`. Each slot's pairs start on a block boundary, in token order.
    """
    device = slot_ids.device
    flat = slot_ids.reshape(-1).long()  # (TK,)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_slots, block_m)
    key = torch.where(flat >= 0, flat, num_slots)  # skipped pairs go to bucket S
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # (S+1,) scatter_add: bincount would sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_slots:].zero_()  # (not `= 0`: a host scalar copy, which a CUDA graph cannot capture)
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)  # (TK,)
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_key]
    dump = num_blocks * block_m  # skipped pairs are written past the end, then cut off
    dest = torch.where(sorted_key < num_slots, pad_start[sorted_key] + rank, dump)
    sorted_pairs = torch.full((dump + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_first_row = torch.arange(num_blocks, device=device) * block_m
    block_slot = torch.searchsorted(pad_end[:num_slots].contiguous(), block_first_row, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1).to(torch.int32)
    return sorted_pairs[:dump], block_slot
