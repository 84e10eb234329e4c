"""The MoE router after the gate matmul in one kernel (DeepSeek-V3 / V3.2, GLM-5 and the other
DeepSeek-family routers): scores, bias for the choice, group limit, top-k, weights.

One program per token holds the token's E scores as a [groups, experts per group] block, so the
group scores and the top-k are register reductions; the k experts come out one at a time, each the
largest remaining choice value. That replaces about 17 PyTorch kernels per layer (sigmoid, add, two
top-k, scatter, masked fill, gather, sum, division, scaling...) with one launch and no host sync.

Ties: among equal choice values (or equal group scores) the lower index wins, and the chosen experts
come out in descending choice order, lower index first among equals. ``torch.topk`` leaves the order
of exact ties unspecified (on the CPU it does not follow the index), so exact ties may pick other
experts of the same value there; values that differ by one ulp are ordered exactly.

Numerics: the sigmoid is ``1 / (1 + exp(-x))`` with a correctly rounded division and, on the GPU,
libdevice's ``expf`` (the function PyTorch's CUDA sigmoid calls), so the scores and hence the choice
match PyTorch's bit for bit there; the softmax and the weight normalisation sum in another order
than PyTorch (the weights may differ by an fp32 ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hearth.kernels._utils import check_tensor, is_interpreter, require

_NO_INDEX = tl.constexpr(1 << 30)  # larger than any expert or group index (the "none" of an argmin)


@triton.jit
def _argmax_first(values, index, axis_len):
    """(max, lowest index holding it) of a 1-D block."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, index, axis_len), axis=0)


@triton.jit
def _router_kernel(logit_ptr, bias_ptr, ids_ptr, w_ptr, stride_l, stride_i, stride_w, scale,
                   G: tl.constexpr, EG: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT_GROUPS: tl.constexpr,
                   GROUP_TOP2: tl.constexpr, NORMALISE: tl.constexpr, LIBDEVICE: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    o_j = tl.arange(0, BLOCK_J)
    o_e = o_g[:, None] * EG + o_j[None, :]  # expert index
    m_e = (o_g[:, None] < G) & (o_j[None, :] < EG)
    b_x = tl.load(logit_ptr + i_t * stride_l + o_e, mask=m_e, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        b_z = libdevice.exp(-b_x) if LIBDEVICE else tl.exp(-b_x)
        b_s = tl.math.div_rn(tl.full(b_x.shape, 1.0, tl.float32), 1.0 + b_z)  # IEEE division, as CUDA's
    else:
        b_z = tl.exp(b_x - tl.max(tl.max(b_x, axis=1), axis=0))
        b_s = tl.math.div_rn(b_z, tl.sum(tl.sum(b_z, axis=1), axis=0))
    b_c = b_s
    if HAS_BIAS:
        b_c = b_s + tl.load(bias_ptr + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_c = tl.where(m_e, b_c, -float("inf"))
    if LIMIT_GROUPS:
        b_top = tl.max(b_c, axis=1)  # [BLOCK_G]
        if GROUP_TOP2:  # the group's two largest choice values, summed
            b_first = tl.min(tl.where(b_c == b_top[:, None], o_j[None, :], BLOCK_J), axis=1)
            b_top = b_top + tl.max(tl.where(o_j[None, :] == b_first[:, None], -float("inf"), b_c), axis=1)
        b_top = tl.where(o_g < G, b_top, -float("inf"))
        m_keep = o_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, i_g = _argmax_first(b_top, o_g, BLOCK_G)
            m_keep = m_keep | (o_g == i_g)
            b_top = tl.where(o_g == i_g, -float("inf"), b_top)
        b_c = tl.where(m_keep[:, None], b_c, -float("inf"))
    o_k = tl.arange(0, BLOCK_K)
    b_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    b_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_sum = tl.zeros([], dtype=tl.float32)
    for k in tl.static_range(K):
        b_best = tl.max(tl.max(b_c, axis=1), axis=0)
        i_e = tl.min(tl.min(tl.where(b_c == b_best, o_e, _NO_INDEX), axis=1), axis=0)
        m_pick = o_e == i_e
        b_pick = tl.sum(tl.sum(tl.where(m_pick, b_s, 0.0), axis=1), axis=0)  # its unbiased score
        b_sum += b_pick
        b_ids = tl.where(o_k == k, i_e.to(tl.int64), b_ids)
        b_w = tl.where(o_k == k, b_pick, b_w)
        b_c = tl.where(m_pick, -float("inf"), b_c)
    if NORMALISE:
        b_w = tl.math.div_rn(b_w, tl.broadcast_to(b_sum + 1e-20, [BLOCK_K]))
    b_w = b_w * scale
    m_k = o_k < K
    tl.store(ids_ptr + i_t * stride_i + o_k, b_ids, mask=m_k)
    tl.store(w_ptr + i_t * stride_w + o_k, b_w, mask=m_k)


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, *, sigmoid: bool, n_group: int = 1,
              topk_group: int = 1, group_top2: bool = True, normalise: bool = True,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route T tokens among E experts from the gate's logits [T, E] fp32 (unit last stride).

    scores = sigmoid(logits) (``sigmoid``) or softmax over E; the choice is scores + bias [E] fp32
    (None: no bias). With n_group > 1 the experts form n_group equal groups of consecutive indices,
    each scored by its top-2 choice values summed (``group_top2``, DeepSeek-V3's ``noaux_tc``) or its
    largest (``group_limited_greedy``), and only the topk_group best groups are eligible. The top_k
    eligible experts by choice value are chosen; their weights are the unbiased scores, divided by their
    sum (+ 1e-20) when ``normalise``, times ``scale``.

    Returns (ids [T, top_k] int64, weights [T, top_k] fp32), experts in descending choice order (ties:
    see the module doc)."""
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2, contiguous=False)
    require(logits.stride(1) == 1, f"logits must have a unit last stride, got strides {logits.stride()}")
    t, e = logits.shape
    require(n_group >= 1 and e % n_group == 0, f"{e} experts do not split into {n_group} groups")
    require(1 <= topk_group <= n_group, f"topk_group must be in 1..{n_group}, got {topk_group}")
    per_group = e // n_group
    limit = n_group > 1
    require(not (limit and group_top2) or per_group >= 2, "top-2 group scores need >= 2 experts per group")
    require(1 <= top_k <= (topk_group * per_group if limit else e),
            f"top_k {top_k} exceeds the {topk_group * per_group if limit else e} eligible experts")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32,), shape=(e,), device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        _router_kernel[(t,)](logits, logits if bias is None else bias, ids, weights, logits.stride(0), ids.stride(0),
                             weights.stride(0), scale, G=n_group, EG=per_group, TOPK_GROUP=topk_group, K=top_k,
                             SIGMOID=sigmoid, HAS_BIAS=bias is not None, LIMIT_GROUPS=limit, GROUP_TOP2=group_top2,
                             NORMALISE=normalise, LIBDEVICE=not is_interpreter(),
                             BLOCK_G=triton.next_power_of_2(n_group), BLOCK_J=triton.next_power_of_2(per_group),
                             BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return ids, weights
