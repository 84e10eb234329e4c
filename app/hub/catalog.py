"""Finding models on the Hub: search filtered to the architectures Hearth runs, and one repo's
details (every file with size and checksum, gated state, the parsed ``config.json``).

The architecture filter asks the Hub once per supported ``model_type`` (the Hub tags models with
their ``model_type``), merges the answers and sorts them locally, so ``limit`` counts runnable
models rather than whatever a text search returned first. ``all_architectures=True`` asks once.
Before asking, one quick request checks that the endpoint can be reached at all: the library
retries each request five times with back-off (some 23 s) when it cannot, while the user waits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from huggingface_hub import hf_hub_download
from huggingface_hub.hf_api import ModelInfo
from huggingface_hub.utils import filter_repo_objects, get_session, httpx

from hearth.app.hub.context import HubContext
from hearth.app.hub.errors import HubError, describe, is_unreachable, search_error
from hearth.app.hub.transfer import QuietTqdm
from hearth.app.paths import cache_dir
from hearth.engine.config import SUPPORTED_MODEL_TYPES

# What ``pull`` fetches unless told otherwise, and what it never fetches (pickles run code on load).
DEFAULT_INCLUDE = ("*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "*.jinja",
                   "merges.txt", "vocab.txt", "LICENSE*")
NEVER_INCLUDE = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")

# What a search asks the Hub for: the sort keys, the config's model_type and the safetensors
# parameter counts (the size column).
SEARCH_EXPAND = ["config", "safetensors", "downloads", "likes", "trendingScore", "createdAt", "gated", "tags"]
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

REACHABLE_TIMEOUT_S = 5.0  # the one attempt that tells an unreachable endpoint before a search
SortKey = Literal["downloads", "likes", "trending", "recent"]
# Hearth's sort names -> (huggingface_hub's sort value, ModelInfo attribute to merge by).
SORTS: dict[str, tuple[str, str]] = {
    "downloads": ("downloads", "downloads"),
    "likes": ("likes", "likes"),
    "trending": ("trending_score", "trending_score"),
    "recent": ("created_at", "created_at"),
}


@dataclass(frozen=True)
class SearchResult:
    repo_id: str
    downloads: int
    likes: int
    model_type: str | None
    is_supported: bool
    gated: bool
    created_at: datetime | None
    weights_bytes: int | None = None  # from the Hub's safetensors parameter counts; None: not published

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "downloads": self.downloads, "likes": self.likes,
                "model_type": self.model_type, "is_supported": self.is_supported, "gated": self.gated,
                "created_at": self.created_at.isoformat() if self.created_at else None,
                "weights_bytes": self.weights_bytes}


@dataclass(frozen=True)
class RepoFileInfo:
    """A file in a repo. ``sha256`` is set for LFS files; ``blob_id`` is the git object id."""

    filename: str
    size: int
    sha256: str | None
    blob_id: str | None


@dataclass(frozen=True)
class RepoDetails:
    """A repo at one commit. ``access_error`` is set when config.json could not be read (gated);
    ``listed_model_type`` is the type the Hub's listing gives, known even then."""

    repo_id: str
    commit: str
    gated: bool
    files: tuple[RepoFileInfo, ...]
    config: dict[str, Any] | None
    access_error: str | None
    listed_model_type: str | None = None

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type") if self.config else self.listed_model_type

    @property
    def is_supported(self) -> bool:
        return self.model_type in SUPPORTED_MODEL_TYPES

    @property
    def weights_bytes(self) -> int:
        return sum(f.size for f in self.files if f.filename.endswith(".safetensors"))

    def pulled_files(self, include: tuple[str, ...] | None = None,
                     exclude: tuple[str, ...] | None = None) -> list[RepoFileInfo]:
        """The files ``pull`` fetches with these patterns (the same filter it uses)."""
        return list(filter_repo_objects(self.files, allow_patterns=list(include or DEFAULT_INCLUDE),
                                        ignore_patterns=[*(exclude or ()), *NEVER_INCLUDE],
                                        key=lambda f: f.filename))

    def download_bytes(self, include: tuple[str, ...] | None = None,
                       exclude: tuple[str, ...] | None = None) -> int:
        """Size of the files ``pull`` would fetch with these patterns."""
        return sum(f.size for f in self.pulled_files(include, exclude))


