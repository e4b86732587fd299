"""When a stored answer may be reused without asking the upstream: the ``--revalidate``
modes, and RFC 9111's freshness for ``--revalidate http`` (lifetime §4.2.1, heuristic
§4.2.2, current age §4.2.3). Pure: no I/O, no clock (the caller passes ``now``).

Stored answers are described by their end-to-end header fields as the store keeps them
(``(name, value)`` pairs, every field line, in order: :attr:`ObjectMeta.fields`), their
``Last-Modified`` and ``response_time``, the proxy's clock when the answer that last
vouched for the bytes arrived (the entry's ``validated``: its download's commit, or a
304). The request time is not stored: the response delay counts as 0, which only matters
when an upstream cache's ``Age`` outweighs the apparent age (``response_time - Date``),
and that already covers the download's duration.
"""

from __future__ import annotations

import calendar
import math
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "HEURISTIC_CAP",
    "HEURISTIC_FRACTION",
    "REVALIDATE_HTTP",
    "current_age",
    "describe_revalidate",
    "directives",
    "freshness_lifetime",
    "http_date",
    "is_fresh",
    "must_revalidate_each_use",
    "needs_revalidation",
    "parse_age",
    "parse_revalidate",
    "stale_needs_upstream",
    "stale_while_revalidate",
]

REVALIDATE_HTTP = "http"  # --revalidate http: RFC 9111 freshness
Revalidate = float | str | None  # None: never; 0.0: always; seconds; REVALIDATE_HTTP

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_revalidate(text: str) -> Revalidate:
    """``--revalidate``: ``never`` -> None (entries are immutable), ``always`` -> 0.0,
    ``http`` -> :data:`REVALIDATE_HTTP` (RFC 9111 freshness), or an age such as ``30s``,
    ``10m``, ``1h``, ``2d``, ``500ms`` or plain seconds -> seconds. Raises ValueError
    naming the bad text."""
    t = text.strip().lower()
    if t == "never":
        return None
    if t == "always":
        return 0.0
    if t == REVALIDATE_HTTP:
        return REVALIDATE_HTTP
    m = _DURATION_RE.match(t)
    if not m:
        raise ValueError(f"expected never, always, http or an age such as 10m (got {text!r})")
    value = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(value):
        raise ValueError(f"age too large: {text!r}")
    return value


def needs_revalidation(max_age: Revalidate, validated: float, now: float) -> bool:
    """Whether a hit validated at ``validated`` must ask the upstream first, by the
    operator's age (``--revalidate always|AGE``); never for ``never`` and ``http`` (which
    asks :func:`is_fresh` instead)."""
    if max_age is None or isinstance(max_age, str):
        return False
    return now - validated >= max_age


def describe_revalidate(value: Revalidate) -> str:
    """``--revalidate`` as the startup log line says it."""
    if value is None:
        return "never"
    if isinstance(value, str):
        return f"{value} (RFC 9111 freshness)"
    return "always" if value == 0 else f"after {value:g}s"


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


# ---------------------------------------------------------------------------------------
# RFC 9111 freshness

HEURISTIC_FRACTION = 0.1  # of the time since Last-Modified (RFC 9111 4.2.2's example)
HEURISTIC_CAP = 24 * 3600.0  # a heuristic lifetime never exceeds a day
DELTA_MAX = 2**31  # RFC 9111 1.2.2: a larger delta-seconds is this

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_DIRECTIVE = re.compile(rf'\s*({_TOKEN})\s*(?:=\s*({_TOKEN}|"(?:[^"\\]|\\.)*"))?\s*(?:,|$)')
_DIGITS = re.compile(r"[0-9]+")


def _values(fields: Iterable[tuple[str, str]], name: str) -> list[str]:
    low = name.lower()
    return [v for k, v in fields if k.lower() == low]


