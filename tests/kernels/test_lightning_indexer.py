"""Lightning indexer logits (decode / prefill, paged FP8 cache) and the fused indexer + top-k,
against the dense torch reference."""

import sys

import pytest
import torch

from hearth.kernels._utils import FP8_E4M3
from hearth.kernels.indexer import (
    indexer_decode_topk,
    indexer_k_cache_write,
    indexer_prefill_topk,
    lightning_indexer_decode,
    lightning_indexer_prefill,
)
from hearth.kernels.indexer.reference import gather_request_keys, indexer_decode_logits_ref, indexer_logits_ref
from hearth.kernels.topk.reference import check_topk
from tests.kernels.conftest import logical_slots, paged_table, requires_cuda


def _filled_cache(ctx: list[int], block_size: int, max_blocks: int, device):
    """A paged FP8 indexer cache holding random keys for requests of the given lengths."""
    n_req = len(ctx)
    num_blocks = n_req * max_blocks + 2
    cache = torch.full((num_blocks, block_size * 132), 0xAB, dtype=torch.uint8, device=device)
    table = paged_table(n_req, max_blocks, num_blocks, device)
    for b, n in enumerate(ctx):
        if n:
            keys = torch.randn(n, 128, device=device) * torch.rand(n, 1, device=device) * 4
            indexer_k_cache_write(keys, logical_slots(table[b], n, block_size), cache, block_size)
    return cache, table


def _queries(shape, q_dtype, device):
    q = torch.randn(*shape, device=device) * 3
    return q.to(FP8_E4M3) if q_dtype == "fp8" else q.to(torch.bfloat16)


