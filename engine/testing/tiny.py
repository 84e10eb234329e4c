"""Tiny random models in the exact Hugging Face layout, for tests and the offline demo.

    python -m hearth.engine.testing.tiny --arch deepseek_v32 --out DIR [--seed S] [--fp8 | --mxfp4]

writes config.json, two safetensors shards + model.safetensors.index.json (real Hub tensor names,
per-expert weights), tokenizer.json trained with ``tokenizers``, tokenizer_config.json (+ a chat
template where the family has one) and generation_config.json. Output is deterministic by seed.
``--fp8`` stores the linear weights as FP8 e4m3 with 128x128 power-of-two block scales
(``weight_scale_inv``), like DeepSeek's releases; partial edge blocks occur on purpose. ``--mxfp4``
(gpt_oss) stores the experts as MXFP4 ``*_blocks`` + ``*_scales``, like the gpt-oss releases.

The weights are random: the text such a model writes is gibberish. Sizes are chosen so that DSA
is active on short prompts (index_topk 16) and FP8 blocks are partial (dims not multiples of 128).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hearth.engine.config import ModelConfig
from hearth.engine.models.layers import FP8_MAX
from hearth.kernels.moe.mxfp4 import quantize_mxfp4

VOCAB_SIZE = 512
ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe",
         "gpt_oss")
# Tokenizer family of each architecture (the GQA families reuse the DeepSeek-V3-style chat template).
_TOKENIZER_FAMILY = {"qwen3_moe": "deepseek_v3", "mixtral": "deepseek_v3"}
_GQA: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": 2,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "float32", "attention_bias": False,
}

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "attention_bias": False,
    "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "float32",
}
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _gpt_oss_config() -> dict[str, Any]:
    """Real gpt-oss keys at tiny widths. The window (8) is shorter than the test prompts; the SwiGLU
    limit is lowered so the clamps act on random weights; YaRN as the release configures it."""
    layers = 4
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **_GQA, "intermediate_size": 32,
            "num_hidden_layers": layers, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
            "attention_bias": True, "sliding_window": 8, "swiglu_limit": 1.5, "rms_norm_eps": 1e-5,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 512}}


def tiny_config(arch: str) -> dict[str, Any]:
    """The config.json of the tiny model of one architecture (Hub-style keys)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if arch == "qwen3_moe":
        return {"model_type": arch, "architectures": ["Qwen3MoeForCausalLM"], **_GQA, "num_experts": 8,
                "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [0], "use_sliding_window": False}
    if arch == "gpt_oss":
        return _gpt_oss_config()
    if arch == "mixtral":
        return {"model_type": arch, "architectures": ["MixtralForCausalLM"], **_GQA, "num_local_experts": 8,
                "intermediate_size": 48, "sliding_window": 24}
    if arch == "glm4_moe":
        return glm4_moe_tiny_config()
    dsa = {"index_n_heads": 8, "index_head_dim": 32, "index_topk": 16}
    sigmoid = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
               "routed_scaling_factor": 2.5}
    configs = {
        "deepseek_v32": {"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 3, "n_group": 4,
                         "topk_group": 2, **sigmoid, **dsa, "rope_theta": 10000.0, "rope_scaling": dict(_YARN),
                         "num_nextn_predict_layers": 1},
        "glm_moe_dsa": {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4, "n_group": 1,
                        "topk_group": 1, **sigmoid, **dsa, "rms_norm_eps": 1e-5, "index_topk_freq": 2,
                        "index_skip_topk_offset": 2, "indexer_rope_interleave": True,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3, "n_group": 4,
                        "topk_group": 2, **sigmoid, "rope_theta": 10000.0, "rope_interleave": True,
                        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
        "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 3, "q_lora_rank": None,
                        "n_group": 1, "topk_group": 1, "scoring_func": "softmax", "topk_method": "greedy",
                        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rope_theta": 10000.0,
                        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
    }
    return {"model_type": arch, **_COMMON, **configs[arch]}


def glm4_moe_tiny_config() -> dict[str, Any]:
    """GLM-4.5-shaped (q/k norms, q/k/v biases, rope on half of each head, one dense layer first,
    sigmoid router with a correction bias and routed scaling, a shared expert, one MTP layer)."""
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **_GQA, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True,
            "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1}


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    from hearth.engine.models.deepseek import DeepseekForCausalLM

    with torch.device("meta"):
        model = DeepseekForCausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".sinks"):  # large enough that a head's sink takes a real share of its attention
        return torch.randn(shape, generator=gen)
    if len(shape) == 3:  # gpt-oss's stacked experts [E, in, out]
        return torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[1]))
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) * (1.0 / math.sqrt(fan_in))


