"""Every routed expert of every MoE layer in host memory, in its checkpoint format.

One contiguous uint8 buffer per MoE layer, expert-major ([E, record_bytes]): one expert is one
contiguous copy to a GPU cache slot. A record holds w13 = [gate; up] [2I, D], w2 = down [D, I] and,
for FP8 checkpoints, their fp32 block scales; gpt-oss's experts add their biases b13 [2I] and b2 [D]
(its checkpoints stack all experts of a layer in one tensor with gate and up interleaved, MXFP4 in the
release: :meth:`ExpertStore.from_stacked_safetensors` dequantises and de-interleaves them).
The buffers are filled straight from the safetensors files one tensor at a time and pinned
(cudaHostRegister) in expert-aligned chunks, falling back to pageable memory where pinning is impossible.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hearth.kernels._utils import count_nonfinite
from hearth.kernels.moe.mxfp4 import dequantize_mxfp4
from hearth.kernels.moe.reference import SWIGLU_ALPHA

log = logging.getLogger(__name__)

SCALE_BLOCK = 128
_ALIGN = 512
PIN_CHUNK_BYTES = 1 << 30
_PROJ = ("gate_proj", "up_proj", "down_proj")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True)
class ExpertWeights:
    """Typed views of S expert records: w13 [S, 2I, D], w2 [S, D, I], s13/s2 fp32 block scales or None;
    gpt-oss: biases b13 [S, 2I], b2 [S, D] and the clamped SwiGLU's limit (None = plain SwiGLU)."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = SWIGLU_ALPHA

    @property
    def plain_swiglu(self) -> bool:
        """True when the fused kernel computes these experts (no biases, no clamp)."""
        return self.b13 is None and self.swiglu_limit is None

    def reference_kwargs(self) -> dict:
        """The gpt-oss extras for ``moe_reference``."""
        return {"b13": self.b13, "b2": self.b2, "swiglu_limit": self.swiglu_limit, "swiglu_alpha": self.swiglu_alpha}


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert record: w13, w2, then (FP8 only) s13 and s2, then (gpt-oss only)
    b13 and b2, each 512-byte aligned."""

    hidden: int  # D
    inter: int  # I
    dtype: torch.dtype  # float8_e4m3fn, bfloat16, float16 or float32
    bias: bool = False  # gpt-oss: biases in the weights' dtype
    swiglu_limit: float | None = None
    swiglu_alpha: float = SWIGLU_ALPHA

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"unsupported expert weight dtype {self.dtype}")
        if self.bias and self.is_fp8:
            raise ValueError("expert biases are stored with float weights only")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def scale_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(s13 shape [2*ceil(I/128), ceil(D/128)], s2 shape [ceil(D/128), ceil(I/128)])."""
        n_i, n_d = _cdiv(self.inter, SCALE_BLOCK), _cdiv(self.hidden, SCALE_BLOCK)
        return (2 * n_i, n_d), (n_d, n_i)

    @property
    def _sections(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of w13, w2, s13, s2, b13, b2 (scales 0 bytes for float weights, biases 0
        bytes without them)."""
        esize = torch.empty(0, dtype=self.dtype).element_size()
        sizes = [2 * self.inter * self.hidden * esize, self.hidden * self.inter * esize]
        (a, b), (c, d) = self.scale_shapes
        sizes += [a * b * 4, c * d * 4] if self.is_fp8 else [0, 0]
        sizes += [2 * self.inter * esize, self.hidden * esize] if self.bias else [0, 0]
        out, off = [], 0
        for size in sizes:
            out.append((off, size))
            off += _align(size)
        return out

    @property
    def record_bytes(self) -> int:
        off, size = self._sections[-1]
        return _align(off + size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one expert's tensors (what a checkpoint holds), without alignment padding."""
        return sum(size for _, size in self._sections)

    def views(self, buf: torch.Tensor) -> ExpertWeights:
        """Typed views of ``buf`` [S, record_bytes] uint8 (rows may be strided)."""
        assert buf.dtype == torch.uint8 and buf.shape[-1] == self.record_bytes and buf.stride(-1) == 1
        (o13, n13), (o2, n2), (os13, ns13), (os2, ns2), (ob13, nb13), (ob2, nb2) = self._sections
        d, i = self.hidden, self.inter
        w13 = buf[:, o13:o13 + n13].view(self.dtype).unflatten(1, (2 * i, d))  # (S, 2I, D)
        w2 = buf[:, o2:o2 + n2].view(self.dtype).unflatten(1, (d, i))  # (S, D, I)
        if self.bias:
            b13, b2 = buf[:, ob13:ob13 + nb13].view(self.dtype), buf[:, ob2:ob2 + nb2].view(self.dtype)
            return ExpertWeights(w13, w2, None, None, b13, b2, self.swiglu_limit, self.swiglu_alpha)
        if not self.is_fp8:
            return ExpertWeights(w13, w2, None, None, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        sh13, sh2 = self.scale_shapes
        s13 = buf[:, os13:os13 + ns13].view(torch.float32).unflatten(1, sh13)
        s2 = buf[:, os2:os2 + ns2].view(torch.float32).unflatten(1, sh2)
        return ExpertWeights(w13, w2, s13, s2)


class ExpertStore:
    """Host-memory store of the routed experts of ``layers`` (checkpoint layer indices)."""

    def __init__(
        self, layout: ExpertLayout, layers: Sequence[int], num_experts: int, pin: bool | None = None
    ) -> None:
        self.layout = layout
        self.layers = tuple(layers)
        self.num_experts = num_experts
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        shape = (num_experts, layout.record_bytes)
        # NOTE: zeros, not empty: alignment padding must be defined, and it touches pages once.
        self._buffers = [torch.zeros(shape, dtype=torch.uint8) for _ in self.layers]
        self._registered: list[int] = []
        self.pinned_bytes = 0
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            for buf in self._buffers:
                if not self._pin(buf):
                    break

    @property
    def total_bytes(self) -> int:
        return sum(buf.numel() for buf in self._buffers)

    @property
    def is_pinned(self) -> bool:
        return self.pinned_bytes == self.total_bytes

    def layer_buffer(self, layer: int) -> torch.Tensor:
        """[E, record_bytes] uint8 buffer of one MoE layer."""
        return self._buffers[self._index[layer]]

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """[record_bytes] uint8: one expert, contiguous."""
        return self._buffers[self._index[layer]][expert]

    def to_device(self, layer: int, device: torch.device | str) -> torch.Tensor:
        """A device copy [E, record_bytes] of one layer, copied pin chunk by pin chunk.

        NOTE: one cudaMemcpy must not span two cudaHostRegister ranges (CUDA rejects it), so whole-layer
        copies go through here; single experts never straddle a chunk.
        """
        src = self.layer_buffer(layer)
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        per_chunk = max(1, PIN_CHUNK_BYTES // src.shape[1])
        for start in range(0, src.shape[0], per_chunk):
            dst[start:start + per_chunk].copy_(src[start:start + per_chunk], non_blocking=True)
        return dst

    def weights(self, layer: int) -> ExpertWeights:
        return self.layout.views(self.layer_buffer(layer))

    def set_expert(self, layer: int, expert: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor in: ``name`` is '{gate,up,down}_proj.weight' or '.weight_scale_inv'."""
        w = self.layout.views(self.layer_buffer(layer)[expert:expert + 1])
        inter = self.layout.inter
        proj, _, kind = name.partition(".")
        if kind == "weight":
            dst = {"gate_proj": w.w13[0, :inter], "up_proj": w.w13[0, inter:], "down_proj": w.w2[0]}[proj]
        elif kind == "weight_scale_inv" and self.layout.is_fp8:
            rows = w.s13.shape[1] // 2
            dst = {"gate_proj": w.s13[0, :rows], "up_proj": w.s13[0, rows:], "down_proj": w.s2[0]}[proj]
        else:
            raise ValueError(f"unexpected expert tensor {name!r} for a {self.layout.dtype} store")
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"layer {layer} expert {expert} {name}: shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        bad = count_nonfinite(tensor)
        if bad:
            raise ValueError(f"layer {layer} expert {expert} {name}: {bad} NaN/inf value(s) (corrupt checkpoint?)")
        dst.copy_(tensor)

    @classmethod
    def from_safetensors(
        cls, files: str | Path | Sequence[str | Path], layers: Sequence[int], num_experts: int,
        pin: bool | None = None, dtype: torch.dtype | None = None, module: str = "mlp",
        proj_names: tuple[str, str, str] = _PROJ,
    ) -> ExpertStore:
        """Fill a store from a checkpoint directory (or its .safetensors files), tensor by tensor.

        Reads ``model.layers.{L}.{module}.experts.{E}.{gate,up,down}.weight`` (+ ``.weight_scale_inv``),
        the three names given by ``proj_names`` (Mixtral: module "block_sparse_moe", w1, w3, w2).
        ``dtype`` defaults to the checkpoint's; a float checkpoint may be stored as another float dtype.
        """
        where = _tensor_files(files)
        naming = (module, dict(zip(_PROJ, proj_names)))
        layout = _infer_layout(where, layers[0], dtype, naming)
        store = cls(layout, layers, num_experts, pin=pin)
        suffixes = ["weight"] + (["weight_scale_inv"] if layout.is_fp8 else [])
        handles: dict[Path, object] = {}
        for layer in layers:
            for expert in range(num_experts):
                for proj in _PROJ:
                    for suffix in suffixes:
                        name = _expert_name(layer, expert, proj, suffix, naming)
                        if name not in where:
                            raise KeyError(f"checkpoint has no tensor {name}")
                        path = where[name]
                        if path not in handles:
                            handles[path] = safe_open(str(path), framework="pt")
                        store.set_expert(layer, expert, f"{proj}.{suffix}", handles[path].get_tensor(name))
        return store

    @classmethod
    def from_stacked_safetensors(
        cls, files: str | Path | Sequence[str | Path], layers: Sequence[int], dtype: torch.dtype,
        swiglu_limit: float, swiglu_alpha: float = SWIGLU_ALPHA, pin: bool | None = None,
    ) -> ExpertStore:
        """Fill a store from gpt-oss's stacked experts, one layer's tensors at a time:
        ``model.layers.{L}.mlp.experts.gate_up_proj`` [E, D, 2I] (gate and up columns interleaved) and
        ``down_proj`` [E, I, D] with their ``_bias``, or the MXFP4 ``_blocks`` + ``_scales`` of the
        release ([E, 2I, D] and [E, D, I] once dequantised), stored as ``dtype``."""
        where = _tensor_files(files)
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            if name not in where:
                raise KeyError(f"checkpoint has no tensor {name}")
            if where[name] not in handles:
                handles[where[name]] = safe_open(str(where[name]), framework="pt")
            return handles[where[name]].get_tensor(name)

        def weight(prefix: str) -> torch.Tensor:
            """[E, out, in] in ``dtype`` (the Linear layout the store keeps)."""
            if prefix + "_blocks" in where:
                return dequantize_mxfp4(read(prefix + "_blocks"), read(prefix + "_scales"), dtype)
            return read(prefix).to(dtype).transpose(1, 2)

        store = None
        for layer in layers:
            prefix = f"model.layers.{layer}.mlp.experts."
            gate_up, down = weight(prefix + "gate_up_proj"), weight(prefix + "down_proj")
            gate_up_bias, down_bias = read(prefix + "gate_up_proj_bias"), read(prefix + "down_proj_bias")
            tensors = {"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": gate_up_bias,
                       "down_proj_bias": down_bias}
            for name, tensor in tensors.items():  # MXFP4: a scale byte of 255 (e8m0's NaN) overflows to inf
                if bad := count_nonfinite(tensor):
                    raise ValueError(f"layer {layer} {name}: {bad} NaN/inf value(s) (corrupt checkpoint?)")
            if store is None:
                num_experts, hidden, inter = down.shape[0], down.shape[1], down.shape[2]
                layout = ExpertLayout(hidden, inter, dtype, bias=True, swiglu_limit=swiglu_limit,
                                      swiglu_alpha=swiglu_alpha)
                store = cls(layout, layers, num_experts, pin=pin)
            w = store.weights(layer)
            if tuple(gate_up.shape) != tuple(w.w13.shape) or tuple(down.shape) != tuple(w.w2.shape):
                raise ValueError(f"layer {layer}: expert tensors {tuple(gate_up.shape)}, {tuple(down.shape)}, "
                                 f"expected {tuple(w.w13.shape)}, {tuple(w.w2.shape)}")
            # NOTE: de-interleaved to [gate rows; up rows], the layout every expert consumer reads.
            w.w13.copy_(torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
            w.b13.copy_(torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1))
            w.w2.copy_(down)
            w.b2.copy_(down_bias)
        if store is None:
            raise ValueError("no MoE layers to store")
        return store

    def _pin(self, buf: torch.Tensor) -> bool:
        """Page-lock ``buf`` in expert-aligned chunks of about 1 GiB; False (and pageable) on failure."""
        try:
            cudart = torch.cuda.cudart()
            per_chunk = max(1, PIN_CHUNK_BYTES // buf.shape[1])
            for start in range(0, buf.shape[0], per_chunk):
                chunk = buf[start:start + per_chunk]
                err = cudart.cudaHostRegister(chunk.data_ptr(), chunk.numel(), 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister returned {err}")
                self._registered.append(chunk.data_ptr())
                self.pinned_bytes += chunk.numel()
        except Exception as exc:  # noqa: BLE001 - any failure to pin means: stay pageable
            log.warning("expert store: pinning failed after %.1f GiB (%s); the rest stays pageable",
                        self.pinned_bytes / 2**30, exc)
            return False
        return True

    def close(self) -> None:
        """Unpin; the store must not be used by the GPU afterwards."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
            self.pinned_bytes = 0

    def __del__(self) -> None:
        # NOTE: at interpreter shutdown CUDA may already be torn down; nothing is left to release then.
        with contextlib.suppress(Exception):
            self.close()


_DEFAULT_NAMING = ("mlp", {p: p for p in _PROJ})


def _expert_name(layer: int, expert: int, proj: str, suffix: str,
                 naming: tuple[str, dict[str, str]] = _DEFAULT_NAMING) -> str:
    """Checkpoint name of one expert tensor; ``proj`` is the canonical gate_proj / up_proj / down_proj."""
    module, names = naming
    return f"model.layers.{layer}.{module}.experts.{expert}.{names[proj]}.{suffix}"


def _tensor_files(files: str | Path | Sequence[str | Path]) -> dict[str, Path]:
    """Tensor name -> file, from ``model.safetensors.index.json`` when present, else the files' headers."""
    if isinstance(files, str | Path) and Path(files).is_dir():
        root = Path(files)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: root / fname for name, fname in weight_map.items()}
        files = sorted(root.glob("*.safetensors"))
    elif isinstance(files, str | Path):
        files = [files]
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({name: Path(path) for name in f.keys()})  # noqa: SIM118 - safe_open is no dict
    return where


def _infer_layout(where: dict[str, Path], layer: int, dtype: torch.dtype | None,
                  naming: tuple[str, dict[str, str]] = _DEFAULT_NAMING) -> ExpertLayout:
    name = _expert_name(layer, 0, "gate_proj", "weight", naming)
    if name not in where:
        raise KeyError(f"checkpoint has no tensor {name}")
    with safe_open(str(where[name]), framework="pt") as f:
        gate = f.get_slice(name)
        inter, hidden = gate.get_shape()
        ckpt_dtype = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F32": torch.float32}[gate.get_dtype()]
    if dtype is not None and ckpt_dtype == torch.float8_e4m3fn and dtype != ckpt_dtype:
        raise ValueError("an FP8 checkpoint is stored as FP8 (no full-size dequantised copy)")
    return ExpertLayout(hidden=hidden, inter=inter, dtype=dtype or ckpt_dtype)
