"""Plain-torch references for the DSA lightning indexer: FP8 ue8m0 quantisation, indexer rope,
the 128x128 Hadamard rotation, the paged indexer-key cache (write and read back) and the indexer logits.

Cache layout (one page of `block_size` tokens = one row of the uint8 cache `[num_blocks, block_size*132]`):
bytes `[0, block_size*128)` hold the e4m3 keys token-major (token o at `o*128`), bytes
`[block_size*128, block_size*132)` the fp32 per-token scales (token o at `block_size*128 + 4*o`).
Logical slot = block * block_size + offset.
"""

from __future__ import annotations

import torch

from hearth.kernels._utils import FP8_E4M3, FP8_MAX, UE8M0_AMAX_FLOOR

INDEX_DIM = 128
CACHE_BYTES_PER_TOKEN = INDEX_DIM + 4


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-row power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (fp32), exact via frexp."""
    v = amax.float().clamp_min(UE8M0_AMAX_FLOOR) / FP8_MAX
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(v), e)


def act_quant_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dim (one group) of x to e4m3 with a ue8m0 scale.

    x: [..., D] float. Returns (x_fp8 [..., D] float8_e4m3fn, scale [...] fp32) with
    x ~= x_fp8.float() * scale[..., None]."""
    xf = x.float()
    scale = ue8m0_scale(xf.abs().amax(dim=-1))
    y = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
    return y, scale


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester (natural order) Hadamard matrix, fp32 [n, n], entries (-1)^popcount(i & j), unscaled."""
    i = torch.arange(n, device=device)
    v = i[:, None] & i[None, :]
    parity = torch.zeros_like(v)
    while bool(v.any()):
        parity ^= v & 1
        v = v >> 1
    return 1.0 - 2.0 * parity.float()


def apply_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the first `2*cos.shape[1]` dims of x [N, D] (fp32 math, result in x.dtype).

    cos, sin: fp32 [max_pos, R/2]. interleaved=True pairs (2i, 2i+1) (GLM); False pairs (i, i+R/2)
    (NeoX half-split, DeepSeek-V3.2's indexer). Pair i rotates by the angle of column i."""
    half = cos.shape[1]
    rope = 2 * half
    xf = x.float()
    c, s = cos[positions.long()], sin[positions.long()]  # (N, R/2)
    xr = xf[:, :rope]
    if interleaved:
        a, b = xr[:, 0::2], xr[:, 1::2]
    else:
        a, b = xr[:, :half], xr[:, half:]
    ra, rb = a * c - b * s, a * s + b * c
    if interleaved:
        out_r = torch.stack([ra, rb], dim=-1).reshape(xr.shape)  # (N, R)
    else:
        out_r = torch.cat([ra, rb], dim=-1)
    return torch.cat([out_r, xf[:, rope:]], dim=-1).to(x.dtype)


def indexer_k_prepare_ref(
    k: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    hadamard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope (optional) -> Hadamard (optional) -> ue8m0 FP8 quantisation of keys k [N, 128].

    Intermediates are rounded to k.dtype after each step, as REF keeps bf16 activations.
    Returns (k_fp8 [N, 128], scale [N] fp32)."""
    x = k
    if cos is not None:
        x = apply_rope_ref(x, positions, cos, sin, rope_interleaved)
    if hadamard:
        h = hadamard_matrix(INDEX_DIM, x.device)
        x = ((x.double() @ h.double()) * INDEX_DIM**-0.5).to(k.dtype)
    return act_quant_ue8m0(x)


def indexer_k_cache_write_ref(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    block_size: int,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    hadamard: bool = False,
) -> None:
    """Reference of `indexer_k_cache_write`: same arguments, writes kv_cache in place (slot < 0 skipped)."""
    k8, ks = indexer_k_prepare_ref(k, positions, cos, sin, rope_interleaved, hadamard)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    data = kv_cache[:, : block_size * INDEX_DIM].view(-1, block_size, INDEX_DIM)
    scales = kv_cache[:, block_size * INDEX_DIM :].view(-1, block_size, 4)
    data[blk, off] = k8[keep].view(torch.uint8)
    scales[blk, off] = ks[keep].contiguous().view(torch.uint8).view(-1, 4)


def read_indexer_k_cache(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the paged cache into (k_fp8 [num_blocks*block_size, 128], scale [num_blocks*block_size])
    indexed by physical slot."""
    nb = kv_cache.shape[0]
    data = kv_cache[:, : block_size * INDEX_DIM].contiguous().view(FP8_E4M3).view(nb * block_size, INDEX_DIM)
    scale = kv_cache[:, block_size * INDEX_DIM :].contiguous().view(torch.float32).reshape(nb * block_size)
    return data, scale


def gather_request_keys(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, n_tokens: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised keys of one request's first n_tokens logical positions: (k fp32 [n, 128], scale [n])."""
    data, scale = read_indexer_k_cache(kv_cache, block_size)
    t = torch.arange(n_tokens, device=kv_cache.device)
    slots = block_table_row.long()[t // block_size] * block_size + t % block_size
    return data[slots].float(), scale[slots]


def indexer_logits_ref(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """Dense logits of one request: q [M, H, 128] (fp8/bf16), weights [M, H] fp32, k [n, 128] fp32
    (unscaled fp8 values), k_scale [n], q_positions [M]. Returns [M, n] fp32 with
    sum_h w[h] * relu(q[h] . k[t]) * k_scale[t] for t <= position, -inf after (causal)."""
    s = torch.einsum("mhd,nd->mhn", q.float(), k.float()).clamp_min(0)
    logits = torch.einsum("mhn,mh->mn", s, weights.float()) * k_scale[None, :]
    t = torch.arange(k.shape[0], device=k.device)
    return logits.masked_fill(t[None, :] > q_positions[:, None], float("-inf"))


def indexer_decode_logits_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> list[torch.Tensor]:
    """Reference decode logits: q [B, next_n, H, 128], weights [B, next_n, H]. Returns a list of B
    tensors [next_n, context_len_b] (query i sits at position context_len - next_n + i)."""
    out = []
    next_n = q.shape[1]
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k, ks = gather_request_keys(kv_cache, block_table[b], n, block_size)
        pos = n - next_n + torch.arange(next_n, device=q.device)
        out.append(indexer_logits_ref(q[b], weights[b], k, ks, pos))
    return out
