"""Model configuration: ``config.json`` of a Hugging Face checkpoint -> frozen dataclasses.

Supported families (``model_type``): ``deepseek_v32`` (DeepSeek-V3.2 / -Exp / -Speciale),
``glm_moe_dsa`` (GLM-5, 5.1, 5.2), ``deepseek_v3`` (DeepSeek-V3/R1, Moonlight) and ``deepseek_v2``
(DeepSeek-V2 / V2-Lite) share MLA attention and DeepSeek-style MoE; the first two add DeepSeek
Sparse Attention (a lightning indexer choosing ``index_topk`` keys per query). ``qwen3_moe``
(Qwen3-30B-A3B, 235B-A22B) and ``mixtral`` (Mixtral 8x7B, 8x22B) use grouped-query attention with
a softmax top-k router. ``glm4_moe`` (GLM-4.5, 4.5-Air, 4.6, 4.7) uses grouped-query attention with
partial rotary embeddings and DeepSeek-style MoE (sigmoid router with a correction bias, a shared
expert, dense first layers). ``gpt_oss`` (gpt-oss-20b / 120b) adds learned attention sinks, sliding-window
layers, attention biases, a biased router and clamped-SwiGLU experts stored in MXFP4.

Fields config.json leaves out take the defaults of transformers' config class for the model_type
(``hearth.engine.config_defaults``), so that both build the same model. Anything that would change the math but is not
implemented, or a value that class ignores where other engines would honour it, raises
``UnsupportedModelError`` naming the field, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hearth.engine.api import CheckpointError, UnsupportedModelError
from hearth.engine.config_defaults import with_defaults

MLA_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa", "deepseek_v3", "deepseek_v2"})
GQA_MODEL_TYPES = frozenset({"qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"})
SUPPORTED_MODEL_TYPES = MLA_MODEL_TYPES | GQA_MODEL_TYPES
DSA_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa"})


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the 64 rope dims (shared by MLA and the DSA indexer).

    ``attention_factor`` multiplies cos/sin (YaRN); ``softmax_mscale`` multiplies the attention
    softmax scale (squared YaRN mscale of ``mscale_all_dim``), as in the reference code.
    """

    theta: float
    rope_type: Literal["default", "yarn"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True

    @staticmethod
    def _get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return self._get_mscale(self.factor, self.mscale) / self._get_mscale(self.factor, self.mscale_all_dim)
        return self._get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        if self.rope_type == "yarn" and self.mscale_all_dim:
            m = self._get_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


@dataclass(frozen=True)
class QuantConfig:
    """FP8 block-scaled weights as shipped by DeepSeek (e4m3, 128x128 blocks, fp32 scales)."""

    block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None  # "ue8m0": scales are powers of two (also used for activations)
    ignored_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one checkpoint. Field names follow the Hugging Face config keys."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int  # MLA only (0 for grouped-query attention)
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # MLA: the shared rope key's width; GQA: head_dim (rope on the whole head)
    v_head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    rope_interleave: bool  # MLA rope dims stored as interleaved pairs (True) or half-split
    # MoE
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    scoring_func: Literal["sigmoid", "softmax"]
    topk_method: Literal["noaux_tc", "greedy", "group_limited_greedy"]
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[Literal["dense", "sparse"], ...]
    # DSA indexer (None when the model has no indexer)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    indexer_rope_interleave: bool = False
    indexer_types: tuple[Literal["full", "shared"], ...] | None = None
    # Grouped-query attention (qwen3_moe, mixtral, glm4_moe, gpt_oss)
    num_key_value_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False  # RMSNorm on each q / k head before rope (Qwen3, GLM-4.5 with use_qk_norm)
    attention_bias: bool = False  # biases on q_proj, k_proj, v_proj
    o_proj_bias: bool = False  # and on o_proj (Qwen3, gpt-oss tie it to attention_bias; GLM-4.5 never has one)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * factor dims of each head (GLM-4.5: 0.5)
    sliding_window: int | None = None
    moe_module: str = "mlp"  # "block_sparse_moe" in Mixtral checkpoints
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    # gpt-oss: per-layer attention kind, learned sinks, clamped SwiGLU experts (limit None = plain SwiGLU)
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    mxfp4_experts: bool = False  # routed experts stored as MXFP4 blocks + e8m0 scales in the checkpoint
    # Misc
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    quantization: QuantConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each GQA head that rope turns (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_MODEL_TYPES

    @property
    def latent_dim(self) -> int:
        """Width of one token's cache row per layer: MLA's normalised latent + shared rope key, or
        GQA's keys then values of every KV head."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        if not self.is_mla:
            return self.head_dim**-0.5
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    def window(self, layer: int) -> int | None:
        """Sliding-window length of ``layer``'s attention (None = full causal attention)."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def runs_indexer(self, layer: int) -> bool:
        """True for DSA layers that run their own indexer ("full"), False for IndexCache
        "shared" layers that reuse the previous full layer's selection."""
        return self.has_indexer and self.indexer_types is not None and self.indexer_types[layer] == "full"

    def with_index_retention(self, freq: int | None = None, offset: int | None = None,
                             pattern: str | None = None) -> ModelConfig:
        """IndexCache retention for models that ship an indexer in every layer: keep the indexer
        on "full" layers only (every ``freq``-th after ``offset``, or an F/S ``pattern``); the
        other layers reuse the previous full layer's top-k."""
        if not self.has_indexer or (freq is None and pattern is None):
            return self
        raw: dict[str, Any] = {"index_topk_freq": freq, "index_skip_topk_offset": offset,
                               "index_topk_pattern": pattern}
        types = _indexer_types({k: v for k, v in raw.items() if v is not None}, self.num_hidden_layers)
        return dataclasses.replace(self, indexer_types=types)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse_checked(raw, "config.json")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no config.json in the model folder") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return _parse_checked(raw, str(path))


# Sizes and counts that must be positive (the rest may be 0 where a model lacks the part).
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")


def _parse_checked(raw: dict[str, Any], where: str) -> ModelConfig:
    """``_parse`` with values of the wrong type or sign reported as a CheckpointError naming the field,
    instead of failing later inside the model code."""
    try:
        config = _parse(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: a value has the wrong type ({exc})") from None
    for name, value in dataclasses.asdict(config).items():
        is_count = isinstance(value, int) and not isinstance(value, bool) and not name.endswith("_token_id")
        if is_count and (value <= 0 if name in _POSITIVE_FIELDS else value < 0):
            raise CheckpointError(f"{where}: {name} must be {'positive' if name in _POSITIVE_FIELDS else '>= 0'}, "
                                  f"got {value}")
    return config


def _require(raw: dict[str, Any], key: str, model_type: str) -> Any:
    if raw.get(key) is None:
        raise UnsupportedModelError(f"config.json ({model_type}): missing required field '{key}'")
    return raw[key]


def _check(ok: bool, field_name: str, value: Any, supported: str) -> None:
    if not ok:
        raise UnsupportedModelError(
            f"config.json: unsupported value {field_name}={value!r} (Hearth supports {supported})"
        )


def _check_routing(n_experts: int, top_k: Any, n_group: int, topk_group: int, topk_method: str) -> None:
    """Router sizes that would crash a top-k or route differently from transformers: the top-k must fit
    the experts, and group-limited routing needs whole groups, each of at least two experts for noaux_tc's
    group score (the sum of its two best), and enough experts in the kept groups for the top-k."""
    _check(top_k is not None and 1 <= int(top_k) <= n_experts, "num_experts_per_tok", top_k,
           f"1..{n_experts} (the number of routed experts)")
    if topk_method == "greedy":
        return
    _check(n_experts % n_group == 0, "n_group", n_group, "a divisor of n_routed_experts")
    _check(1 <= topk_group <= n_group, "topk_group", topk_group, f"1..n_group ({n_group})")
    per_group = n_experts // n_group
    if topk_method == "noaux_tc":
        _check(per_group >= 2, "n_group", n_group, "at most n_routed_experts / 2 (a group scores its top two experts)")
    if n_group > 1:
        _check(int(top_k) <= topk_group * per_group, "num_experts_per_tok", top_k,
               f"at most topk_group * experts per group ({topk_group * per_group})")


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope dict as transformers reads it: legacy ``rope_scaling``, when given, replaces
    ``rope_parameters`` (``PreTrainedConfig.convert_rope_params_to_dict``), it is not merged into it."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise TypeError(f"rope_scaling / rope_parameters must be an object, got {params!r}")
    return dict(params)


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = _rope_params(raw)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "deepseek_yarn":
        rope_type = "yarn"
    _check(rope_type in ("default", "yarn"), "rope_scaling.type", rope_type, "default or yarn")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = float(params.get("factor") or 1.0)
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
        ),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor_override=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _check_whole_head_rope(raw: dict[str, Any]) -> None:
    """Qwen3-MoE, Mixtral and gpt-oss rotate whole heads; a partial rotary factor (top level or in the
    rope dict, where transformers moves it) would rotate fewer dims there than Hearth does."""
    factor = _rope_params(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    _check(float(factor or 1.0) == 1.0, "partial_rotary_factor", factor, f"1.0 for {raw['model_type']}")


def _check_act(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    _check(act in ("silu", "swish"), "hidden_act", act, "silu (or its alias swish)")


def _parse_quant(raw: dict[str, Any]) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    _check(method == "fp8", "quantization_config.quant_method", method, "fp8 (block-scaled FP8)")
    fmt = q.get("fmt", "e4m3")
    _check(fmt == "e4m3", "quantization_config.fmt", fmt, "e4m3")
    block = tuple(q.get("weight_block_size") or (128, 128))
    _check(len(block) == 2 and tuple(int(b) for b in block) == (128, 128), "quantization_config.weight_block_size",
           list(block), "[128, 128] (the block of the DeepSeek, GLM and Qwen3 FP8 releases)")
    scale_fmt = q.get("scale_fmt")
    _check(scale_fmt in (None, "ue8m0"), "quantization_config.scale_fmt", scale_fmt, "ue8m0 or none")
    ignored = tuple(q.get("modules_to_not_convert") or ())
    return QuantConfig(block_size=(int(block[0]), int(block[1])), scale_fmt=scale_fmt, ignored_modules=ignored)


def _mlp_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """MLA families, as transformers builds them: the first ``first_k_dense_replace`` layers dense, the rest
    MoE; DeepSeek-V3.2 and GLM-5 may list ``mlp_layer_types`` instead (DeepSeek-V3 and V2 ignore that key)."""
    model_type = raw["model_type"]
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    derived = tuple("dense" if i < first_dense else "sparse" for i in range(num_layers))
    explicit = raw.get("mlp_layer_types")
    if explicit:
        if len(explicit) != num_layers or any(t not in ("dense", "sparse") for t in explicit):
            raise UnsupportedModelError("config.json: mlp_layer_types must list 'dense'/'sparse' per layer")
        if model_type in DSA_MODEL_TYPES:
            return tuple(explicit)
        _check(tuple(explicit) == derived, "mlp_layer_types", explicit,
               f"first_k_dense_replace's layers for {model_type} (transformers ignores mlp_layer_types there)")
    # NOTE: DeepSeek's remote code and vLLM make only every moe_layer_freq-th layer MoE, transformers ignores the
    # key; no release sets it to anything but 1, so any other value is refused rather than guessed.
    freq = raw.get("moe_layer_freq")
    _check(freq in (None, 1), "moe_layer_freq", freq, "1")
    return derived


def _indexer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    explicit = raw.get("indexer_types")
    if explicit:
        if len(explicit) != num_layers or any(t not in ("full", "shared") for t in explicit):
            raise UnsupportedModelError("config.json: indexer_types must list 'full'/'shared' per layer")
        types = tuple(explicit)
    elif raw.get("index_topk_pattern"):
        pattern = str(raw["index_topk_pattern"]).upper()
        _check(len(pattern) == num_layers and set(pattern) <= {"F", "S"}, "index_topk_pattern", pattern,
               f"a string of F/S of length {num_layers}")
        types = tuple("full" if c == "F" else "shared" for c in pattern)
    else:
        freq = int(raw.get("index_topk_freq") or 1)
        offset = int(raw.get("index_skip_topk_offset") if raw.get("index_skip_topk_offset") is not None else 2)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
    if types and types[0] != "full":
        raise UnsupportedModelError("config.json: the first layer must run its own indexer (indexer_types[0])")
    return types


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"config.json: unsupported model_type {model_type!r} "
            f"(Hearth runs {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    raw = with_defaults(raw)
    if model_type == "glm4_moe":
        return _parse_glm4_moe(raw)
    if model_type == "gpt_oss":
        return _parse_gpt_oss(raw)
    if model_type in GQA_MODEL_TYPES:
        return _parse_gqa(raw)
    return _parse_mla(raw)


def _mla_router(raw: dict[str, Any]) -> tuple[str, str, bool]:
    """(scoring_func, topk_method, norm_topk_prob) of an MLA family, as transformers routes it: DeepSeek-V3,
    V3.2 and GLM-5 always score with a sigmoid and route noaux_tc; DeepSeek-V2 always scores with a softmax,
    greedy or group-limited, and never renormalises. Those classes ignore other values of the keys, where
    DeepSeek's own code (and vLLM) would honour some; no release sets them, so they are refused."""
    model_type = raw["model_type"]
    v2 = model_type == "deepseek_v2"
    scoring = raw.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    _check(scoring == ("softmax" if v2 else "sigmoid"), "scoring_func", scoring,
           f"{'softmax' if v2 else 'sigmoid'} for {model_type}")
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    topk_method = raw.get("topk_method") or methods[0]
    _check(topk_method in methods, "topk_method", topk_method, f"{' or '.join(methods)} for {model_type}")
    norm = bool(raw.get("norm_topk_prob"))
    # NOTE: DeepSeek's V2 code renormalises when norm_topk_prob is set (and top-k > 1), transformers never does.
    _check(not (v2 and norm), "norm_topk_prob", raw.get("norm_topk_prob"), "false for deepseek_v2")
    return scoring, topk_method, norm


def _dsa_indexer(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of the DSA lightning indexer (DeepSeek-V3.2, GLM-5)."""
    model_type = raw["model_type"]
    req = lambda key: _require(raw, key, model_type)  # noqa: E731
    k_norm_type = raw.get("index_k_norm_type", "layer")
    _check(k_norm_type == "layer", "index_k_norm_type", k_norm_type, "layer (LayerNorm with bias)")
    q_lora = raw.get("q_lora_rank")
    _check(q_lora is not None, "q_lora_rank", q_lora, "a number for DSA models (the indexer reads q_a)")
    head_dim, topk = int(req("index_head_dim")), int(raw["index_topk"])
    rope_dim = int(req("qk_rope_head_dim"))
    _check(head_dim >= rope_dim, "index_head_dim", head_dim, f"at least qk_rope_head_dim ({rope_dim})")
    _check(topk >= 1, "index_topk", topk, "a positive number")
    # transformers fixes the indexer's rope layout per class (half-split for DeepSeek-V3.2, whose first release
    # had interleaved by mistake, see dsa-models.md section 1.5; interleaved for GLM-5); vLLM and SGLang read the
    # key. The releases agree with the class, so a config that says otherwise is refused.
    interleave = model_type == "glm_moe_dsa"
    given = raw.get("indexer_rope_interleave")
    _check(given is None or bool(given) == interleave, "indexer_rope_interleave", given,
           f"{str(interleave).lower()} for {model_type}")
    # NOTE: IndexCache keys are read for DeepSeek-V3.2 too (as vLLM and SGLang do; train/ builds such models),
    # although transformers' DeepseekV32 has no IndexCache; the loader refuses a checkpoint that ships the
    # indexer weights of layers config.json shares, which transformers would run.
    return {"index_n_heads": int(req("index_n_heads")), "index_head_dim": head_dim, "index_topk": topk,
            "indexer_rope_interleave": interleave, "indexer_types": _indexer_types(raw, num_layers)}


def _parse_mla(raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V3.2, GLM-5, DeepSeek-V3 and DeepSeek-V2: MLA attention and DeepSeek-style MoE."""
    model_type = raw["model_type"]
    req = lambda key: _require(raw, key, model_type)  # noqa: E731
    num_layers = int(req("num_hidden_layers"))
    _check_act(raw)
    _check(not raw.get("attention_bias"), "attention_bias", raw.get("attention_bias"), "false")
    _check(not raw.get("mlp_bias"), "mlp_bias", raw.get("mlp_bias"), "false")
    heads, kv_heads = int(req("num_attention_heads")), raw.get("num_key_value_heads")
    _check(kv_heads in (None, heads), "num_key_value_heads", kv_heads, "== num_attention_heads (MLA)")

    scoring, topk_method, norm_topk_prob = _mla_router(raw)
    n_experts = int(raw.get("n_routed_experts") or 0)
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    top_k = raw.get("num_experts_per_tok")
    mlp_layer_types = _mlp_layer_types(raw, num_layers)
    if "sparse" in mlp_layer_types:
        _check(n_experts > 0, "n_routed_experts", n_experts, "a positive number (the model has MoE layers)")
        if top_k is None:
            req("num_experts_per_tok")
        _check_routing(n_experts, top_k, n_group, topk_group, topk_method)
    indexer = _dsa_indexer(raw, num_layers) if model_type in DSA_MODEL_TYPES else {}

    default_interleave = model_type != "deepseek_v3" or raw.get("rope_interleave", True)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        intermediate_size=int(req("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(req("kv_lora_rank")),
        qk_nope_head_dim=int(req("qk_nope_head_dim")),
        qk_rope_head_dim=int(req("qk_rope_head_dim")),
        v_head_dim=int(req("v_head_dim")),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        rope=_parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        rope_interleave=bool(default_interleave),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        n_routed_experts=n_experts,
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(top_k or 0),
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring,
        topk_method=topk_method,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        mlp_layer_types=mlp_layer_types,
        **indexer,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        quantization=_parse_quant(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )


def _qwen3_moe_num_experts(raw: dict[str, Any]) -> int:
    """``num_experts``, or ``num_local_experts`` (the name transformers 5 writes when it saves a
    Qwen3-MoE config); transformers' default of 128 when neither is given."""
    for key in ("num_experts", "num_local_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return 128


def _gqa_layer_types(raw: dict[str, Any], num_layers: int, n_experts: int) -> tuple[str, ...]:
    """Mixtral: every layer sparse. Qwen3-MoE, as transformers decides: a layer is sparse iff it is
    not in ``mlp_only_layers``, there are experts, and ``(layer + 1) % decoder_sparse_step == 0``."""
    if raw["model_type"] == "mixtral":
        return ("sparse",) * num_layers
    dense = set(raw.get("mlp_only_layers") or [])
    step = raw.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    _check(step >= 1, "decoder_sparse_step", step, "a positive number")
    return tuple("sparse" if n_experts > 0 and i not in dense and (i + 1) % step == 0 else "dense"
                 for i in range(num_layers))


def _parse_gqa(raw: dict[str, Any]) -> ModelConfig:
    """qwen3_moe and mixtral: grouped-query attention (+ Qwen3's q/k norms), softmax top-k routing."""
    model_type = raw["model_type"]
    req = lambda key: _require(raw, key, model_type)  # noqa: E731
    mixtral = model_type == "mixtral"
    _check_act(raw)
    _check_whole_head_rope(raw)
    if model_type == "qwen3_moe":
        _check(not raw.get("use_sliding_window"), "use_sliding_window", raw.get("use_sliding_window"), "false")
    heads, hidden = int(req("num_attention_heads")), int(req("hidden_size"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    _check(heads % kv_heads == 0, "num_key_value_heads", kv_heads, "a divisor of num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    num_layers = int(req("num_hidden_layers"))
    n_experts = int(raw.get("num_local_experts") or 0) if mixtral else _qwen3_moe_num_experts(raw)
    layer_types = _gqa_layer_types(raw, num_layers, n_experts)
    top_k = raw.get("num_experts_per_tok")
    if "sparse" in layer_types:
        _check_routing(n_experts, top_k, 1, 1, "greedy")
    inter = int(req("intermediate_size"))
    # NOTE: transformers' Mixtral has no attention biases whatever attention_bias says (MixtralConfig has no
    # such field); Qwen3-MoE biases q/k/v and o.
    bias = not mixtral and bool(raw.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type, vocab_size=int(req("vocab_size")), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=num_layers, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=0,
        qk_nope_head_dim=0, qk_rope_head_dim=head_dim, v_head_dim=head_dim,
        rms_norm_eps=float(raw["rms_norm_eps"]), rope=_parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096), rope_interleave=False,
        moe_intermediate_size=inter if mixtral else int(raw.get("moe_intermediate_size") or inter),
        n_routed_experts=n_experts, n_shared_experts=0, num_experts_per_tok=int(top_k or 0),
        n_group=1, topk_group=1, scoring_func="softmax", topk_method="greedy",
        norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)), routed_scaling_factor=1.0,
        mlp_layer_types=layer_types,
        num_key_value_heads=kv_heads, head_dim=head_dim, qk_norm=model_type == "qwen3_moe",
        attention_bias=bias, o_proj_bias=bias,
        sliding_window=raw.get("sliding_window") if mixtral else None,
        moe_module="block_sparse_moe" if mixtral else "mlp",
        expert_proj_names=("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), quantization=_parse_quant(raw),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )


_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}  # transformers' default when config.json has none


def _gpt_oss_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    explicit = raw.get("layer_types")
    if explicit is None:  # the reference's default: sliding on even layers, full on odd ones
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
    kinds = ("sliding_attention", "full_attention")
    if len(explicit) != num_layers or any(t not in kinds for t in explicit):
        raise UnsupportedModelError("config.json: layer_types must list 'sliding_attention'/'full_attention' "
                                    "per layer")
    return tuple(explicit)


def _gpt_oss_mxfp4(raw: dict[str, Any]) -> bool:
    q = raw.get("quantization_config")
    if not q:
        return False
    method = q.get("quant_method")
    _check(method == "mxfp4", "quantization_config.quant_method", method, "mxfp4 for gpt_oss")
    return not q.get("dequantize", False)


def _parse_gpt_oss(raw: dict[str, Any]) -> ModelConfig:
    """gpt-oss: grouped-query attention with biases and per-head sinks, sliding-window and full
    layers, a router with bias (softmax over the top-k logits) and clamped-SwiGLU experts."""
    req = lambda key: _require(raw, key, "gpt_oss")  # noqa: E731
    _check_act(raw)
    _check_whole_head_rope(raw)
    heads, hidden = int(req("num_attention_heads")), int(req("hidden_size"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    _check(heads % kv_heads == 0, "num_key_value_heads", kv_heads, "a divisor of num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    num_layers = int(req("num_hidden_layers"))
    n_experts = int(req("num_local_experts"))
    # transformers reads num_experts_per_tok only; the releases also carry the same count as experts_per_token,
    # so a config where the two disagree is refused rather than run with one of them.
    top_k = raw.get("num_experts_per_tok")
    _check_routing(n_experts, top_k, 1, 1, "greedy")
    other = raw.get("experts_per_token")
    _check(other is None or other == top_k, "experts_per_token", other, f"num_experts_per_tok's value ({top_k})")
    inter = int(req("intermediate_size"))
    rope_raw = dict(raw)
    if raw.get("rope_parameters") is None and not raw.get("rope_scaling"):
        rope_raw["rope_parameters"] = _GPT_OSS_ROPE
    window = raw.get("sliding_window")
    bias = bool(raw.get("attention_bias"))
    layer_types = _gpt_oss_layer_types(raw, num_layers)
    if "sliding_attention" in layer_types:
        _check(isinstance(window, int) and window > 0, "sliding_window", window, "a positive number")
    return ModelConfig(
        model_type="gpt_oss", vocab_size=int(req("vocab_size")), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=num_layers, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=0,
        qk_nope_head_dim=0, qk_rope_head_dim=head_dim, v_head_dim=head_dim,
        rms_norm_eps=float(raw["rms_norm_eps"]), rope=_parse_rope(rope_raw),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 131072), rope_interleave=False,
        moe_intermediate_size=inter, n_routed_experts=n_experts, n_shared_experts=0,
        num_experts_per_tok=int(top_k),
        n_group=1, topk_group=1, scoring_func="softmax", topk_method="greedy", norm_topk_prob=True,
        routed_scaling_factor=1.0, mlp_layer_types=("sparse",) * num_layers,
        num_key_value_heads=kv_heads, head_dim=head_dim, attention_bias=bias,
        o_proj_bias=bias, sliding_window=window, layer_types=layer_types, attention_sinks=True,
        swiglu_alpha=float(raw["swiglu_alpha"]), swiglu_limit=float(raw["swiglu_limit"]),
        mxfp4_experts=_gpt_oss_mxfp4(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )


def _glm4_moe_partial_rotary_factor(raw: dict[str, Any]) -> float:
    """transformers' order: legacy ``rope_scaling`` (which replaces ``rope_parameters`` when both are
    given), ``rope_parameters``, the top-level key, then 0.5 for configs that leave the key out.
    NOTE: an explicit ``null`` is not "left out": transformers then rotates whole heads, as Hearth does."""
    for params in (raw.get("rope_scaling"), raw.get("rope_parameters")):
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    if "partial_rotary_factor" not in raw:
        return 0.5
    factor = raw["partial_rotary_factor"]
    return 1.0 if factor is None else float(factor)


def _parse_glm4_moe(raw: dict[str, Any]) -> ModelConfig:
    """GLM-4.5 / 4.5-Air / 4.6 / 4.7: grouped-query attention (optional q/k norms, q/k/v biases,
    rope on the first ``partial_rotary_factor`` of each head), dense MLPs in the first
    ``first_k_dense_replace`` layers, then sigmoid-routed experts plus a shared expert. Fields a
    config leaves out take transformers' Glm4MoeConfig defaults."""
    model_type = "glm4_moe"
    req = lambda key: _require(raw, key, model_type)  # noqa: E731
    _check_act(raw)
    heads, hidden = int(req("num_attention_heads")), int(req("hidden_size"))
    kv_heads = int(req("num_key_value_heads"))
    _check(heads % kv_heads == 0, "num_key_value_heads", kv_heads, "a divisor of num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    partial = _glm4_moe_partial_rotary_factor(raw)
    rotary_dim = int(head_dim * partial)
    _check(0 < partial <= 1 and rotary_dim % 2 == 0, "partial_rotary_factor", partial,
           "a fraction in (0, 1] giving an even number of rotary dims")
    n_experts, top_k = int(req("n_routed_experts")), int(req("num_experts_per_tok"))
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    _check(n_experts > 0, "n_routed_experts", n_experts, "a positive number")
    _check_routing(n_experts, top_k, n_group, topk_group, "noaux_tc")
    num_layers = int(req("num_hidden_layers"))
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    inter = int(req("intermediate_size"))
    return ModelConfig(
        model_type=model_type, vocab_size=int(req("vocab_size")), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=num_layers, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=0,
        qk_nope_head_dim=0, qk_rope_head_dim=head_dim, v_head_dim=head_dim,
        rms_norm_eps=float(raw["rms_norm_eps"]), rope=_parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 131072), rope_interleave=False,
        moe_intermediate_size=int(req("moe_intermediate_size")), n_routed_experts=n_experts,
        n_shared_experts=int(raw.get("n_shared_experts") or 0), num_experts_per_tok=top_k,
        n_group=n_group, topk_group=topk_group, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=bool(raw.get("norm_topk_prob")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        mlp_layer_types=tuple("sparse" if i >= first_dense else "dense" for i in range(num_layers)),
        num_key_value_heads=kv_heads, head_dim=head_dim, qk_norm=bool(raw.get("use_qk_norm", False)),
        attention_bias=bool(raw.get("attention_bias", False)), partial_rotary_factor=partial,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        quantization=_parse_quant(raw), bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")), pad_token_id=raw.get("pad_token_id"),
    )
