"""Bad checkpoints give one clear error naming the file and the tensor; nothing half-loads."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hearth.engine.api import CheckpointError, UnsupportedModelError
from hearth.engine.config import ModelConfig
from hearth.engine.loader import load_checkpoint
from hearth.engine.testing.tiny import tiny_config


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_models["deepseek_v2"], path)
    return path


def _load(path):
    import torch

    return load_checkpoint(path, torch.device("cpu"), torch.float32)


def test_truncated_safetensors_names_the_file(model_copy):
    shard = model_copy / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        _load(model_copy)


def test_missing_shard_is_named(model_copy):
    (model_copy / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors.*missing"):
        _load(model_copy)


def test_wrong_shape_names_tensor_and_shapes(model_copy):
    shard = model_copy / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if n.endswith("o_proj.weight"))[0]
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        _load(model_copy)


def test_missing_tensor_is_named(model_copy):
    index_path = model_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model_copy / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    del tensors[name]
    del index["weight_map"][name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        _load(model_copy)


def test_unexpected_tensor_is_named(model_copy):
    shard = model_copy / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["model.layers.0.mlp.surprise.weight"] = tensors[sorted(tensors)[0]].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = model_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.surprise.weight"] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.surprise.weight'"):
        _load(model_copy)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("deepseek_v2")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle files are never loaded"):
        _load(tmp_path)


def test_unknown_model_type_and_unsupported_values():
    raw = tiny_config("deepseek_v3")
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'llama'"):
        ModelConfig.from_dict({**raw, "model_type": "llama"})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_dict({**raw, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="rope_scaling.type"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"type": "longrope"}})
    with pytest.raises(UnsupportedModelError, match="quant_method"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(UnsupportedModelError, match="n_group"):
        ModelConfig.from_dict({**raw, "n_group": 3})


def test_config_variants_parse():
    v32 = ModelConfig.from_dict(tiny_config("deepseek_v32"))
    assert v32.has_indexer and not v32.indexer_rope_interleave and v32.rope.rope_type == "yarn"
    assert v32.mlp_layer_types == ("dense", "sparse", "sparse")
    glm = ModelConfig.from_dict(tiny_config("glm_moe_dsa"))
    assert glm.indexer_rope_interleave and glm.rope.theta == 1e6
    assert glm.indexer_types == ("full", "full", "shared", "full")
    pattern = ModelConfig.from_dict({**tiny_config("glm_moe_dsa"), "index_topk_pattern": "FSSF"})
    assert pattern.indexer_types == ("full", "shared", "shared", "full")
    v2 = ModelConfig.from_dict(tiny_config("deepseek_v2"))
    assert v2.q_lora_rank is None and v2.scoring_func == "softmax" and not v2.has_indexer


# Values transformers ignores for the model_type (or cannot run) where DeepSeek's code or vLLM would honour
# them, and that no release sets: refused, naming the field and the value.
@pytest.mark.parametrize("arch,change,message", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'.*sigmoid"),
    ("deepseek_v32", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("glm_moe_dsa", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'.*softmax"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'.*noaux_tc"),
    ("deepseek_v32", {"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v32", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3", {"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types="),
    ("deepseek_v32", {"indexer_rope_interleave": True}, "indexer_rope_interleave=True"),
    ("glm_moe_dsa", {"indexer_rope_interleave": False}, "indexer_rope_interleave=False"),
    ("gpt_oss", {"num_experts_per_tok": 4}, "experts_per_token=2"),
])
def test_values_transformers_ignores_are_refused(arch, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**tiny_config(arch), **change})


def test_the_release_values_of_those_fields_still_parse():
    v32 = ModelConfig.from_dict({**tiny_config("deepseek_v32"), "moe_layer_freq": 1, "index_topk_freq": 1,
                                 "indexer_rope_interleave": False, "mlp_layer_types": ["dense", "sparse", "dense"]})
    assert v32.mlp_layer_types == ("dense", "sparse", "dense") and not v32.indexer_rope_interleave
    v2 = ModelConfig.from_dict({**tiny_config("deepseek_v2"), "topk_method": "group_limited_greedy", "n_group": 2})
    assert (v2.scoring_func, v2.topk_method, v2.norm_topk_prob) == ("softmax", "group_limited_greedy", False)
    assert ModelConfig.from_dict({**tiny_config("deepseek_v3"), "hidden_act": "swish"}).model_type == "deepseek_v3"


@pytest.mark.parametrize("arch,change,message", [
    *[(arch, {"num_experts_per_tok": k}, f"num_experts_per_tok={k}") for k in (0, 9)
      for arch in ("deepseek_v32", "deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe")],
    ("gpt_oss", {"num_experts_per_tok": 9, "experts_per_token": 9}, "num_experts_per_tok=9"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 4}, "n_group=8"),  # one expert per group: no top-2 score
    ("deepseek_v3", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "num_experts_per_tok": 3},
     "num_experts_per_tok=3"),
    ("deepseek_v3", {"n_routed_experts": 0}, "n_routed_experts=0"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk=0"),
    ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim=4"),
    ("gpt_oss", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ("mixtral", {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_out_of_range_values_are_refused(arch, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**tiny_config(arch), **change})


def test_deepseek_v32_index_sharing_over_shipped_indexers_is_refused(tmp_path):
    """transformers' DeepseekV32 has no IndexCache and runs every indexer the checkpoint ships: config.json keys
    that share those layers are refused at load instead of their weights being skipped. A checkpoint without the
    shared layers' indexers (built for IndexCache) loads."""
    import torch

    from hearth.engine.testing.tiny import write_tiny_model

    pruned = write_tiny_model(tmp_path / "pruned", "deepseek_v32", seed=1, overrides={"index_topk_pattern": "FSF"})
    assert not any(".layers.1.self_attn.indexer." in n for n in _load(pruned).state_dict())
    path = write_tiny_model(tmp_path / "full", "deepseek_v32", seed=1)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "index_topk_freq": 2, "index_skip_topk_offset": 1}))
    with pytest.raises(UnsupportedModelError, match="layers.1.self_attn.indexer.*index_topk_freq"):
        load_checkpoint(path, torch.device("cpu"), torch.float32)