def directives(lines: Iterable[str]) -> dict[str, str | None] | None:
    """The directives of ``Cache-Control`` field lines (lower-cased name -> argument,
    quoted strings unquoted; None without an argument). Commas inside quoted strings
    do not split. A directive repeated with another argument maps to ``""`` (invalid:
    RFC 9111 4.2.1 lets a cache treat the answer as stale). None when a line does not
    parse (RFC 9213 has an invalid CDN-Cache-Control ignored as a whole)."""
    out: dict[str, str | None] = {}
    for line in lines:
        pos, text = 0, line.strip()
        while pos < len(text):
            m = _DIRECTIVE.match(text, pos)
            if m is None or m.end() == pos:
                return None
            pos = m.end()
            name, arg = m.group(1).lower(), m.group(2)
            if arg is not None and arg.startswith('"'):
                arg = re.sub(r"\\(.)", r"\1", arg[1:-1])
            if name in out and out[name] != arg:
                out[name] = ""
            else:
                out[name] = arg
    return out


def _delta(arg: str | None) -> int | None:
    """A directive's delta-seconds (RFC 9111 1.2.2), capped at 2^31; None when invalid."""
    if arg is None or not _DIGITS.fullmatch(arg):
        return None
    digits = arg.lstrip("0") or "0"
    return DELTA_MAX if len(digits) > 10 else min(int(digits), DELTA_MAX)


def parse_age(lines: Sequence[str]) -> int | None:
    """The ``Age`` of an answer (RFC 9111 5.1): the first member of the first line,
    capped at 2^31; None when absent or invalid (ignored)."""
    if not lines:
        return None
    return _delta(lines[0].split(",")[0].strip())


_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_LONG_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_TIME = r"([0-9]{2}):([0-9]{2}):([0-9]{2})"
_IMF = re.compile(rf"([a-z]{{3}}), ([0-9]{{2}}) ([a-z]{{3}}) ([0-9]{{4}}) {_TIME} gmt")
_RFC850 = re.compile(rf"([a-z]{{6,9}}), ([0-9]{{2}})-([a-z]{{3}})-([0-9]{{2}}) {_TIME} gmt")
_ASCTIME = re.compile(rf"([a-z]{{3}}) ([a-z]{{3}}) ([ 0-9][0-9]) {_TIME} ([0-9]{{4}})")


