"""A guard for CPU emulations of CUDA-graph capture: inside its block, Tensor methods that read device
values on the host raise when hearth code calls them (the Triton interpreter's own calls, which stand
for the GPU, pass), and so does the tiers' host phase (``reserve``, which must run before a step). Code
that ran inside it has no host synchronisation for a real capture to bake in."""

from __future__ import annotations

import sys

import torch

from hearth.offload.planned_tiers import PlannedKeys, PlannedLatents

_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


class NoHostSync:
    """Patches (through ``monkeypatch``) the host reads and the tiers' ``reserve``; active within ``with``."""

    def __init__(self, monkeypatch) -> None:
        self.active = False
        for name in _SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._guard(name, getattr(torch.Tensor, name)))
        for cls in (PlannedKeys, PlannedLatents):
            monkeypatch.setattr(cls, "reserve", self._guard("reserve", cls.reserve))

    def _guard(self, name, real):
        def guarded(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.active and "triton" not in caller:
                raise AssertionError(f"{name} inside a captured step or piece (from {caller})")
            return real(*args, **kwargs)
        return guarded

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, *exc) -> None:
        self.active = False
