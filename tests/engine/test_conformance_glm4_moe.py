"""GLM-4.5-family (``glm4_moe``) variants against transformers: the tiny model of the main
conformance suite is GLM-4.5-shaped (q/k norms, q/k/v biases, half-head rope, one dense layer, one
MTP layer to skip); these configs flip each switch the releases differ in (GLM-4.5-Air has no q/k
norms) and the rarer ones: whole-head rope, a rope factor only in ``rope_parameters`` or left out,
no attention biases, no dense layer, group-limited routing, top-1 without normalisation, no shared
expert, YaRN on the rotary part. fp32 logits within 1e-4 (whole and chunked prefill) and 40 greedy
tokens, as for the other families."""

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
IDS = torch.randint(3, 500, (44,), generator=torch.Generator().manual_seed(21)).tolist()
VARIANTS = {
    "air": {"use_qk_norm": False},
    "whole_head_rope_no_dense_layer": {"partial_rotary_factor": 1.0, "first_k_dense_replace": 0},
    "no_biases_two_dense_layers": {"attention_bias": False, "first_k_dense_replace": 2},
    "rope_factor_in_rope_parameters": {"partial_rotary_factor": None, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    "group_limited_routing": {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3},
    "top1_unnormalised_no_shared_expert": {"num_experts_per_tok": 1, "norm_topk_prob": False,
                                           "n_shared_experts": 0},
    "yarn": {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
}


def _write(tmp_path, overrides: dict, drop: tuple[str, ...] = ()):
    path = write_tiny_model(tmp_path / "glm", "glm4_moe", seed=5, overrides=overrides)
    if drop:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in drop}))
    return path


def _check(path) -> None:
    reference = hf_model(path)
    with torch.no_grad():
        ref = reference(torch.tensor([IDS])).logits[0].float()
    ours = load_model(str(path), device=TEST_DEVICE, dtype="float32")
    assert (ours.logits(IDS) - ref).abs().max() < FP32_ATOL
    assert (ours.logits(IDS, chunk_size=13) - ref).abs().max() < FP32_ATOL
    prompt, steps = IDS[:20], 40
    engine = Engine.load(str(path), EngineConfig(device=TEST_DEVICE, dtype="float32", block_size=16))
    events = engine.generate(prompt_token_ids=prompt,
                             sampling=SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    assert [t for e in events if hasattr(e, "token_ids") for t in e.token_ids] == hf_greedy(reference, prompt, steps)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_transformers(tmp_path, name):
    _check(_write(tmp_path, VARIANTS[name]))


def test_rope_factor_left_out_means_half_heads(tmp_path):
    """transformers fills in 0.5 when config.json has no partial_rotary_factor at all."""
    path = _write(tmp_path, {}, drop=("partial_rotary_factor",))
    assert ModelConfig.from_file(path).rotary_dim == 8  # half of head_dim 16
    _check(path)


def test_config_fields():
    config = ModelConfig.from_dict(tiny_config("glm4_moe"))
    assert config.mlp_layer_types == ("dense", "sparse", "sparse")
    assert (config.scoring_func, config.topk_method, config.routed_scaling_factor) == ("sigmoid", "noaux_tc", 2.5)
    assert config.qk_norm and config.attention_bias and not config.o_proj_bias
    assert (config.head_dim, config.rotary_dim, config.latent_dim) == (16, 8, 2 * 2 * 16)
    assert config.num_nextn_predict_layers == 1 and not config.is_mla


@pytest.mark.parametrize("change,field", [
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 2}, "topk_group"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),  # 1.6 rotary dims
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_values_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict({**tiny_config("glm4_moe"), **change})
