"""A decode token's write-through (hearth.kernels.tiered.write_through) against the torch path it
replaces: for decode tokens across page boundaries, from a partial page on, the host rows and the
summaries of the pages they fill equal, byte for byte, the torch path's (``PagePool.dequantized``,
the mean over each group, ``quantize_means``) computed on the CPU; tokens that leave their page
partial write nothing. Keys whose large first and last keys of a group cancel make the fp32 group
sums round, so the summation order shows: the kernel's is the CPU torch path's on both devices."""

from __future__ import annotations

import pytest
import torch

from hearth.kernels.indexer.reference import act_quant_ue8m0
from hearth.kernels.tiered import write_row, write_through_page
from hearth.offload.coarse_index import PagePool, quantize_means

GROUP, D, POISON = 16, 128, 0xAB


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


def _sync(device: torch.device) -> None:
    """Before the host reads the pinned pool the kernels wrote (a CPU tensor: no implicit sync)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_path(ring: torch.Tensor, host: PagePool, means: PagePool, pos: int, ps: int, hot: int) -> None:
    """The summary and host row of pos's page as the torch path computed them (on the CPU)."""
    page, groups = pos // ps, ps // GROUP
    host.buf[page] = ring[page % hot]
    view = PagePool(1, ps, D, "fp8", torch.device("cpu"))
    view.buf = ring[page % hot:page % hot + 1].clone()
    keys = view.dequantized(torch.zeros(1, dtype=torch.long))
    m, s = quantize_means(keys.view(1, groups, GROUP, D).mean(dim=2))
    idx = page * groups + torch.arange(groups)
    means.write(idx // GROUP, idx % GROUP, m.reshape(-1, D), s.reshape(-1))


@pytest.mark.parametrize("ps,hot,spread", [(16, 1, False), (32, 3, True), (64, 2, False), (64, 4, True)])
def test_full_pages_equal_the_torch_path_and_partial_pages_write_nothing(device, ps, hot, spread):
    n_pages, first = 7, ps + ps // 2 + 3  # decoding starts inside page 1
    n = n_pages * ps - 5  # and stops inside the last page
    g = torch.Generator().manual_seed(ps + hot)
    x = torch.randn(n, D, generator=g)
    if spread:  # token scales 2^-8..2^0, and each group's first key 2^16 larger, cancelled by its last:
        # the group sums round, by an amount that depends on the order of the additions
        x = x * torch.exp2(torch.randint(-8, 1, (n, 1), generator=g).float())
        x[::GROUP] *= 65536.0
        x[GROUP - 1::GROUP] = -x[::GROUP][: x[GROUP - 1::GROUP].shape[0]]
    k8, ks = act_quant_ue8m0(x)
    ring = torch.full((hot + 2, ps * (D + 4)), POISON, dtype=torch.uint8)  # 2 cache rows after the ring
    host = _pinned(torch.full((n_pages, ps * (D + 4)), POISON, dtype=torch.uint8), device)
    means_rows = -(-n_pages * ps // GROUP // GROUP)
    means = torch.full((means_rows, GROUP * (D + 4)), POISON, dtype=torch.uint8, device=device)
    ref_host = PagePool(n_pages, ps, D, "fp8", torch.device("cpu"))
    ref_host.buf = host.cpu().clone()
    ref_means = PagePool(means_rows, GROUP, D, "fp8", torch.device("cpu"))
    ref_means.buf = means.cpu().clone()
    ring_pool = PagePool(hot + 2, ps, D, "fp8", torch.device("cpu"))
    ring_pool.buf = ring
    ring_pool.write(torch.tensor([first // ps % hot]), torch.arange(first % ps), k8[first - first % ps:first],
                    ks[first - first % ps:first])  # the partial page's earlier tokens (prefill)
    dev_ring = ring.to(device)
    for pos in range(first, n):
        p = torch.tensor([pos])
        ring_pool.write(p // ps % hot, p % ps, k8[pos:pos + 1], ks[pos:pos + 1])  # the cache-write kernel's part
        dev_ring[(pos // ps) % hot] = ring[(pos // ps) % hot].to(device)
        write_through_page(dev_ring, host, means, torch.tensor([pos], device=device), ps, hot)
        if (pos + 1) % ps == 0:
            _torch_path(ring, ref_host, ref_means, pos, ps, hot)
        _sync(device)
        assert torch.equal(host.cpu(), ref_host.buf), f"host pool differs after position {pos}"
        assert torch.equal(means.cpu(), ref_means.buf), f"summaries differ after position {pos}"
    assert torch.equal(dev_ring.cpu(), ring)  # the ring is only read
    full = n // ps
    assert (host[first // ps:full] != POISON).any(dim=1).all() and (host[full] == POISON).all()
    assert (host[:first // ps] == POISON).all()  # pages before the first decode token's are not rewritten


def test_all_zero_group_gets_zero_means_and_the_floor_scale(device):
    """A group of zero keys: the torch path's clamp (absmax 1e-30) gives scale 1e-30 / 448, values 0."""
    ps = 32
    ring = torch.zeros(1, ps * (D + 4), dtype=torch.uint8)
    pool = PagePool(1, ps, D, "fp8", torch.device("cpu"))
    pool.buf = ring
    k8, ks = act_quant_ue8m0(torch.randn(GROUP, D))
    pool.write(torch.zeros(GROUP, dtype=torch.long), torch.arange(GROUP, 2 * GROUP), k8, ks)  # group 1 only
    host = _pinned(torch.zeros(1, ps * (D + 4), dtype=torch.uint8), device)
    means = torch.zeros(1, GROUP * (D + 4), dtype=torch.uint8, device=device)
    write_through_page(ring.to(device), host, means, torch.tensor([ps - 1], device=device), ps, 1)
    _sync(device)
    got = PagePool(1, GROUP, D, "fp8", torch.device("cpu"))
    got.buf = means.cpu()
    vals, scales = got.tokens(torch.zeros(1, dtype=torch.long))
    assert torch.equal(vals[0].float(), torch.zeros(D)) and scales[0] == torch.tensor(1e-30) / 448.0
    assert vals[1].float().abs().amax() == 448.0 and scales[1] > 0
    assert torch.equal(host.cpu(), ring)


@pytest.mark.parametrize("dtype,width,ring", [(torch.bfloat16, 576, 4), (torch.float32, 3, 1), (torch.uint8, 6, 5)])
def test_row_goes_to_its_ring_row_and_host_row(device, dtype, width, ring):
    """Rows in any dtype (int32 words or bytes) at positions that wrap the ring; the cache rows after
    the ring and the other host rows stay as they were."""
    n, g = 3 * ring + 2, torch.Generator().manual_seed(width)
    rows = (torch.randn(n, width, generator=g) * 50).to(dtype)
    dev = torch.zeros(ring + 2, width, dtype=dtype, device=device)
    host = _pinned(torch.zeros(n + 1, width, dtype=dtype), device)
    for pos in range(n):
        position = torch.tensor([pos], dtype=torch.int32 if pos % 2 else torch.int64, device=device)
        write_row(rows[pos:pos + 1].to(device), position, dev, ring, host)
        assert torch.equal(dev[pos % ring].cpu(), rows[pos])
    _sync(device)
    assert torch.equal(host[:n], rows) and not host[n].any() and not dev[ring:].any()
    last = [max(p for p in range(n) if p % ring == r) for r in range(ring)]  # the ring's rows: the latest
    assert torch.equal(dev[:ring].cpu(), rows[last])


def test_layout_errors(device):
    ring = torch.zeros(2, 16 * 132, dtype=torch.uint8, device=device)
    host = _pinned(torch.zeros(4, 16 * 132, dtype=torch.uint8), device)
    means = torch.zeros(1, 16 * 132, dtype=torch.uint8, device=device)
    pos = torch.tensor([3], device=device)
    with pytest.raises(ValueError, match="position"):
        write_through_page(ring, host, means, torch.tensor([[3]], device=device), 16, 2)
    with pytest.raises(ValueError, match="means"):
        write_through_page(ring, host, means[:, :-4], pos, 16, 2)
    with pytest.raises(ValueError, match="hot_pages"):
        write_through_page(ring, host, means, pos, 16, 3)
    with pytest.raises(ValueError, match="group"):
        write_through_page(ring, host, means, pos, 16, 2, group=12)
    row = torch.zeros(1, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="rows must match"):
        write_row(row, pos, torch.zeros(4, 8, dtype=torch.float32, device=device), 2,
                  _pinned(torch.zeros(8, 8, dtype=torch.float32), device))
    with pytest.raises(ValueError, match="ring"):
        write_row(row, pos, torch.zeros(4, 8, dtype=torch.bfloat16, device=device), 5,
                  _pinned(torch.zeros(8, 8, dtype=torch.bfloat16), device))