def small_decode(device):
    """Two requests of 37 and 90 tokens (16-token pages, 16 heads, FP8 queries), k 24: the decode indexer's
    arguments (q, weights, cache, table, context lengths, block size), k, and its (logits, lengths)."""
    block_size, ctx, k = 16, [37, 90], 24
    cache, table = _filled_cache(ctx, block_size, 8, device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = _queries((2, 1, 16, 128), "fp8", device)
    w = torch.randn(2, 1, 16, device=device)
    args = (q, w, cache, table, ctx_t, block_size)
    return args, k, lightning_indexer_decode(*args)


# Error bound relative to sum_h |w_h| sum_d |q_hd k_d| k_scale (the usual dot-product error scale):
# Hopper's fp8 MMA accumulates partial sums in reduced precision (the kernels' default, fp8_precise=False).
LOGIT_TOL = 1e-3


def _magnitude(q, w, keys, scales, pos):
    return indexer_logits_ref(q.float().abs(), w.abs(), keys.abs(), scales, pos)


def _decode_magnitudes(q, w, cache, table, ctx, block_size):
    out = []
    for b, n in enumerate(ctx):
        keys, scales = gather_request_keys(cache, table[b], n, block_size)
        pos = n - q.shape[1] + torch.arange(q.shape[1], device=q.device)
        out.append(_magnitude(q[b], w[b], keys, scales, pos))
    return out


def _check_logits(got_row: torch.Tensor, ref_row: torch.Tensor, abs_row: torch.Tensor, n_valid: int) -> None:
    got, ref, mag = got_row[:n_valid].double(), ref_row[:n_valid].double(), abs_row[:n_valid].double()
    assert torch.isfinite(got).all(), "NaN/inf in valid logits"
    assert bool(((got - ref).abs() <= LOGIT_TOL * mag + 1e-6).all()), float(((got - ref).abs() / (mag + 1e-6)).max())
    assert bool(torch.isneginf(got_row[n_valid:]).all()), "causal tail must be -inf"


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("next_n", [1, 3])
@pytest.mark.parametrize("q_dtype", ["fp8", "bf16"])
def test_decode_logits_and_topk(block_size, next_n, q_dtype, device):
    ctx = [1, 63, 2049] if block_size == 64 else [1, 63, 300]
    heads, k = 16, 64
    max_blocks = -(-max(ctx) // block_size) + 1
    cache, table = _filled_cache(ctx, block_size, max_blocks, device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = _queries((len(ctx), next_n, heads, 128), q_dtype, device)
    w = torch.randn(len(ctx), next_n, heads, device=device)
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx_t, block_size)
    ref = indexer_decode_logits_ref(q, w, cache, table, ctx_t, block_size)
    mag = _decode_magnitudes(q, w, cache, table, ctx, block_size)
    for b, n in enumerate(ctx):
        for j in range(next_n):
            row = b * next_n + j
            n_valid = max(n - next_n + j + 1, 0)
            assert int(lengths[row]) == n_valid
            _check_logits(logits[row, :n], ref[b][j], mag[b][j], n_valid)
    # fuse_hist: the select's first histogram added by the indexer kernel (True) or a launch of its own (False)
    for fuse, topk in ((True, "radix"), (False, "radix"), (False, "sampled"), (True, "one_launch"),
                       (False, "one_launch"), (None, "one_launch")):
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, fuse_hist=fuse, topk=topk)
        assert idx.shape == (len(ctx), next_n, k)
        check_topk(idx.view(-1, k), logits, lengths, k)


def test_decode_topk_auto_picks_by_work_and_keeps_its_workspace(device, monkeypatch):
    """"auto" selects with the one-launch select where rows x the table's capacity is small (its workspace
    kept and left clean for the next call), its first histogram fused in the indexer up to the limit and
    from a launch of its own past it; exact either way."""
    from hearth.kernels.indexer import lightning
    from hearth.kernels.topk import cooperative

    monkeypatch.setattr(cooperative, "COOPERATIVE", False)  # its own test: test_topk_cooperative.py
    args, k, (logits, lengths) = small_decode(device)
    q, w, cache, table, ctx_t, block_size = args
    hist_launches = []
    real_hist = lightning.fine_hist_launch
    monkeypatch.setattr(lightning, "fine_hist_launch", lambda *a, **kw: (hist_launches.append(1), real_hist(*a, **kw)))
    for limit, separate in ((2 * 8 * block_size, False), (2 * 8 * block_size - 1, True)):  # one pair short: separate
        monkeypatch.setattr(lightning, "ONE_LAUNCH_FUSED_MAX_WORK", limit)
        lightning._KEPT_ONE_LAUNCH.clear()
        hist_launches.clear()
        for _ in range(2):  # the second call reuses the first's workspace: it must have been left clean
            idx = indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k)
            check_topk(idx.view(-1, k), logits, lengths, k)
        (kept,) = lightning._KEPT_ONE_LAUNCH.values()
        assert len(kept) == 1 and kept[0].shape[0] >= 2
        assert len(hist_launches) == (2 if separate else 0)


def test_decode_topk_k_exceeds_context_and_ties(device):
    block_size, ctx = 16, [5, 40]
    cache, table = _filled_cache(ctx, block_size, 4, device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = torch.zeros(2, 1, 16, 128, device=device).to(FP8_E4M3)  # all logits 0: one big tie
    w = torch.randn(2, 1, 16, device=device)
    for topk in ("radix", "sampled", "one_launch"):
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, block_size, 32, topk=topk)
        assert sorted(idx[0, 0, :5].tolist()) == list(range(5)) and bool((idx[0, 0, 5:] == -1).all())
        sel = idx[1, 0]
        assert sel.unique().numel() == 32 and bool((sel >= 0).all()) and bool((sel < 40).all())


