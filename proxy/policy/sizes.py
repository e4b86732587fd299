"""Sizes in settings and requests: ``500G``, ``1.5T``, ``10MiB``, bytes; ``--min-free``
as bytes or a percentage. Pure: no I/O."""

from __future__ import annotations

import math
import re

from shardcache.sizes import format_size

__all__ = ["BARE_SIZE_MIN", "format_size", "parse_bound", "parse_min_free", "parse_size"]

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtpe", start=1):
    _UNITS[_p] = 1000**_i
    _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = 1024**_i
    _UNITS[_p + "ib"] = 1024**_i


def parse_size(text: str | int, *, unit_below: int = 0) -> int:
    """Parse a byte count: ``"500G"``, ``"1.5T"``, ``"10MiB"``, ``"4096"``.

    Suffixes K, M, G, T, P, E (optionally followed by ``B``) are powers of 1000 (``1G`` is
    10^9 bytes); ``Ki``, ``Mi``, ``Gi``… (optionally ``KiB``…) are powers of 1024 (``1GiB``
    is 2^30 bytes). Case is ignored. The result is rounded down to whole bytes. Raises
    ValueError naming the bad text, also for a negative size.

    ``unit_below``: a text without a unit that means fewer bytes than this (but not 0) is
    refused with a hint. ``--cache-size 10`` is a unit forgotten far more often than a
    wish for 10 bytes, and such a bound silently turns every shard away; ``10B`` says
    bytes on purpose.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    if str(text).strip().startswith("-"):
        raise ValueError(f"size must not be negative: {text!r}")
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 500G, 1.5T, 10MiB or bytes)")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    value = float(number) * factor
    if not math.isfinite(value):
        raise ValueError(f"size too large: {text!r}")
    if not unit and 0 < value < unit_below:
        raise ValueError(
            f"{number} = {int(value)} bytes; did you mean {number}G? (a size without a unit "
            f"is bytes: write {number}B if bytes are meant)"
        )
    return int(value)


BARE_SIZE_MIN = 1 << 20  # a setting's size without a unit below this is refused


def parse_bound(text: str | int) -> int:
    """A size that bounds the cache (``--cache-size``, ``--min-free``, a plan's lookahead):
    :func:`parse_size`, refusing a number without a unit below 1 MiB as a forgotten unit."""
    return parse_size(text, unit_below=BARE_SIZE_MIN)


def parse_min_free(text: str) -> int | float:
    """``--min-free``: a byte count (``"2G"``, ``"0"``) -> int, or a percentage of the
    filesystem (``"5%"``) -> a fraction below 1. Raises ValueError naming the bad text."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 <= pct < 100:
            raise ValueError(f"percentage must be in [0, 100): {text!r}")
        return pct / 100.0
    return parse_bound(t)
