"""What the operator tools share: the proxy address, errors, human-readable figures and
tables (``rich`` when installed and on a terminal, plain text otherwise). Pure functions,
tested directly."""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any
from urllib.parse import quote, urlsplit

from shardcache.errors import ShardcacheError
from shardcache.plans import TOKEN_ENV
from shardcache.urls import PROXY_ENV

DEFAULT_PROXY = "http://127.0.0.1:8080"
CACHE_DIR_ENV = "SHARDCACHE_CACHE_DIR"  # the variable serve reads too (settings table)
CHUNK = 1 << 20


def add_option(
    parser: argparse.ArgumentParser | Any,
    *flags: str,
    help: str,
    env: str | None = None,
    shown_default: str | None = None,
    **kw: Any,
) -> argparse.Action:
    """``parser.add_argument(*flags, **kw)`` for an option of a tool, declared once: its
    ``--help`` line gets ``(default: X)`` (from ``default``, or ``shown_default`` when the
    real default is computed at run time) and ``[env VAR]`` appended, and the action
    keeps ``help``, ``env`` and the default apart as ``action.doc`` for the
    configuration reference, which thus never parses help text."""
    default = kw.get("default")
    if shown_default is None and default not in (None, False, argparse.SUPPRESS):
        shown_default = f"{default:g}" if isinstance(default, float) else str(default)
    text = help
    if shown_default:
        text += f" (default: {shown_default})"
    if env:
        text += f" [env {env}]"
    action = parser.add_argument(*flags, help=text, **kw)
    action.doc = OptionDoc(help.replace("%%", "%"), env or "", shown_default or "")  # type: ignore[attr-defined]
    return action


@dataclass(frozen=True)
class OptionDoc:
    """What the configuration reference shows of a tool's option."""

    help: str
    env: str
    default: str


def add_proxy_option(parser: argparse.ArgumentParser) -> argparse.Action:
    """``--proxy URL`` of the tools that talk to a running proxy."""
    return add_option(
        parser,
        "--proxy",
        default=None,
        metavar="URL",
        help="URL of the running proxy",
        env=PROXY_ENV,
        shown_default=DEFAULT_PROXY,
    )


class ToolError(ShardcacheError):
    """A tool could not do its job (proxy unreachable, bad answer, bad argument)."""


def cache_dir_arg(given: str | None) -> str:
    """The cache directory a tool reads: ``--cache-dir``, else ``$SHARDCACHE_CACHE_DIR``
    (the variable ``serve`` reads), checked to be a shardcache cache that this uid can
    read. :class:`ToolError` says which of these it is not, and why: a directory that
    cannot be listed is not "a directory without an index"."""
    from shardcache.store import INDEX_NAME

    cache_dir = given or os.environ.get(CACHE_DIR_ENV)
    if not cache_dir:
        raise ToolError(f"--cache-dir: required (or set {CACHE_DIR_ENV})")
    uid = os.getuid() if hasattr(os, "getuid") else "?"
    try:
        is_dir = stat.S_ISDIR(os.stat(cache_dir).st_mode)
        if is_dir:  # readable: the listing opens (not every name read: a flat cache of
            with os.scandir(cache_dir) as it:  # millions would take seconds and GBs)
                next(it, None)
    except FileNotFoundError:
        raise ToolError(f"--cache-dir: {cache_dir} does not exist") from None
    except NotADirectoryError:
        raise ToolError(f"--cache-dir: {cache_dir} is not a directory") from None
    except OSError as exc:
        raise ToolError(
            f"--cache-dir: cannot read {cache_dir} ({exc.strerror or exc}); running as uid "
            f"{uid}: run as the proxy's user, or make the directory readable by this uid"
        ) from None
    if not is_dir:
        raise ToolError(f"--cache-dir: {cache_dir} is not a directory")
    if not os.path.lexists(os.path.join(cache_dir, INDEX_NAME)):
        raise ToolError(f"--cache-dir: {cache_dir} is not a shardcache cache (no {INDEX_NAME})")
    return cache_dir


# --------------------------------------------------------------------------- pure helpers


