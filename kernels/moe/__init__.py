"""Fused routed-expert MoE: Triton grouped SwiGLU over expert cache slots, plus its torch reference."""

from hearth.kernels.moe.align import group_by_slot, max_blocks
from hearth.kernels.moe.fused_moe import ExpertExtras, fused_moe
from hearth.kernels.moe.reference import dequant_block_fp8, moe_reference

__all__ = ["ExpertExtras", "dequant_block_fp8", "fused_moe", "group_by_slot", "max_blocks", "moe_reference"]
