"""Command-line flags for the engine options, generated from ``EngineConfig``'s field metadata (one
flag per field: ``--max-model-len`` for ``max_model_len``). Light to import: the CLI builds its
parsers from it without loading torch or the server."""

from __future__ import annotations

import argparse
from typing import Any

from hearth.engine.api import EngineConfig, engine_options


def add_engine_arguments(parser: argparse.ArgumentParser, defaults_from: str | None = None) -> None:
    """One flag per ``EngineConfig`` field (``--max-model-len`` for ``max_model_len``), from its metadata.
    ``defaults_from`` (e.g. "the settings"): flags left out are absent from the parsed arguments, and
    the help says where their values come from instead."""
    group = parser.add_argument_group("engine options")

    def given(value: object) -> object:
        return argparse.SUPPRESS if defaults_from is not None else value

    for option in engine_options():
        default = "" if option.default is None else f" (default: {str(option.default).lower()})"
        if defaults_from is not None:
            default = f" (default: {defaults_from})"
        if option.kind == "bool":
            parse = _optional_flag if option.optional else _flag
            values = "true, false or auto" if option.optional else "true or false"
            group.add_argument(option.flag, type=parse, default=given(option.default), metavar="BOOL",
                               help=f"{option.text.help} ({values}){default}")
        elif option.kind == "choice":
            group.add_argument(option.flag, choices=option.choices, default=given(option.default),
                               help=option.text.help + default)
        else:
            parse_value = {"int": int, "float": float, "str": str}[option.kind]
            group.add_argument(option.flag, type=parse_value, default=given(option.default),
                               metavar="TEXT" if option.kind == "str" else "N", help=option.text.help + default)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the parsed flags describe (raises HearthError for bad values)."""
    return EngineConfig(**{option.name: getattr(args, option.name) for option in engine_options()})


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optional_flag(text: str) -> bool | None:
    return None if text.lower() in ("auto", "none") else _flag(text)


def engine_flags(config: EngineConfig) -> list[str]:
    """The flags that give ``config`` to a parser built by :func:`add_engine_arguments` (options at
    their default are left out)."""
    argv: list[str] = []
    for option in engine_options():
        value: Any = getattr(config, option.name)
        if value == option.default or (value is None and option.kind != "bool"):
            continue  # (None of a non-flag option has no spelling: the parser's default is None or better)
        if value is None or isinstance(value, bool):
            argv += [option.flag, "auto" if value is None else str(value).lower()]
        else:
            argv += [option.flag, str(value)]
    return argv