def is_fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Which tensors DeepSeek's FP8 releases store in FP8: the 2-D linear weights except the
    embedding, lm_head, router gate and the indexer's weights_proj. (Mixtral's router,
    ``block_sparse_moe.gate``, is stored in FP8 on purpose: a weight of a module that is not a linear
    layer, which the loader must dequantise even with keep_fp8.)"""
    excluded = ("embed_tokens", "lm_head", "mlp.gate.weight", "weights_proj", "norm")
    return len(shape) == 2 and name.endswith(".weight") and not any(e in name for e in excluded)


def quantize_fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 power-of-two scale_inv [ceil(r/128), ceil(c/128)]) with W ~= W8 * s."""
    rows, cols = weight.shape
    pr, pc = math.ceil(rows / block) * block, math.ceil(cols / block) * block
    padded = torch.zeros(pr, pc, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(pr // block, block, pc // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4)  # (rb, cb)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(pr, pc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def make_weights(config: ModelConfig, seed: int, fp8: bool = False, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of the model (plus an MTP layer stub if configured).
    ``mxfp4``: gpt-oss's stacked expert weights as MXFP4 (stored [E, out, in] like the release)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():
        value = _init(name, shape, gen)
        if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(value.transpose(1, 2))
        elif fp8 and is_fp8_quantized(name, shape):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(value)
        else:
            tensors[name] = value.contiguous()
    for i in range(config.num_nextn_predict_layers):  # MTP layers: present in releases, skipped by engines
        prefix = f"model.layers.{config.num_hidden_layers + i}"
        tensors[f"{prefix}.enorm.weight"] = torch.ones(config.hidden_size)
        tensors[f"{prefix}.eh_proj.weight"] = _init("eh", (config.hidden_size, 2 * config.hidden_size), gen)
    return tensors


def _write_shards(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / file_name), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = file_name
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# Widths the GPU DSA kernels need (indexer head dim 128, 576-wide latents, >= 16 indexer heads).
KERNEL_SHAPES: dict[str, Any] = {"hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
                                 "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
                                 "qk_rope_head_dim": 64, "v_head_dim": 32, "index_n_heads": 16,
                                 "index_head_dim": 128, "index_topk": 64}


def write_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, fp8: bool = False,
                     overrides: dict[str, Any] | None = None, mxfp4: bool = False,
                     drop: tuple[str, ...] = ()) -> Path:
    """Write a complete Hub-layout model folder; returns its path. ``overrides`` replace
    config.json fields (e.g. KERNEL_SHAPES); ``drop`` leaves fields out (the weights then follow
    the defaults Hearth reads in their place). ``mxfp4``: gpt_oss experts in MXFP4, as released."""
    from hearth.engine.testing.tiny_tokenizer import write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {k: v for k, v in {**tiny_config(arch), **(overrides or {})}.items() if k not in drop}
    special = write_tiny_tokenizer(out, _TOKENIZER_FAMILY.get(arch, arch), VOCAB_SIZE)
    raw.update(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"],
               pad_token_id=special.get("pad_token_id"))
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    if mxfp4:
        if arch != "gpt_oss":
            raise ValueError("MXFP4 experts are gpt_oss's format (use --fp8 for the DeepSeek family)")
        raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    config = ModelConfig.from_dict(raw)
    _write_shards(out, make_weights(config, seed, fp8, mxfp4))
    generation = {"bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"],
                  "do_sample": True, "temperature": 1.0, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hearth.engine.testing.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="store linear weights as FP8 with block scales")
    parser.add_argument("--mxfp4", action="store_true", help="gpt_oss: store the experts as MXFP4, as released")
    parser.add_argument("--kernel-shapes", action="store_true", help="widths the GPU DSA kernels accept")
    args = parser.parse_args(argv)
    try:
        path = write_tiny_model(args.out, args.arch, args.seed, args.fp8,
                                KERNEL_SHAPES if args.kernel_shapes else None, args.mxfp4)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.arch} tiny model to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
