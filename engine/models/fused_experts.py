"""Routed experts resident on the GPU through the fused MoE kernel (hearth.kernels.moe).

Each MoE layer's experts are stacked once into ``w13 [E, 2I, D]`` (gate rows, then up rows) and
``w2 [E, D, I]`` — bf16/fp16, or FP8 e4m3 with the checkpoint's 128x128 block scales — and the
expert modules' parameters become views into those tensors, so there is no second copy. A call is
one grouped kernel launch pair with no host synchronisation (the router's choice never goes back to
the host), which also lets a decode step run inside a CUDA graph. ``MoE.local_experts``, a Python
loop over the experts in use, stays the CPU path and the reference.

gpt-oss's experts are stacked already (``gate_up_proj`` [E, D, 2I] with gate and up columns
interleaved, ``down_proj`` [E, I, D]): they are transposed once into the kernel's row-major
``w13`` [E, 2I, D] (rows still interleaved) and ``w2`` [E, D, I], the parameters become transposed
views of those, and the kernel adds the biases and the clamped SwiGLU (``ExpertExtras``). Experts
the loader kept in the release's MXFP4 (:meth:`GptOssExperts.keep_mxfp4`) are already in the
kernel's layout (``*_blocks`` [E, out, in/32, 16] + ``*_scales``): the kernel reads them as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.models.gpt_oss import GptOssExperts
from hearth.engine.models.layers import Fp8Linear
from hearth.kernels.moe import ExpertExtras, fused_moe
from hearth.kernels.moe.fused_moe import weight_format

_SCALE_BLOCK = (128, 128)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


class FusedExperts:
    """The ``MoE.backend`` of one layer: ``(layer, x [T, D], ids [T, K], weights [T, K] fp32) -> [T, D]``.
    Weights and scales as :func:`fused_moe` takes them (float, FP8 or MXFP4)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None, s2: torch.Tensor | None,
                 extras: ExpertExtras | None = None):
        self.w13, self.w2, self.s13, self.s2 = w13, w2, s13, s2
        self.extras = extras or ExpertExtras()
        self.format = weight_format(w13, s13)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = fused_moe(x.contiguous(), ids, weights.float(), self.w13, self.w2, self.s13, self.s2, extras=self.extras)
        return out.to(x.dtype)


def _projections(moe) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    return [tuple(getattr(expert, name) for name in expert._names) for expert in moe.experts]


def _stackable(projs: list[tuple[nn.Module, nn.Module, nn.Module]], require_cuda: bool) -> str | None:
    """"fp8", "float" or None (mixed kinds, not on CUDA, unsupported block size)."""
    flat = [p for triple in projs for p in triple]
    if require_cuda and not all(p.weight.is_cuda for p in flat):
        return None
    if all(isinstance(p, Fp8Linear) and p.block == _SCALE_BLOCK for p in flat):
        return "fp8"
    if (all(type(p) is nn.Linear and p.weight.dtype in _FLOAT for p in flat)
            and len({p.weight.dtype for p in flat}) == 1):
        return "float"
    return None


def _repoint(module: nn.Module, name: str, view: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(view, requires_grad=False))


def stack_layer(moe, require_cuda: bool = True) -> FusedExperts | None:
    """Stack one MoE layer's experts (see the module doc); None when they cannot be stacked.
    require_cuda=False also stacks CPU experts (tests: the kernel under Triton's interpreter)."""
    projs = _projections(moe)
    kind = _stackable(projs, require_cuda)
    if kind is None or not projs:
        return None
    gate0, _, down0 = projs[0]
    inter, hidden = gate0.weight.shape
    n = len(projs)
    w13 = torch.empty(n, 2 * inter, hidden, dtype=gate0.weight.dtype, device=gate0.weight.device)
    w2 = torch.empty(n, hidden, inter, dtype=down0.weight.dtype, device=down0.weight.device)
    s13 = s2 = None
    if kind == "fp8":
        (si, sd), (sdi, sii) = gate0.weight_scale_inv.shape, down0.weight_scale_inv.shape
        s13 = torch.empty(n, 2 * si, sd, dtype=torch.float32, device=w13.device)
        s2 = torch.empty(n, sdi, sii, dtype=torch.float32, device=w13.device)
    for e, (gate, up, down) in enumerate(projs):
        w13[e, :inter].copy_(gate.weight)
        w13[e, inter:].copy_(up.weight)
        w2[e].copy_(down.weight)
        _repoint(gate, "weight", w13[e, :inter])
        _repoint(up, "weight", w13[e, inter:])
        _repoint(down, "weight", w2[e])
        if kind == "fp8":
            si = gate.weight_scale_inv.shape[0]
            s13[e, :si].copy_(gate.weight_scale_inv)
            s13[e, si:].copy_(up.weight_scale_inv)
            s2[e].copy_(down.weight_scale_inv)
            _repoint(gate, "weight_scale_inv", s13[e, :si])
            _repoint(up, "weight_scale_inv", s13[e, si:])
            _repoint(down, "weight_scale_inv", s2[e])
    return FusedExperts(w13, w2, s13, s2)


def _gpt_oss_extras(experts: GptOssExperts) -> ExpertExtras:
    return ExpertExtras(b13=experts.gate_up_proj_bias, b2=experts.down_proj_bias, swiglu_limit=experts.limit,
                        swiglu_alpha=experts.alpha, interleaved=True)


def stack_gpt_oss(experts: GptOssExperts, require_cuda: bool = True) -> FusedExperts | None:
    """gpt-oss's experts of one layer in the kernel's layout (see the module doc); None when not on
    CUDA (with require_cuda) or neither float nor (both projections) MXFP4."""
    packed13, packed2 = experts.mxfp4("gate_up_proj"), experts.mxfp4("down_proj")
    if packed13 is not None and packed2 is not None:
        if require_cuda and not packed13[0].is_cuda:
            return None
        return FusedExperts(packed13[0], packed2[0], packed13[1], packed2[1], _gpt_oss_extras(experts))
    if packed13 is not None or packed2 is not None:
        return None
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if (require_cuda and not gate_up.is_cuda) or gate_up.dtype not in _FLOAT or down.dtype != gate_up.dtype:
        return None
    w13 = gate_up.transpose(1, 2).contiguous()  # [E, 2I, D]: row 2j gate j, row 2j + 1 up j
    w2 = down.transpose(1, 2).contiguous()  # [E, D, I]
    _repoint(experts, "gate_up_proj", w13.transpose(1, 2))
    _repoint(experts, "down_proj", w2.transpose(1, 2))
    return FusedExperts(w13, w2, None, None, _gpt_oss_extras(experts))


def applies(device: torch.device) -> bool:
    """Whether resident experts on ``device`` take the fused kernel (the runner asks; CUDA)."""
    return device.type == "cuda"


def enable(model, require_cuda: bool = True) -> int:
    """Give every MoE layer of ``model`` whose experts sit on CUDA (and have no other backend) the
    fused backend. Returns how many layers got it."""
    done = 0
    for layer in model.layers:
        moe = layer.mlp
        if not layer.is_moe or moe.backend is not None:
            continue
        if isinstance(moe.experts, GptOssExperts):
            backend = stack_gpt_oss(moe.experts, require_cuda)
        elif len(moe.experts):
            backend = stack_layer(moe, require_cuda)
        else:
            continue
        if backend is not None:
            moe.backend = backend
            done += 1
    return done
