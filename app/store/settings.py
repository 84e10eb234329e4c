"""Hearth's settings: one JSON file under the config folder, shared by the GUI and the CLI.

``load_settings()`` never fails: a missing file gives the defaults, a bad value falls back to its
default with a warning, and a file that is not JSON is renamed aside (``settings.json.corrupt-<time>``,
so nothing is lost) before the defaults are used. ``save_settings()`` writes atomically (temporary
file + ``os.replace``) and keeps keys this version does not know, so an older Hearth does not erase
a newer one's settings.

The Hugging Face token is deliberately not a setting: it comes from ``HF_TOKEN`` or the library's
own login store (``hf auth login``), so Hearth never writes a secret into its files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hearth.app.paths import settings_path
from hearth.engine.api import EngineConfig, HearthError, engine_options

logger = logging.getLogger(__name__)

Theme = Literal["light", "dark", "system"]
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_CONTEXT_LENGTH = 8192


class SettingsError(HearthError):
    """A settings value is out of range or of the wrong type."""


@dataclass(frozen=True)
class Settings:
    """Everything the user can set. ``None`` means "decide from the machine" or "library default".

    hf_endpoint: the Hub or a mirror (passed as ``endpoint=`` to every huggingface_hub call).
    hf_cache_dir: where model weights go; None = the library's cache (``HF_HUB_CACHE``).
    download_parallelism: files downloaded at once.
    offline: no network calls at all; only installed models are listed and used.
    backend_url: an OpenAI-compatible server to use instead of the local engine host; None = local.
    engine: the local engine's options (memory budgets, context length, scheduler, long-context
        tiers...), described once by ``EngineConfig``'s field metadata. In the settings file they
        sit beside the other keys, under their ``EngineConfig`` names.
    """

    hf_endpoint: str = DEFAULT_ENDPOINT
    hf_cache_dir: str | None = None
    download_parallelism: int = 4
    offline: bool = False
    backend_url: str | None = None
    theme: Theme = "system"
    default_model: str | None = None
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_model_len=DEFAULT_CONTEXT_LENGTH))

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "hf_endpoint", self.hf_endpoint.rstrip("/"))
        checks = [
            (self.hf_endpoint.startswith(("http://", "https://")), "hf_endpoint must be an http(s) URL"),
            (1 <= self.download_parallelism <= 64, "download_parallelism must be in [1, 64]"),
            (self.theme in ("light", "dark", "system"), "theme must be light, dark or system"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)

    @property
    def context_length(self) -> int:
        """Tokens per request the fit estimate and the engine plan for (before the model's own cap)."""
        return self.engine.max_model_len or DEFAULT_CONTEXT_LENGTH

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``; ``EngineConfig`` names (and ``context_length`` for
        ``max_model_len``) change the engine options."""
        changes = {_LEGACY_KEYS.get(k, k): v for k, v in changes.items()}
        engine_changes = {k: changes.pop(k) for k in list(changes) if k in ENGINE_KEYS}
        if engine_changes:
            try:
                changes["engine"] = dataclasses.replace(changes.get("engine", self.engine), **engine_changes)
            except HearthError as exc:
                raise SettingsError(str(exc)) from None
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The settings as the file holds them: one flat object."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"}
        return {**flat, **dataclasses.asdict(self.engine)}


ENGINE_KEYS = frozenset(option.name for option in engine_options())
_LEGACY_KEYS = {"context_length": "max_model_len"}  # the name older settings files use
_TYPES: dict[str, tuple[type, ...]] = {
    "hf_endpoint": (str,),
    "hf_cache_dir": (str, type(None)),
    "download_parallelism": (int,),
    "offline": (bool,),
    "backend_url": (str, type(None)),
    "theme": (str,),
    "default_model": (str, type(None)),
    "engine": (EngineConfig,),
}


def restart_needed(old: Settings, new: Settings) -> bool:
    """Whether going from ``old`` to ``new`` needs the engine started again: another backend, or a
    changed engine option that takes effect at load time."""
    return old.backend_url != new.backend_url or any(
        option.text.restart and getattr(old.engine, option.name) != getattr(new.engine, option.name)
        for option in engine_options())


def _check_types(settings: Settings) -> None:
    for name, types in _TYPES.items():
        value = getattr(settings, name)
        # NOTE: bool is an int subclass; a JSON true must not pass as a count or a size.
        is_bool_for_number = isinstance(value, bool) and bool not in types
        if is_bool_for_number or not isinstance(value, types):
            raise SettingsError(f"{name} has the wrong type ({type(value).__name__})")


def load_settings(path: Path | None = None) -> Settings:
    """Read the settings file; never raises for a bad file (see the module docstring)."""
    path = path or settings_path()
    raw = _read_raw(path)
    if raw is None:
        return Settings()
    for old, new in _LEGACY_KEYS.items():
        if old in raw:
            raw.setdefault(new, raw.pop(old))
    settings = Settings()
    for name in [f.name for f in dataclasses.fields(Settings) if f.name != "engine"] + sorted(ENGINE_KEYS):
        if name not in raw:
            continue
        try:
            settings = settings.replace(**{name: raw[name]})
        except (HearthError, TypeError) as exc:
            logger.warning("Ignoring setting %s in %s: %s", name, path, exc)
    return settings


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write ``settings`` atomically, keeping unknown keys already in the file."""
    path = path or settings_path()
    raw = _read_raw(path, set_aside_if_corrupt=False) or {}
    for old in _LEGACY_KEYS:
        raw.pop(old, None)  # now written under its new name
    raw.update(settings.to_json())
    write_json_atomic(path, raw)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so readers see the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _read_raw(path: Path, *, set_aside_if_corrupt: bool = True) -> dict[str, Any] | None:
    """The file's JSON object, or None when it is missing or corrupt."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("the top level is not a JSON object")
    except ValueError as exc:
        if set_aside_if_corrupt:
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            logger.warning("Settings file %s is not valid JSON (%s); moved it to %s, using defaults",
                           path, exc, aside)
        return None
    return raw
