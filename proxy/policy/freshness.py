"""When a stored answer may be reused without asking the upstream: the ``--revalidate``
modes, and RFC 9111's freshness (lifetime, current age) for ``--revalidate http``.
Pure: no I/O, no clock (the caller passes ``now``)."""

from __future__ import annotations

import math
import re

__all__ = ["must_revalidate_each_use", "needs_revalidation", "parse_revalidate"]

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_revalidate(text: str) -> float | None:
    """``--revalidate``: ``never`` -> None (entries are immutable), ``always`` -> 0.0, or an
    age such as ``30s``, ``10m``, ``1h``, ``2d``, ``500ms`` or plain seconds -> seconds.
    Raises ValueError naming the bad text."""
    t = text.strip().lower()
    if t == "never":
        return None
    if t == "always":
        return 0.0
    m = _DURATION_RE.match(t)
    if not m:
        raise ValueError(f"expected never, always or an age such as 10m (got {text!r})")
    value = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(value):
        raise ValueError(f"age too large: {text!r}")
    return value


def needs_revalidation(max_age: float | None, validated: float, now: float) -> bool:
    """Whether a hit validated at ``validated`` must ask the upstream first."""
    return max_age is not None and now - validated >= max_age


def _directives(value: str | None) -> dict[str, str | None]:
    """The directives of a Cache-Control value: lower-cased name -> argument or None."""
    out: dict[str, str | None] = {}
    for directive in (value or "").split(","):
        name, eq, arg = directive.partition("=")
        name = name.strip().lower()
        if name:
            out.setdefault(name, arg.strip().strip('"') if eq else None)
    return out


def must_revalidate_each_use(cache_control: str | None) -> bool:
    """Whether a stored answer with this ``Cache-Control`` may be reused only after the
    upstream confirms it, every time (``no-cache`` without field names, RFC 9111 5.2.2.4;
    the qualified form only forbids replaying the fields it names)."""
    d = _directives(cache_control)
    return "no-cache" in d and not d["no-cache"]
