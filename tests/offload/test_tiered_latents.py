"""Tiered latents: the hot buffer returns exactly what an all-in-memory gather would, under random
write/select sequences with tiny hot buffers; hit/miss/byte counters add up; clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from hearth.offload.tiered_latents import LatentTierConfig, TieredLatents

CPU = torch.device("cpu")
# HEARTH_TEST_DEVICE=cuda runs the random-sequence test on the GPU (pinned staging, side stream)
DEVICE = torch.device(os.environ.get("HEARTH_TEST_DEVICE", "cpu"))


@pytest.mark.parametrize("hot_rows,k,dtype", [(40, 32, torch.bfloat16), (33, 33, torch.float32),
                                              (300, 64, torch.uint8)])
def test_random_sequences_match_in_memory_gather(hot_rows: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hot_rows)
    width = 576 if dtype != torch.uint8 else 656
    total = 1500
    if dtype == torch.uint8:
        rows = torch.randint(0, 256, (total, width), generator=g, dtype=torch.uint8)
    else:
        rows = torch.randn(total, width, generator=g).to(dtype)
    lat = TieredLatents(LatentTierConfig(width=width, dtype=dtype, hot_rows=hot_rows), DEVICE, initial_rows=8)
    step = 0
    while lat.num_tokens < total:
        n = 1 if step % 3 else min(total - lat.num_tokens, int(torch.randint(1, 200, (1,), generator=g)))
        lat.append(rows[lat.num_tokens:lat.num_tokens + n].to(DEVICE))
        m = min(k, lat.num_tokens)
        recent = torch.arange(max(0, lat.num_tokens - 16), lat.num_tokens)
        sel = torch.cat((recent, torch.randint(0, lat.num_tokens, (m,), generator=g)))[:m]
        sel = torch.cat((sel, torch.full((k - m,), -1)))[torch.randperm(k, generator=g)]  # -1 padding
        got, pos = lat.gather(sel.to(DEVICE))
        got, pos = got.cpu(), pos.cpu()
        want = torch.where((sel >= 0)[:, None], rows[sel.clamp(min=0)], torch.zeros((), dtype=dtype))
        assert torch.equal(got, want), f"step {step}"
        assert torch.equal(pos, sel)
        step += 1
    assert torch.equal(lat.read(torch.arange(total)).cpu(), rows)
    s = lat.stats()
    assert s["hits"] + s["misses"] == s["lookups"] and s["misses"] > 0 and s["hits"] > 0
    assert s["bytes_h2d"] == s["misses"] * lat.config.row_bytes
    assert s["bytes_d2h"] == total * lat.config.row_bytes


def test_repeated_selection_hits() -> None:
    lat = TieredLatents(LatentTierConfig(width=8, dtype=torch.float32, hot_rows=64), CPU)
    lat.append(torch.randn(1000, 8))
    sel = torch.arange(100, 164)
    lat.gather(sel)
    before = lat.stats()
    lat.gather(sel.flip(0))
    after = lat.stats()
    assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 64
    assert after["hit_rate"] == after["hits"] / after["lookups"]


def test_selection_larger_than_hot_buffer_is_an_error() -> None:
    lat = TieredLatents(LatentTierConfig(width=8, dtype=torch.float32, hot_rows=16), CPU)
    lat.append(torch.randn(100, 8))
    with pytest.raises(ValueError, match="hot_rows"):
        lat.gather(torch.arange(0, 40))
    with pytest.raises(ValueError, match="past"):
        lat.gather(torch.tensor([100]))


def test_from_budget() -> None:
    cfg = LatentTierConfig.from_budget(4096 * 1152)
    assert cfg.hot_rows == 4096 and cfg.device_bytes == 4096 * 1152
