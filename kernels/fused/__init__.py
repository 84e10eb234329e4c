"""Fused small kernels of a decode step (RMSNorm with residual add, rotary in place, MLA latent write)."""

from hearth.kernels.fused.kernel import mla_latent_write, rms_norm, rope_

__all__ = ["mla_latent_write", "rms_norm", "rope_"]
