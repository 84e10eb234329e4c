"""Tiny Hub-layout checkpoints for the engine tests (written once per session) and the Hugging Face
transformers reference loaded from the same files (transformers is a test-only dependency)."""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch

from hearth.engine.testing.tiny import ARCHS, write_tiny_model

# The conformance suite runs on the CPU in CI and on the GPU machine with HEARTH_TEST_DEVICE=cuda
# (and HEARTH_TEST_DTYPE=bfloat16 for the bf16 run of the exact-match tests).
TEST_DEVICE = os.environ.get("HEARTH_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_fp8") / "deepseek_v32", "deepseek_v32", seed=2, fp8=True)


def hf_model(path: Path, dtype: torch.dtype = torch.float32, **kwargs):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager",
                                                              **kwargs)
    return honor_swiglu_config(model).eval()


def honor_swiglu_config(model):
    """gpt-oss's clamped SwiGLU with the config's ``swiglu_limit`` / ``swiglu_alpha``, in every transformers.

    transformers 5.24 reads both from the config; older releases (5.17, on the GPU machine) hard-code the
    release values 7.0 and 1.702 in ``GptOssExperts`` and ignore the config. The tiny gpt-oss config sets
    ``swiglu_limit`` 1.5 so that the clamp acts on small random activations, so an old reference would
    compute another function than the config describes; this sets the reference to the config's values.
    """
    config = model.config
    if getattr(config, "model_type", None) != "gpt_oss":
        return model
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            module.limit = getattr(config, "swiglu_limit", 7.0)
            module.alpha = getattr(config, "swiglu_alpha", 1.702)
    return model


def dequantize_reference(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Independent FP8 block dequantisation for the tests (W[i, j] * s[i // 128, j // 128])."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols)
    for bi in range(math.ceil(rows / block)):
        for bj in range(math.ceil(cols / block)):
            r, c = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[r, c] = weight[r, c].float() * scale[bi, bj]
    return out


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with the reference model's own KV cache, one token per forward."""
    # transformers 5.24 renamed past_key_values to cache; older versions swallow unknown kwargs.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), **{cache_arg: result.past_key_values}, use_cache=True)
    return out


def run_to_completion(engine, prompts, sampling) -> list[list[int]]:
    """Add every prompt at once, step the engine until all finish; the tokens of each, in order."""
    from hearth.engine import TokenDelta

    ids = [engine.add_request(prompt_token_ids=p, sampling=sampling) for p in prompts]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, TokenDelta):
                out[event.request_id].extend(event.token_ids)
    return [out[i] for i in ids]


@pytest.fixture
def kernel_path(monkeypatch):
    """On the CPU, the DSA kernel path as CUDA would take it (the kernels run under Triton's interpreter)."""
    if TEST_DEVICE == "cpu":
        from hearth.engine.models import dsa_kernels

        real = dsa_kernels.kernels_apply
        monkeypatch.setattr(dsa_kernels, "kernels_apply", lambda config, block, device, dtype:
                            real(config, block, torch.device("cuda"), dtype))


@pytest.fixture
def fused_experts_path(monkeypatch):
    """On the CPU, resident experts through the fused MoE kernel as on CUDA (under Triton's interpreter):
    the runner picks it and the loader keeps gpt-oss's MXFP4 experts packed for it."""
    if TEST_DEVICE == "cpu":
        from hearth.engine.models import fused_experts

        real = fused_experts.enable
        monkeypatch.setattr(fused_experts, "applies", lambda device: True)
        monkeypatch.setattr(fused_experts, "enable", lambda model: real(model, require_cuda=False))
