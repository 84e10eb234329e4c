"""Hub and download errors as one clear line each, and the rule for which ones are worth a retry.

huggingface_hub raises rich exceptions (``GatedRepoError``, ``HfHubHTTPError``, httpx transport
errors...); ``describe()`` turns them into a ``HubError`` whose message tells the user what to do.
Messages never contain the token: the library keeps it in request headers, which we never print.
"""

from __future__ import annotations

import errno

import huggingface_hub
from huggingface_hub.errors import (
    DryRunError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import httpx, validate_repo_id

from hearth.engine.api import HearthError

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class HubError(HearthError):
    """A Hub, download or model-store problem; the message is one line meant for people."""

    is_resumable = False


class OfflineError(HubError):
    """Offline mode is on and the action needs the network."""


class GatedRepoAccessError(HubError):
    """The repo is gated and the token (if any) has no access to it."""


class RepoNotFoundError(HubError):
    """No such repo or revision, or it is private."""


class DiskFullError(HubError):
    """Not enough free space for the download; partial files are kept."""

    is_resumable = True


class ChecksumError(HubError):
    """A downloaded file does not match its published checksum; the bad file was deleted."""

    is_resumable = True


class NetworkError(HubError):
    """The Hub could not be reached or kept failing after the retries."""

    is_resumable = True


class UnsupportedRepoError(HubError):
    """The repo holds nothing Hearth can load: no safetensors weights, or an architecture it does not run."""


class NotInstalledError(HubError):
    """No installed model goes by the name asked for. ``repo_id``: the Hub repo that pulling would fetch
    (or finish: ``is_partial``) to have it, None when the name is no repo id."""

    def __init__(self, message: str, repo_id: str | None = None, *, is_partial: bool = False) -> None:
        super().__init__(message)
        self.repo_id = repo_id
        self.is_partial = is_partial


def is_transient(exc: BaseException) -> bool:
    """True for failures a retry can fix: network drops, timeouts, 5xx/429, short reads."""
    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        return is_transient(exc.__cause__)
    if isinstance(exc, (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError,
                        RemoteEntryNotFoundError)):
        return False
    if isinstance(exc, HfHubHTTPError):
        response = exc.response
        return response is not None and response.status_code in TRANSIENT_STATUS
    if isinstance(exc, (httpx.TransportError, LocalEntryNotFoundError)):
        return True
    # http_get checks the received size against the expected one after a dropped connection.
    return isinstance(exc, OSError) and "Consistency check failed" in str(exc)


def is_unreachable(exc: BaseException) -> bool:
    """True when no connection could be made at all (refused, unknown host, no route, no answer to
    the connection attempt): unlike a dropped transfer, retrying for minutes seldom helps, so planning
    gives up after a short try and a search after one."""
    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        return is_unreachable(exc.__cause__)
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def describe(exc: BaseException, repo_id: str, endpoint: str) -> HubError:
    """Map any exception from a Hub call to a ``HubError`` with an actionable message."""
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, DryRunError) and exc.__cause__ is not None:
        return describe(exc.__cause__, repo_id, endpoint)
    if isinstance(exc, GatedRepoError):
        return GatedRepoAccessError(gated_message(repo_id, endpoint))
    if isinstance(exc, RevisionNotFoundError):
        return RepoNotFoundError(f"{repo_id} has no such revision (branch, tag or commit)")
    if isinstance(exc, RepositoryNotFoundError):
        return RepoNotFoundError(
            f"{repo_id} was not found on {endpoint}: check the name; if it is private, set HF_TOKEN "
            "or run `hf auth login` with an account that can see it")
    if isinstance(exc, HfHubHTTPError) and _status(exc) in (401, 403):
        return GatedRepoAccessError(gated_message(repo_id, endpoint))
    if isinstance(exc, RemoteEntryNotFoundError):
        return RepoNotFoundError(f"A file of {repo_id} is missing on the Hub: {_first_line(exc)}")
    if isinstance(exc, OfflineModeIsEnabled):
        return OfflineError(f"Cannot reach {endpoint} for {repo_id}: HF_HUB_OFFLINE is set in the environment")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskFullError(f"The disk filled up while downloading {repo_id}; free some space and "
                             "resume (the partial files are kept)")
    if is_unreachable(exc):
        return NetworkError(f"Cannot reach {endpoint} to download {repo_id} ({_first_line(exc)}); check the "
                            "network, or the hf_endpoint setting / HF_ENDPOINT")
    if is_transient(exc):
        return NetworkError(f"Cannot download {repo_id} from {endpoint}: {_first_line(exc)}")
    return HubError(f"{repo_id}: {type(exc).__name__}: {_first_line(exc)}")


def is_repo_id(name: str) -> bool:
    """``name`` is a well-formed Hub repo id (``org/name``), one that could be pulled."""
    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed repo id before anything uses it (it also becomes a cache folder name)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise RepoNotFoundError(f"{ascii(repo_id)[:120]} is not a Hub repo id: use org/name (letters, digits, "
                                "'-', '_' and '.')") from None


def gated_message(repo_id: str, endpoint: str) -> str:
    has_token = huggingface_hub.get_token() is not None
    token_part = ("your Hugging Face token has no access yet (wait for approval, or use a token of "
                  "the account that was granted access)") if has_token else (
        "then set HF_TOKEN or run `hf auth login` so Hearth can use your token")
    return (f"{repo_id} is gated: open {endpoint}/{repo_id} and accept its conditions to request "
            f"access; {token_part}")


def _status(exc: HfHubHTTPError) -> int | None:
    return exc.response.status_code if exc.response is not None else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def search_error(exc: BaseException, query: str, endpoint: str) -> HubError:
    """Map an exception from a Hub search to a ``HubError`` that names the search and the endpoint."""
    if isinstance(exc, HubError):
        return exc
    what = f"Search for {query!r}" if query else "Search"
    if isinstance(exc, OfflineModeIsEnabled):
        return OfflineError(f"{what} needs {endpoint}, but HF_HUB_OFFLINE is set in the environment")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return NetworkError(f"{what} failed: {endpoint} answered HTTP {exc.response.status_code} "
                            f"({_first_line(exc)})")
    if is_transient(exc):
        return NetworkError(f"{what} failed: cannot reach {endpoint} ({_first_line(exc)}); check the "
                            "network, or the hf_endpoint setting / HF_ENDPOINT")
    return HubError(f"{what} on {endpoint} failed: {type(exc).__name__}: {_first_line(exc)}")
