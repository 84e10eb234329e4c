"""A decode token's write-through from a tiered cache's device ring to its pinned host pool, one
launch each, every index computed in the kernel from the token's position on the device (no host
value, so a CUDA graph replays the same launch at every position).

``write_through_page`` (tiered indexer keys, pages in the 132-byte-per-token indexer-cache layout of
``hearth.kernels.indexer``): when the token fills its page (position p, page ``p // page_size`` in
ring row ``page % hot_pages``), the ring page is stored to host row ``page`` and the page's summary
is written: the mean of every ``group`` dequantised keys, as e4m3 with one fp32 absmax scale
(largest entry -> 448), at summary index ``page * groups + g`` of a summary pool in the same layout
with ``group`` entries a block. A token that leaves its page partial writes nothing: only full pages
are ever read from the host pool or scored by their summaries (the partial page lives in the ring).

The summary equals ``hearth.offload.coarse_index``'s torch path (``PagePool.dequantized``, the mean
over each group, ``quantize_means``) bit for bit where the group's fp32 sum is exact: every key is
an e4m3 value times its token's power-of-two scale, so the sum is exact in any order while a
group's token scales span at most 4x (the sum then stays below 2^24 units of its smallest
scale's 2^-9). Beyond that the kernel adds the tokens in order, as torch does on the CPU; a
reduction in another order (torch on CUDA) may differ by an fp32 rounding, which can move an e4m3
value by one step. Divisions are correctly rounded (``div_rn``), as torch's.

``write_row`` (tiered latents): a row into ring row ``p % ring`` of the device buffer and host row p.

The host pool is pinned memory mapped into the device's address space and is stored to in place
(zero-copy; see ``hearth.kernels.tiered.residency``); under ``TRITON_INTERPRET=1`` every buffer is
an ordinary CPU tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hearth.kernels._utils import FP8_MAX, check_tensor, e4m3_encode, is_power_of_two, require
from hearth.kernels.tiered.residency import row_words

KEY_DIM = 128
E4M3_MAX = tl.constexpr(FP8_MAX)
SCALE_FLOOR = tl.constexpr(1e-30)  # the smallest absmax a summary scale divides (an all-zero mean)


@triton.jit
def _page_write_kernel(
    pos_ptr,
    ring_u8_ptr,
    ring_f32_ptr,
    host_u8_ptr,
    host_f32_ptr,
    means_u8_ptr,
    means_f32_ptr,
    hot_pages,
    PS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
):
    """Program g: tokens [g * GROUP, (g + 1) * GROUP) of the page the token at pos_ptr fills, to the
    host row and summary g (module doc); nothing while the page stays partial."""
    i_g = tl.program_id(0)
    pos = tl.load(pos_ptr).to(tl.int64)
    if (pos + 1) % PS == 0:
        ROW: tl.constexpr = PS * (D + 4)  # bytes of a page: PS * D e4m3 bytes, then PS fp32 scales
        page = pos // PS
        src = (page % hot_pages) * ROW
        dst = page * ROW
        o_d = tl.arange(0, D)
        acc = tl.zeros([D], dtype=tl.float32)
        for t in tl.static_range(GROUP):  # token order: the sum of torch's CPU reduction
            tok = i_g * GROUP + t
            b_k = tl.load(ring_u8_ptr + src + tok * D + o_d)
            b_s = tl.load(ring_f32_ptr + (src + PS * D) // 4 + tok)
            tl.store(host_u8_ptr + dst + tok * D + o_d, b_k)
            tl.store(host_f32_ptr + (dst + PS * D) // 4 + tok, b_s)
            acc += b_k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s  # exact product (power-of-two s)
        b_mean = acc * (1.0 / GROUP)  # exact: GROUP is a power of two
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(b_mean), 0), SCALE_FLOOR), E4M3_MAX)
        b_y = tl.math.div_rn(b_mean, scale)
        b_code = e4m3_encode(tl.minimum(tl.maximum(b_y, -E4M3_MAX), E4M3_MAX)).to(tl.uint8)
        MROW: tl.constexpr = GROUP * (D + 4)  # bytes of a summary block of GROUP means
        idx = page * (PS // GROUP) + i_g
        blk, off = idx // GROUP, idx % GROUP
        tl.store(means_u8_ptr + blk * MROW + off * D + o_d, b_code)
        tl.store(means_f32_ptr + (blk * MROW + GROUP * D) // 4 + off, scale)


@triton.jit
def _row_write_kernel(row_ptr, pos_ptr, dev_ptr, host_ptr, ring, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Program j: words [j * BLOCK, (j + 1) * BLOCK) of the row into ring row pos % ring and host row pos."""
    o_w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_w = o_w < ROW
    pos = tl.load(pos_ptr).to(tl.int64)
    b_w = tl.load(row_ptr + o_w, mask=m_w)
    tl.store(dev_ptr + (pos % ring) * ROW + o_w, b_w, mask=m_w)
    tl.store(host_ptr + pos * ROW + o_w, b_w, mask=m_w)


