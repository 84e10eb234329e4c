"""Where the Hub manager talks to and writes into, derived once from ``Settings``.

The Hub's environment conventions apply unless a Hearth setting overrides them: the endpoint is the
``hf_endpoint`` setting, else ``HF_ENDPOINT``, else https://huggingface.co; the cache folder is the
``hf_cache_dir`` setting, else ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's default;
``HF_HUB_OFFLINE`` in the environment counts as offline like the setting; the token is always the
library's (``HF_TOKEN`` or ``hf auth login``). The environment is read here, at each call, because
the library reads it only once at import. The endpoint and the cache folder are passed explicitly
to every huggingface_hub call, so a setting changed in the GUI takes effect without restarting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants

from hearth.app.hub.errors import OfflineError
from hearth.app.paths import data_dir
from hearth.app.store.settings import DEFAULT_ENDPOINT, Settings

_TRUE = ("1", "on", "yes", "true")  # what huggingface_hub counts as a set switch

# No telemetry from a local app: with it on, huggingface_hub 2.4 puts the torch version in every request's
# user agent and, on the first request of a process, fetches an "agent harnesses" list from its own default
# endpoint (huggingface.co, whatever mirror Hearth's settings name; a 3 s wait where it cannot be reached).
constants.HF_HUB_DISABLE_TELEMETRY = True


@dataclass(frozen=True)
class HubContext:
    """The Hub endpoint, the HF cache folder, Hearth's state folder and the offline switch."""

    endpoint: str
    cache_dir: Path
    state_dir: Path
    is_offline: bool
    parallelism: int

    @classmethod
    def from_settings(cls, settings: Settings, state_dir: Path | None = None) -> HubContext:
        return cls(
            endpoint=hub_endpoint(settings),
            cache_dir=hub_cache_dir(settings),
            state_dir=state_dir or data_dir(),
            is_offline=settings.offline or env_offline(),
            parallelism=settings.download_parallelism,
        )

    def api(self) -> HfApi:
        self.require_online("talk to the Hub")
        # token=None: the library uses HF_TOKEN or its stored login, and never logs it.
        return HfApi(endpoint=self.endpoint, library_name="hearth")

    def require_online(self, action: str) -> None:
        if self.is_offline:
            raise OfflineError(f"Offline mode is on, so Hearth cannot {action}; turn it off in the settings")

    @property
    def queue_path(self) -> Path:
        return self.state_dir / "downloads.json"

    @property
    def registry_path(self) -> Path:
        return self.state_dir / "models.json"


def hub_endpoint(settings: Settings) -> str:
    """The ``hf_endpoint`` setting, else ``HF_ENDPOINT``, else the Hub."""
    return settings.hf_endpoint or os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or DEFAULT_ENDPOINT


def hub_cache_dir(settings: Settings) -> Path:
    """The ``hf_cache_dir`` setting, else ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's."""
    hf_home = os.environ.get("HF_HOME")
    cache = (settings.hf_cache_dir or os.environ.get("HF_HUB_CACHE")
             or (os.path.join(hf_home, "hub") if hf_home else constants.HF_HUB_CACHE))
    return Path(cache).expanduser().resolve()


def env_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set, now or when huggingface_hub was imported."""
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
