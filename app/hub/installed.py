"""Models on this machine: what is installed, importing a local folder, resolving a name to a
folder, and deleting a download.

Downloaded models live in the Hugging Face cache (listed with the library's ``scan_cache_dir``,
deleted with its ``delete_revisions(...).execute()``); ``models.json`` records which downloads
finished verification (``is_ready``) and which local folders were imported under a name. An import
is a reference, as in LM Studio: the folder is used where it is (never copied: checkpoints are large,
and a hard link would tie Hearth's copy to the user's edits anyway), and forgetting it never deletes
it. Nothing here uses the network, so it all works in offline mode.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound
from huggingface_hub.utils import CachedRepoInfo, CachedRevisionInfo

from hearth.app.demo_model import DEMO_NAMES
from hearth.app.hub.catalog import SUPPORTED_MODEL_TYPES
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError, NotInstalledError, is_repo_id
from hearth.app.hub.loadable import architecture_problem, weights_problem
from hearth.app.hub.state import QueueFile, Registry
from hearth.app.hub.transfer import RepoCache
from hearth.app.store.settings import load_settings


@dataclass(frozen=True)
class InstalledModel:
    """A model Hearth can see. ``is_ready``: downloaded and verified (or an imported folder), with
    safetensors weights; ``has_weights``: the folder holds ``*.safetensors`` files (a pull with
    ``--include`` may have fetched none, and Hearth never loads other weight formats)."""

    name: str
    path: Path
    size_bytes: int
    model_type: str | None
    source: Literal["hub", "imported"]
    is_ready: bool
    commit: str | None
    has_weights: bool = True

    @property
    def is_supported(self) -> bool:
        """An architecture Hearth runs, with weights it can load."""
        return self.model_type in SUPPORTED_MODEL_TYPES and self.has_weights

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "size_bytes": self.size_bytes,
                "model_type": self.model_type, "is_supported": self.is_supported, "source": self.source,
                "is_ready": self.is_ready, "commit": self.commit, "has_weights": self.has_weights}


def list_installed(ctx: HubContext | None = None) -> list[InstalledModel]:
    """Downloaded repos (from the HF cache) and imported folders, sorted by name."""
    ctx = ctx or HubContext.from_settings(load_settings())
    registry = Registry(ctx.registry_path)
    ready = registry.ready()
    models = []
    for repo in _cached_repos(ctx):
        revision = _pick_revision(repo, ready.get(repo.repo_id))
        if revision is None:
            continue
        entry = ready.get(repo.repo_id)
        has_weights = _has_weights(revision.snapshot_path)
        models.append(InstalledModel(
            name=repo.repo_id, path=revision.snapshot_path, size_bytes=repo.size_on_disk,
            model_type=_model_type(revision.snapshot_path), source="hub",
            is_ready=entry is not None and entry.get("commit") == revision.commit_hash and has_weights,
            commit=revision.commit_hash, has_weights=has_weights))
    for name, folder in registry.imported().items():
        path = Path(folder)
        has_weights = _has_weights(path)
        models.append(InstalledModel(name, path, _folder_size(path), _model_type(path), "imported",
                                     is_ready=path.is_dir() and has_weights, commit=None, has_weights=has_weights))
    return sorted(models, key=lambda m: m.name.lower())


def find_installed(name: str, ctx: HubContext | None = None) -> list[InstalledModel]:
    """The installed models ``name`` names: the one with exactly that name, else those whose name,
    or repo name without the owner, is ``name`` in any letter case (what ``--model`` accepts)."""
    models = list_installed(ctx)
    exact = [m for m in models if m.name == name]
    if exact:
        return exact
    wanted = name.lower()
    return [m for m in models if wanted in (m.name.lower(), m.name.rsplit("/", 1)[-1].lower())]


def import_local_model(folder: str | Path, name: str | None = None,
                       ctx: HubContext | None = None) -> InstalledModel:
    """Register a local Hugging Face-layout folder under ``name`` (default: the folder's name), used
    in place: nothing is copied, and forgetting it (``delete_model``) leaves the folder alone.

    Checked first, without loading any weight: a config.json of an architecture Hearth runs (the rule
    ``pull`` applies), a tokenizer.json, and safetensors files whose headers the engine's loader reads,
    the shard index naming only files inside the folder. Pickle files (.bin/.pt) are never opened."""
    ctx = ctx or HubContext.from_settings(load_settings())
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise HubError(f"{folder} is not a folder")
    name = _import_name(name, path)
    config = _read_config(path)
    if config is None:
        raise HubError(f"{path} has no readable config.json, so it is not a Hugging Face checkpoint; not imported")
    filenames = [p.name for p in path.iterdir()]
    problem = (weights_problem(str(path), filenames, filenames)
               or architecture_problem(str(path), config.get("model_type")))
    if problem:
        raise HubError(f"{problem}; not imported")
    if not (path / "tokenizer.json").is_file():
        raise HubError(f"{path} has no tokenizer.json, which Hearth needs to run a model; not imported")
    _check_weight_files(path)
    registry = Registry(ctx.registry_path)
    earlier = registry.imported().get(name)
    if earlier is not None and Path(earlier) != path:
        raise HubError(f"{name} already names the folder {earlier}; pick another --name, or forget that one "
                       f"first with `hearth --cli rm {name}`")
    registry.add_import(name, path)
    return InstalledModel(name, path, _folder_size(path), config.get("model_type"), "imported", True, None)


def _import_name(name: str | None, path: Path) -> str:
    """The name an imported folder goes by: not a repo id, a path or the demo model's name, which
    ``--model`` would take for something else."""
    name = (name if name is not None else path.name).strip()
    if not name or "/" in name or "\\" in name or name.startswith((".", "~")):
        raise HubError(f"{name!r} cannot name a model: use a name without '/' (those are Hub repo ids) that does not "
                       "start with '.' or '~' (those are folders)")
    if name.lower() in DEMO_NAMES:
        raise HubError(f"{name!r} is the bundled demo model's name; pick another with --name")
    return name


def _check_weight_files(path: Path) -> None:
    """The safetensors files as the engine's loader reads them at load time (headers only: tensor
    names, shapes and offsets); an index naming a file outside the folder, a missing shard or an
    unreadable header is refused."""
    from hearth.engine.api import CheckpointError
    from hearth.engine.loader import CheckpointFiles  # lazy: it imports torch

    try:
        CheckpointFiles(path)
    except CheckpointError as err:
        raise HubError(f"{err}; not imported") from None


def resolve_model(name_or_path: str | Path, ctx: HubContext | None = None) -> Path:
    """The folder to load: a folder path, an imported name, a downloaded repo id's snapshot, or a
    short name: an installed model's name or its repo's name part, in any letter case."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    ctx = ctx or HubContext.from_settings(load_settings())
    name = str(name_or_path)
    registry = Registry(ctx.registry_path)
    imported = registry.imported().get(name)
    if imported is not None:
        if not Path(imported).is_dir():
            raise HubError(f"The folder imported as {name} is gone ({imported}); import it again")
        return Path(imported)
    if is_repo_id(name):
        found = _downloaded_snapshot(name, ctx, registry)
        if found is not None:
            return found
    return _by_short_name(name, ctx)


