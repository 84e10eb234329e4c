"""DSA sparse MLA (absorbed form) over the paged bf16 or FP8 (656-byte) latent cache."""

from hearth.kernels.sparse_mla.kernel import default_sm_scale, sparse_mla_decode, sparse_mla_prefill
from hearth.kernels.sparse_mla.reference import dequantize_latent_fp8, quantize_latent_fp8

__all__ = [
    "default_sm_scale",
    "dequantize_latent_fp8",
    "quantize_latent_fp8",
    "sparse_mla_decode",
    "sparse_mla_prefill",
]
