"""What transformers' config classes put in the fields a config.json leaves out (``with_defaults``), so that
Hearth and transformers build the same model from the same file. Plain tables: Hearth never imports
transformers.
"""

from __future__ import annotations

from typing import Any

# What transformers' config class of each model_type (transformers 5.25,
# models/<type>/configuration_<type>.py) puts in a field config.json leaves out, for the fields whose value the
# weights do not reveal (routing, norms, rope, windows) and a few sizes. Hearth fills the same values so that
# both compute the same model. The sizes that fix most tensor shapes (hidden_size, head dims, kv_lora_rank,
# indexer widths...) stay required: a config without them is broken, and saying so beats a shape mismatch.
# Qwen3-MoE's expert count and GLM-4.5's rotary factor are hearth.engine.config's own (they depend on other fields).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {  # DeepseekV3Config
        "q_lora_rank": 1536, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "deepseek_v32": {  # DeepseekV32Config
        "q_lora_rank": 1536, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000.0,
        "index_topk": 2048},
    "glm_moe_dsa": {  # GlmMoeDsaConfig
        "q_lora_rank": 2048, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "rope_theta": 10000.0,
        "index_topk": 2048},
    "deepseek_v2": {  # DeepseekV2Config; no num_experts_per_tok (None there), so MoE configs must give it
        "q_lora_rank": 1536, "moe_intermediate_size": 1407, "n_routed_experts": 64, "n_shared_experts": 2,
        "first_k_dense_replace": 0, "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "qwen3_moe": {  # Qwen3MoeConfig
        "num_key_value_heads": 4, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0},
    "mixtral": {  # MixtralConfig (default_theta 1e6)
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0},
    "glm4_moe": {  # Glm4MoeConfig
        "num_key_value_heads": 8, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 10000.0},
    "gpt_oss": {  # GptOssConfig (default_theta 150000; its default rope dict is _GPT_OSS_ROPE)
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
        "sliding_window": 128, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 150000.0},
}
# Other names the config classes accept for a field (their ``attribute_map``; DeepseekV32Config and
# GlmMoeDsaConfig also take ``num_experts``).
HF_ALIASES: dict[str, dict[str, str]] = {
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
    "deepseek_v32": {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"},
    "glm_moe_dsa": {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "glm4_moe": {"num_local_experts": "n_routed_experts"},
    "mixtral": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
}


def with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with aliases renamed and left-out fields filled in as transformers' config class does."""
    model_type = raw.get("model_type")
    filled = dict(raw)
    for alias, key in HF_ALIASES.get(model_type, {}).items():
        if key not in filled and alias in filled:
            filled[key] = filled[alias]
    return {**HF_DEFAULTS.get(model_type, {}), **filled}
