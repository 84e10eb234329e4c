"""Fused RMSNorm: one kernel per call instead of the ~7 elementwise launches of the torch form."""

from hearth.kernels.norm.reference import rms_norm_reference
from hearth.kernels.norm.rmsnorm import rms_norm

__all__ = ["rms_norm", "rms_norm_reference"]