def _downloaded_snapshot(repo_id: str, ctx: HubContext, registry: Registry) -> Path | None:
    cache = RepoCache(ctx.cache_dir, repo_id)
    entry = registry.ready().get(repo_id)
    if entry is not None and cache.snapshot(entry["commit"]).is_dir():
        snapshot = cache.snapshot(entry["commit"])
        if not _has_weights(snapshot):
            raise HubError(_no_weights(repo_id))
        return snapshot
    if QueueFile(ctx.queue_path).unfinished(repo_id):
        raise NotInstalledError(f"{repo_id} is not fully downloaded yet; resume it with `hearth --cli pull {repo_id}`",
                                repo_id, is_partial=True)
    for repo in _cached_repos(ctx):
        revision = _pick_revision(repo, None) if repo.repo_id == repo_id else None
        if revision is not None and (revision.snapshot_path / "config.json").exists():
            return revision.snapshot_path
    return None


def _by_short_name(name: str, ctx: HubContext) -> Path:
    """The one installed model whose name, or repo name without the owner, is ``name`` (any case)."""
    matches = find_installed(name, ctx)
    ready = [m for m in matches if m.is_ready]
    if len(ready) == 1:
        return ready[0].path
    if len(ready) > 1:
        raise HubError(f"{name} could be {', '.join(m.name for m in ready)}; pass the full name")
    if matches:
        model = matches[0]
        if model.source == "imported" and not model.path.is_dir():
            raise HubError(f"The folder imported as {model.name} is gone ({model.path}); import it again")
        if not model.has_weights and (model.source == "imported" or model.name in Registry(ctx.registry_path).ready()):
            raise HubError(_no_weights(model.name))
        raise NotInstalledError(f"{model.name} is not fully downloaded yet; resume it with `hearth --cli pull "
                                f"{model.name}`", model.name if model.source == "hub" else None, is_partial=True)
    raise NotInstalledError(f"No model called {name}: not a folder, an installed name, a downloaded repo or its short "
                            "name (see `hearth --cli models`)", name if is_repo_id(name) else None)


def delete_model(name: str, ctx: HubContext | None = None) -> int:
    """Forget an imported name (its folder stays) or delete a download, partial ones and their queue
    entries included; returns bytes freed."""
    ctx = ctx or HubContext.from_settings(load_settings())
    registry = Registry(ctx.registry_path)
    if registry.remove_import(name):
        return 0
    freed = 0
    repo = next((r for r in _cached_repos(ctx) if r.repo_id == name), None)
    if repo is not None:
        strategy = scan_cache_dir(ctx.cache_dir).delete_revisions(*(r.commit_hash for r in repo.revisions))
        freed = strategy.expected_freed_size
        strategy.execute()
    folder = RepoCache(ctx.cache_dir, name).folder
    had_folder = folder.exists()
    if had_folder:  # partial downloads the cache scanner does not list as a revision
        freed += _folder_size(folder)
        shutil.rmtree(folder)
    queued = QueueFile(ctx.queue_path).remove_repo(name)  # a failed or paused pull of it, too
    if repo is None and not had_folder and not queued and name not in registry.ready():
        raise HubError(f"{name} is not installed (see `hearth --cli models`)")
    registry.unmark_ready(name)
    return freed


def _cached_repos(ctx: HubContext) -> list[CachedRepoInfo]:
    try:
        info = scan_cache_dir(ctx.cache_dir)
    except CacheNotFound:
        return []
    return [r for r in info.repos if r.repo_type == "model"]


def _pick_revision(repo: CachedRepoInfo, ready: dict[str, Any] | None) -> CachedRevisionInfo | None:
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    by_commit = {r.commit_hash: r for r in revisions}
    if ready is not None and ready.get("commit") in by_commit:
        return by_commit[ready["commit"]]
    on_main = [r for r in revisions if "main" in r.refs]
    return (on_main or revisions or [None])[0]


def _read_config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def _no_weights(name: str) -> str:
    return (f"{name} has no .safetensors weights (Hearth never loads pickle files; GGUF is not supported); "
            f"remove it with `hearth --cli rm {name}`")


def _model_type(folder: Path) -> str | None:
    config = _read_config(folder)
    return config.get("model_type") if config else None


def _folder_size(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