def test_deepseek_v2_moe_needs_its_top_k():
    """DeepseekV2Config has no default top-k (None): a MoE config without it cannot run in transformers."""
    raw = {k: v for k, v in tiny_config("deepseek_v2").items() if k != "num_experts_per_tok"}
    with pytest.raises(UnsupportedModelError, match="missing required field 'num_experts_per_tok'"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantization_config_of_grouped_query_families_is_parsed(arch):
    raw = tiny_config(arch)
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert ModelConfig.from_dict({**raw, "quantization_config": fp8}).quantization.block_size == (128, 128)
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size=\[64, 64\]"):
        ModelConfig.from_dict({**raw, "quantization_config": {**fp8, "weight_block_size": [64, 64]}})
    for method in ("awq", "gptq"):
        with pytest.raises(UnsupportedModelError, match=f"quant_method='{method}'"):
            ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": method, "bits": 4}})


@pytest.fixture
def fp8_copy(tiny_fp8_model, tmp_path):
    path = tmp_path / "fp8"
    shutil.copytree(tiny_fp8_model, path)
    return path


def _edit_tensor(folder, edit) -> str:
    """Apply edit(name, tensors) -> changed name to the shard holding an FP8 attention weight."""
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(shard))
        name = next((n for n in sorted(tensors) if n.endswith("self_attn.o_proj.weight")), None)
        if name is not None:
            changed = edit(name, tensors)
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return changed
    raise AssertionError("no FP8 o_proj weight in the tiny checkpoint")


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_nan_weight_is_refused_at_load(fp8_copy, keep_fp8):
    import torch

    def poison(name, tensors):
        assert tensors[name].dtype == torch.float8_e4m3fn
        raw = tensors[name].view(torch.uint8).clone()
        raw.view(-1)[3] = 0x7F  # e4m3fn NaN
        tensors[name] = raw.view(torch.float8_e4m3fn)
        return name

    name = _edit_tensor(fp8_copy, poison)
    with pytest.raises(CheckpointError, match=f"'{name}' has 1 NaN/inf"):
        load_checkpoint(fp8_copy, torch.device("cpu"), torch.float32, keep_fp8=keep_fp8)


def test_inf_scale_is_refused(fp8_copy):
    def inf_scale(name, tensors):
        tensors[name + "_scale_inv"][0, 0] = float("inf")
        return name + "_scale_inv"

    name = _edit_tensor(fp8_copy, inf_scale)
    with pytest.raises(CheckpointError, match=f"'{name}' has 1 NaN/inf"):
        _load(fp8_copy)


def test_wrong_scale_shape_is_refused(fp8_copy):
    import torch

    def bad_shape(name, tensors):
        tensors[name + "_scale_inv"] = torch.ones(3, 5)
        return name + "_scale_inv"

    name = _edit_tensor(fp8_copy, bad_shape)
    with pytest.raises(CheckpointError, match=f"'{name}': FP8 scale shape \\(3, 5\\) does not match"):
        _load(fp8_copy)


def test_fp8_block_size_other_than_128_is_refused():
    raw = tiny_config("deepseek_v32")
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size.*\[64, 64\].*128, 128"):
        ModelConfig.from_dict({**raw, "quantization_config": quant})


def test_nan_routed_expert_is_refused_when_experts_are_offloaded(fp8_copy):
    import torch

    from hearth.engine import Engine, EngineConfig

    def poison(_, tensors):
        name = next(n for n in sorted(tensors) if ".experts." in n and n.endswith("down_proj.weight"))
        raw = tensors[name].view(torch.uint8).clone()
        raw.view(-1)[0] = 0xFF
        tensors[name] = raw.view(torch.float8_e4m3fn)
        return name

    for shard in sorted(fp8_copy.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if any(".experts." in n for n in tensors):
            name = poison(None, tensors)
            save_file(tensors, str(shard), metadata={"format": "pt"})
            break
    with pytest.raises(CheckpointError, match=f"{name.split('.experts.')[1].split('.')[0]}.*NaN/inf"):
        Engine.load(str(fp8_copy), EngineConfig(device="cpu", offload="always", expert_cache_slots=2))
