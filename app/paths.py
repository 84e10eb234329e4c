"""Hearth's folders: config, data, cache, runtime and logs.

platformdirs picks the usual place on each OS. The ``HEARTH_HOME`` environment variable puts all of
them under one folder instead (portable installs, tests with ``tmp_path``). Each function creates
its folder on first use, so callers can write into the returned path straight away.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from platformdirs import PlatformDirs, RuntimeDirWarning

APP_NAME = "hearth"
HOME_ENV = "HEARTH_HOME"


def _platform_dirs() -> PlatformDirs:
    return PlatformDirs(APP_NAME, appauthor=False)


def _folder(name_under_home: str, platform_attribute: str) -> Path:
    home = os.environ.get(HOME_ENV)
    if home:
        path = Path(home).expanduser() / name_under_home
    else:  # looked up only when needed: platformdirs warns when e.g. XDG_RUNTIME_DIR is unset
        path = Path(getattr(_platform_dirs(), platform_attribute))
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    """Settings shared by the GUI and the CLI."""
    return _folder("config", "user_config_dir")


def data_dir() -> Path:
    """Things that must survive: the download queue, the model registry, chats."""
    return _folder("data", "user_data_dir")


def cache_dir() -> Path:
    """Things that can be rebuilt (Hearth's own caches; model weights live in the HF cache)."""
    return _folder("cache", "user_cache_dir")


def runtime_dir() -> Path:
    """Sockets, pid and port files of a running engine host; private to the user (0700).

    Without a usable ``XDG_RUNTIME_DIR`` platformdirs falls back to a private folder it checks
    (``/run/user/<uid>``, else ``runtime-<uid>`` in the temporary folder). That is normal on
    servers and in containers, so its RuntimeDirWarning is not shown to the user.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeDirWarning)
        path = _folder("run", "user_runtime_dir")
    path.chmod(0o700)  # it holds the engine host's token
    return path


def log_dir() -> Path:
    """Log files of the app and the engine host."""
    return _folder("logs", "user_log_dir")


def settings_path() -> Path:
    """The one settings file (JSON) under the config folder."""
    return config_dir() / "settings.json"
