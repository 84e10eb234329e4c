"""The Hugging Face Hub side of Hearth: search, repo details and fit verdicts, a resumable download
queue, and the list of installed models. Qt-free: the GUI wraps the plain-dataclass events of
``DownloadManager`` in Qt signals, the CLI prints them.

Every network call goes through huggingface_hub with the user's endpoint (``Settings.hf_endpoint``);
in offline mode nothing here touches the network.
"""

from hearth.app.hub.catalog import RepoDetails, RepoFileInfo, SearchResult, repo_details, search_models
from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import (
    ChecksumError,
    DiskFullError,
    GatedRepoAccessError,
    HubError,
    NotInstalledError,
    OfflineError,
    RepoNotFoundError,
)
from hearth.app.hub.events import (
    DownloadCancelled,
    DownloadEvent,
    DownloadFailed,
    DownloadPaused,
    DownloadProgress,
    DownloadQueued,
    DownloadReady,
    DownloadRetrying,
    DownloadStalled,
    DownloadStarted,
    DownloadVerifying,
    FileProgress,
)
from hearth.app.hub.fit import (
    FitReport,
    Footprint,
    Machine,
    Verdict,
    assess_fit,
    fit_for_repo,
    footprint_from_config,
    probe_machine,
)
from hearth.app.hub.installed import (
    InstalledModel,
    delete_model,
    find_installed,
    import_local_model,
    list_installed,
    resolve_model,
)
from hearth.app.hub.manager import DownloadItem, DownloadManager, DownloadOptions, ItemState

__all__ = [
    "ChecksumError", "DiskFullError", "DownloadCancelled", "DownloadEvent", "DownloadFailed",
    "DownloadItem", "DownloadManager", "DownloadOptions", "DownloadPaused", "DownloadProgress",
    "DownloadQueued", "DownloadReady", "DownloadRetrying", "DownloadStalled", "DownloadStarted",
    "DownloadVerifying", "FileProgress", "FitReport", "Footprint", "GatedRepoAccessError", "HubContext",
    "HubError", "InstalledModel", "ItemState", "Machine", "NotInstalledError", "OfflineError", "RepoDetails",
    "RepoFileInfo", "RepoNotFoundError", "SearchResult", "Verdict", "assess_fit", "delete_model", "find_installed",
    "fit_for_repo", "footprint_from_config", "import_local_model", "list_installed", "probe_machine", "repo_details",
    "resolve_model", "search_models",
]
