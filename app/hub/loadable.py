"""What Hearth can load: ``.safetensors`` weights (never pickles; GGUF is not supported) of an
architecture the engine runs. One rule, one wording: ``pull`` (so also ``run``'s download of a
missing model) applies it to a repo before fetching any weight, ``import`` to a local folder before
registering it. Each check returns why the model cannot be loaded, or None; callers add what
happens next (nothing downloaded, not imported).
"""

from __future__ import annotations

from collections.abc import Iterable

from hearth.engine.config import SUPPORTED_MODEL_TYPES

NOT_LOADABLE = (".gguf", ".bin", ".pt", ".pth", ".ckpt")  # weights Hearth never loads, named when only those exist


def unloadable_kinds(filenames: Iterable[str]) -> list[str]:
    """The weight formats Hearth never loads (``NOT_LOADABLE``) among ``filenames``, sorted."""
    return sorted({ext for f in filenames for ext in NOT_LOADABLE if f.endswith(ext)})


def weights_problem(name: str, filenames: Iterable[str], listing: Iterable[str]) -> str | None:
    """Why ``name`` has nothing to load when ``filenames`` (what would be used) hold no safetensors
    file; ``listing`` (every file there) names the unloadable weight formats it has instead."""
    if any(f.endswith(".safetensors") for f in filenames):
        return None
    kinds = unloadable_kinds(listing)
    has = f" (only {', '.join(kinds)} files)" if kinds else ""
    return f"{name} has no .safetensors weights{has}: Hearth never loads pickle files; GGUF is not supported"


def architecture_problem(name: str, model_type: str | None) -> str | None:
    """Why ``name`` is not an architecture the engine runs (its config's ``model_type``)."""
    runs = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
    if model_type is None:
        return f"{name} names no model_type (config.json), so it is not a model Hearth can run (it runs {runs})"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"{name} is a {model_type} model, an architecture Hearth cannot run (it runs {runs})"
    return None
