"""Operator tools: ``shardcache prefetch``, ``shardcache stats`` and ``shardcache ls``.

- ``prefetch PATTERN`` warms a brace pattern of shards through a running proxy: it GETs
  every shard with bounded concurrency, discards the bytes, shows progress (bytes/s, ETA)
  and ends with a summary table. Exit status 1 names every shard that failed.
- ``stats`` prints the proxy's ``/-/stats`` as a table (``--json`` for scripts).
- ``ls --cache-dir DIR`` lists the entries of an on-disk store.

The proxy address comes from ``--proxy``, else ``SHARDCACHE_PROXY`` (read when the command
runs), else ``http://127.0.0.1:8080``. Output uses ``rich`` when it is installed and plain
text otherwise; formatting and estimates are pure functions tested directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any
from urllib.parse import quote, urlsplit

from shardcache.errors import ShardcacheError

DEFAULT_PROXY = "http://127.0.0.1:8080"
PROXY_ENV = "SHARDCACHE_PROXY"
CHUNK = 1 << 20


class ToolError(ShardcacheError):
    """A tool could not do its job (proxy unreachable, bad answer, bad argument)."""


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


def format_stat(key: str, value: Any) -> str:
    """A ``/-/stats`` value for people: byte counts with units, ratios as percentages."""
    leaf = key.rsplit(".", 1)[-1].lower()
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        if "bytes" in leaf or leaf in ("size", "limit", "cache_size", "capacity"):
            return f"{human_bytes(value)} ({int(value)})" if value >= 1024 else f"{int(value)} B"
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


# --------------------------------------------------------------------------- prefetch


@dataclass
class ShardResult:
    """What fetching one shard through the proxy gave."""

    url: str
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    cache: str = ""
    error: str = ""


@dataclass
class Progress:
    """Running totals of a prefetch, shared by the fetch tasks and the display."""

    n_total: int
    started: float = field(default_factory=time.monotonic)
    done_bytes: int = 0
    done_shards: int = 0
    failed: int = 0
    lengths: list[int] = field(default_factory=list)

    def estimated_total(self) -> int | None:
        return estimate_total(self.lengths, self.n_total)

    def line(self) -> str:
        """One status line: shards, bytes, rate, ETA."""
        elapsed = time.monotonic() - self.started
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        total = self.estimated_total()
        eta = eta_seconds(self.done_bytes, total, elapsed)
        of = f" of ~{human_bytes(total)}" if total is not None else ""
        fail = f", {self.failed} failed" if self.failed else ""
        return (
            f"{self.done_shards}/{self.n_total} shards{fail}, {human_bytes(self.done_bytes)}{of}, "
            f"{human_bytes(rate)}/s, ETA {human_duration(eta)}"
        )


async def _fetch_one(
    session: Any, url: str, progress: Progress, on_bytes: Callable[[], None]
) -> ShardResult:
    import aiohttp

    t0 = time.monotonic()
    got = 0
    try:
        async with session.get(url) as resp:
            cache = resp.headers.get("X-Cache", "")
            if resp.status != 200:
                text = (await resp.text(errors="replace")).strip().splitlines()
                first = text[0][:200] if text else resp.reason or ""
                return ShardResult(
                    url, False, 0, time.monotonic() - t0, cache, f"HTTP {resp.status}: {first}"
                )
            length = resp.content_length
            if length is not None:
                progress.lengths.append(length)
            async for chunk in resp.content.iter_chunked(CHUNK):
                got += len(chunk)
                progress.done_bytes += len(chunk)
                on_bytes()
            if length is not None and got != length:
                return ShardResult(
                    url,
                    False,
                    got,
                    time.monotonic() - t0,
                    cache,
                    f"short body: {got} of {length} bytes",
                )
            return ShardResult(url, True, got, time.monotonic() - t0, cache)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        if got:
            reason = f"{reason} after {got} bytes"
        return ShardResult(url, False, got, time.monotonic() - t0, "", reason)


async def prefetch_urls(
    urls: Sequence[str],
    concurrency: int = 8,
    timeout: float | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> list[ShardResult]:
    """GET every URL with at most ``concurrency`` at once, discarding the bytes.

    Returns one result per URL, in the order given. ``timeout`` bounds each shard's read
    between chunks (seconds; None for no bound). ``on_progress`` is called as bytes arrive.
    """
    import aiohttp

    if concurrency < 1:
        raise ToolError(f"--concurrency must be at least 1, got {concurrency}")
    progress = Progress(n_total=len(urls))
    notify = (lambda: on_progress(progress)) if on_progress else (lambda: None)
    sem = asyncio.Semaphore(concurrency)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(
        timeout=client_timeout, connector=connector, auto_decompress=False
    ) as session:

        async def run(url: str) -> ShardResult:
            async with sem:
                result = await _fetch_one(session, url, progress, notify)
            progress.done_shards += 1
            progress.failed += not result.ok
            notify()
            return result

        return list(await asyncio.gather(*(run(u) for u in urls)))


def summarize(results: Sequence[ShardResult], wall: float) -> list[tuple[str, int, str, str]]:
    """Summary rows (outcome, shards, bytes, rate) with a total row last."""
    groups: dict[str, list[ShardResult]] = {}
    for r in results:
        key = (r.cache or "ok") if r.ok else "FAILED"
        groups.setdefault(key, []).append(r)
    order = ["HIT", "MISS", "COALESCED", "BYPASS", "ok", "FAILED"]
    keys = sorted(groups, key=lambda k: (order.index(k) if k in order else len(order) - 1, k))
    rows = []
    for k in keys:
        n_bytes = sum(r.bytes for r in groups[k])
        rows.append((k, len(groups[k]), human_bytes(n_bytes), ""))
    total = sum(r.bytes for r in results)
    rate = f"{human_bytes(total / wall)}/s" if wall > 0 else "-"
    rows.append(("total", len(results), human_bytes(total), rate))
    return rows


def _resolve_proxy(arg: str | None) -> str:
    proxy = arg or os.environ.get(PROXY_ENV) or DEFAULT_PROXY
    parts = urlsplit(proxy)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ToolError(f"--proxy: expected an http(s)://host:port URL, got {proxy!r}")
    return proxy.rstrip("/")


def _expand(pattern: str) -> list[str]:
    try:
        from shardcache.urls import expand_urls
    except ImportError:  # pragma: no cover - shardcache.urls ships with the package
        from braceexpand import braceexpand

        def expand_urls(p: str) -> list[str]:
            return list(braceexpand(p))

    try:
        urls = list(expand_urls(pattern))
    except ShardcacheError:
        raise
    except (ValueError, TypeError) as exc:
        raise ToolError(f"bad pattern {pattern!r}: {exc}") from exc
    if not urls:
        raise ToolError(f"pattern {pattern!r} names no shards")
    return urls


def cmd_prefetch(args: argparse.Namespace) -> int:
    """``shardcache prefetch``: warm a pattern of shards through a running proxy."""
    proxy = _resolve_proxy(args.proxy)
    items = _expand(args.pattern)
    urls = [proxy_url(proxy, item) for item in items]
    err = sys.stderr
    console = None if args.quiet else _rich_console(err)
    t0 = time.monotonic()

    if console is not None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        task = bar.add_task("prefetch", total=None)

        def show(p: Progress) -> None:
            finished = p.done_shards == p.n_total
            bar.update(
                task,
                completed=p.done_bytes,
                total=p.done_bytes if finished else p.estimated_total(),
                description=f"{p.done_shards}/{p.n_total} shards"
                + (f" ({p.failed} failed)" if p.failed else ""),
            )

        with bar:
            results = asyncio.run(prefetch_urls(urls, args.concurrency, args.timeout, show))
    else:
        last = [0.0]
        interactive = err.isatty()

        def show(p: Progress) -> None:
            now = time.monotonic()
            final = p.done_shards == p.n_total
            if args.quiet or (now - last[0] < (0.2 if interactive else 2.0) and not final):
                return
            last[0] = now
            print(
                ("\r" if interactive else "") + p.line(),
                end="" if interactive else "\n",
                file=err,
                flush=True,
            )

        results = asyncio.run(prefetch_urls(urls, args.concurrency, args.timeout, show))
        if interactive and not args.quiet:
            print(file=err)

    wall = time.monotonic() - t0
    print_table(
        f"prefetch through {proxy}: {len(results)} shards in {wall:.2f} s",
        ["outcome", "shards", "bytes", "rate"],
        summarize(results, wall),
        right=(1, 2, 3),
    )
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"shardcache prefetch: {len(failed)} of {len(results)} shards failed:", file=err)
        for r in failed:
            print(f"  {r.url}: {r.error}", file=err)
        return 1
    return 0


# --------------------------------------------------------------------------- stats


def fetch_stats(proxy: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET ``/-/stats`` from ``proxy`` and return the decoded JSON object."""
    import urllib.error
    import urllib.request

    url = f"{proxy}/-/stats"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise ToolError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ToolError(f"{url}: cannot reach the proxy ({reason})") from exc
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ToolError(f"{url}: answer is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ToolError(f"{url}: expected a JSON object, got {type(data).__name__}")
    return data


def cmd_stats(args: argparse.Namespace) -> int:
    """``shardcache stats``: the proxy's ``/-/stats`` as a table or JSON."""
    proxy = _resolve_proxy(args.proxy)
    data = fetch_stats(proxy)
    if args.json:
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        print()
        return 0
    rows = [(k, format_stat(k, v)) for k, v in flatten(data)]
    print_table(f"shardcache stats: {proxy}", ["stat", "value"], rows)
    return 0


# --------------------------------------------------------------------------- ls


_LS_SORT: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "access": (lambda e: e.last_access or 0, True),
    "size": (lambda e: e.size, True),
    "hits": (lambda e: e.hits, True),
    "url": (lambda e: e.url, False),
}


