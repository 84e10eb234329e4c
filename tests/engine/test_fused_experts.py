"""Resident experts through the fused MoE kernel (hearth.engine.models.fused_experts): same logits
as the per-expert Python loop, parameters turned into views of the stacked tensors (no copy).
On the CPU the kernel runs under Triton's interpreter; on the GPU machine (HEARTH_TEST_DEVICE=cuda)
for real."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import load_model
from hearth.engine.models import fused_experts
from hearth.engine.testing.tiny import write_tiny_model
from tests.engine.conftest import TEST_DEVICE


@pytest.mark.parametrize("arch,fp8", [("deepseek_v3", False), ("deepseek_v32", True), ("mixtral", False),
                                     ("glm4_moe", False)])
def test_fused_backend_matches_expert_loop(tmp_path, arch, fp8):
    path = write_tiny_model(tmp_path / arch, arch, seed=5, fp8=fp8)
    ids = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    model = load_model(str(path), device=TEST_DEVICE, dtype="float32", keep_fp8=fp8, use_kernels="never")
    want = model.logits(ids)
    net = model.runner.model
    moe_layers = [layer.mlp for layer in net.layers if layer.is_moe]
    assert all(moe.backend is None for moe in moe_layers)  # use_kernels="never": the Python loop
    assert fused_experts.enable(net, require_cuda=False) == len(moe_layers) > 0
    backend = moe_layers[0].backend
    expert = moe_layers[0].experts[1]
    first = getattr(expert, expert._names[0])
    assert first.weight.data_ptr() == backend.w13[1].data_ptr()  # a view into the stack
    assert (backend.s13 is not None) == fp8
    got = model.logits(ids)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for moe in moe_layers:  # the loop still reads the (now transposed) views
        moe.backend = None
    assert (model.logits(ids) - want).abs().max() <= 1e-5


def test_gpt_oss_experts_through_the_fused_kernel(tmp_path):
    """gpt-oss's stacked experts (interleaved gate/up, biases, clamped SwiGLU with the tiny config's
    low limit) through the kernel: the logits of the per-expert loop, parameters turned into views."""
    path = write_tiny_model(tmp_path / "gpt_oss", "gpt_oss", seed=5)
    ids = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    model = load_model(str(path), device=TEST_DEVICE, dtype="float32", use_kernels="never")
    want = model.logits(ids)
    net = model.runner.model
    moe_layers = [layer.mlp for layer in net.layers if layer.is_moe]
    assert fused_experts.enable(net, require_cuda=False) == len(moe_layers) > 0
    backend, experts = moe_layers[0].backend, moe_layers[0].experts
    assert backend.extras.interleaved and backend.extras.swiglu_limit == 1.5
    assert experts.gate_up_proj.data_ptr() == backend.w13.data_ptr()  # a view into the kernel's layout
    assert torch.equal(experts.gate_up_proj[2, :, 1], backend.w13[2, 1])  # column 1 (up 0) is row 1
    got = model.logits(ids)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for moe in moe_layers:  # the loop still reads the (now transposed) views
        moe.backend = None
    assert (model.logits(ids) - want).abs().max() <= 1e-5
