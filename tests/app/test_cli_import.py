"""``hearth --cli import DIR [--name NAME]``: a local Hugging Face-layout folder, checked (the
architecture rule pull applies, safetensors headers, an index naming only files inside the folder,
a tokenizer; pickles never opened), then used where it is by models, run and the app's list; ``rm``
only forgets it."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from hearth.app.cli.main import main as cli
from hearth.app.hub.context import HubContext
from hearth.app.hub.installed import list_installed
from hearth.app.store.settings import load_settings
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import SHARD_1, SHARD_2, TerminalStdin

INDEX = "model.safetensors.index.json"


class _Touch:
    """Unpickling it creates ``marker``: what a hostile pytorch_model.bin could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("import") / "tiny-v32", "deepseek_v32", seed=7)


@pytest.fixture
def folder(model_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny model, with a pickle beside it that must never be loaded."""
    copy = Path(shutil.copytree(model_dir, tmp_path / "My-Tiny"))
    (copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(tmp_path / "unpickled")))
    return copy


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _installed() -> list:
    return list_installed(HubContext.from_settings(load_settings()))


def test_import_then_list_run_and_rm_which_keeps_the_folder(folder: Path, tmp_path: Path, capsys):
    files_before = sorted(p.name for p in folder.iterdir())
    assert cli(["import", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"Imported My-Tiny (1.3 MB, deepseek_v32) from {folder}")
    assert "`hearth --cli rm My-Tiny` forgets it and leaves the folder alone" in out[1]
    assert cli(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)[0]  # what the app's installed list reads too
    assert (listed["name"], listed["path"], listed["source"], listed["is_ready"]) == ("My-Tiny", str(folder),
                                                                                      "imported", True)
    assert cli(["run", "-m", "my-tiny", "--max-tokens", "1", "--json", "hi"]) == 0  # short names as for downloads
    assert json.loads(capsys.readouterr().out)["model"] == "my-tiny"
    assert cli(["rm", "My-Tiny", "--yes"]) == 0
    assert capsys.readouterr().out == f"Forgot My-Tiny; its folder {folder} was left alone.\n"
    assert sorted(p.name for p in folder.iterdir()) == files_before and _installed() == []
    assert not (tmp_path / "unpickled").exists()


def test_rm_asks_to_forget_not_to_delete(folder: Path, monkeypatch, capsys):
    assert cli(["import", str(folder), "--name", "mine"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", TerminalStdin())
    monkeypatch.setattr("builtins.input", lambda prompt: print(prompt) or "n")
    assert cli(["rm", "mine"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"Forget mine? Its folder {folder} stays as it is. [y/N] "


def _without(folder: Path, name: str) -> Path:
    (folder / name).unlink()
    return folder


def _set_type(folder: Path, model_type: str) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return folder


def _only_pickles(folder: Path) -> Path:
    for name in (SHARD_1, SHARD_2, INDEX):
        (folder / name).unlink()
    return folder


def _index_naming(shard: str):
    def change(folder: Path) -> Path:
        index = json.loads((folder / INDEX).read_text())
        index["weight_map"] = {k: shard if v == SHARD_2 else v for k, v in index["weight_map"].items()}
        (folder / INDEX).write_text(json.dumps(index))
        return folder
    return change


def _outside_shard(folder: Path) -> Path:
    shutil.copy(folder / SHARD_2, folder.parent / "outside.safetensors")
    return _index_naming("../outside.safetensors")(folder)


def _garbage_header(folder: Path) -> Path:
    (folder / SHARD_2).write_bytes(b"\xff" * 64)
    return folder


@pytest.mark.parametrize(("defect", "words"), [
    (lambda f: _without(f, "config.json"), "has no readable config.json"),
    (lambda f: _set_type(f, "llama"), "is a llama model, an architecture Hearth cannot run (it runs "),
    (_only_pickles, "has no .safetensors weights (only .bin files): Hearth never loads pickle files"),
    (lambda f: _without(f, "tokenizer.json"), "has no tokenizer.json"),
    (lambda f: _without(f, SHARD_2), f"{SHARD_2}: shard listed in {INDEX} is missing"),
    (_outside_shard, "shard '../outside.safetensors' is not a file inside the model folder"),
    (_index_naming("/etc/hostname"), "shard '/etc/hostname' is not a file inside the model folder"),
    (_garbage_header, f"{SHARD_2}: not a valid safetensors file"),
], ids=["no-config", "llama", "only-pickles", "no-tokenizer", "missing-shard", "dotdot-shard", "absolute-shard",
        "bad-header"])
def test_a_folder_hearth_cannot_load_is_refused(folder: Path, tmp_path: Path, capsys, defect, words):
    defect(folder)
    assert cli(["import", str(folder)]) == 1
    line = _error_line(capsys.readouterr().err)
    assert words in line and line.endswith("; not imported"), line
    assert _installed() == [] and not (tmp_path / "unpickled").exists()


def test_names_and_folders_import_refuses(folder: Path, model_dir: Path, tmp_path: Path, capsys):
    for name, words in (("org/name", "use a name without '/'"), (".hidden", "does not start with '.' or '~'"),
                        ("Demo", "is the bundled demo model's name")):
        assert cli(["import", str(folder), "--name", name]) == 1
        assert words in _error_line(capsys.readouterr().err)
    assert cli(["import", str(tmp_path / "nowhere")]) == 1
    assert "is not a folder" in _error_line(capsys.readouterr().err)
    assert cli(["import", str(folder), "--name", "mine"]) == 0
    assert cli(["import", str(folder), "--name", "mine"]) == 0  # again: nothing changes
    assert cli(["import", str(model_dir), "--name", "mine"]) == 1
    assert f"mine already names the folder {folder}" in _error_line(capsys.readouterr().err)
    assert [(m.name, m.path) for m in _installed()] == [("mine", folder)]
