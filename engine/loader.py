"""Load a Hugging Face checkpoint folder (config.json + safetensors) into the model.

- Single ``model.safetensors`` or sharded with ``model.safetensors.index.json``; files are
  memory-mapped and read one tensor at a time straight onto the target device, so peak RAM is not
  twice the model. Pickle formats (``.bin``, ``.pt``, ``.pth``) are never loaded.
- FP8 block-scaled weights (``weight`` e4m3 + ``weight_scale_inv``) are either dequantised at load
  or kept in FP8 with their scales (``Fp8Linear``).
- gpt-oss's MXFP4 experts (``experts.gate_up_proj_blocks`` + ``_scales``, likewise ``down_proj``) are
  dequantised at load into the stacked expert parameters, or kept as MXFP4 (``keep_mxfp4``: the
  fused MoE kernel reads them directly).
- MTP layers (``model.layers.{num_hidden_layers + i}``) are skipped, as are indexer weights of
  layers configured to share the previous layer's top-k and tensors with no elements.
- Missing, unexpected and mis-shaped tensors and truncated/corrupt files raise one
  ``CheckpointError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hearth.engine.api import CheckpointError, UnsupportedModelError
from hearth.engine.config import ModelConfig
from hearth.engine.models.deepseek import DeepseekForCausalLM
from hearth.engine.models.gpt_oss import GptOssExperts
from hearth.engine.models.layers import Fp8Linear, Rotary, check_fp8_scales, dequantize_fp8_blocks, rope_inv_freq
from hearth.engine.models.mla import PLAIN_ATTENTION, AttentionPaths
from hearth.kernels._utils import count_nonfinite
from hearth.kernels.moe.mxfp4 import MXFP4_GROUP, count_nonfinite_mxfp4, dequantize_mxfp4

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FP32_PARAMS = re.compile(r"((mlp|block_sparse_moe)\.gate\.weight|e_score_correction_bias|indexer\.weights_proj\.weight"
                          r"|indexer\.k_norm\.)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointFiles:
    """The safetensors files of a model folder and which file holds each tensor."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.location: dict[str, Path] = {}
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self._read_index(index)
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                pickles = [p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES]
                hint = f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else ""
                raise CheckpointError(f"{folder}: no .safetensors weight files{hint}")
            for file in files:
                for name in self._keys(file):
                    self.location[name] = file
        self._handles: dict[Path, object] = {}

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        for file_name in sorted(set(weight_map.values())):
            path = self._shard_path(index, file_name)
            if not path.exists():
                raise CheckpointError(f"{path}: shard listed in {index.name} is missing")
            present = set(self._keys(path))
            for name, mapped in weight_map.items():
                if mapped == file_name and name not in present:
                    raise CheckpointError(f"{path}: tensor '{name}' listed in {index.name} is not in the file")
        self.location = {name: self.folder / f for name, f in weight_map.items()}

    def _shard_path(self, index: Path, file_name: str) -> Path:
        """A shard named by the index, refused unless it is a file of this folder: an index may come
        from anywhere, and ``../`` or an absolute path would read weights from elsewhere on disk."""
        parts = file_name.replace("\\", "/").split("/")
        path = self.folder / file_name
        # The shard itself may be a symlink (the Hugging Face cache links snapshot files to blobs);
        # the folder it sits in must not lead out of the model folder.
        escapes = (Path(file_name).is_absolute() or any(p in ("", "..") or ":" in p for p in parts)
                   or not path.parent.resolve().is_relative_to(self.folder.resolve()))
        if escapes:
            raise CheckpointError(f"{index}: shard {ascii(file_name)[:120]} is not a file inside the model folder; "
                                  "refusing to load it")
        return path

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                return list(handle.keys())
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None

    def _handle(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle

    def get(self, name: str) -> torch.Tensor:
        path = self.location[name]
        try:
            return self._handle(path).get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' (truncated or corrupt file?): {exc}") \
                from None

    def is_empty(self, name: str) -> bool:
        """Whether tensor ``name`` holds no elements (from its header; nothing is read)."""
        path = self.location[name]
        try:
            return 0 in self._handle(path).get_slice(name).get_shape()
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' (truncated or corrupt file?): {exc}") \
                from None

    def close(self) -> None:
        self._handles.clear()


def _is_skipped(name: str, config: ModelConfig) -> bool:
    match = _LAYER.match(name)
    if match is None:
        return "rotary_emb" in name
    layer = int(match.group(1))
    if layer >= config.num_hidden_layers:
        return True  # MTP (speculative decoding) layers
    return ".self_attn.indexer." in name and not config.runs_indexer(layer)


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))