@pytest.mark.parametrize("block_size,ctx,n_q", [(16, 63, 40), (64, 2049, 100), (64, 1, 1)])
@pytest.mark.parametrize("q_dtype", ["fp8", "bf16"])
def test_prefill_logits_and_topk(block_size, ctx, n_q, q_dtype, device):
    heads, k = 16, 48
    max_blocks = -(-ctx // block_size) + 2
    cache, table = _filled_cache([ctx], block_size, max_blocks, device)
    q = _queries((n_q, heads, 128), q_dtype, device)
    w = torch.randn(n_q, heads, device=device)
    logits = lightning_indexer_prefill(q, w, cache, table[0], ctx, block_size)
    keys, scales = gather_request_keys(cache, table[0], ctx, block_size)
    pos = ctx - n_q + torch.arange(n_q, device=device)
    ref = indexer_logits_ref(q, w, keys, scales, pos)
    mag = _magnitude(q, w, keys, scales, pos)
    for i in range(n_q):
        _check_logits(logits[i], ref[i], mag[i], int(pos[i]) + 1)
    idx = indexer_prefill_topk(q, w, cache, table[0], ctx, block_size, k)
    check_topk(idx, logits.contiguous(), (pos + 1).int(), k)
    lightning = sys.modules[indexer_prefill_topk.__module__]
    with pytest.MonkeyPatch.context() as mp:  # the torch.topk path for many long rows, at this size
        mp.setattr(lightning, "TORCH_TOPK_MIN_WORK", n_q * ctx - 1)
        idx = indexer_prefill_topk(q, w, cache, table[0], ctx, block_size, k)
    check_topk(idx, logits.contiguous(), (pos + 1).int(), k)


@pytest.mark.parametrize("many", [False, True])  # the radix select, torch.topk (the chunk past TORCH_TOPK_MIN_WORK)
def test_prefill_topk_in_row_blocks_matches_one_block(many, device, monkeypatch):
    """A chunk whose logits exceed the budget runs in sub-blocks of query rows, each scored up to its last
    query's position: every row's logits are the one-block logits (bit for bit in blocks of BLOCK_Q rows) and
    the selection the same, at odd sizes (a last block shorter than the others, rows aligned to BLOCK_Q or
    not); within the budget, one block and one indexer launch as before."""
    from hearth.kernels.indexer import lightning

    block_size, ctx, n_q, k = 16, 301, 150, 40
    cache, table = _filled_cache([ctx], block_size, -(-ctx // block_size) + 1, device)
    q = _queries((n_q, 16, 128), "fp8", device)
    w = torch.randn(n_q, 16, device=device)
    if many:
        monkeypatch.setattr(lightning, "TORCH_TOPK_MIN_WORK", n_q * ctx - 1)
    full = lightning_indexer_prefill(q, w, cache, table[0], ctx, block_size)
    pos = ctx - n_q + torch.arange(n_q, device=device)
    whole = indexer_prefill_topk(q, w, cache, table[0], ctx, block_size, k)
    check_topk(whole, full.contiguous(), (pos + 1).int(), k)
    row_bytes = 304 * 4  # 301 columns padded to 16
    launches = []
    real = lightning.lightning_indexer_prefill
    monkeypatch.setattr(lightning, "lightning_indexer_prefill", lambda q, *a, **kw: launches.append(q.shape[0])
                        or real(q, *a, **kw))
    for budget, rows in ((64 * row_bytes + 5, 64), (100 * row_bytes, 64), (37 * row_bytes, 37), (row_bytes - 1, 1)):
        if rows == 1 and not many:
            continue  # 150 one-row radix selects: slow in the interpreter, the 37-row blocks cover it
        assert lightning.prefill_block_rows(n_q, ctx, budget) == rows
        launches.clear()
        got = indexer_prefill_topk(q, w, cache, table[0], ctx, block_size, k, logits_budget=budget)
        assert launches == [rows] * (n_q // rows) + ([n_q % rows] if n_q % rows else [])
        assert torch.equal(got.sort(dim=1).values, whole.sort(dim=1).values), budget
    for a, b in ((0, 64), (64, 128), (128, 150)):  # blocks of BLOCK_Q rows: the whole chunk's tiles, bit for bit
        part = real(q[a:b], w[a:b], cache, table[0], ctx - n_q + b, block_size)
        assert torch.equal(part, full[a:b, :ctx - n_q + b])
    # rows in other places of their tiles (blocks under BLOCK_Q rows, past 1M tokens at the default budget):
    # the same sums, which the interpreter's matmul may round differently in the last bit
    part = real(q[37:74], w[37:74], cache, table[0], ctx - n_q + 74, block_size)
    torch.testing.assert_close(part, full[37:74, :ctx - n_q + 74], rtol=1e-6, atol=1e-4)
    launches.clear()  # logits within the budget: one block, one indexer launch
    indexer_prefill_topk(q, w, cache, table[0], ctx, block_size, k, logits_budget=n_q * row_bytes)
    assert launches == [n_q]
    assert lightning.prefill_block_rows(n_q, ctx, n_q * row_bytes) == n_q


def test_layout_errors(device):
    cache, table = _filled_cache([10], 16, 2, device)
    q = torch.randn(1, 1, 16, 128, device=device).to(FP8_E4M3)
    w = torch.randn(1, 1, 16, device=device)
    ctx = torch.tensor([10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="next_n"):
        lightning_indexer_decode(
            q.expand(1, 5, 16, 128).contiguous(), w.expand(1, 5, 16).contiguous(), cache, table, ctx, 16
        )
    with pytest.raises(ValueError, match="weights"):
        lightning_indexer_decode(q, w.half(), cache, table, ctx, 16)
    with pytest.raises(ValueError, match="kv_cache"):
        lightning_indexer_decode(q, w, cache, table, ctx, 64)
    with pytest.raises(ValueError, match="context_lens"):
        lightning_indexer_decode(q, w, cache, table, ctx.long(), 16)
    with pytest.raises(ValueError, match="context_len"):
        lightning_indexer_prefill(q[0], w[0], cache, table[0], 40, 16)
    with pytest.raises(ValueError, match="topk must"):
        indexer_decode_topk(q, w, cache, table, ctx, 16, 4, topk="sort")
    with pytest.raises(ValueError, match="fuse_hist"):
        indexer_decode_topk(q, w, cache, table, ctx, 16, 4, fuse_hist=True, topk="sampled")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads", [64, 32])
def test_decode_real_shapes_gpu(heads):
    ctx = [32768, 1, 4097, 20000, 63, 32000, 8192, 2049]
    cache, table = _filled_cache(ctx, 64, 513, "cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = _queries((8, 1, heads, 128), "fp8", "cuda")
    w = torch.randn(8, 1, heads, device="cuda") * 0.01
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx_t, 64)
    ref = indexer_decode_logits_ref(q, w, cache, table, ctx_t, 64)
    mag = _decode_magnitudes(q, w, cache, table, ctx, 64)
    for b, n in enumerate(ctx):
        _check_logits(logits[b, :n], ref[b][0], mag[b][0], n)
    for topk in ("radix", "sampled", "one_launch"):
        idx = indexer_decode_topk(q, w, cache, table, ctx_t, 64, 2048, topk=topk)
        check_topk(idx.view(-1, 2048), logits, lengths, 2048)


@pytest.mark.gpu
@requires_cuda
def test_prefill_real_shapes_gpu():
    ctx, n_q = 8192, 1024
    cache, table = _filled_cache([ctx], 64, 130, "cuda")
    q = _queries((n_q, 64, 128), "fp8", "cuda")
    w = torch.randn(n_q, 64, device="cuda") * 0.01
    logits = lightning_indexer_prefill(q, w, cache, table[0], ctx, 64)
    keys, scales = gather_request_keys(cache, table[0], ctx, 64)
    pos = ctx - n_q + torch.arange(n_q, device="cuda")
    ref = indexer_logits_ref(q, w, keys, scales, pos)
    mag = _magnitude(q, w, keys, scales, pos)
    for i in range(0, n_q, 97):
        _check_logits(logits[i], ref[i], mag[i], int(pos[i]) + 1)
    idx = indexer_prefill_topk(q, w, cache, table[0], ctx, 64, 2048)
    check_topk(idx[-64:], logits[-64:].contiguous(), (pos[-64:] + 1).int(), 2048)
