"""Qwen3-MoE layer kinds follow transformers' rule exactly: a layer is sparse iff it is not in
``mlp_only_layers``, the model has experts and ``(layer + 1) % decoder_sparse_step == 0``; a config
saved by transformers (which writes ``num_local_experts`` instead of ``num_experts``) loads too.
Checked against transformers on fp32 logits (1e-4, whole and chunked prefill) and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from hearth.engine import Engine, EngineConfig, SamplingParams, load_model
from hearth.engine.api import UnsupportedModelError
from hearth.engine.config import ModelConfig
from hearth.engine.testing.tiny import tiny_config, write_tiny_model
from tests.engine.conftest import TEST_DEVICE, hf_greedy, hf_model

FP32_ATOL = 1e-4
IDS = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(11)).tolist()


def _reference_kinds(reference) -> list[str]:
    return ["sparse" if hasattr(layer.mlp, "experts") else "dense" for layer in reference.model.layers]


def _check_logits(path, reference) -> None:
    with torch.no_grad():
        ref = reference(torch.tensor([IDS])).logits[0].float()
    ours = load_model(str(path), device=TEST_DEVICE, dtype="float32")
    assert (ours.logits(IDS) - ref).abs().max() < FP32_ATOL
    assert (ours.logits(IDS, chunk_size=9) - ref).abs().max() < FP32_ATOL


@pytest.mark.parametrize("overrides,kinds", [
    ({"decoder_sparse_step": 2, "mlp_only_layers": []}, ["dense", "sparse", "dense", "sparse"]),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, ["dense", "sparse", "dense", "dense"]),
    ({"decoder_sparse_step": 3, "mlp_only_layers": [0]}, ["dense", "dense", "sparse", "dense"]),
    ({"decoder_sparse_step": 1, "num_experts": 0}, ["dense"] * 4),
])
def test_layer_kinds_match_transformers(tmp_path, overrides, kinds):
    path = write_tiny_model(tmp_path / "qwen3", "qwen3_moe", seed=4, overrides={"num_hidden_layers": 4, **overrides})
    reference = hf_model(path)
    assert list(ModelConfig.from_file(path).mlp_layer_types) == _reference_kinds(reference) == kinds
    _check_logits(path, reference)
    prompt, steps = IDS[:16], 40
    engine = Engine.load(str(path), EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16))
    events = engine.generate(prompt_token_ids=prompt,
                             sampling=SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    assert [t for e in events if hasattr(e, "token_ids") for t in e.token_ids] == hf_greedy(reference, prompt, steps)


def test_a_checkpoint_saved_by_transformers_loads(tmp_path):
    """transformers 5 saves Qwen3-MoE's expert count as ``num_local_experts``; decoder_sparse_step 2
    then made every layer dense and loading failed on the first sparse layer's missing dense MLP."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in tiny_config("qwen3_moe").items() if k not in ("model_type", "architectures")}
    raw.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**raw))
    model.save_pretrained(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "num_experts" not in saved and saved["num_local_experts"] == 8
    assert ModelConfig.from_file(tmp_path / "saved").mlp_layer_types == ("dense", "sparse", "dense", "sparse")
    _check_logits(tmp_path / "saved", model.eval())


def test_a_zero_sparse_step_is_refused():
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step"):
        ModelConfig.from_dict({**tiny_config("qwen3_moe"), "decoder_sparse_step": 0})


def test_expert_count_defaults_to_transformers():
    raw = {k: v for k, v in tiny_config("qwen3_moe").items() if k != "num_experts"}
    assert ModelConfig.from_dict(raw).n_routed_experts == 128  # Qwen3MoeConfig's default
