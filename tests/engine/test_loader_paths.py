"""A shard index (``model.safetensors.index.json``) cannot make the loader read files outside the
model folder: ``../``, absolute paths and folders that lead elsewhere are refused with one error.
Shards that are symlinks themselves (the Hugging Face cache's layout) still load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hearth.engine.api import CheckpointError
from hearth.engine.loader import CheckpointFiles, load_checkpoint

SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def layout(tiny_models, tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose second shard lives in a sibling folder ``outside`` instead."""
    model = Path(shutil.copytree(tiny_models["deepseek_v2"], tmp_path / "model"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (model / SHARD).rename(outside / SHARD)
    return model, outside


def _point_shard_at(model: Path, file_name: str) -> None:
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {name: file_name if shard == SHARD else shard for name, shard in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["parent", "absolute", "nested-parent", "backslash", "linked-folder"])
def test_index_entries_outside_the_folder_are_refused(layout, how: str):
    model, outside = layout
    if how == "linked-folder":
        (model / "sub").symlink_to(outside, target_is_directory=True)
    file_name = {"parent": f"../outside/{SHARD}", "absolute": str(outside / SHARD),
                 "nested-parent": f"sub/../../outside/{SHARD}", "backslash": f"..\\outside\\{SHARD}",
                 "linked-folder": f"sub/{SHARD}"}[how]
    _point_shard_at(model, file_name)
    with pytest.raises(CheckpointError, match="is not a file inside the model folder"):
        load_checkpoint(model, torch.device("cpu"), torch.float32)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        CheckpointFiles(model)


def test_a_shard_that_is_a_symlink_still_loads(layout):
    model, outside = layout
    os.symlink(os.path.relpath(outside / SHARD, model), model / SHARD)  # like snapshots/<commit>/ -> blobs/
    assert load_checkpoint(model, torch.device("cpu"), torch.float32) is not None


def test_weight_map_of_the_wrong_type_is_refused(layout):
    model, _ = layout
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 1}}))
    with pytest.raises(CheckpointError, match="weight_map must map"):
        CheckpointFiles(model)
