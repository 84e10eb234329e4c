"""A tiny model rewired so that greedy decoding writes a fixed token script (for tests of how the
server parses what a model writes: reasoning, harmony channels, tool calls)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Every block's output projections: zeroed, the residual stream stays the current token's embedding.
_BLOCK_OUTPUTS = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias", "experts.down_proj",
                  "experts.down_proj_bias")


def rewire(src: Path, dst: Path, script: list[int]) -> Path:
    """Copy the checkpoint at ``src`` to ``dst`` with no attention or MLP output and an lm_head whose
    row for each scripted token points at its predecessor's normalised embedding: after
    ``script[i]`` the greedy next token is ``script[i + 1]``. Every token but the last must appear
    once in ``script`` (so "next token" is a function)."""
    assert len(set(script[:-1])) == len(script) - 1, "a scripted token repeats"
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = {name: t for file in files for name, t in load_file(str(file)).items()}
    embed, norm = tensors["model.embed_tokens.weight"], tensors["model.norm.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    head = torch.zeros_like(tensors["lm_head.weight"])
    for current, following in zip(script, script[1:]):
        head[following] = normed[current] / normed[current].norm()
    tensors["lm_head.weight"] = head
    for name in tensors:
        if name.endswith(_BLOCK_OUTPUTS):
            tensors[name] = torch.zeros_like(tensors[name])
    for file in files:
        keep = {n: t for n, t in tensors.items() if n in load_file(str(file))}
        save_file(keep, str(file), metadata={"format": "pt"})
    return dst
