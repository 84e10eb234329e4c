"""Test helpers: write a small MoE checkpoint in the Hugging Face tensor names, and a plain-torch
MoE over its tensors (independent of the store's byte layout)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

PROJ_SHAPES = {"gate_proj": lambda d, i: (i, d), "up_proj": lambda d, i: (i, d), "down_proj": lambda d, i: (d, i)}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def make_expert_tensors(
    layers: list[int], num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random routed-expert tensors; FP8 gets power-of-two ``weight_scale_inv`` blocks (edges partial)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        for e in range(num_experts):
            for proj, shape_of in PROJ_SHAPES.items():
                shape = shape_of(hidden, inter)
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                w = torch.randn(shape, generator=g)
                if dtype == torch.float8_e4m3fn:
                    out[f"{name}.weight"] = (w * 8).to(dtype)
                    exp = torch.randint(-9, -5, (_cdiv(shape[0], 128), _cdiv(shape[1], 128)), generator=g)
                    out[f"{name}.weight_scale_inv"] = torch.exp2(exp.float())
                else:
                    out[f"{name}.weight"] = (w * 0.05).to(dtype)
    return out


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], num_files: int = 2) -> Path:
    """Split ``tensors`` over ``num_files`` safetensors files with a ``model.safetensors.index.json``."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_files):
        fname = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::num_files]}
        save_file(part, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def dense_weight(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """fp32 weight of ``name`` (without '.weight'), dequantised by its 128x128 block scales if FP8."""
    w = tensors[f"{name}.weight"].float()
    scale = tensors.get(f"{name}.weight_scale_inv")
    if scale is not None:
        rows = torch.arange(w.shape[0]) // 128
        cols = torch.arange(w.shape[1]) // 128
        w = w * scale[rows][:, cols]
    return w


def reference_moe(
    tensors: dict[str, torch.Tensor], layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_k w[t,k] * down(silu(gate x) * up x), token by token; returns x.dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            name = f"model.layers.{layer}.mlp.experts.{int(ids[t, k])}"
            wg, wu, wd = (dense_weight(tensors, f"{name}.{p}").to(x.dtype) for p in PROJ_SHAPES)
            h = (F.silu(F.linear(x[t], wg).float()) * F.linear(x[t], wu).float()).to(x.dtype)
            out[t] += weights[t, k] * F.linear(h, wd).float()
    return out.to(x.dtype)
