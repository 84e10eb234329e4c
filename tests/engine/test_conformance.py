"""Conformance: Hearth's engine against Hugging Face transformers on tiny random configs of every
model type (deepseek_v32, glm_moe_dsa, deepseek_v3, deepseek_v2, qwen3_moe, mixtral, glm4_moe).

Tolerances: fp32 logits must agree to 1e-4 absolute (observed ~5e-6; logits are O(5)); bf16 no
worse than the reference's own bf16 error (median per token, with slack) and its top-1 agreement.
Prompts are longer than index_topk (16) so DSA sparsity is active; greedy decoding runs 40 steps
through absorbed decode and the paged cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.engine import Engine, EngineConfig, SamplingParams, load_model
from hearth.engine.config import ModelConfig
from hearth.engine.testing.tiny import ARCHS, write_tiny_model
from tests.engine.conftest import TEST_DEVICE, dequantize_reference, hf_greedy, hf_model

FP32_ATOL = 1e-4


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, tiny_models):
    ids = _prompt(48)
    ref = _reference_logits(hf_model(tiny_models[arch]), ids)
    ours = load_model(str(tiny_models[arch]), device=TEST_DEVICE, dtype="float32")
    whole = ours.logits(ids)
    assert whole.shape == ref.shape
    assert (whole - ref).abs().max() < FP32_ATOL
    chunked = ours.logits(ids, chunk_size=11)  # prefill starting mid-page at several positions
    assert (chunked - ref).abs().max() < FP32_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_matches_transformers(arch, tiny_models):
    prompt, steps = _prompt(24, seed=1), 40
    expected = hf_greedy(hf_model(tiny_models[arch]), prompt, steps)
    engine = Engine.load(str(tiny_models[arch]), EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16))
    sampling = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    events = list(engine.generate(prompt_token_ids=prompt, sampling=sampling))
    got = [t for e in events if hasattr(e, "token_ids") for t in e.token_ids]
    assert got == expected
    assert events[-1].reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v32", "deepseek_v2", "glm4_moe"])
def test_bfloat16_as_close_as_the_reference_in_bfloat16(arch, tiny_models):
    """bf16 flips discrete choices (expert routing, top-k) on some tokens, so the bar is the
    reference's own bf16 error against its fp32 logits: ours must be no worse (with slack)."""
    ids = _prompt(40, seed=3)
    ref = _reference_logits(hf_model(tiny_models[arch]), ids)
    ref_bf16 = _reference_logits(hf_model(tiny_models[arch], torch.bfloat16), ids)
    got = load_model(str(tiny_models[arch]), device=TEST_DEVICE, dtype="bfloat16").logits(ids)
    ours_err, ref_err = (got - ref).abs().max(-1).values, (ref_bf16 - ref).abs().max(-1).values
    assert ours_err.median() <= 2 * ref_err.median() + 0.02
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert top1 >= (ref_bf16.argmax(-1) == ref.argmax(-1)).float().mean() - 0.1


def test_absorbed_decode_equals_expanded_prefill(tiny_models):
    model = load_model(str(tiny_models["deepseek_v32"]), device=TEST_DEVICE, dtype="float32")
    ids = _prompt(40, seed=4)
    expanded = model.logits(ids)
    for layer in model.runner.model.layers:
        layer.self_attn.force_absorbed = True
    absorbed = model.logits(ids)
    assert (absorbed - expanded).abs().max() < 1e-4


def test_index_cache_layers_match_transformers(tiny_models, tmp_path):
    """GLM IndexCache: explicit indexer_types with two shared layers reusing the previous selection."""
    src = tiny_models["glm_moe_dsa"]
    path = tmp_path / "glm_shared"
    shutil.copytree(src, path)
    raw = json.loads((path / "config.json").read_text())
    raw["indexer_types"] = ["full", "shared", "shared", "full"]
    (path / "config.json").write_text(json.dumps(raw))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):  # shared layers ship no indexer weights
        tensors = load_file(str(path / file))
        keep = {k: v for k, v in tensors.items()
                if not any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for i in (1, 2))}
        save_file(keep, str(path / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for i in (1, 2))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))

    config = ModelConfig.from_file(path)
    assert [config.runs_indexer(i) for i in range(4)] == [True, False, False, True]
    reference = hf_model(path)
    assert list(reference.config.indexer_types) == list(config.indexer_types)
    ids = _prompt(48, seed=5)
    got = load_model(str(path), device=TEST_DEVICE, dtype="float32").logits(ids, chunk_size=20)
    assert (got - _reference_logits(reference, ids)).abs().max() < FP32_ATOL


def test_glm_index_topk_freq_derivation_matches_transformers(tiny_models):
    config = ModelConfig.from_file(tiny_models["glm_moe_dsa"])
    assert list(hf_model(tiny_models["glm_moe_dsa"]).config.indexer_types) == list(config.indexer_types)
    assert "shared" in config.indexer_types


