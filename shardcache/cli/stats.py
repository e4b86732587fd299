"""``shardcache stats`` (a running proxy's ``/-/stats`` as a table, ``--json`` for
scripts) and ``shardcache ls --cache-dir DIR`` (the entries of an on-disk store)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from shardcache.cli.common import (
    CACHE_DIR_ENV,
    ToolError,
    _resolve_proxy,
    add_option,
    add_proxy_option,
    cache_dir_arg,
    flatten,
    format_stat,
    format_time,
    human_bytes,
    no_proxy_error,
    print_table,
)
from shardcache.compat import SubParsersAction

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
        if exc.code in (404, 405, 501):  # a server without the route: not ours
            raise ToolError(f"{url}: HTTP {exc.code} {exc.reason}: {_not_a_proxy(proxy)}") from exc
        raise ToolError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise no_proxy_error(proxy, exc) from exc
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ToolError(f"{url}: answer is not JSON ({exc}): {_not_a_proxy(proxy)}") from exc
    if not isinstance(data, dict) or "hits" not in data:
        raise ToolError(f"{url}: not the statistics of a shardcache proxy: {_not_a_proxy(proxy)}")
    return data


def _not_a_proxy(proxy: str) -> str:
    return (
        f"the server at {proxy} answers HTTP but is not a shardcache proxy (an origin, or "
        "another service on that port?); give the proxy's address with --proxy or "
        "SHARDCACHE_PROXY"
    )


def cmd_stats(args: argparse.Namespace) -> int:
    """``shardcache stats``: the proxy's ``/-/stats`` as a table or JSON."""
    proxy = _resolve_proxy(args.proxy)
    data = fetch_stats(proxy)
    if args.json:
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        print()
        return 0
    health = data.get("upstream_health")
    rows = [(k, format_stat(k, v)) for k, v in flatten(data) if k != "upstream_health"]
    if isinstance(health, list):
        rows += [_upstream_row(u) for u in health if isinstance(u, dict)]
    print_table(f"shardcache stats: {proxy}", ["stat", "value"], rows)
    return 0


def _upstream_row(u: dict[str, Any]) -> tuple[str, str]:
    """One upstream of /-/stats' ``upstream_health``: its state, its failures by reason,
    its last error with its time."""
    failures = u.get("failures") or {}
    counted = ", ".join(f"{r} {n}" for r, n in failures.items()) or "no failures"
    error = u.get("last_error") or {}
    last = (
        f"; last error {error.get('at')}: {error.get('reason')}: {error.get('message')}"
        if error
        else ""
    )
    return f"upstream_health.{u.get('upstream')}", f"{u.get('state')}: {counted}{last}"


# --------------------------------------------------------------------------- ls


_LS_SORT: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "access": (lambda e: e.last_access or 0, True),
    "size": (lambda e: e.size, True),
    "hits": (lambda e: e.hits, True),
    "url": (lambda e: e.url, False),
}


def cmd_ls(args: argparse.Namespace) -> int:
    """``shardcache ls``: the entries of an on-disk store."""
    from shardcache.store import Store

    # Opening a Store reconciles the directory; never do that to a directory that is not
    # a cache (it would create an index there and treat uuid-named files as orphans).
    cache_dir = cache_dir_arg(args.cache_dir)
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


def register(subparsers: SubParsersAction) -> None:
    """Add the ``stats`` and ``ls`` subcommands."""
    s = subparsers.add_parser(
        "stats",
        help="show a running proxy's /-/stats",
        description="Print the proxy's /-/stats (entries, bytes, hit ratio, downloads in "
        "flight) as a table, or as JSON with --json.",
    )
    add_proxy_option(s)
    s.add_argument("--json", action="store_true", help="print the JSON as the proxy sent it")
    s.set_defaults(func=cmd_stats)

    ls = subparsers.add_parser(
        "ls",
        help="list the entries of a cache directory",
        description="List the entries of a cache directory with their size, last access, "
        "hits and source URL. Works beside a running proxy (the store is shared).",
    )
    add_option(
        ls, "--cache-dir", default=None, help="the proxy's cache directory", env=CACHE_DIR_ENV
    )
    add_option(
        ls,
        "--sort",
        choices=sorted(_LS_SORT),
        default="access",
        help="order of the listing, largest or most recent first",
    )
    ls.add_argument("--json", action="store_true", help="one JSON list for scripts")
    ls.set_defaults(func=cmd_ls)
