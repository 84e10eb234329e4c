"""Fused small kernels of a decode step (RMSNorm with residual add, rotary in place, MLA latent write,
the indexer's query quantisation, the MoE router)."""

from hearth.kernels.fused.kernel import indexer_q_fp8, mla_latent_write, rms_norm, rope_
from hearth.kernels.fused.router import moe_route

__all__ = ["indexer_q_fp8", "mla_latent_write", "moe_route", "rms_norm", "rope_"]