def cmd_ls(args: argparse.Namespace) -> int:
    """``shardcache ls``: the entries of an on-disk store."""
    from shardcache.store import INDEX_NAME, Store

    cache_dir = args.cache_dir or os.environ.get("SHARDCACHE_CACHE_DIR")
    if not cache_dir:
        raise ToolError("--cache-dir: required (or set SHARDCACHE_CACHE_DIR)")
    if not os.path.isdir(cache_dir):
        raise ToolError(f"--cache-dir: {cache_dir} is not a directory")
    # Opening a Store reconciles the directory; never do that to a directory that is not
    # a cache (it would create an index there and treat uuid-named files as orphans).
    if not os.path.exists(os.path.join(cache_dir, INDEX_NAME)):
        raise ToolError(f"--cache-dir: {cache_dir} is not a shardcache cache (no {INDEX_NAME})")
    key, reverse = _LS_SORT[args.sort]
    with Store(cache_dir, reconcile=False) as store:
        entries = sorted(store.entries(), key=key, reverse=reverse)
    if args.json:
        out = [
            {
                "url": e.url,
                "size": e.size,
                "last_access": e.last_access,
                "created": e.created,
                "hits": e.hits,
                "etag": e.etag,
                "key": e.key,
                "path": str(e.path),
            }
            for e in entries
        ]
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    rows = [(human_bytes(e.size), format_time(e.last_access), e.hits, e.url) for e in entries]
    total = sum(e.size for e in entries)
    print_table(
        f"{cache_dir}: {len(entries)} entries, {human_bytes(total)}",
        ["size", "last access", "hits", "url"],
        rows,
        right=(0, 2),
    )
    return 0


