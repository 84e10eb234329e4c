"""Where the Hub manager talks to and writes into, derived once from ``Settings``.

The endpoint is passed explicitly to every huggingface_hub call (``HF_ENDPOINT`` is read by the
library only once, at import), and the cache folder too, so a setting changed in the GUI takes
effect without restarting. ``HF_HUB_OFFLINE`` set in the environment also counts as offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants

from hearth.app.hub.errors import OfflineError
from hearth.app.paths import data_dir
from hearth.app.store.settings import Settings


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
        cache = Path(settings.hf_cache_dir) if settings.hf_cache_dir else Path(constants.HF_HUB_CACHE)
        return cls(
            endpoint=settings.hf_endpoint,
            cache_dir=cache.expanduser().resolve(),
            state_dir=state_dir or data_dir(),
            is_offline=settings.offline or bool(constants.HF_HUB_OFFLINE),
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