def http_date(value: str | None, now: float | None = None) -> float | None:
    """An HTTP-date (RFC 9110 5.6.7: IMF-fixdate, the obsolete RFC 850 and asctime
    forms; names in any case) as a POSIX time, or None when it is not one. A two-digit
    year more than 50 years ahead of ``now`` is in the past century."""
    if value is None:
        return None
    text = value.strip().lower()
    m = _IMF.fullmatch(text)
    if m:
        wday, day, mon, year, hh, mm, ss = m.groups()
        ok = wday in _DAYS
    else:
        m = _RFC850.fullmatch(text)
        if m:
            wday, day, mon, yy, hh, mm, ss = m.groups()
            ok = wday in _LONG_DAYS
            this_year = 1970 + int((now or 0.0) // 31_556_952)
            year = str(2000 + int(yy) if 2000 + int(yy) <= this_year + 50 else 1900 + int(yy))
        else:
            m = _ASCTIME.fullmatch(text)
            if m is None:
                return None
            wday, mon, day, hh, mm, ss, year = m.groups()
            ok = wday in _DAYS
    if not ok or mon not in _MONTHS:
        return None
    try:
        fields = (int(year), _MONTHS.index(mon) + 1, int(day), int(hh), int(mm), int(ss))
        if not (1 <= fields[2] <= 31 and fields[3] < 24 and fields[4] < 60 and fields[5] < 61):
            return None
        return float(calendar.timegm((*fields, 0, 0, 0)))
    except (ValueError, OverflowError):
        return None


def _cache_directives(fields: Sequence[tuple[str, str]]) -> dict[str, str | None]:
    """The directives that govern this cache: ``CDN-Cache-Control``'s when it has any
    that parse (RFC 9213: a CDN then ignores Cache-Control), else ``Cache-Control``'s
    (an unparsable line keeps the directives of the lines that parse)."""
    cdn = directives(_values(fields, "CDN-Cache-Control"))
    if cdn:
        return cdn
    out: dict[str, str | None] = {}
    for line in _values(fields, "Cache-Control"):
        got = directives([line])
        for name, arg in (got or {}).items():
            out[name] = "" if name in out and out[name] != arg else arg
    return out


def freshness_lifetime(
    fields: Sequence[tuple[str, str]], last_modified: str | None, response_time: float
) -> float:
    """How long a stored answer is fresh, in seconds (RFC 9111 4.2.1), for a shared
    cache: ``s-maxage``, else ``max-age``, else ``Expires`` minus ``Date``, else
    (no explicit lifetime) 10 % of ``Date`` minus ``Last-Modified``, at most a day
    (4.2.2). An invalid or repeated-and-different ``s-maxage``/``max-age``, or an
    ``Expires`` that is invalid or on several lines, gives 0 (stale). Without a valid
    ``Date`` the response time stands for it."""
    cc = _cache_directives(fields)
    for name in ("s-maxage", "max-age"):
        if name in cc:
            delta = _delta(cc[name])
            return 0.0 if delta is None else float(delta)
    date = http_date(next(iter(_values(fields, "Date")), None), response_time)
    if date is None:
        date = response_time
    expires = _values(fields, "Expires")
    if expires:
        when = http_date(expires[0], response_time) if len(expires) == 1 else None
        return 0.0 if when is None else max(0.0, when - date)
    lm = http_date(last_modified, response_time)
    if lm is None:
        return 0.0
    return min(HEURISTIC_CAP, max(0.0, HEURISTIC_FRACTION * (date - lm)))


def current_age(fields: Sequence[tuple[str, str]], response_time: float, now: float) -> float:
    """A stored answer's current age in seconds (RFC 9111 4.2.3): the larger of its
    apparent age (``response_time`` minus its ``Date``) and the ``Age`` the upstream
    sent, plus the time it has been resident since ``response_time``."""
    age_value = parse_age(_values(fields, "Age")) or 0
    date = http_date(next(iter(_values(fields, "Date")), None), response_time)
    apparent = 0.0 if date is None else max(0.0, response_time - date)
    return max(apparent, float(age_value)) + max(0.0, now - response_time)


def is_fresh(
    fields: Sequence[tuple[str, str]],
    last_modified: str | None,
    response_time: float,
    now: float,
) -> bool:
    """Whether a stored answer may be reused without asking the upstream (RFC 9111
    4.2): its freshness lifetime exceeds its current age. ``no-cache`` is the caller's
    (:func:`must_revalidate_each_use`)."""
    lifetime = freshness_lifetime(fields, last_modified, response_time)
    return lifetime > current_age(fields, response_time, now)


def stale_needs_upstream(fields: Sequence[tuple[str, str]]) -> bool:
    """Whether a stale stored answer must not be served when the upstream cannot be
    asked (RFC 9111 4.2.4, 5.2.2.2, 5.2.2.8, 5.2.2.10): ``must-revalidate``,
    ``proxy-revalidate`` or ``s-maxage`` (a shared cache)."""
    cc = _cache_directives(fields)
    return any(d in cc for d in ("must-revalidate", "proxy-revalidate", "s-maxage"))


def stale_while_revalidate(
    fields: Sequence[tuple[str, str]],
    last_modified: str | None,
    response_time: float,
    now: float,
) -> bool:
    """Whether a stale stored answer may still be served at once while the upstream is
    asked about it in the background: its age is within its lifetime plus its
    ``stale-while-revalidate`` window (RFC 5861 3), and nothing forbids serving it stale
    (:func:`stale_needs_upstream`, ``no-cache``)."""
    cc = _cache_directives(fields)
    window = _delta(cc.get("stale-while-revalidate"))
    if not window or "no-cache" in cc or stale_needs_upstream(fields):
        return False
    lifetime = freshness_lifetime(fields, last_modified, response_time)
    return lifetime + window > current_age(fields, response_time, now)