# --------------------------------------------------------------------------- CLI


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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``prefetch``, ``stats`` and ``ls`` subcommands."""
    proxy_help = f"URL of the running proxy (default: {DEFAULT_PROXY}) [env {PROXY_ENV}]"

    p = subparsers.add_parser(
        "prefetch",
        help="warm a brace pattern of shards through a running proxy",
        description="GET every shard of PATTERN through the proxy, discarding the bytes, "
        "so that later readers hit the cache. PATTERN is a brace pattern of paths on the "
        "proxy (e.g. '/shards/train-{000000..000099}.tar') or of absolute URLs of hosts "
        "the proxy allows. Exits 1 naming the shards that failed.",
    )
    p.add_argument("pattern", metavar="PATTERN", help="brace pattern of shard paths or URLs")
    p.add_argument("--proxy", default=None, help=proxy_help)
    p.add_argument(
        "--concurrency",
        "-j",
        type=_positive_int,
        default=8,
        help="shards fetched at once (default: 8)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        help="seconds without data before a shard counts as failed (default: 300)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_prefetch)

    s = subparsers.add_parser(
        "stats",
        help="show a running proxy's /-/stats",
        description="Print the proxy's /-/stats (entries, bytes, hit ratio, downloads in "
        "flight) as a table, or as JSON with --json.",
    )
    s.add_argument("--proxy", default=None, help=proxy_help)
    s.add_argument("--json", action="store_true", help="print the JSON as the proxy sent it")
    s.set_defaults(func=cmd_stats)

    ls = subparsers.add_parser(
        "ls",
        help="list the entries of a cache directory",
        description="List the entries of a cache directory with their size, last access, "
        "hits and source URL. Works beside a running proxy (the store is shared).",
    )
    ls.add_argument(
        "--cache-dir",
        default=None,
        help="the proxy's cache directory [env SHARDCACHE_CACHE_DIR]",
    )
    ls.add_argument(
        "--sort",
        choices=sorted(_LS_SORT),
        default="access",
        help="order of the listing, largest or most recent first (default: access)",
    )
    ls.add_argument("--json", action="store_true", help="one JSON list for scripts")
    ls.set_defaults(func=cmd_ls)


# --------------------------------------------------------------------------- configuration


_DEFAULT_RE = re.compile(r"\s*\(default:? ([^()]*(?:\([^()]*\))?[^()]*)\)")
_ENV_RE = re.compile(r"\s*\[env [A-Z0-9_]+\]|\s*\(env [A-Z0-9_]+[^)]*\)")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise ToolError(f"no {name!r} subcommand in the CLI")


def option_rows(
    parser: argparse.ArgumentParser, env_of: Callable[[argparse.Action], str | None]
) -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, default, meaning) for each option of ``parser``.

    The default is the argparse default when there is one, else what the help text says
    in ``(default X)``; the help text loses its ``[env ...]`` and ``(default ...)`` notes.
    """
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs != 0:
            flag += " " + (action.metavar or action.dest.upper())
        text = (action.help or "").replace("%%", "%")  # argparse escapes
        default = ""
        if action.default not in (None, False, argparse.SUPPRESS):
            default = str(action.default)
        m = _DEFAULT_RE.search(text)
        if m:
            default = default or m.group(1).strip()
            text = text[: m.start()] + text[m.end() :]
        text = _ENV_RE.sub("", text).strip()
        if "(required)" in text:
            text = text.replace("(required)", "").strip()
            default = "required"
        if action.choices:
            text += " (one of: " + ", ".join(map(str, action.choices)) + ")"
        if isinstance(action, argparse._AppendAction):
            text += " (repeatable)" if "repeatable" not in text else ""
        rows.append((flag, env_of(action) or "", default, " ".join(text.split())))
    return rows


