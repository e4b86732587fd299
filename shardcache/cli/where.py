"""``shardcache where URL``: where a shard URL goes, the first thing to run when reads
seem to miss the cache. It shows how the environment rewrites the URL (webdataset's
``GOPEN_REWRITE``, ``SHARDCACHE_PROXY``), what the running proxy maps it to (the
upstream, the upstream URL, the proxy URL, the cache key), whether the proxy holds it
(cached, downloading, in a read plan), and whether it answers a HEAD for it. It warns
when a rewrite misses the URL or sends it somewhere other than the proxy, and exits 1
when anything is wrong, 0 when reads of the URL go through the proxy."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from shardcache.cli.common import (
    ToolError,
    _resolve_proxy,
    add_option,
    add_proxy_option,
    human_bytes,
    no_proxy_error,
)
from shardcache.compat import SubParsersAction
from shardcache.urls import PROXY_ENV

REWRITE_ENV = "GOPEN_REWRITE"  # webdataset's prefix rewriting (webdataset.gopen.rewrite_url)
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})

# --------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class Rewrite:
    """What ``GOPEN_REWRITE`` does to one URL: the rules, the one that matched (its
    prefix and replacement), the result; or why the variable cannot be used."""

    rules: tuple[tuple[str, str], ...] = ()
    matched: tuple[str, str] | None = None
    result: str | None = None
    error: str = ""


def gopen_rewrite(url: str, spec: str) -> Rewrite:
    """``url`` rewritten as webdataset 1.0 rewrites it from ``GOPEN_REWRITE=spec``:
    ``PREFIX=REPLACEMENT`` rules separated by ``;``, the first whose prefix (a regular
    expression anchored at the start, as webdataset reads it) matches wins."""
    rules: list[tuple[str, str]] = []
    for rule in spec.split(";"):
        prefix, eq, replacement = rule.partition("=")
        if not eq:
            return Rewrite(tuple(rules), error=f"rule {rule!r} has no '=' (webdataset fails on it)")
        rules.append((prefix, replacement))
    for prefix, replacement in rules:
        try:
            result = re.sub("^" + prefix, replacement, url)
        except re.error as exc:
            return Rewrite(tuple(rules), error=f"prefix {prefix!r} is not a valid pattern: {exc}")
        if result != url:
            return Rewrite(tuple(rules), (prefix, replacement), result)
    return Rewrite(tuple(rules))


def same_server(a: str, b: str) -> bool:
    """Whether URLs ``a`` and ``b`` name the same server: scheme, port (default ports
    written or not) and host, any loopback name standing for any other."""
    try:
        pa, pb = urlsplit(a), urlsplit(b)
        ports = [p.port or (443 if p.scheme.lower() == "https" else 80) for p in (pa, pb)]
    except ValueError:
        return False
    ha, hb = (pa.hostname or "").lower(), (pb.hostname or "").lower()
    same_host = ha == hb or (ha in _LOOPBACK and hb in _LOOPBACK)
    return pa.scheme.lower() == pb.scheme.lower() and ports[0] == ports[1] and same_host


@dataclass
class Report:
    """Everything ``where`` found out, in the order it is shown."""

    url: str
    proxy: str
    proxy_from: str  # "--proxy", PROXY_ENV or "default"
    lines: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def environment_checks(report: Report, environ: Mapping[str, str]) -> str:
    """Add what the environment does to ``report.url``; return the URL a reader will
    ask the proxy about (the rewritten one when ``GOPEN_REWRITE`` sends it there)."""
    url = report.url
    proxy_env = environ.get(PROXY_ENV)
    if proxy_env:
        report.lines.append((PROXY_ENV, proxy_env))
        if report.proxy_from == "--proxy" and not same_server(proxy_env, report.proxy):
            report.warnings.append(
                f"{PROXY_ENV}={proxy_env} is not the proxy asked here ({report.proxy}): "
                "shardcache.proxied() and the tools without --proxy use the variable"
            )
    spec = environ.get(REWRITE_ENV)
    if spec is None:
        return url
    rw = gopen_rewrite(url, spec)
    report.data["gopen_rewrite"] = {
        "spec": spec,
        "matched": list(rw.matched) if rw.matched else None,
        "result": rw.result,
        "error": rw.error or None,
    }
    report.lines.append((REWRITE_ENV, spec))
    if rw.error:
        report.errors.append(f"{REWRITE_ENV}: {rw.error}")
        return url
    if rw.matched is None or rw.result is None:
        report.lines.append(("rewritten", "no: the URL matches none of the prefixes"))
        if "://" in url and not same_server(url, report.proxy):
            prefixes = [p for p, _ in rw.rules]
            close = difflib.get_close_matches(url[: max(map(len, prefixes))], prefixes, n=1)
            hint = f"; did you mean {close[0]!r}? (a typo in a prefix)" if close else ""
            report.warnings.append(
                f"{url} matches none of the {REWRITE_ENV} prefixes "
                f"({', '.join(map(repr, prefixes))}): webdataset reads it from the origin, "
                f"not through the proxy{hint}"
            )
        return url
    report.lines.append(("rewritten", f"{rw.result}  (by {rw.matched[0]}={rw.matched[1]})"))
    if not same_server(rw.result, report.proxy):
        report.warnings.append(
            f"{REWRITE_ENV} sends {url} to {rw.result}, which is not the proxy at "
            f"{report.proxy}; make the rule's replacement the proxy's address"
        )
        return url
    return rw.result


def where_lines(report: Report, where: Mapping[str, Any]) -> None:
    """Add the proxy's answer about a URL (``GET /-/where``) to ``report``."""
    if where.get("error"):
        report.lines.append(("form", str(where.get("form", "?"))))
        report.errors.append(f"the proxy maps it nowhere: {where['error']}")
        return
    state = str(where.get("state", "?"))
    size = where.get("size")
    if isinstance(size, int):
        state += f", {human_bytes(size)}"
    if where.get("downloaded") is not None:
        state += f", {human_bytes(where['downloaded'])} downloaded so far"
    for plan in where.get("planned") or ():
        name = f" ({plan['name']})" if plan.get("name") else ""
        state += (
            f"; planned: shard {plan['index']} of plan {plan['plan']}{name}, at {plan['position']}"
        )
    report.lines += [
        ("form", str(where.get("form"))),
        ("upstream", str(where.get("upstream"))),
        ("upstream URL", str(where.get("upstream_url"))),
        ("proxy URL", str(where.get("proxy_url"))),
        ("cache key", str(where.get("key"))),
        ("state", state),
    ]
    asked = report.url
    fetched = str(where.get("upstream_url"))
    if "://" in asked and where.get("form") == "upstream URL" and fetched != asked:
        report.warnings.append(f"the proxy fetches {fetched}, not {asked}")


