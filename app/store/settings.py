"""Hearth's settings: one JSON file under the config folder, shared by the GUI and the CLI.

``load_settings()`` never fails: a missing file gives the defaults, a bad value falls back to its
default with a warning, and a file that is not JSON is renamed aside (``settings.json.corrupt-<time>``,
so nothing is lost) before the defaults are used. ``save_settings()`` writes atomically (temporary
file + ``os.replace``) and keeps keys this version does not know, so an older Hearth does not erase
a newer one's settings.

The Hugging Face token is deliberately not a setting: it comes from ``HF_TOKEN`` or the library's
own login store (``hf auth login``), so Hearth never writes a secret into its files. The Hub's other
conventions (``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``) apply unless a
setting overrides them: ``hf_endpoint`` and ``hf_cache_dir`` are null by default, meaning "what the
environment says" (see ``hearth.app.hub.context``).

Files written before ``settings_version`` 2 stored the default endpoint explicitly; that value is
read as unset, so ``HF_ENDPOINT`` applies to them too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hearth.app.paths import settings_path
from hearth.engine.api import HearthError

logger = logging.getLogger(__name__)

Theme = Literal["light", "dark", "system"]
DEFAULT_ENDPOINT = "https://huggingface.co"
SETTINGS_VERSION = 2
VERSION_KEY = "settings_version"


class SettingsError(HearthError):
    """A settings value is out of range or of the wrong type."""


@dataclass(frozen=True)
class Settings:
    """Everything the user can set. ``None`` means "decide from the machine" or "library default".

    hf_endpoint: the Hub or a mirror (passed as ``endpoint=`` to every huggingface_hub call); None =
    ``HF_ENDPOINT``, else https://huggingface.co.
    hf_cache_dir: where model weights go; None = the library's cache (``HF_HUB_CACHE``, ``HF_HOME``).
    download_parallelism: files downloaded at once.
    offline: no network calls at all; only installed models are listed and used (``HF_HUB_OFFLINE``
    in the environment turns it on as well).
    gpu_memory_gib / host_memory_gib: memory Hearth may use; None = what the machine has free.
    expert_cache_gib: GPU memory for resident experts when experts live in RAM; None = auto.
    context_length: tokens per request the fit estimate and the engine plan for.
    backend_url: an OpenAI-compatible server to use instead of the local engine host; None = local.
    scheduler: "sync" or "runahead" decode scheduling of the local engine (matters with experts in RAM).
    mli: Multi-layer Indexer on DSA models. index_topk_freq: IndexCache retention (an indexer every
    N layers; None = as the model ships). index_key_hot_pages / latent_hot_rows: long-context tiers
    (indexer-key pages / latent rows kept on the GPU per request; None = everything on the GPU).
    cuda_graphs: replay decode steps from CUDA graphs on the GPU (off = every step runs eagerly).
    context_overflow: when a chat outgrows the context, "truncate" drops its oldest messages (the
    system prompt stays), "stop" says so and sends nothing.
    api_host / api_port: where the app's API server switch listens (127.0.0.1: this machine only).
    """

    hf_endpoint: str | None = None
    hf_cache_dir: str | None = None
    download_parallelism: int = 4
    offline: bool = False
    gpu_memory_gib: float | None = None
    expert_cache_gib: float | None = None
    host_memory_gib: float | None = None
    context_length: int = 8192
    backend_url: str | None = None
    theme: Theme = "system"
    default_model: str | None = None
    scheduler: str = "sync"
    mli: bool = False
    index_topk_freq: int | None = None
    index_key_hot_pages: int | None = None
    latent_hot_rows: int | None = None
    cuda_graphs: bool = True
    context_overflow: str = "truncate"
    api_host: str = "127.0.0.1"
    api_port: int = 8000

    def __post_init__(self) -> None:
        _check_types(self)
        if self.hf_endpoint is not None:
            object.__setattr__(self, "hf_endpoint", self.hf_endpoint.rstrip("/"))
        checks = [
            (self.hf_endpoint is None or self.hf_endpoint.startswith(("http://", "https://")),
             "hf_endpoint must be an http(s) URL (or null for HF_ENDPOINT / the Hub)"),
            (1 <= self.download_parallelism <= 64, "download_parallelism must be in [1, 64]"),
            (self.context_length >= 2, "context_length must be >= 2"),
            (self.theme in ("light", "dark", "system"), "theme must be light, dark or system"),
            (self.scheduler in ("sync", "runahead"), "scheduler must be sync or runahead"),
            (self.context_overflow in ("truncate", "stop"), "context_overflow must be truncate or stop"),
            (0 <= self.api_port <= 65535, "api_port must be in [0, 65535]"),
        ]
        for name in ("index_topk_freq", "index_key_hot_pages", "latent_hot_rows"):
            value = getattr(self, name)
            checks.append((value is None or value >= 1, f"{name} must be >= 1 (or null for off)"))
        for name in ("gpu_memory_gib", "expert_cache_gib", "host_memory_gib"):
            value = getattr(self, name)
            checks.append((value is None or value > 0, f"{name} must be > 0 (or null for auto)"))
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


_TYPES: dict[str, tuple[type, ...]] = {
    "hf_endpoint": (str, type(None)),
    "hf_cache_dir": (str, type(None)),
    "download_parallelism": (int,),
    "offline": (bool,),
    "gpu_memory_gib": (int, float, type(None)),
    "expert_cache_gib": (int, float, type(None)),
    "host_memory_gib": (int, float, type(None)),
    "context_length": (int,),
    "backend_url": (str, type(None)),
    "theme": (str,),
    "default_model": (str, type(None)),
    "scheduler": (str,),
    "mli": (bool,),
    "index_topk_freq": (int, type(None)),
    "index_key_hot_pages": (int, type(None)),
    "latent_hot_rows": (int, type(None)),
    "cuda_graphs": (bool,),
    "context_overflow": (str,),
    "api_host": (str,),
    "api_port": (int,),
}


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
    if raw.get(VERSION_KEY) is None and raw.get("hf_endpoint") == DEFAULT_ENDPOINT:
        raw.pop("hf_endpoint")  # an older Hearth wrote its default here, not the user's choice
    defaults = Settings()
    good: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        if field.name not in raw:
            continue
        try:
            defaults.replace(**{field.name: raw[field.name]})
        except (SettingsError, TypeError) as exc:
            logger.warning("Ignoring setting %s in %s: %s", field.name, path, exc)
            continue
        good[field.name] = raw[field.name]
    return Settings(**good)


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write ``settings`` atomically, keeping unknown keys already in the file."""
    path = path or settings_path()
    raw = _read_raw(path, set_aside_if_corrupt=False) or {}
    raw.update(dataclasses.asdict(settings))
    raw[VERSION_KEY] = SETTINGS_VERSION
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


def setting_names() -> list[str]:
    return [field.name for field in dataclasses.fields(Settings)]


def parse_setting(name: str, text: str) -> Any:
    """``text`` (from a command line) as a value of setting ``name``: true/false for switches,
    numbers for counts and sizes, ``null`` for "unset" where a setting allows it."""
    types = _TYPES.get(name)
    if types is None:
        raise SettingsError(f"unknown setting {name!r}; known: {', '.join(setting_names())}")
    if text.strip().lower() in ("null", "none") and type(None) in types:
        return None
    if bool in types:
        word = text.strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
        raise SettingsError(f"{name} is true or false, not {text!r}")
    for kind, what in ((int, "a whole number"), (float, "a number")):
        if kind in types:
            try:
                return kind(text)
            except ValueError:
                if float not in types or kind is float:
                    raise SettingsError(f"{name} takes {what}{_or_null(types)}, not {text!r}") from None
    return text


def _or_null(types: tuple[type, ...]) -> str:
    return " (or null)" if type(None) in types else ""