def _md_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    def cell(s: str, code: bool = False) -> str:
        s = s.replace("|", "\\|")
        return f"`{s}`" if code and s else (s or "—")

    out = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for flag, env, default, text in rows:
        out.append(
            f"| {cell(flag, True)} | {cell(env, True)} | {cell(default, True)} | {cell(text)} |"
        )
    return "\n".join(out)


def configuration_reference() -> str:
    """The configuration reference (markdown), generated from the CLI's own parsers."""
    from proxy.config import ENV_PREFIX
    from shardcache.cli import build_parser

    parser = build_parser()
    serve = _subparser(parser, "serve")

    def serve_env(action: argparse.Action) -> str:
        return ENV_PREFIX + action.dest.upper()

    def tool_env(action: argparse.Action) -> str | None:
        return {"proxy": PROXY_ENV, "cache_dir": "SHARDCACHE_CACHE_DIR"}.get(action.dest)

    parts = [
        "# Configuration reference",
        "",
        "<!-- Generated from the code by `python docs/gen_configuration.py`; do not edit by "
        "hand. tests/test_configuration_doc.py fails when this file and the code disagree. -->",
        "",
        "## `shardcache serve`",
        "",
        "Every flag can also be given as an environment variable; a flag on the command line "
        "wins over the variable. Settings are read and validated once at startup, and a bad "
        "value stops the proxy with a message naming the flag. Sizes accept `500G`, `1.5T`, "
        "`10MiB` or plain bytes. Lists in an environment variable (`SHARDCACHE_UPSTREAM`, "
        "`SHARDCACHE_ALLOW_HOST`) are separated by commas or spaces.",
        "",
        _md_table(option_rows(serve, serve_env)),
        "",
    ]
    for name in ("prefetch", "stats", "ls"):
        sub = _subparser(parser, name)
        parts += [
            f"## `shardcache {name}`",
            "",
            " ".join((sub.description or getattr(sub, "help", "") or "").split()) or "",
            "",
            _md_table(option_rows(sub, tool_env)),
            "",
        ]
    return "\n".join(p for p in parts if p is not None).rstrip() + "\n"
