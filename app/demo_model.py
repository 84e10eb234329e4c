"""The demo model shipped inside Hearth (``hearth.resources/demo_model``), Qt-free.

A few-million-parameter DeepSeek-V3.2 trained on Python's documentation (see its MODEL_CARD.md and
``train/``): it loads with the real engine and writes English-looking text, so a first start with no
downloaded model still shows Hearth working. The CLI and the GUI offer it when no other model is
installed.

    path = bundled_demo_path()      # Path to the folder, or None (not bundled / incomplete / in a zip)
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

DEMO_FOLDER = "demo_model"
DEMO_LABEL = "Demo (tiny model)"  # its name in the GUI's model picker and in ``hearth --cli models``
DEMO_NAMES = ("demo", DEMO_LABEL.lower())  # what ``--model`` accepts for it (any letter case)
NO_BUNDLED_DEMO_ENV = "HEARTH_NO_BUNDLED_DEMO"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def bundled_demo_path() -> Path | None:
    """The bundled demo model's folder when all its files are there as real files, else None.

    None when ``hearth.resources`` is missing, when the folder was left out of a build, or when the
    resources live inside a zip (the engine memory-maps real files, so it needs a folder on disk).
    """
    if os.environ.get(NO_BUNDLED_DEMO_ENV):
        return None  # forces the random-weight fallback (GUI tests pin that small, fast model)
    try:
        root = resources.files("hearth.resources").joinpath(DEMO_FOLDER)
    except ModuleNotFoundError:
        return None
    if not isinstance(root, Path):
        return None
    if all((root / name).is_file() for name in REQUIRED_FILES):
        return root
    return None


def bundled_demo_context_length() -> int | None:
    """``max_position_embeddings`` of the bundled demo model (None when it is not bundled)."""
    path = bundled_demo_path()
    if path is None:
        return None
    try:
        return int(json.loads((path / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
