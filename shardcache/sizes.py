"""Byte counts as people read them: one formatter for the logs and messages of the
library and the proxy (the tools print the same units)."""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``, ``8488960`` -> ``'8.1 MiB'``; exact below 1 KiB
    (``'10 B'``). Binary units, as ``ls -h``, ``df -h`` and the tools print them."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