def _dequantized_copy(src, dst) -> int:
    """A copy of an FP8 checkpoint with every FP8 weight dequantised (and no quantization_config), for the
    transformers reference; returns how many FP8 weights there were."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(raw))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {name: t for file in files for name, t in load_file(str(dst / file)).items()}
    fp8_names = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    for name in fp8_names:
        tensors[name] = dequantize_reference(tensors[name], tensors.pop(name + "_scale_inv"))
    for file in files:
        save_file({n: t for n, t in tensors.items() if index["weight_map"][n] == file}, str(dst / file),
                  metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return len(fp8_names)


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_checkpoint_matches_dequantized_reference(tiny_fp8_model, tmp_path, keep_fp8):
    deq = tmp_path / "dequantized"
    assert _dequantized_copy(tiny_fp8_model, deq) > 10

    ids = _prompt(40, seed=6)
    ref = _reference_logits(hf_model(deq), ids)
    got = load_model(str(tiny_fp8_model), device=TEST_DEVICE, dtype="float32", keep_fp8=keep_fp8).logits(ids)
    assert (got - ref).abs().max() < FP32_ATOL
    if keep_fp8:
        from hearth.engine.models.layers import Fp8Linear

        model = load_model(str(tiny_fp8_model), device=TEST_DEVICE, dtype="float32", keep_fp8=True).runner.model
        assert any(isinstance(m, Fp8Linear) for m in model.modules())


@pytest.mark.parametrize("weights", ["dequantized", "fp8", "fp8_kernels"])
@pytest.mark.parametrize("arch,overrides", [("glm4_moe", {}), ("qwen3_moe", {"attention_bias": True}),
                                            ("mixtral", {})])
def test_fp8_gqa_checkpoint_matches_dequantized_reference(tmp_path, monkeypatch, arch, overrides, weights):
    """GLM-4.5 and Qwen3 FP8 checkpoints with q/k/v biases, kept in FP8 (keep_fp8, the default on CUDA):
    the biases are added after the FP8 product, on the per-call dequantisation and on the FP8 kernels (forced
    on the CPU under Triton's interpreter). The tiny Mixtral stores its router in FP8: not a linear layer, it is
    dequantised at load even with keep_fp8."""
    from hearth.engine.models import layers

    src = write_tiny_model(tmp_path / "fp8", arch, seed=3, fp8=True, overrides=overrides)
    assert _dequantized_copy(src, tmp_path / "dequantized") > 10
    if weights == "fp8_kernels" and TEST_DEVICE == "cpu":
        monkeypatch.setattr(layers, "fp8_kernels_apply", lambda x, block: block == (128, 128))
    ids = _prompt(40, seed=8)
    ref = _reference_logits(hf_model(tmp_path / "dequantized"), ids)
    ours = load_model(str(src), device=TEST_DEVICE, dtype="float32", keep_fp8=weights != "dequantized")
    assert (ours.logits(ids) - ref).abs().max() < FP32_ATOL
    kept = [m for m in ours.runner.model.modules() if isinstance(m, layers.Fp8Linear)]
    assert bool(kept) == (weights != "dequantized")
    if weights != "dequantized" and arch != "mixtral":
        assert any(m.bias is not None for m in kept)
    if arch == "mixtral":  # the FP8 router became a float parameter
        assert ours.runner.model.layers[0].block_sparse_moe.gate.weight.dtype == torch.float32


@pytest.mark.gpu
def test_fp8_biases_on_the_gpu_kernels_in_bfloat16(tmp_path):
    """The serving default (CUDA, bf16, keep_fp8): GLM-4.5's biased q/k/v projections through the FP8 kernels
    agree with the same checkpoint dequantised at load up to bf16 rounding (dropped biases moved logits by ~3)."""
    src = write_tiny_model(tmp_path / "glm", "glm4_moe", seed=3, fp8=True)
    ids = _prompt(40, seed=9)
    kept = load_model(str(src), device="cuda", dtype="bfloat16", keep_fp8=True)
    assert any(getattr(m, "bias", None) is not None for m in kept.runner.model.modules()
               if type(m).__name__ == "Fp8Linear")
    got = kept.logits(ids)
    ref = load_model(str(src), device="cuda", dtype="bfloat16", keep_fp8=False).logits(ids)
    row_err = (got - ref).abs().max(-1).values
    assert row_err.median() < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_faithful_mode_rounds_but_stays_close(tiny_models):
    ids = _prompt(40, seed=7)
    plain = load_model(str(tiny_models["deepseek_v32"]), device=TEST_DEVICE, dtype="float32").logits(ids)
    faithful = load_model(str(tiny_models["deepseek_v32"]), device=TEST_DEVICE, dtype="float32",
                          faithful=True).logits(ids)
    row_err = (faithful - plain).abs().max(-1).values
    assert row_err.max() > 1e-6  # the FP8 round trips really happen
    # Before sparsity starts (position < index_topk) only the latent cache's FP8 rounding acts;
    # it can still flip an expert choice here and there, so the bar is on the typical token.
    dense = slice(0, 16)
    assert row_err[dense].median() < 0.05 * (plain.max() - plain.min())
    assert (faithful.argmax(-1)[dense] == plain.argmax(-1)[dense]).float().mean() >= 0.85
