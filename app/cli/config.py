"""``hearth --cli config``: read and write the settings file (the one the desktop app uses).

    hearth --cli config list [--json]      every setting, and where the Hub ones come from
    hearth --cli config get KEY            one value (null = unset)
    hearth --cli config set KEY VALUE      validated; true/false, numbers, null to unset (a default_model
                                           that is not installed is kept, with a warning; an hf_cache_dir
                                           must be a folder Hearth can write to, as in the app's Settings,
                                           and is created)
    hearth --cli config unset KEY          back to the default
    hearth --cli config path               where the file is
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hearth.app.cli.common import add_debug_option, print_json, resolve_model_path
from hearth.app.paths import settings_path
from hearth.app.store.settings import (
    Settings,
    SettingsError,
    folder_problem,
    load_settings,
    parse_setting,
    save_settings,
    setting_names,
)
from hearth.engine.api import HearthError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="show or change settings (the file the app uses)",
                                   description="Show or change Hearth's settings; the desktop app reads the "
                                   "same file.")
    add_debug_option(parser)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every setting with its value")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    getter = actions.add_parser("get", help="one setting's value")
    getter.add_argument("key")
    setter = actions.add_parser("set", help="change a setting (null unsets one that may be unset)")
    setter.add_argument("key")
    setter.add_argument("value")
    unsetter = actions.add_parser("unset", help="put a setting back to its default")
    unsetter.add_argument("key")
    where = actions.add_parser("path", help="where the settings file is")
    for action in (listing, getter, setter, unsetter, where):
        add_debug_option(action)
    parser.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "path":
        print(settings_path())
        return 0
    settings = load_settings()
    if args.action != "list" and args.key not in setting_names():
        raise SettingsError(f"unknown setting {args.key!r}; known: {', '.join(setting_names())}")
    if args.action == "list":
        _list(settings, as_json=args.json)
    elif args.action == "get":
        print(_shown(settings.to_json()[args.key]))
    else:
        default = Settings().to_json()[args.key]
        value = parse_setting(args.key, args.value) if args.action == "set" else default
        settings = settings.replace(**{args.key: value})  # validates: SettingsError is one line
        if args.key == "hf_cache_dir" and settings.hf_cache_dir is not None:
            _prepare_models_folder(settings.hf_cache_dir)
        save_settings(settings)
        print(f"{args.key} = {_shown(settings.to_json()[args.key])}")
        if args.key == "default_model" and settings.default_model:
            _warn_if_not_installed(settings)
    return 0


def _prepare_models_folder(folder: str) -> None:
    """The Settings tab's check (``folder_problem``), then the folder made, so downloads and the disk
    check find it; nothing is saved when either fails."""
    problem = folder_problem(folder)
    if problem:
        raise SettingsError(f"hf_cache_dir not changed: {problem}")
    try:
        Path(folder).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(f"hf_cache_dir not changed: cannot create {folder} ({exc.strerror or exc})") from None


def _warn_if_not_installed(settings: Settings) -> None:
    """The default model may be pulled later, so it is kept; say when it cannot be loaded now."""
    try:
        resolve_model_path(settings.default_model, settings)
    except HearthError as err:
        print(f"warning: {settings.default_model} cannot be loaded yet: {err}", file=sys.stderr)


def _list(settings: Settings, *, as_json: bool) -> None:
    values = settings.to_json()  # flat, as the file holds them: engine options beside the rest
    if as_json:
        print_json(values)
        return
    print(f"# {settings_path()}")
    notes = _environment_notes(settings)
    width = max(len(name) for name in values)
    for name, value in values.items():
        note = f"  ({notes[name]})" if name in notes else ""
        print(f"{name.ljust(width)} = {_shown(value)}{note}")


def _environment_notes(settings: Settings) -> dict[str, str]:
    """Where the Hub settings left unset (or off) take their value from."""
    try:
        from hearth.app.hub.context import env_offline, hub_cache_dir, hub_endpoint
    except ImportError:  # the Hub manager is optional
        return {}
    notes = {}
    if settings.hf_endpoint is None:
        source = "from HF_ENDPOINT" if os.environ.get("HF_ENDPOINT", "").strip() else "the default"
        notes["hf_endpoint"] = f"in effect: {hub_endpoint(settings)}, {source}"
    if settings.hf_cache_dir is None:
        notes["hf_cache_dir"] = f"in effect: {hub_cache_dir(settings)}"
    if not settings.offline and env_offline():
        notes["offline"] = "in effect: true, from HF_HUB_OFFLINE"
    return notes


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
