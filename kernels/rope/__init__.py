"""Fused rotary embedding: one kernel per call for either layout (interleaved pairs or halves)."""

from hearth.kernels.rope.reference import apply_rotary_reference
from hearth.kernels.rope.rotary import apply_rotary

__all__ = ["apply_rotary", "apply_rotary_reference"]
