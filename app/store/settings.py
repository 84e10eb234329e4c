"""Hearth's settings: one JSON file under the config folder, shared by the GUI and the CLI.

``load_settings()`` never fails: a missing file gives the defaults, a bad value falls back to its
default with a warning, and a file that is not JSON is renamed aside (``settings.json.corrupt-<time>``,
so nothing is lost) before the defaults are used. ``save_settings()`` writes atomically (temporary
file + ``os.replace``) and keeps keys this version does not know, so an older Hearth does not erase
a newer one's settings.

The Hugging Face token is deliberately not a setting: it comes from ``HF_TOKEN`` or the library's
own login store (``hf auth login``), so Hearth never writes that secret into its files. The remote
backend's API key (``backend_api_key``) has no such store: it is kept apart from the settings file, in
``backend-api-key`` beside it (private to the user, 0600), so ``config list``, a shared settings file
or a bug report never carry it. The Hub's other
conventions (``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``) apply unless a
setting overrides them: ``hf_endpoint`` and ``hf_cache_dir`` are null by default, meaning "what the
environment says" (see ``hearth.app.hub.context``).

Files written before ``settings_version`` 2 stored the default endpoint explicitly; that value is
read as unset, so ``HF_ENDPOINT`` applies to them too.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hearth.app.paths import settings_path
from hearth.engine.api import EngineConfig, HearthError, engine_options

logger = logging.getLogger(__name__)

Theme = Literal["light", "dark", "system"]
SendKey = Literal["enter", "ctrl+enter"]
SEND_KEYS: tuple[SendKey, ...] = ("enter", "ctrl+enter")
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_CONTEXT_LENGTH = 8192
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
    backend_url: an OpenAI-compatible server to use instead of the local engine host; None = local.
    backend_api_key: the key sent to ``backend_url`` as a Bearer token; None = none. Not in the settings
    file, nor in ``to_json()`` or ``setting_names()`` (see the module docstring).
    engine: the local engine's options (memory budgets, context length, scheduler, long-context
        tiers...), described once by ``EngineConfig``'s field metadata. In the settings file they
        sit beside the other keys, under their ``EngineConfig`` names.
    context_overflow: when a chat outgrows the context, "truncate" drops its oldest messages (the
    system prompt stays), "stop" says so and sends nothing.
    api_host / api_port: where the app's API server switch listens (127.0.0.1: this machine only).
    show_thinking: the chat shows a thinking model's reasoning (a foldable block above the answer).
    think: the chat's Think switch: requests ask the chat template for reasoning (``thinking`` /
    ``enable_thinking`` in ``chat_template_kwargs``).
    send_key: the key that sends from the message box: "enter" (Shift+Enter starts a new line) or
    "ctrl+enter" (Enter starts a new line); Ctrl+Enter sends in both.
    """

    hf_endpoint: str | None = None
    hf_cache_dir: str | None = None
    download_parallelism: int = 4
    offline: bool = False
    backend_url: str | None = None
    backend_api_key: str | None = field(default=None, repr=False)
    theme: Theme = "system"
    default_model: str | None = None
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_model_len=DEFAULT_CONTEXT_LENGTH))
    context_overflow: str = "truncate"
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    show_thinking: bool = True
    think: bool = False
    send_key: SendKey = "enter"

    def __post_init__(self) -> None:
        _check_types(self)
        if self.hf_endpoint is not None:
            object.__setattr__(self, "hf_endpoint", self.hf_endpoint.rstrip("/"))
        if self.backend_api_key is not None:
            object.__setattr__(self, "backend_api_key", self.backend_api_key.strip() or None)
        key = self.backend_api_key
        engine = self.engine
        checks = [
            (self.hf_endpoint is None or _is_http_url(self.hf_endpoint),
             "hf_endpoint must be an http(s) URL (or null for HF_ENDPOINT / the Hub)"),
            (self.hf_cache_dir is None or Path(self.hf_cache_dir).expanduser().is_absolute(),
             f"hf_cache_dir must be an absolute folder path (~ allowed), not {self.hf_cache_dir!r}"),
            (self.backend_url is None or _is_http_url(self.backend_url),
             f"backend_url must be an http(s) URL such as http://host:8000/v1 (or null for the local engine), "
             f"not {self.backend_url!r}"),
            (key is None or (key.isprintable() and key.isascii() and " " not in key),
             "the backend API key must be one line of printable ASCII without spaces"),
            (1 <= self.download_parallelism <= 64, "download_parallelism must be in [1, 64]"),
            (self.theme in ("light", "dark", "system"), "theme must be light, dark or system"),
            (self.context_overflow in ("truncate", "stop"), "context_overflow must be truncate or stop"),
            (self.send_key in SEND_KEYS, f"send_key must be enter or ctrl+enter, not {self.send_key!r}"),
            (_is_host(self.api_host), f"api_host must be an IP address or a host name, not {self.api_host!r}"),
            (0 <= self.api_port <= 65535, "api_port must be in [0, 65535]"),
            # NOTE: the engine takes any page size, but its attention kernels only powers of two from 16;
            # another size would quietly run the slow plain-PyTorch path.
            (engine.block_size >= MIN_BLOCK_SIZE and engine.block_size & (engine.block_size - 1) == 0,
             f"block_size must be a power of two of at least {MIN_BLOCK_SIZE} (16, 32, 64, 128...), "
             f"not {engine.block_size}"),
            (engine.index_topk_pattern is None or _INDEX_PATTERN.fullmatch(engine.index_topk_pattern),
             "index_topk_pattern must be one letter per layer, F (own indexer) or S (reuse), starting with F, "
             f"not {engine.index_topk_pattern!r}"),
            (engine.index_topk_pattern is None or engine.index_topk_freq is None,
             "index_topk_pattern replaces index_topk_freq: set one of them, not both"),
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
        """The settings as the file holds them: one flat object (without the API key)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_IN_FILE}
        return {**flat, **dataclasses.asdict(self.engine)}


MIN_BLOCK_SIZE = 16  # the smallest page size the attention kernels take (hearth.engine.models.dsa_kernels)
_INDEX_PATTERN = re.compile(r"[Ff][FfSs]*")  # the engine reads it upper-cased; the first layer runs its indexer
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_http_url(url: str) -> bool:
    scheme, _, rest = url.partition("://")
    return scheme.lower() in ("http", "https") and bool(rest) and not rest.startswith("/")


def _is_host(host: str) -> bool:
    """An IPv4 / IPv6 address or a DNS host name (what a server can bind)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return 0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)