def human_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def human_duration(seconds: float | None) -> str:
    """``75`` → ``'1:15'``, ``3725`` → ``'1:02:05'``; unknown → ``'-:--'``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def estimate_total(known_lengths: Sequence[int], n_total: int) -> int | None:
    """Estimate the bytes of ``n_total`` shards from the lengths known so far.

    Shards whose length is not known yet are assumed to be the mean of the known ones;
    with no length known there is no estimate.
    """
    if not known_lengths:
        return None
    known = sum(known_lengths)
    missing = max(n_total - len(known_lengths), 0)
    return known + round(missing * known / len(known_lengths))


def eta_seconds(done_bytes: int, total_bytes: int | None, elapsed: float) -> float | None:
    """Seconds left at the mean rate so far; ``None`` when it cannot be told yet."""
    if total_bytes is None or done_bytes <= 0 or elapsed <= 0:
        return None
    rate = done_bytes / elapsed
    return max(total_bytes - done_bytes, 0) / rate


def proxy_url(proxy: str, item: str) -> str:
    """The URL on ``proxy`` that serves ``item`` of a prefetch pattern.

    - a URL already on the proxy is used as it is;
    - a path (``/shards/a.tar`` or ``shards/a.tar``) is taken relative to the proxy root;
    - another absolute ``http(s)://`` URL is asked for as ``/<url>`` (the proxy serves it
      only for hosts named with ``--allow-host``).
    """
    base = proxy.rstrip("/")
    if not item:
        raise ToolError("empty shard name in pattern")
    if item.startswith(base + "/"):
        return item
    scheme = urlsplit(item).scheme.lower()
    if scheme in ("http", "https", "s3"):
        return f"{base}/{quote(item, safe=':/?&=%~')}"
    if "://" in item:
        raise ToolError(f"{item}: unsupported URL scheme for prefetch")
    return f"{base}/{quote(item.lstrip('/'), safe='/%~')}"


def render_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = ()
) -> str:
    """A plain-text table with a header rule; columns in ``right`` are right-aligned."""
    right = set(right)
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested mappings as dotted keys, in the order given: ``{"a": {"b": 1}}`` → ``a.b``."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += flatten(value, name + ".")
        else:
            out.append((name, value))
    return out


# /-/stats fields that are bytes without saying so in their name (``*bytes*`` ones do)
BYTE_STATS = frozenset({"size", "limit", "cache_size", "capacity", "reserved", "effective_limit"})
# numbers that name something (a process, an errno): shown as they are, no separators
ID_STATS = frozenset({"pid", "errno", "id", "port"})


def format_stat(key: str, value: Any) -> str:
    """A ``/-/stats`` value for people: every byte figure as ``4.8 MiB (5000000)`` (or
    ``512 B``), ratios as percentages, counts with separators, ids as they are."""
    leaf = key.rsplit(".", 1)[-1].lower()
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        if "bytes" in leaf or leaf in BYTE_STATS:
            return f"{human_bytes(value)} ({int(value)})" if value >= 1024 else f"{int(value)} B"
        if leaf in ID_STATS or leaf.endswith(("_id", "_pid")):
            return str(value)
        if "ratio" in leaf:
            return f"{value * 100:.1f}%"
        if "seconds" in leaf or "uptime" in leaf:
            return human_duration(value) if value >= 60 else f"{value:.2f} s"
        if isinstance(value, float):
            return f"{value:.3f}"
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "(none)"
    return str(value)


def format_time(ts: float | None) -> str:
    """A POSIX time as local ``YYYY-mm-dd HH:MM:SS``."""
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------- output


def _rich_console(stream: IO[str]) -> Any | None:
    """A rich Console on ``stream`` when rich is installed and ``stream`` is a terminal.

    Pipes and files get plain text (one row per line, nothing folded), so scripts can
    grep the output; rich's own ``FORCE_COLOR``/``TTY_COMPATIBLE`` variables force it.
    """
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console(file=stream, soft_wrap=True)
    return console if console.is_terminal else None


def print_table(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Iterable[int] = (),
    stream: IO[str] | None = None,
) -> None:
    """Print a table with rich when available, else as plain text."""
    stream = stream or sys.stdout
    right = set(right)
    console = _rich_console(stream)
    if console is not None:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="right" if i in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*(str(c) for c in row))
        console.print(table)
        return
    if title:
        print(title, file=stream)
    print(render_table(headers, rows, right), file=stream)


def _resolve_proxy(arg: str | None) -> str:
    proxy = arg or os.environ.get(PROXY_ENV) or DEFAULT_PROXY
    parts = urlsplit(proxy)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ToolError(f"--proxy: expected an http(s)://host:port URL, got {proxy!r}")
    return proxy.rstrip("/")


def no_proxy_error(proxy: str, exc: BaseException) -> ToolError:
    """The one message for a proxy that does not answer at all (nothing listening, no
    such host, no route), the same from every tool."""
    cause: object = getattr(exc, "reason", exc)
    if isinstance(cause, ConnectionRefusedError):
        why = "connection refused"
    elif isinstance(cause, TimeoutError):
        why = "timed out"
    elif isinstance(cause, OSError) and cause.strerror:
        why = cause.strerror[:1].lower() + cause.strerror[1:]
    else:
        why = str(cause) or type(cause).__name__
    return ToolError(
        f"no proxy answers at {proxy}: {why}; start one with `shardcache serve --upstream URL "
        f"...`, or give its address with --proxy or {PROXY_ENV}"
    )


def admin_token_error(status: int | None, message: str) -> ToolError | None:
    """What to tell someone whose request the proxy refused for its admin token (401: none
    sent, 403 "wrong admin token"): which variable to set. None for any other answer."""
    if status == 401:
        return ToolError(
            f"{message}; the proxy requires its admin token: set {TOKEN_ENV} to the "
            "proxy's --admin-token"
        )
    if status == 403 and "wrong admin token" in message:
        return ToolError(f"{message}; {TOKEN_ENV} does not match the proxy's --admin-token")
    return None


def probe_proxy(proxy: str, timeout: float = 10.0) -> None:
    """Raise :func:`no_proxy_error` unless something answers HTTP at ``proxy`` (any status:
    a proxy that is shutting down or refuses the probe still answers)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{proxy}/-/healthz", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        raise no_proxy_error(proxy, exc) from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