def _load_mxfp4(model: nn.Module, files: CheckpointFiles, name: str, expected: torch.Size, dtype: torch.dtype,
                device: torch.device, consumed: set[str], keep: bool) -> None:
    """A stacked gpt-oss expert tensor from its MXFP4 ``_blocks`` [E, out, G, 16] and ``_scales``
    [E, out, G]: dequantised to [E, out, in], stored as the parameter's [E, in, out]; with ``keep``
    held as MXFP4 instead (``GptOssExperts.keep_mxfp4``)."""
    blocks_name, scales_name = name + "_blocks", name + "_scales"
    if scales_name not in files.location:
        raise CheckpointError(f"{files.location[blocks_name]}: MXFP4 tensor '{blocks_name}' has no '{scales_name}'")
    blocks, scales = files.get(blocks_name), files.get(scales_name)
    consumed.update((blocks_name, scales_name))
    if keep:
        _keep_mxfp4(model, files, name, expected, dtype, device, blocks, scales)
        return
    try:
        weight = dequantize_mxfp4(blocks.to(device), scales.to(device), dtype).transpose(1, 2)
    except ValueError as exc:
        raise CheckpointError(f"{files.location[blocks_name]}: tensor '{blocks_name}': {exc}") from None
    _check_finite(files, blocks_name, weight)  # a scale byte of 255 (e8m0's NaN) overflows to inf
    if tuple(weight.shape) != tuple(expected):
        raise CheckpointError(f"{files.location[blocks_name]}: MXFP4 tensor '{blocks_name}' holds "
                              f"{list(weight.shape)} values, config.json implies {list(expected)}")
    _set_param(model, name, weight.contiguous())


def _keep_mxfp4(model: nn.Module, files: CheckpointFiles, name: str, expected: torch.Size, dtype: torch.dtype,
                device: torch.device, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    blocks_name = name + "_blocks"
    num, k, rows = expected  # the parameter's [E, in, out]
    shape = (num, rows, k // MXFP4_GROUP, MXFP4_GROUP // 2)
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != shape
            or tuple(scales.shape) != shape[:3] or k % MXFP4_GROUP):
        raise CheckpointError(f"{files.location[blocks_name]}: MXFP4 tensor '{blocks_name}' {blocks.dtype} "
                              f"{list(blocks.shape)} with scales {scales.dtype} {list(scales.shape)}; config.json "
                              f"implies uint8 {list(shape)} and {list(shape[:3])}")
    if bad := count_nonfinite_mxfp4(blocks, scales, dtype):  # a scale byte of 255 (e8m0's NaN) or too large
        raise CheckpointError(f"{files.location[blocks_name]}: tensor '{blocks_name}' has {bad} NaN/inf value(s) "
                              f"of {blocks.numel() * 2} (corrupt checkpoint?)")
    module_name, _, attr = name.rpartition(".")
    experts = model.get_submodule(module_name)
    if not isinstance(experts, GptOssExperts):
        raise CheckpointError(f"{files.location[blocks_name]}: MXFP4 tensor '{blocks_name}' is not gpt-oss's experts")
    experts.keep_mxfp4(attr, blocks.to(device).contiguous(), scales.to(device).contiguous())


def _load_one(model: nn.Module, files: CheckpointFiles, name: str, expected: torch.Size, dtype: torch.dtype,
              device: torch.device, keep_fp8: bool, consumed: set[str], keep_mxfp4: bool = False) -> None:
    if name not in files.location and name + "_blocks" in files.location:
        _load_mxfp4(model, files, name, expected, dtype, device, consumed, keep_mxfp4)
        return
    if name not in files.location:
        raise CheckpointError(f"{files.folder}: missing tensor '{name}'")
    tensor = files.get(name)
    consumed.add(name)
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(f"{files.location[name]}: tensor '{name}' has shape {list(tensor.shape)}, "
                              f"config.json implies {list(expected)}")
    target = torch.float32 if _FP32_PARAMS.search(name) else dtype
    tensor = tensor.to(device)
    _check_finite(files, name, tensor)
    if tensor.dtype != torch.float8_e4m3fn:
        _set_param(model, name, tensor.to(dtype=target))
        return
    scale_name = name + "_scale_inv"
    if scale_name not in files.location:
        raise CheckpointError(f"{files.location[name]}: FP8 tensor '{name}' has no '{scale_name}'")
    scale = files.get(scale_name).to(device)
    consumed.add(scale_name)
    _check_finite(files, scale_name, scale)
    block = model.config.quantization.block_size if model.config.quantization else (128, 128)
    try:
        check_fp8_scales(tensor, scale, block)
    except ValueError as exc:
        raise CheckpointError(f"{files.location[name]}: tensor '{scale_name}': {exc}") from None
    module_name = name.rpartition(".")[0]
    module = model.get_submodule(module_name) if name.endswith(".weight") else None
    # Only a true nn.Linear becomes an Fp8Linear (carrying its bias, loaded before or after the weight);
    # an FP8 weight of another module (a Mixtral router stored in FP8) is dequantised here.
    if keep_fp8 and isinstance(module, nn.Linear):
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, Fp8Linear(tensor, scale, block, target, module.bias))
    else:
        _set_param(model, name, dequantize_fp8_blocks(tensor, scale, block, target))