def _check_host(host: torch.Tensor, dev: torch.Tensor) -> None:
    if dev.is_cuda:
        require(host.device.type == "cpu" and host.is_pinned(), "the host pool must be pinned CPU memory")


def _check_position(position: torch.Tensor, device: torch.device) -> None:
    check_tensor("position", position, dtypes=(torch.int32, torch.int64), shape=(1,), device=device)


def write_through_page(ring: torch.Tensor, host: torch.Tensor, means: torch.Tensor, position: torch.Tensor,
                       page_size: int, hot_pages: int, group: int = 16) -> None:
    """When the token at position fills its page, store the ring page to the host pool and write the
    page's group means into the summary pool (module doc). ring: uint8 [>= hot_pages, page_size * 132]
    (page p in row p % hot_pages), host: uint8 [> page, page_size * 132] (pinned CPU memory on CUDA),
    means: uint8 [> page * groups / group, group * 132] (summary i in block i // group, entry
    i % group), position: (1,) int32/int64 on the ring's device. One launch of page_size // group
    programs. No host sync."""
    require(is_power_of_two(group) and page_size % group == 0, f"need a power-of-two group dividing page_size, "
                                                              f"got {group} and {page_size}")
    require(hot_pages >= 1, f"hot_pages must be >= 1, got {hot_pages}")
    check_tensor("ring", ring, dtypes=(torch.uint8,), shape=(None, page_size * (KEY_DIM + 4)))
    check_tensor("host", host, dtypes=(torch.uint8,), shape=(None, page_size * (KEY_DIM + 4)))
    check_tensor("means", means, dtypes=(torch.uint8,), shape=(None, group * (KEY_DIM + 4)), device=ring.device)
    require(ring.shape[0] >= hot_pages, f"the ring has {ring.shape[0]} pages, fewer than hot_pages ({hot_pages})")
    _check_position(position, ring.device)
    _check_host(host, ring)
    _page_write_kernel[(page_size // group,)](
        position, ring, ring.view(torch.float32), host, host.view(torch.float32), means, means.view(torch.float32),
        hot_pages, PS=page_size, GROUP=group, D=KEY_DIM, num_warps=1,
    )


def write_row(row: torch.Tensor, position: torch.Tensor, dev: torch.Tensor, ring: int, host: torch.Tensor) -> None:
    """dev[position % ring] = host[position] = row[0]: row (1, width), dev [>= ring, width], host
    [> position, width] (pinned CPU memory on CUDA) of one dtype, contiguous; position (1,)
    int32/int64 on the device. One launch. No host sync."""
    require(row.shape[0] == 1 and row.dtype == dev.dtype == host.dtype and row.shape[1:] == dev.shape[1:]
            == host.shape[1:], "row, dev and host rows must match, one row written")
    require(row.is_contiguous() and dev.is_contiguous() and host.is_contiguous(), "row buffers must be contiguous")
    require(1 <= ring <= dev.shape[0], f"ring must be in [1, {dev.shape[0]}], got {ring}")
    _check_position(position, dev.device)
    _check_host(host, dev)
    r, d, h = row_words(row), row_words(dev), row_words(host)
    width = r.shape[1]
    block = min(1024, triton.next_power_of_2(width))
    _row_write_kernel[(triton.cdiv(width, block),)](r, position, d, h, ring, ROW=width, BLOCK=block, num_warps=4)
