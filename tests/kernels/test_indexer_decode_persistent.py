"""The persistent decode indexer kernel: its device-side work split (every chunk of every request
scored by exactly one program, the same share for every program, any program count) and its logits
against the torch reference and the tiled kernel it replaces, at odd sizes."""

import pytest
import torch
import triton
import triton.language as tl

from hearth.kernels._utils import FP8_E4M3
from hearth.kernels.indexer import indexer_decode_topk, lightning_indexer_decode
from hearth.kernels.indexer.decode_persistent import _request_span, _split_chunks, _work_item, persistent_config
from hearth.kernels.indexer.reference import indexer_decode_logits_ref
from hearth.kernels.topk.reference import check_topk
from tests.kernels.conftest import paged_table, requires_cuda
from tests.kernels.test_lightning_indexer import _check_logits, _decode_magnitudes, _filled_cache, _queries


@triton.jit
def _split_probe_kernel(ctx_ptr, out_ptr, n_req, n_progs, BLOCK_T: tl.constexpr, REQ_P2: tl.constexpr):
    """Writes program i_p's work items as out[i_p, request] = (first chunk, end chunk), the loop of
    the persistent kernel without the scoring."""
    i_p = tl.program_id(0)
    _, b_start, b_end, g_lo, g_hi = _split_chunks(ctx_ptr, n_req, i_p, n_progs, BLOCK_T, REQ_P2)
    i_first, i_end = _request_span(b_start, b_end, g_lo, g_hi)
    for i_b in range(i_first, i_end):
        c_lo, c_hi = _work_item(b_start, b_end, i_b, g_lo, g_hi, REQ_P2)
        p_out = out_ptr + (i_p * n_req + i_b) * 2
        tl.store(p_out, c_lo)
        tl.store(p_out + 1, c_hi)


def _work_items(ctx: list[int], n_progs: int, block_t: int, device: torch.device) -> torch.Tensor:
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    out = torch.full((n_progs, len(ctx), 2), -7, dtype=torch.int32, device=device)  # -7: not visited
    req_p2 = triton.next_power_of_2(max(len(ctx), 2))
    _split_probe_kernel[(n_progs,)](ctx_t, out, len(ctx), n_progs, BLOCK_T=block_t, REQ_P2=req_p2)
    return out.cpu()