def _check_finite(files: CheckpointFiles, name: str, tensor: torch.Tensor) -> None:
    """A NaN/inf weight or scale would load and answer garbage (or nothing): refuse it at load."""
    bad = count_nonfinite(tensor)
    if bad:
        raise CheckpointError(f"{files.location[name]}: tensor '{name}' has {bad} NaN/inf value(s) "
                              f"of {tensor.numel()} (corrupt checkpoint?)")


def _check_declared_index_sharing(declared: ModelConfig, files: CheckpointFiles) -> None:
    """A DeepSeek-V3.2 config.json with IndexCache keys (index_topk_freq / _pattern / indexer_types) over a
    checkpoint that ships the indexers of the layers they share: transformers' DeepseekV32 has no IndexCache
    and runs those indexers, so the keys are refused rather than their weights silently skipped. (GLM-5's
    class reads the keys; Hearth's index_topk_freq engine option shares layers at run time on purpose.)"""
    if declared.model_type != "deepseek_v32" or declared.indexer_types is None:
        return
    shared = {f"model.layers.{i}.self_attn.indexer." for i, kind in enumerate(declared.indexer_types)
              if kind == "shared"}
    shipped = next((n for n in files.location if any(n.startswith(prefix) for prefix in shared)), None)
    if shipped is not None:
        raise UnsupportedModelError(
            f"{files.folder}/config.json: its IndexCache keys share the indexer of a layer whose weights the "
            f"checkpoint ships ('{shipped}'); transformers' DeepseekV32 runs every layer's indexer. Remove "
            "index_topk_freq / index_topk_pattern / indexer_types from config.json (Hearth's index_topk_freq "
            "option shares layers at run time)")


def materialize_buffers(model: DeepseekForCausalLM, device: torch.device) -> None:
    """Compute the non-weight buffers (rope frequencies) of a model built on the meta device."""
    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = rope_inv_freq(model.config.rope, module.inv_freq.shape[0] * 2).to(device)


def tensor_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of every tensor in a checkpoint folder, from the safetensors headers (nothing loaded)."""
    files = CheckpointFiles(Path(path))
    sizes = {}
    for file in sorted(set(files.location.values())):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                piece = handle.get_slice(name)
                numel = 1
                for dim in piece.get_shape():
                    numel *= dim
                sizes[name] = numel * _DTYPE_BYTES.get(piece.get_dtype(), 4)
    return sizes


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Per-expert tensors (DeepSeek, Qwen3, Mixtral) or gpt-oss's stacked ones (with bias, blocks, scales).
ROUTED_EXPERT = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.(\d+\.|gate_up_proj|down_proj)")


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype, keep_fp8: bool = False,
                    faithful: bool = False, skip_routed_experts: bool = False,
                    config: ModelConfig | None = None, attention: AttentionPaths = PLAIN_ATTENTION,
                    keep_mxfp4: bool = False) -> DeepseekForCausalLM:
    """Build the model for ``path/config.json`` and fill it from the folder's safetensors.

    skip_routed_experts: leave the routed experts out (they are served from an expert store and
    cache instead); their module parameters stay on the meta device. ``config`` replaces the
    folder's config.json (e.g. with IndexCache retention applied); ``attention`` is how the
    attention layers run (kernels, MLI). keep_mxfp4: gpt-oss's MXFP4 experts stay MXFP4 (for the
    fused MoE kernel) instead of being dequantised to ``dtype``."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a model folder")
    declared = ModelConfig.from_file(folder)
    config = config or declared
    files = CheckpointFiles(folder)
    _check_declared_index_sharing(declared, files)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, faithful, attention)
    consumed: set[str] = set()
    expected = {name: p.shape for name, p in model.named_parameters()
                if not (skip_routed_experts and ROUTED_EXPERT.search(name))}
    if config.tie_word_embeddings and "lm_head.weight" not in files.location:
        expected.pop("lm_head.weight")
    for name, shape in expected.items():
        _load_one(model, files, name, shape, dtype, device, keep_fp8, consumed, keep_mxfp4)
    if "lm_head.weight" not in expected:
        model.lm_head.weight = model.model.embed_tokens.weight
    # NOTE: zero-element tensors carry no weights: transformers saves a shared_experts MLP of width 0 when
    # n_shared_experts is 0, which Hearth builds no module for.
    unexpected = [n for n in files.location if n not in consumed and not _is_skipped(n, config)
                  and not (skip_routed_experts and ROUTED_EXPERT.search(n)) and not files.is_empty(n)]
    files.close()
    if unexpected:
        first = unexpected[0]
        raise CheckpointError(f"{files.location[first]}: unexpected tensor '{first}' "
                              f"({len(unexpected)} unexpected in all; does config.json match the weights?)")
    materialize_buffers(model, device)
    return model.eval()
