"""Human-readable sizes, speeds and durations for the CLI and the GUI (decimal units, as the Hub)."""

from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def format_bytes(n: float) -> str:
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_speed(bytes_per_s: float | None) -> str:
    return "-- B/s" if not bytes_per_s else f"{format_bytes(bytes_per_s)}/s"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


GIB = 1024**3