@pytest.mark.parametrize("n_progs", [1, 2, 3, 7, 132, 301])
@pytest.mark.parametrize(
    "ctx,block_t", [([0, 5, 0, 0, 300, 1, 64, 65, 0], 64), ([131072, 1, 8191], 128), ([1], 64), ([0, 0], 64)]
)
def test_work_split_covers_every_chunk_once(ctx, block_t, n_progs, device):
    items = _work_items(ctx, n_progs, block_t, device)  # (P, B, 2)
    chunks = torch.tensor([-(-n // block_t) for n in ctx], dtype=torch.int32)
    visited = items[..., 0] != -7
    lo, hi = items[..., 0], items[..., 1]
    assert bool((lo[visited] >= 0).all()) and bool((hi <= chunks).all()), "a work item outside its request"
    cover = [torch.zeros(int(c), dtype=torch.int32) for c in chunks]
    for p, b in visited.nonzero().tolist():
        cover[b][lo[p, b] : hi[p, b]] += 1
    for b, c in enumerate(cover):
        assert bool((c == 1).all()), f"request {b}: chunks scored {c.tolist()} times"
    per_program = ((hi - lo).clamp(min=0) * visited).sum(dim=1)
    total = int(chunks.sum())
    assert set(per_program.tolist()) <= {total // n_progs, -(-total // n_progs)}, per_program.tolist()


def _exact_cache(ctx: list[int], block_size: int, max_blocks: int, device):
    """A paged cache of small-integer e4m3 keys and power-of-two scales, with every page of the table
    beyond each request's context set to a block that does not exist (never to be read)."""
    n_req = len(ctx)
    num_blocks = n_req * max_blocks + 1
    cache = torch.empty((num_blocks, block_size * 132), dtype=torch.uint8, device=device)
    keys = torch.randint(-3, 4, (num_blocks, block_size, 128), device=device).float().to(FP8_E4M3)
    cache[:, : block_size * 128] = keys.view(torch.uint8).view(num_blocks, -1)
    scales = torch.exp2(torch.randint(-6, 2, (num_blocks, block_size), device=device).float())
    cache[:, block_size * 128 :] = scales.view(torch.uint8).view(num_blocks, -1)
    table = paged_table(n_req, max_blocks, num_blocks, device)
    for b, n in enumerate(ctx):
        table[b, -(-n // block_size) :] = 1 << 30
    return cache, table


def _logits(q, w, cache, table, ctx, block_size, kernel: str, programs: int | None = None):
    cfg = {"kernel": kernel} | ({"programs": programs} if programs else {})
    return lightning_indexer_decode(
        q, w, cache, table, torch.tensor(ctx, dtype=torch.int32, device=q.device), block_size, config=cfg
    )


@pytest.mark.parametrize(
    "ctx,block_size,next_n,programs",
    [
        ([77], 16, 1, None),  # batch 1, one program per chunk
        ([130, 0, 1], 64, 2, 2),  # an empty request between two programs' shares
        ([1, 200, 63, 129, 64], 16, 1, 3),  # requests split across programs and programs across requests
        ([193, 5, 64, 17, 300], 64, 4, 5),
    ],
)
@pytest.mark.parametrize("q_dtype", ["fp8", "bf16"])
def test_persistent_bit_exact_on_exact_sums(ctx, block_size, next_n, programs, q_dtype, device):
    """Integer keys and queries, eighths as weights and power-of-two scales make every sum exact in
    fp32, so any summation order gives the same bits: the persistent kernel must equal the tiled
    kernel and the reference exactly (any wrong page, token, head or mask shows)."""
    heads = 16
    max_blocks = -(-max(ctx) // block_size)  # no spare column: the last request fills the table
    cache, table = _exact_cache(ctx, block_size, max_blocks, device)
    q = torch.randint(-3, 4, (len(ctx), next_n, heads, 128), device=device).float()
    q = q.to(FP8_E4M3) if q_dtype == "fp8" else q.to(torch.bfloat16)
    w = torch.randint(-16, 17, (len(ctx), next_n, heads), device=device).float() / 8
    new, new_len = _logits(q, w, cache, table, ctx, block_size, "persistent", programs)
    old, old_len = _logits(q, w, cache, table, ctx, block_size, "tiled")
    ref = indexer_decode_logits_ref(q, w, cache, table, torch.tensor(ctx), block_size)
    assert torch.equal(new_len, old_len)
    for b, n in enumerate(ctx):
        rows = slice(b * next_n, (b + 1) * next_n)
        assert torch.equal(new[rows, :n], old[rows, :n]), f"request {b}: persistent != tiled"
        assert torch.equal(new[rows, :n], ref[b]), f"request {b}: persistent != reference"


@pytest.mark.parametrize("programs", [None, 4])
@pytest.mark.parametrize("q_dtype", ["fp8", "bf16"])
def test_persistent_against_reference_and_tiled(programs, q_dtype, device):
    """Random keys (rounded sums): within the tests' tolerance of the reference and of the tiled kernel,
    and the fused first top-k histogram as with the tiled kernel."""
    ctx, block_size, next_n, heads, k = [300, 45, 1], 16, 3, 16, 40
    max_blocks = -(-max(ctx) // block_size) + 1
    cache, table = _filled_cache(ctx, block_size, max_blocks, device)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    q = _queries((len(ctx), next_n, heads, 128), q_dtype, device)
    w = torch.randn(len(ctx), next_n, heads, device=device)
    new, lengths = _logits(q, w, cache, table, ctx, block_size, "persistent", programs)
    old, _ = _logits(q, w, cache, table, ctx, block_size, "tiled")
    ref = indexer_decode_logits_ref(q, w, cache, table, ctx_t, block_size)
    mag = _decode_magnitudes(q, w, cache, table, ctx, block_size)
    for b, n in enumerate(ctx):
        for j in range(next_n):
            row, n_valid = b * next_n + j, max(n - next_n + j + 1, 0)
            _check_logits(new[row, :n], ref[b][j], mag[b][j], n_valid)
            _check_logits(new[row, :n], old[row, :n], 2 * mag[b][j], n_valid)
    cfg = {"kernel": "persistent"} | ({"programs": programs} if programs else {})
    idx = indexer_decode_topk(q, w, cache, table, ctx_t, block_size, k, fuse_hist=True, config=cfg)
    check_topk(idx.view(-1, k), new, lengths, k)


def test_plan_depends_on_shapes_only():
    """The grid and tile come from the batch, the table width and the SM count: never from context_lens."""
    small = persistent_config(1, 512, 64, 1, 132)
    assert small["block_t"] == 64 and small["programs"] == 264
    big = persistent_config(8, 131072, 64, 1, 132)
    assert big["block_t"] == 128 and big["programs"] == 264
    assert persistent_config(8, 131072, 64, 4, 132)["block_t"] == 64  # [BLOCK_T, 4 * 64] accumulator


def test_rejects_unknown_kernel(device):
    q = torch.zeros(1, 1, 16, 128, device=device).to(FP8_E4M3)
    cache, table = _filled_cache([4], 16, 1, device)
    with pytest.raises(ValueError, match="config kernel"):
        _logits(q, torch.zeros(1, 1, 16, device=device), cache, table, [4], 16, "fast")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("next_n", [1, 2])
def test_persistent_real_shapes_gpu(next_n):
    """DeepSeek's 64 heads, batch 8 of mixed contexts up to 128K, the default launch plan: bit-equal to
    the tiled kernel and the reference on exact sums."""
    ctx, heads = [131072, 1, 4097, 20000, 63, 32000, 8192, 2049], 64
    cache, table = _exact_cache(ctx, 64, 2048, "cuda")
    q = torch.randint(-3, 4, (len(ctx), next_n, heads, 128), device="cuda").float().to(FP8_E4M3)
    w = torch.randint(-16, 17, (len(ctx), next_n, heads), device="cuda").float() / 8
    new, _ = _logits(q, w, cache, table, ctx, 64, "persistent")
    old, _ = _logits(q, w, cache, table, ctx, 64, "tiled")
    ref = indexer_decode_logits_ref(q, w, cache, table, torch.tensor(ctx, device="cuda"), 64)
    for b, n in enumerate(ctx):
        rows = slice(b * next_n, (b + 1) * next_n)
        assert torch.equal(new[rows, :n], old[rows, :n]), f"request {b}: persistent != tiled"
        assert torch.equal(new[rows, :n], ref[b]), f"request {b}: persistent != reference"
