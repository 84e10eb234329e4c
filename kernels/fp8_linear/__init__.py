"""FP8 block-scaled linear layers (GEMV for decode, tl.dot GEMM for prefill) and their torch reference."""

from hearth.kernels.fp8_linear.kernel import GemmConfig, GemvConfig, check_weights, fp8_gemm, fp8_gemv, fp8_linear
from hearth.kernels.fp8_linear.reference import dequantize, fp8_linear_reference

__all__ = ["GemmConfig", "GemvConfig", "check_weights", "dequantize", "fp8_gemm", "fp8_gemv", "fp8_linear",
           "fp8_linear_reference"]
