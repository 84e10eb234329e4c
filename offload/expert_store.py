"""Every routed expert of every MoE layer in host memory, in its checkpoint format.

One contiguous uint8 buffer per MoE layer, expert-major ([E, record_bytes]): one expert is one
contiguous copy to a GPU cache slot. A record holds w13 = [gate; up] [2I, D], w2 = down [D, I] and,
for FP8 checkpoints, their fp32 block scales; gpt-oss's experts add their biases b13 [2I] and b2 [D]
(its checkpoints stack all experts of a layer in one tensor with gate and up interleaved:
:meth:`ExpertStore.from_stacked_safetensors` de-interleaves them).

gpt-oss's release stores its experts as MXFP4 (4.25 bits a weight). Such a store keeps them so
(:class:`Mxfp4Packing`: the code bytes and scale bytes of w13 and w2, then the biases), 3.76x fewer
bytes in RAM and over the link than bf16; what consumers compute with is still :attr:`ExpertStore.layout`
(float weights), which :meth:`Mxfp4Packing.unpack` writes from a packed record (the Triton kernel of
:mod:`hearth.kernels.moe.mxfp4` on the GPU right after the copy, torch on the host).
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
from hearth.kernels.moe import ExpertExtras
from hearth.kernels.moe.mxfp4 import MXFP4_GROUP, count_nonfinite_mxfp4, dequantize_mxfp4, dequantize_mxfp4_into
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
    gpt-oss: biases b13 [S, 2I], b2 [S, D] and the clamped SwiGLU's limit (None = plain SwiGLU). Of
    MXFP4 records (:meth:`Mxfp4Packing.weights`): w13/w2 uint8 code bytes [S, rows, K/32, 16] and s13/s2
    uint8 e8m0 scales [S, rows, K/32], as ``fused_moe`` and ``moe_reference`` take them."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = SWIGLU_ALPHA

    @property
    def kernel_extras(self) -> ExpertExtras:
        """What the fused kernel adds to plain SwiGLU experts for these (gpt-oss: biases and the clamp)."""
        return ExpertExtras(self.b13, self.b2, self.swiglu_limit, self.swiglu_alpha)

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

    @property
    def bias_span(self) -> tuple[int, int]:
        """(offset, nbytes) of the record's bytes from b13 through b2."""
        (ob13, _), (ob2, nb2) = self._sections[4:]
        return ob13, ob2 + nb2 - ob13

    def bias_views(self, span: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b13 [S, 2I], b2 [S, D]) of ``span`` [S, bias_span bytes] uint8, the records' bias bytes."""
        (ob13, nb13), (ob2, nb2) = self._sections[4:]
        return span[:, :nb13].view(self.dtype), span[:, ob2 - ob13:ob2 - ob13 + nb2].view(self.dtype)

    def views(self, buf: torch.Tensor) -> ExpertWeights:
        """Typed views of ``buf`` [S, record_bytes] uint8 (rows may be strided)."""
        assert buf.dtype == torch.uint8 and buf.shape[-1] == self.record_bytes and buf.stride(-1) == 1
        (o13, n13), (o2, n2), (os13, ns13), (os2, ns2) = self._sections[:4]
        d, i = self.hidden, self.inter
        w13 = buf[:, o13:o13 + n13].view(self.dtype).unflatten(1, (2 * i, d))  # (S, 2I, D)
        w2 = buf[:, o2:o2 + n2].view(self.dtype).unflatten(1, (d, i))  # (S, D, I)
        if self.bias:
            start, nbytes = self.bias_span
            b13, b2 = self.bias_views(buf[:, start:start + nbytes])
            return ExpertWeights(w13, w2, None, None, b13, b2, self.swiglu_limit, self.swiglu_alpha)
        if not self.is_fp8:
            return ExpertWeights(w13, w2, None, None, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        sh13, sh2 = self.scale_shapes
        s13 = buf[:, os13:os13 + ns13].view(torch.float32).unflatten(1, sh13)
        s2 = buf[:, os2:os2 + ns2].view(torch.float32).unflatten(1, sh2)
        return ExpertWeights(w13, w2, s13, s2)


@dataclass(frozen=True)
class PackedWeights:
    """Views of S packed (MXFP4) records: code bytes [S, rows, G, 16] and scale bytes [S, rows, G] of w13
    (gate rows, then up rows) and w2, and the biases' bytes [S, n], laid out as in the float record."""

    blocks13: torch.Tensor
    scales13: torch.Tensor
    blocks2: torch.Tensor
    scales2: torch.Tensor
    biases: torch.Tensor


@dataclass(frozen=True)
class Mxfp4Packing:
    """Byte layout of one MXFP4 expert record whose float form is ``float_layout`` (biases required):
    w13's code bytes [2I, D/32, 16] and scale bytes [2I, D/32], w2's [D, I/32, 16] and [D, I/32], each
    512-byte aligned, then the biases exactly as the float record holds them (one byte copy)."""

    float_layout: ExpertLayout

    def __post_init__(self) -> None:
        f = self.float_layout
        if not f.bias or f.is_fp8 or f.hidden % MXFP4_GROUP or f.inter % MXFP4_GROUP:
            raise ValueError(f"MXFP4 records need float weights with biases and widths that are multiples of "
                             f"{MXFP4_GROUP}, got {f}")

    @property
    def _sections(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of w13's blocks and scales, w2's blocks and scales, and the biases."""
        f = self.float_layout
        g13, g2 = f.hidden // MXFP4_GROUP, f.inter // MXFP4_GROUP
        sizes = [2 * f.inter * g13 * 16, 2 * f.inter * g13, f.hidden * g2 * 16, f.hidden * g2]
        out, off = [], 0
        for size in sizes:
            out.append((off, size))
            off += _align(size)
        out.append((off, self.float_layout.bias_span[1]))
        return out

    @property
    def record_bytes(self) -> int:
        off, size = self._sections[-1]
        return _align(off + size)

    def views(self, buf: torch.Tensor) -> PackedWeights:
        """Views of ``buf`` [S, record_bytes] uint8 (rows may be strided)."""
        assert buf.dtype == torch.uint8 and buf.shape[-1] == self.record_bytes and buf.stride(-1) == 1
        (ob13, nb13), (os13, ns13), (ob2, nb2), (os2, ns2), (obias, nbias) = self._sections
        f = self.float_layout
        g13, g2 = f.hidden // MXFP4_GROUP, f.inter // MXFP4_GROUP
        return PackedWeights(
            buf[:, ob13:ob13 + nb13].unflatten(1, (2 * f.inter, g13, 16)),
            buf[:, os13:os13 + ns13].unflatten(1, (2 * f.inter, g13)),
            buf[:, ob2:ob2 + nb2].unflatten(1, (f.hidden, g2, 16)),
            buf[:, os2:os2 + ns2].unflatten(1, (f.hidden, g2)),
            buf[:, obias:obias + nbias],
        )

    def weights(self, buf: torch.Tensor) -> ExpertWeights:
        """The kernel's views of packed records ``buf`` [S, record_bytes] uint8 (rows may be strided):
        MXFP4 weights read as they are (gate rows, then up rows), float biases."""
        p, f = self.views(buf), self.float_layout
        b13, b2 = f.bias_views(p.biases)
        return ExpertWeights(p.blocks13, p.blocks2, p.scales13, p.scales2, b13, b2, f.swiglu_limit, f.swiglu_alpha)

    def unpack(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write the float records ``dst`` [n, float record_bytes] from the packed ``src`` [n, record_bytes]
        (same device). On CUDA two kernel launches and one byte copy; on the host torch."""
        p, w = self.views(src), self.float_layout.views(dst)
        start, nbytes = self.float_layout.bias_span
        dst[:, start:start + nbytes].copy_(p.biases)
        if dst.is_cuda:
            dequantize_mxfp4_into(p.blocks13, p.scales13, w.w13)
            dequantize_mxfp4_into(p.blocks2, p.scales2, w.w2)
        else:
            w.w13.copy_(dequantize_mxfp4(p.blocks13, p.scales13, w.w13.dtype))
            w.w2.copy_(dequantize_mxfp4(p.blocks2, p.scales2, w.w2.dtype))


class ExpertStore:
    """Host-memory store of the routed experts of ``layers`` (checkpoint layer indices). ``layout`` is
    what the experts are computed from; ``packing`` (MXFP4) what the store holds and fetches, if not that."""

    def __init__(
        self, layout: ExpertLayout, layers: Sequence[int], num_experts: int, pin: bool | None = None,
        packing: Mxfp4Packing | None = None,
    ) -> None:
        if packing is not None and packing.float_layout != layout:
            raise ValueError(f"packing {packing} does not unpack to {layout}")
        self.layout = layout
        self.packing = packing
        self.layers = tuple(layers)
        self.num_experts = num_experts
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        shape = (num_experts, self.record_bytes)
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
    def record_bytes(self) -> int:
        """Bytes of one stored expert: what a fetch moves over the link."""
        return self.layout.record_bytes if self.packing is None else self.packing.record_bytes

    def record_weights(self, buf: torch.Tensor) -> ExpertWeights:
        """The kernel's views of stored records ``buf`` [S, record_bytes] uint8 (an expert cache's slots):
        float or FP8 as :meth:`ExpertLayout.views`, MXFP4 as :meth:`Mxfp4Packing.weights`."""
        return self.layout.views(buf) if self.packing is None else self.packing.weights(buf)

    @property
    def is_pinned(self) -> bool:
        return self.pinned_bytes == self.total_bytes

    def layer_buffer(self, layer: int) -> torch.Tensor:
        """[E, record_bytes] uint8 buffer of one MoE layer."""
        return self._buffers[self._index[layer]]

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """[record_bytes] uint8: one expert, contiguous."""
        return self._buffers[self._index[layer]][expert]

    def float_records(self, layer: int, device: torch.device | str) -> torch.Tensor:
        """One layer's experts [E, layout.record_bytes] on ``device`` as they are computed from (the
        store's own buffer when it holds them so on the host)."""
        device = torch.device(device)
        if self.packing is None and device.type == "cpu":
            return self.layer_buffer(layer)
        src = self.layer_buffer(layer) if device.type == "cpu" else self.to_device(layer, device)
        if self.packing is None:
            return src
        dst = torch.empty((self.num_experts, self.layout.record_bytes), dtype=torch.uint8, device=device)
        self.packing.unpack(src, dst)
        return dst

    def expert_weights(self, layer: int, expert: int) -> ExpertWeights:
        """One expert's weights on the host ([1, ...] views; dequantised into a new record when packed)."""
        row = self.layer_buffer(layer)[expert:expert + 1]
        if self.packing is None:
            return self.layout.views(row)
        dst = torch.empty((1, self.layout.record_bytes), dtype=torch.uint8)
        self.packing.unpack(row, dst)
        return self.layout.views(dst)

    def to_device(self, layer: int, device: torch.device | str) -> torch.Tensor:
        """A device copy [E, record_bytes] of one layer's stored records, copied pin chunk by pin chunk.

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
        """Views of one layer's float records (see :meth:`packed_weights` for an MXFP4 store)."""
        if self.packing is not None:
            raise ValueError("an MXFP4 expert store holds no float weights: use packed_weights or expert_weights")
        return self.layout.views(self.layer_buffer(layer))

    def packed_weights(self, layer: int) -> PackedWeights:
        if self.packing is None:
            raise ValueError("this expert store holds float weights: use weights")
        return self.packing.views(self.layer_buffer(layer))

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
        release ([E, 2I, D/32, 16] and [E, D, I/32, 16]). Computed as ``dtype``; MXFP4 experts stay
        MXFP4 (:class:`Mxfp4Packing`), float ones are held as ``dtype`` (quantising them at load would
        change the model's outputs)."""
        where = _tensor_files(files)
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            if name not in where:
                raise KeyError(f"checkpoint has no tensor {name}")
            if where[name] not in handles:
                handles[where[name]] = safe_open(str(where[name]), framework="pt")
            return handles[where[name]].get_tensor(name)

        store = None
        for layer in layers:
            prefix = f"model.layers.{layer}.mlp.experts."
            mxfp4 = prefix + "gate_up_proj_blocks" in where
            tensors = {name: read(prefix + name) for name in _stacked_names(mxfp4)}
            _check_stacked(layer, tensors, dtype)
            if store is None:
                bias13, bias2 = tensors["gate_up_proj_bias"], tensors["down_proj_bias"]
                layout = ExpertLayout(bias2.shape[1], bias13.shape[1] // 2, dtype, bias=True,
                                      swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
                store = cls(layout, layers, bias2.shape[0], pin=pin, packing=Mxfp4Packing(layout) if mxfp4 else None)
            _fill_stacked(store, layer, tensors)
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


def _stacked_names(mxfp4: bool) -> list[str]:
    if mxfp4:
        return ["gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
                "gate_up_proj_bias", "down_proj_bias"]
    return ["gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"]


def _check_stacked(layer: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """NaN/inf in a float tensor, or an MXFP4 group that dequantises to one, is a corrupt checkpoint."""
    for name, tensor in tensors.items():
        if bad := count_nonfinite(tensor):
            raise ValueError(f"layer {layer} {name}: {bad} NaN/inf value(s) (corrupt checkpoint?)")
    for name in ("gate_up_proj", "down_proj"):
        blocks, scales = tensors.get(name + "_blocks"), tensors.get(name + "_scales")
        if blocks is not None and (bad := count_nonfinite_mxfp4(blocks, scales, dtype)):  # e.g. a scale byte of 255
            raise ValueError(f"layer {layer} {name}: {bad} NaN/inf value(s) in {dtype} (corrupt checkpoint?)")


def _copy_checked(layer: int, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"layer {layer} {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up alternating along dim 1 -> [gate rows; up rows]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _fill_stacked(store: ExpertStore, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    """Copy one layer's stacked gpt-oss tensors into ``store`` with gate and up rows de-interleaved,
    the layout every expert consumer reads (MXFP4 codes and scales are per row: they move as bytes)."""
    if store.packing is None:
        w = store.weights(layer)
        w13, w2, b13, b2 = w.w13, w.w2, w.b13, w.b2
        # [E, in, out] as shipped -> the Linear layout [E, out, in]
        _copy_checked(layer, "gate_up_proj", w13, _deinterleave(tensors["gate_up_proj"].transpose(1, 2)))
        _copy_checked(layer, "down_proj", w2, tensors["down_proj"].transpose(1, 2))
    else:
        p = store.packed_weights(layer)
        for name, dst in (("gate_up_proj_blocks", p.blocks13), ("gate_up_proj_scales", p.scales13)):
            _copy_checked(layer, name, dst, _deinterleave(tensors[name]))
        for name, dst in (("down_proj_blocks", p.blocks2), ("down_proj_scales", p.scales2)):
            _copy_checked(layer, name, dst, tensors[name])
        b13, b2 = store.layout.bias_views(p.biases)
    _copy_checked(layer, "gate_up_proj_bias", b13, _deinterleave(tensors["gate_up_proj_bias"]))
    _copy_checked(layer, "down_proj_bias", b2, tensors["down_proj_bias"])


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
