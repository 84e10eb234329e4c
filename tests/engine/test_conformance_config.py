"""config.json variants against transformers: fields a config leaves out take the default of transformers'
config class of that model_type (not a Hearth default); a legacy ``rope_scaling`` replaces ``rope_parameters``;
keys transformers ignores for a model_type are ignored (Mixtral's attention_bias); a checkpoint transformers
saved without shared experts (zero-size tensors) loads. Parse-level against ``AutoConfig.for_model``, and
fp32 logits within 1e-4 (whole and chunked prefill) on tiny random models. The values Hearth refuses
instead are tested in test_loader_errors.py."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from hearth.engine import load_model
from hearth.engine.config import ModelConfig
from hearth.engine.testing.tiny import _init, tiny_config, write_tiny_model
from tests.engine.conftest import TEST_DEVICE, hf_model

FP32_ATOL = 1e-4
IDS = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(31)).tolist()

_GROUPS_OFF = {"n_group": 1, "topk_group": 1}  # so that a default top-k of 8 fits the 8 tiny experts
# (model_type, field left out, other changes to the tiny config)
LEFT_OUT = [
    *[(arch, key, {}) for arch in ("deepseek_v32", "deepseek_v3", "glm_moe_dsa") for key in (
        "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "norm_topk_prob",
        "routed_scaling_factor", "n_routed_experts")],
    *[(arch, "num_experts_per_tok", _GROUPS_OFF) for arch in ("deepseek_v32", "deepseek_v3", "glm_moe_dsa")],
    *[(arch, "topk_group", {}) for arch in ("deepseek_v32", "deepseek_v3")],
    *[(arch, "n_group", {"n_routed_experts": 16}) for arch in ("deepseek_v32", "deepseek_v3")],
    ("deepseek_v3", "q_lora_rank", {}), ("glm_moe_dsa", "rms_norm_eps", {}),
    *[("deepseek_v2", key, {}) for key in ("moe_intermediate_size", "q_lora_rank", "n_routed_experts",
                                           "n_shared_experts", "first_k_dense_replace")],
    *[("qwen3_moe", key, {}) for key in ("num_key_value_heads", "num_experts_per_tok", "moe_intermediate_size")],
    *[("mixtral", key, {}) for key in ("rope_theta", "rms_norm_eps", "num_local_experts", "num_experts_per_tok",
                                       "num_key_value_heads")],
    ("glm4_moe", "num_experts_per_tok", {}),
    *[("gpt_oss", key, {}) for key in ("head_dim", "sliding_window", "num_key_value_heads")],
]


def _layer_kinds(reference) -> list[str]:
    config = reference
    if hasattr(config, "mlp_layer_types"):
        return list(config.mlp_layer_types)
    return ["dense" if i < config.first_k_dense_replace else "sparse" for i in range(config.num_hidden_layers)]


def _view(key: str, ours: ModelConfig, reference) -> tuple:
    """(Hearth's value, transformers' value) of the field ``key``."""
    if key == "first_k_dense_replace":
        return list(ours.mlp_layer_types), _layer_kinds(reference)
    if key == "rope_theta":
        return ours.rope.theta, reference.rope_parameters["rope_theta"]
    if key in ("num_local_experts", "n_routed_experts"):
        return ours.n_routed_experts, getattr(reference, key)
    if key == "head_dim":
        return ours.head_dim, reference.head_dim
    return getattr(ours, key), getattr(reference, key)


@pytest.mark.parametrize("arch,key,changes", LEFT_OUT, ids=[f"{a}-{k}" for a, k, _ in LEFT_OUT])
def test_left_out_field_takes_the_transformers_default(arch, key, changes):
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in {**tiny_config(arch), **changes}.items() if k != key}
    ours, theirs = _view(key, ModelConfig.from_dict(raw), transformers.AutoConfig.for_model(**raw))
    assert ours == (pytest.approx(theirs) if isinstance(theirs, float) else theirs)


def _check_logits(path, reference=None) -> None:
    reference = reference if reference is not None else hf_model(path)
    with torch.no_grad():
        ref = reference(torch.tensor([IDS])).logits[0].float()
    ours = load_model(str(path), device=TEST_DEVICE, dtype="float32")
    assert (ours.logits(IDS) - ref).abs().max() < FP32_ATOL
    assert (ours.logits(IDS, chunk_size=9) - ref).abs().max() < FP32_ATOL


@pytest.mark.parametrize("arch,drop,changes", [
    ("deepseek_v3", ("norm_topk_prob", "routed_scaling_factor", "n_shared_experts"), {}),
    ("deepseek_v32", ("num_experts_per_tok",), _GROUPS_OFF),
    ("glm_moe_dsa", ("first_k_dense_replace", "rms_norm_eps"), {}),
    ("mixtral", ("rope_theta", "rms_norm_eps"), {}),
    ("qwen3_moe", ("num_key_value_heads", "num_experts_per_tok"), {}),
    ("gpt_oss", ("head_dim", "sliding_window"), {}),
    ("glm4_moe", ("num_experts_per_tok",), {}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_model_with_left_out_fields_matches_transformers(tmp_path, arch, drop, changes):
    _check_logits(write_tiny_model(tmp_path / arch, arch, seed=6, overrides=changes, drop=drop))


def test_rope_scaling_replaces_rope_parameters(tmp_path):
    """Both keys given: transformers takes the legacy rope_scaling whole and drops rope_parameters."""
    changes = {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
    path = write_tiny_model(tmp_path / "v3", "deepseek_v3", seed=7, overrides=changes)
    rope = ModelConfig.from_file(path).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("yarn", 10000.0, 4.0)
    _check_logits(path)


def test_mixtral_attention_bias_is_ignored_as_transformers_does(tmp_path):
    """transformers' Mixtral has no attention biases whatever config.json says."""
    path = write_tiny_model(tmp_path / "mixtral", "mixtral", seed=8, overrides={"attention_bias": True})
    assert not ModelConfig.from_file(path).attention_bias
    _check_logits(path)


def test_swish_is_silu(tmp_path):
    path = write_tiny_model(tmp_path / "v2", "deepseek_v2", seed=9, overrides={"hidden_act": "swish"})
    _check_logits(path)


def test_checkpoint_saved_by_transformers_without_shared_experts_loads(tmp_path):
    """transformers builds (and saves) a shared-expert MLP of width 0 when n_shared_experts is 0: its
    zero-element tensors are no weights, not unexpected tensors."""
    transformers = pytest.importorskip("transformers")
    raw = {**tiny_config("deepseek_v3"), "n_shared_experts": 0}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel():
                param.copy_(_init(name, tuple(param.shape), gen))
    model.save_pretrained(str(tmp_path / "saved"))
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), framework="pt") as handle:
        empty = [n for n in handle.keys() if math.prod(handle.get_slice(n).get_shape()) == 0]  # noqa: SIM118
    assert any(".shared_experts." in n for n in empty)
    _check_logits(tmp_path / "saved", model.eval())
