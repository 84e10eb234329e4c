"""Downloading the model that ``run``, ``chat`` or ``serve`` name when it is not installed, as
Ollama's ``run`` does.

Only for a Hub repo id (``org/name``) that is neither installed nor a folder, and only when someone
is there to see it: stdin a terminal, no ``--no-pull``, not offline. Otherwise the command fails at
once, naming the ``hearth --cli pull`` command that downloads it. The download is ``pull`` itself:
the same plan (an architecture Hearth cannot run and a repo without safetensors weights are refused
before any weight), the same progress line on stderr (stdout stays the answer's), Ctrl-C pausing
and a later ``pull`` resuming, and the same checksum verification before the model counts as
installed. A download left unfinished by an earlier ``pull`` is resumed the same way.
"""

from __future__ import annotations

from typing import Any, TextIO

from hearth.app.hub.context import HubContext, env_offline
from hearth.app.hub.errors import HubError, NotInstalledError, OfflineError
from hearth.app.hub.units import format_bytes
from hearth.app.store.settings import Settings


def pull_missing(missing: NotInstalledError, settings: Settings, *, no_pull: bool, stdin: TextIO,
                 err: TextIO) -> None:
    """Download ``missing.repo_id`` with ``pull``'s progress on ``err``, or raise ``missing`` itself
    (no repo id), ``HubError`` (--no-pull, stdin not a terminal, the download failed), ``OfflineError``
    or KeyboardInterrupt (Ctrl-C paused the download)."""
    repo_id = missing.repo_id
    if repo_id is None:
        raise missing
    state = "is not fully downloaded" if missing.is_partial else "is not installed"
    command = f"`hearth --cli pull {repo_id}`"
    if no_pull:
        raise HubError(f"{repo_id} {state}, and --no-pull is set; download it with {command}")
    ctx = HubContext.from_settings(settings)
    if ctx.is_offline:
        why = ("HF_HUB_OFFLINE is set" if env_offline() else
               "offline mode is on (`hearth --cli config set offline false` turns it off)")
        raise OfflineError(f"{repo_id} {state} and cannot be downloaded now: {why}; once online, {command} "
                           "downloads it")
    if not _is_terminal(stdin):
        raise HubError(f"{repo_id} {state}; download it with {command} first (a missing model is downloaded by "
                       "itself only when stdin is a terminal)")
    from hearth.app.cli.hub_commands import pull_model  # lazy: the Hub commands load the download manager

    doing = "resuming its download" if missing.is_partial else "pulling it"
    print(f"{repo_id} {state}: {doing} from {ctx.endpoint} (Ctrl-C pauses; {command} resumes)", file=err, flush=True)
    item = pull_model(repo_id, progress=err, settings=settings)
    print(f"Pulled {repo_id} ({format_bytes(item.bytes_total)}, checksums verified).", file=err, flush=True)


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
