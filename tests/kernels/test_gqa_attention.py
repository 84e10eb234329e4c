"""Paged GQA decode attention (hearth.kernels.gqa_attention) against its torch reference at odd
sizes: contexts that end mid-page, windows shorter and longer than the context, sinks on and off,
GQA ratios 1 / 4 / 8 / 12, head dims 64 and 128, with and without split-K."""

import pytest
import torch

from hearth.kernels.gqa_attention import gqa_decode, gqa_decode_ref
from tests.kernels.conftest import paged_table, rel_err

SCALE = 0.125


def _inputs(lens, heads, kv_heads, head_dim, block_size, dtype, device):
    batch = len(lens)
    max_blocks = max(lens) // block_size + 2
    num_blocks = batch * max_blocks + 1
    cache = torch.randn(num_blocks, block_size, 2 * kv_heads * head_dim, device=device).to(dtype)
    table = paged_table(batch, max_blocks, num_blocks, device)
    q = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (16, 2, 64), (24, 2, 128)])
@pytest.mark.parametrize("window", [None, 5, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_reference(heads, kv_heads, head_dim, window, with_sinks, splits, device):
    lens = [1, 37, 70]  # a lone token, mid-page ends (page 16)
    q, cache, table, ctx = _inputs(lens, heads, kv_heads, head_dim, 16, torch.float32, device)
    sinks = 2 * torch.randn(heads, device=device) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    gqa_decode(q, cache, table, ctx, SCALE, max(lens), window=window, sinks=sinks, out=out, splits=splits,
               block_n=16)
    ref = gqa_decode_ref(q, cache, table, ctx, SCALE, window=window, sinks=sinks)
    assert rel_err(out, ref) < 1e-5


def test_bf16_with_default_tiles(device):
    """bf16 operands (probabilities rounded to bf16 for the P.V product), 64-key tiles, a page size
    that is not a power of two, a window inside the context and sinks: the gpt-oss shape of a layer."""
    lens = [3, 130, 200]
    q, cache, table, ctx = _inputs(lens, 8, 1, 64, 24, torch.bfloat16, device)
    sinks = torch.randn(8, device=device, dtype=torch.bfloat16)
    out = gqa_decode(q, cache, table, ctx, SCALE, 256, window=100, sinks=sinks)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, gqa_decode_ref(q, cache, table, ctx, SCALE, window=100, sinks=sinks)) < 1e-2


def test_window_and_sinks_change_the_result(device):
    """The test cases above would pass with a kernel that ignored them if they had no effect."""
    q, cache, table, ctx = _inputs([50], 4, 1, 64, 16, torch.float32, device)
    base = gqa_decode(q, cache, table, ctx, SCALE, 50, block_n=16)
    windowed = gqa_decode(q, cache, table, ctx, SCALE, 50, window=10, block_n=16)
    sunk = gqa_decode(q, cache, table, ctx, SCALE, 50, sinks=torch.full((4,), 3.0, device=device), block_n=16)
    assert (windowed - base).abs().max() > 1e-2
    assert (sunk - base).abs().max() > 1e-2
    # a window as long as the context changes nothing
    same = gqa_decode(q, cache, table, ctx, SCALE, 50, window=50, block_n=16)
    assert rel_err(same, base) < 1e-6


def test_bad_arguments_are_named(device):
    q, cache, table, ctx = _inputs([5], 6, 4, 64, 16, torch.float32, device)
    with pytest.raises(ValueError, match="share"):
        gqa_decode(q, cache, table, ctx, SCALE, 5)
    q, cache, table, ctx = _inputs([5], 8, 4, 64, 16, torch.float32, device)
    with pytest.raises(ValueError, match="kv_cache"):
        gqa_decode(q, cache.to(torch.float16), table, ctx, SCALE, 5)
    with pytest.raises(ValueError, match="context_lens"):
        gqa_decode(q, cache, table, ctx.long(), SCALE, 5)
    with pytest.raises(ValueError, match="sinks"):
        gqa_decode(q, cache, table, ctx, SCALE, 5, sinks=torch.zeros(3, device=device))