def search_models(ctx: HubContext, query: str, *, sort: SortKey = "downloads",
                  all_architectures: bool = False, limit: int = 20) -> list[SearchResult]:
    """Models matching ``query``, best first by ``sort``; only runnable ones unless asked for all."""
    if sort not in SORTS:
        raise HubError(f"sort must be one of {', '.join(SORTS)}, not {sort!r}")
    api = ctx.api()
    hub_sort, attribute = SORTS[sort]
    tags: list[str | None] = [None] if all_architectures else sorted(SUPPORTED_MODEL_TYPES)
    found: dict[str, ModelInfo] = {}
    try:
        _check_reachable(ctx.endpoint)
        for tag in tags:
            for info in api.list_models(search=query or None, filter=tag, sort=hub_sort, limit=limit,
                                        expand=SEARCH_EXPAND):
                found.setdefault(info.id, info)
    except Exception as exc:
        raise search_error(exc, query, ctx.endpoint) from exc
    results = [_search_result(info) for info in found.values()]
    if not all_architectures:
        results = [r for r in results if r.is_supported]
    results.sort(key=lambda r: _sort_value(found[r.repo_id], attribute), reverse=True)
    return results[:limit]


def _check_reachable(endpoint: str) -> None:
    """Fail at once (one attempt, no retries) when no connection to ``endpoint`` can be made, by the
    rule that cuts a pull's planning short (``is_unreachable``); any answer, even an error status,
    means it can, and the search then keeps the library's retries for what they can ride out (5xx,
    429, dropped connections)."""
    try:
        get_session().head(endpoint, timeout=REACHABLE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        if is_unreachable(exc):
            raise
        # It answered, if oddly: the search itself says what is wrong.


def repo_details(ctx: HubContext, repo_id: str, revision: str | None = None) -> RepoDetails:
    """Every file with its size and checksum, the gated flag and the parsed config.json."""
    api = ctx.api()
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise describe(exc, repo_id, ctx.endpoint) from exc
    files = tuple(
        RepoFileInfo(s.rfilename, s.lfs.size if s.lfs else (s.size or 0),
                     s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or ()
    )
    config, access_error = None, None
    if any(f.filename == "config.json" for f in files):
        try:
            config = fetch_config(ctx, repo_id, info.sha or revision)
        except HubError as exc:
            access_error = str(exc)
    listed = info.config.get("model_type") if isinstance(info.config, dict) else None
    return RepoDetails(repo_id, info.sha or "", bool(info.gated), files, config, access_error, listed)


def fetch_config(ctx: HubContext, repo_id: str, revision: str | None) -> dict[str, Any]:
    """The repo's parsed config.json (raises ``HubError``)."""
    try:
        # NOTE: into Hearth's own cache, not the HF cache: a lone config.json there would make the
        # repo look half-installed.
        path = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir() / "hub-meta",
                               endpoint=ctx.endpoint, library_name="hearth", tqdm_class=QuietTqdm)
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as exc:
        raise HubError(f"{repo_id}: config.json is not valid JSON ({exc})") from exc
    except Exception as exc:
        raise describe(exc, repo_id, ctx.endpoint) from exc
    if not isinstance(config, dict):
        raise HubError(f"{repo_id}: config.json is not a JSON object")
    return config


def _search_result(info: ModelInfo) -> SearchResult:
    config = info.config if isinstance(info.config, dict) else {}
    model_type = config.get("model_type")
    if model_type is None:  # no config in the answer: fall back to the Hub's tags
        model_type = next((t for t in info.tags or () if t in SUPPORTED_MODEL_TYPES), None)
    return SearchResult(
        repo_id=info.id,
        downloads=info.downloads or 0,
        likes=info.likes or 0,
        model_type=model_type,
        is_supported=model_type in SUPPORTED_MODEL_TYPES,
        gated=bool(info.gated),
        created_at=info.created_at,
        weights_bytes=_safetensors_bytes(info),
    )


def _safetensors_bytes(info: ModelInfo) -> int | None:
    """The weights' size from the Hub's per-dtype parameter counts (None when it publishes none)."""
    counts = info.safetensors.parameters if info.safetensors else None
    if not counts:
        return None
    return sum(int(n) * _DTYPE_BYTES.get(dtype.upper(), 2) for dtype, n in counts.items())


def _sort_value(info: ModelInfo, attribute: str) -> Any:
    value = getattr(info, attribute, None)
    if isinstance(value, datetime):
        return value.timestamp()
    return value or 0