ENGINE_KEYS = frozenset(option.name for option in engine_options())
BACKEND_KEY_FILE = "backend-api-key"  # beside the settings file: backend_api_key
_NOT_IN_FILE = frozenset({"engine", "backend_api_key"})  # (the engine options are flattened into the file)
_LEGACY_KEYS = {"context_length": "max_model_len"}  # the name older settings files use
_TYPES: dict[str, tuple[type, ...]] = {
    "hf_endpoint": (str, type(None)),
    "hf_cache_dir": (str, type(None)),
    "download_parallelism": (int,),
    "offline": (bool,),
    "backend_url": (str, type(None)),
    "backend_api_key": (str, type(None)),
    "theme": (str,),
    "default_model": (str, type(None)),
    "engine": (EngineConfig,),
    "context_overflow": (str,),
    "api_host": (str,),
    "api_port": (int,),
    "show_thinking": (bool,),
    "think": (bool,),
    "send_key": (str,),
}


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` cannot take downloads, or None when it can: it must be an absolute path, and
    a folder Hearth can write to; one that does not exist yet is fine when the nearest existing
    folder above it can be written to (the folder can then be made there)."""
    path = Path(folder).expanduser()
    if not path.is_absolute():
        return f"{folder} is not an absolute path (such as {Path.home() / 'models'})"
    existing = path
    while not existing.exists():
        if existing.parent == existing:  # a drive that is not there
            return f"{existing} does not exist"
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        # NOTE: a real write, not os.access: permission bits do not tell about read-only mounts or ACLs.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"Hearth cannot write to {existing} ({exc.strerror or exc})"
    return None


def backend_changed(old: Settings, new: Settings) -> bool:
    """Whether ``new`` talks to another backend than ``old``: another URL (or local instead of
    remote), or another API key for the same remote one."""
    return old.backend_url != new.backend_url or (
        new.backend_url is not None and old.backend_api_key != new.backend_api_key)


def restart_needed(old: Settings, new: Settings) -> bool:
    """Whether going from ``old`` to ``new`` needs the engine started again: another backend, or a
    changed engine option that takes effect at load time."""
    return backend_changed(old, new) or any(
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
    return _with_key(_read_settings(path), path)


def _read_settings(path: Path) -> Settings:
    raw = _read_raw(path)
    if raw is None:
        return Settings()
    if raw.get(VERSION_KEY) is None and raw.get("hf_endpoint") == DEFAULT_ENDPOINT:
        raw.pop("hf_endpoint")  # an older Hearth wrote its default here, not the user's choice
    for old, new in _LEGACY_KEYS.items():
        if old in raw:
            raw.setdefault(new, raw.pop(old))
    settings = Settings()
    for name in setting_names():
        if name not in raw:
            continue
        try:
            settings = settings.replace(**{name: raw[name]})
        except (HearthError, TypeError) as exc:
            logger.warning("Ignoring setting %s in %s: %s", name, path, exc)
    return settings


def _with_key(settings: Settings, path: Path) -> Settings:
    """``settings`` with the API key stored beside ``path`` (one that cannot be used is ignored)."""
    try:
        key = (path.parent / BACKEND_KEY_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return settings
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("Ignoring the backend API key file beside %s: %s", path, exc)
        return settings
    try:
        return settings.replace(backend_api_key=key or None)
    except SettingsError as exc:
        logger.warning("Ignoring the backend API key file beside %s: %s", path, exc)
        return settings


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write ``settings`` atomically, keeping unknown keys already in the file; the API key goes to
    its own private file beside it (removed when there is none)."""
    path = path or settings_path()
    raw = _read_raw(path, set_aside_if_corrupt=False) or {}
    for old in _LEGACY_KEYS:
        raw.pop(old, None)  # now written under its new name
    raw.update(settings.to_json())
    raw[VERSION_KEY] = SETTINGS_VERSION
    write_json_atomic(path, raw)
    key_path = path.parent / BACKEND_KEY_FILE
    if settings.backend_api_key is None:
        key_path.unlink(missing_ok=True)
    else:
        write_text_atomic(key_path, settings.backend_api_key + "\n")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so readers see the old file or the new one, never a torn one."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, in a file only its owner can read (mkstemp's 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
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
    """The keys of the settings file: the app's settings, then every engine option."""
    return [f.name for f in dataclasses.fields(Settings) if f.name not in _NOT_IN_FILE] + [
        o.name for o in engine_options()]


def _setting_types(name: str) -> tuple[type, ...] | None:
    """The JSON types setting ``name`` takes (None for an unknown name)."""
    option = next((o for o in engine_options() if o.name == name), None)
    if option is None:
        return _TYPES.get(name) if name not in _NOT_IN_FILE else None
    types: tuple[type, ...] = {"bool": (bool,), "int": (int,), "float": (float,)}.get(option.kind, (str,))
    return (*types, type(None)) if option.optional else types


def parse_setting(name: str, text: str) -> Any:
    """``text`` (from a command line) as a value of setting ``name``: true/false for switches,
    numbers for counts and sizes, ``null`` for "unset" where a setting allows it."""
    types = _setting_types(name)
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