def render(report: Report) -> str:
    """The report as aligned ``name  value`` lines."""
    rows = [("URL", report.url), ("proxy", f"{report.proxy}  (from {report.proxy_from})")]
    rows += report.lines
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# --------------------------------------------------------------------------- I/O


def fetch_where(proxy: str, url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The proxy's ``GET /-/where?url=...`` answer; ToolError when it cannot be had."""
    import urllib.error
    import urllib.request

    route = f"{proxy}/-/where?url={quote(url, safe='')}"
    try:
        with urllib.request.urlopen(route, timeout=timeout) as resp:
            data = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        raise ToolError(
            f"{proxy}/-/where: HTTP {exc.code} {exc.reason}: not a shardcache proxy, or one "
            "older than this command"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise no_proxy_error(proxy, exc) from exc
    except ValueError as exc:
        raise ToolError(f"{proxy}/-/where: answer is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ToolError(f"{proxy}/-/where: not a shardcache answer")
    return data


def probe(url: str, timeout: float) -> tuple[bool, str]:
    """HEAD ``url`` (a proxy URL): whether it answered 2xx, and a line saying what came
    back. For an object neither cached nor downloading, the proxy asks the upstream and
    starts no download."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            size = f", {human_bytes(int(length))}" if length and length.isdigit() else ""
            cache = resp.headers.get("X-Cache")
            return True, f"HTTP {resp.status}{size}" + (f", X-Cache {cache}" if cache else "")
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code} {exc.reason}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"no answer: {getattr(exc, 'reason', exc)}"


def cmd_where(args: argparse.Namespace) -> int:
    """``shardcache where URL``."""
    proxy = _resolve_proxy(args.proxy)
    source = "--proxy" if args.proxy else PROXY_ENV if os.environ.get(PROXY_ENV) else "default"
    report = Report(args.url, proxy, source)
    asked = environment_checks(report, os.environ)
    try:
        where = fetch_where(proxy, asked, args.timeout)
    except ToolError as exc:
        report.errors.append(str(exc))
        where = {}
    if where:
        report.data["where"] = where
        where_lines(report, where)
        if not where.get("error") and not args.no_probe:
            ok, line = probe(str(where["proxy_url"]), args.timeout)
            report.lines.append(("HEAD", f"{line}  ({'through the proxy' if ok else 'failed'})"))
            report.data["head"] = {"ok": ok, "answer": line}
            if not ok:
                report.errors.append(f"HEAD {where['proxy_url']}: {line}")
    if args.json:
        out = {"url": report.url, "proxy": proxy, **report.data}
        out.update(warnings=report.warnings, errors=report.errors)
        print(json.dumps(out, indent=2))
    else:
        print(render(report))
    for w in report.warnings:
        print(f"shardcache where: warning: {w}", file=sys.stderr)
    for e in report.errors:
        print(f"shardcache where: error: {e}", file=sys.stderr)
    return 1 if report.warnings or report.errors else 0


def register(subparsers: SubParsersAction) -> None:
    """Add the ``where`` subcommand."""
    p = subparsers.add_parser(
        "where",
        help="say where a shard URL goes: rewrite, upstream, cache key, cached or not",
        description="Show what a URL maps to: how GOPEN_REWRITE (webdataset's) and "
        "SHARDCACHE_PROXY rewrite it, which upstream and upstream URL the running proxy "
        "maps it to, its proxy URL and cache key, whether it is cached, downloading or in "
        "a read plan, and whether a HEAD through the proxy answers. URL may be a path on "
        "the proxy, a URL of the proxy, an upstream URL or s3://BUCKET/KEY of the S3 "
        "front. Warns when a rewrite misses the URL or does not reach the proxy; exits 1 "
        "when anything is wrong.",
    )
    p.add_argument("url", metavar="URL", help="a shard's URL, proxy URL or path on the proxy")
    add_proxy_option(p)
    add_option(p, "--timeout", type=float, default=10.0, help="seconds to wait for each answer")
    p.add_argument(
        "--no-probe", action="store_true", help="do not send a HEAD for the URL through the proxy"
    )
    p.add_argument("--json", action="store_true", help="one JSON object for scripts")
    p.set_defaults(func=cmd_where)
