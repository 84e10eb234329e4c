"""The models the Models tab opens on: a short bundled list (``hearth.resources``'s
``recommended_models.json``, read offline) with each entry's fit verdict for this machine, the
ones that fit first.

    for pick in recommendations(settings, machine):
        pick.repo_id, pick.report.verdict
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from hearth.app.hub.fit import FitReport, Machine, Verdict, assess_fit, footprint_from_config
from hearth.app.hub.units import GIB
from hearth.app.store.settings import Settings

LIST_FILE = "recommended_models.json"
_ORDER = (Verdict.GPU, Verdict.EXPERTS_IN_RAM, Verdict.CPU_ONLY, Verdict.DOES_NOT_FIT)


@dataclass(frozen=True)
class Recommendation:
    repo_id: str
    why: str
    model_type: str
    weights_bytes: int  # estimated from the parameter count (see the list's "about")
    report: FitReport

    @property
    def fits(self) -> bool:
        return self.report.verdict != Verdict.DOES_NOT_FIT


def recommendations(settings: Settings, machine: Machine) -> list[Recommendation]:
    """The bundled list with verdicts for ``machine`` at the user's context length: fitting
    models first (GPU, then experts in RAM, then CPU), smaller first within each verdict."""
    expert_cache = int(settings.engine.expert_cache_gib * GIB) if settings.engine.expert_cache_gib else None
    picks = []
    for entry in _entries():
        weights = int(float(entry["weights_gb"]) * 1e9)
        config = entry["config"]
        context = min(settings.context_length, int(config.get("max_position_embeddings") or settings.context_length))
        report = assess_fit(footprint_from_config(config, weights), machine, context_length=context,
                            expert_cache_bytes=expert_cache, download_bytes=weights)
        picks.append(Recommendation(entry["repo_id"], entry["why"], config["model_type"], weights, report))
    return sorted(picks, key=lambda p: (_ORDER.index(p.report.verdict), p.weights_bytes))


def _entries() -> list[dict[str, Any]]:
    text = resources.files("hearth.resources").joinpath(LIST_FILE).read_text(encoding="utf-8")
    return list(json.loads(text)["models"])
