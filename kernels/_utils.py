"""Shared helpers for Hearth's Triton kernels: layout checks that raise ValueError before a launch,
and small `@triton.jit` device functions (FP8 e4m3 encoding, ue8m0 scales, order-preserving float keys)
that are written with integer arithmetic only so they behave identically on the GPU and in
Triton's CPU interpreter (whose float -> fp8 cast mis-rounds at binade edges)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
UE8M0_AMAX_FLOOR = 1e-4


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before
# it in the stream drains (its launch and ramp-up overlap that kernel's tail) and waits in `pdl_wait` before it
# reads anything that kernel wrote. Benchmarks set PDL = False for rows without it.
PDL = True


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (`PDL`, sm_90+, not the interpreter)."""
    return PDL and device.type == "cuda" and not is_interpreter() and _capability(device)[0] >= 9


def _capability(device: torch.device) -> tuple[int, int]:
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel of the stream has finished and its writes are visible (every
    program of a kernel launched with ``launch_pdl`` calls this before its first dependent load), then let the
    next kernel launch early (its programs start as SMs free, and wait here in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """With PDL: let the next kernel of the stream start launching now (a kernel not itself launched with PDL)."""
    if PDL:
        gdc_launch_dependents()


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA device; ``cpu``: how many a launch plans for under the CPU
    interpreter (each caller says why its number)."""
    if device.type != "cuda":
        return cpu
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond holds (launcher-side layout checks)."""
    if not cond:
        raise ValueError(msg)


# A float dtype's bits as an integer dtype of its width, and the mask of its exponent (float8_e4m3fn: exponent and
# mantissa, its only non-finite value being NaN, S.1111.111): an element is NaN or inf exactly where all of its mask's
# bits are set, and the mask is the largest value `bits & mask` can take (it has no sign bit).
_NONFINITE_BITS = {
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN/inf elements of a float or float8_e4m3fn tensor (e4m3fn has no inf; NaN is S.1111.111).

    Every weight of a checkpoint goes through this at load, so the common answer, none, is found in one masked
    max over the raw bits (two passes over the bytes, no bool tensor): on a CPU core 3 ms for a 14.7 MB e4m3
    expert matrix where counting took 80 ms (the bool tensor's sum), which made the checks most of an
    experts-in-RAM load. Only a tensor with a non-finite element is counted exactly."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    bits = _NONFINITE_BITS.get(t.dtype)
    if bits is not None:
        as_int, mask = bits
        masked = t.view(as_int) & mask
        if int(masked.max()) != mask:
            return 0
        return int((masked == mask).sum())
    return int((~torch.isfinite(t)).sum())


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
    device: torch.device | None = None,
) -> None:
    """Check a launcher argument and raise a ValueError that names it; `None` in shape = any size."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if ndim is not None:
        require(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        require(ok, f"{name} must have shape {shape} (None = any), got {tuple(t.shape)}")
    if contiguous:
        require(t.is_contiguous(), f"{name} must be contiguous (strides {t.stride()})")
    if device is not None:
        require(t.device == device, f"{name} must be on {device}, got {t.device}")


@triton.jit
def ue8m0_exponent(amax):
    """Exponent e with 2^e = 2^ceil(log2(amax / 448)) for fp32 amax >= 1e-4 (a normal number).

    With amax = m * 2^E (m in [1, 2)) and 448 = 1.75 * 2^8: e = E - 8 if m <= 1.75 else E - 7, which
    equals the exponent of the correctly rounded fp32 quotient (the quotient never rounds onto a
    power of two), so no division is needed."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    return exp - 8 + (mant > 0x600000).to(tl.int32)


@triton.jit
def exp2_int(e):
    """2.0 ** e as fp32 for an int32 e in the normal range [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(y):
    """fp32 -> float8_e4m3fn bit pattern (int32 in 0..255), round to nearest even, for |y| <= 448.

    Normal range: round the fp32 mantissa to 3 bits on the raw bits (a carry moves into the exponent,
    as it should), then rebias the exponent (127 -> 7). Subnormals (|y| < 2^-6) are k * 2^-9, k in 0..8:
    adding 2^23 to |y| * 512 rounds it to an integer in fp32 (k = 8 encodes 2^-6, the next pattern)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    a = mag.to(tl.float32, bitcast=True)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6 as fp32
    return code | sign


@triton.jit
def float_order_key(x):
    """fp32 -> int32 key whose signed order equals the float order (-inf < ... < -0 < +0 < ... < +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def round_to_bf16(x):
    """Round fp32 to the nearest bf16 value (ties to even), kept in fp32; finite inputs.

    Done on the bits because the CPU interpreter's fp32 -> bf16 cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """tl.dot(a, b, acc); with UPCAST (set under the CPU interpreter, whose bf16 dot is wrong in
    Triton 3.9) the operands are widened to fp32 first, which is exact for bf16 / fp8 inputs."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def mma_fp8(a, b, acc, UPCAST: tl.constexpr, PRECISE: tl.constexpr):
    """fp8 x fp8 -> fp32 tl.dot. Hopper's fp8 MMA accumulates with reduced precision (about 1e-4
    relative on 128-long sums); PRECISE adds the partial sums into fp32 every 32 products."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif PRECISE:
        out = tl.dot(a, b, acc, max_num_imprecise_acc=32)
    else:
        out = tl.dot(a, b, acc)
    return out
