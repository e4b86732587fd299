"""``shardcache prefetch PATTERN``: warm a brace pattern of shards through a running
proxy. It GETs every shard with bounded concurrency, discards the bytes, shows progress
(bytes/s, ETA) and ends with a summary table; exit status 1 names every shard that
failed. The proxy address comes from ``--proxy``, else ``SHARDCACHE_PROXY``, else
``http://127.0.0.1:8080``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from shardcache.cli.common import (
    CHUNK,
    ToolError,
    _positive_float,
    _positive_int,
    _resolve_proxy,
    _rich_console,
    add_option,
    add_proxy_option,
    estimate_total,
    eta_seconds,
    human_bytes,
    human_duration,
    print_table,
    probe_proxy,
    proxy_url,
)
from shardcache.compat import SubParsersAction
from shardcache.errors import ShardcacheError

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
    """Running totals of a prefetch, shared by the fetch tasks and the display.

    Times count the transfer only, from the first request to the last shard's end
    (``started`` to ``finished``), so the progress and the summary give one rate.
    """

    n_total: int
    started: float | None = None
    finished: float | None = None
    done_bytes: int = 0
    done_shards: int = 0
    failed: int = 0
    lengths: list[int] = field(default_factory=list)
    results: list[ShardResult] = field(default_factory=list)  # as they end
    asking: set[str] = field(default_factory=set)  # URLs whose GET is under way

    def estimated_total(self) -> int | None:
        return estimate_total(self.lengths, self.n_total)

    def elapsed(self) -> float:
        """Seconds of transfer so far (all of it once finished)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.monotonic()) - self.started

    def rate(self) -> float:
        """Mean bytes per second over :meth:`elapsed`."""
        elapsed = self.elapsed()
        return self.done_bytes / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """One status line: shards, bytes, mean rate, ETA."""
        elapsed = self.elapsed()
        rate = self.rate()
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
    progress: Progress | None = None,
) -> list[ShardResult]:
    """GET every URL with at most ``concurrency`` at once, discarding the bytes.

    Returns one result per URL, in the order given. ``timeout`` bounds each shard's read
    between chunks (seconds; None for no bound). ``on_progress`` is called as bytes arrive
    with ``progress`` (a new :class:`Progress` when not given), which times the transfer.
    """
    import aiohttp

    if concurrency < 1:
        raise ToolError(f"--concurrency must be at least 1, got {concurrency}")
    progress = progress or Progress(n_total=len(urls))
    notify = (lambda: on_progress(progress)) if on_progress else (lambda: None)
    sem = asyncio.Semaphore(concurrency)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(
        timeout=client_timeout, connector=connector, auto_decompress=False
    ) as session:

        async def run(url: str) -> ShardResult:
            async with sem:
                progress.asking.add(url)  # left there when Ctrl-C cancels the GET
                result = await _fetch_one(session, url, progress, notify)
                progress.asking.discard(url)
            progress.results.append(result)
            progress.done_shards += 1
            progress.failed += not result.ok
            if progress.done_shards == progress.n_total:
                progress.finished = time.monotonic()
            notify()
            return result

        progress.started = time.monotonic()
        return list(await asyncio.gather(*(run(u) for u in urls)))


def summarize(results: Sequence[ShardResult], wall: float) -> list[tuple[str, int, str, str]]:
    """Summary rows (outcome, shards, bytes, rate) with a total row last; the rate is the
    total bytes over ``wall``, the transfer's seconds."""
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


def proxy_urls(proxy: str, items: Sequence[str], stats: Callable[[], dict[str, Any]]) -> list[str]:
    """The URLs on ``proxy`` of the shards ``items`` name, in the forms a read plan takes:
    a path on the proxy, a URL of the proxy, an upstream URL (mapped to the proxy's path
    as :func:`shardcache.proxied` maps it, with the upstreams the proxy reports in
    ``/-/stats``), ``s3://BUCKET/KEY`` of a bucket of the S3 front, or a URL of a host the
    proxy allows (``--allow-host``). ``stats`` is called once, when an absolute URL
    needs it. ToolError for a URL under none of the upstreams, naming them."""
    from shardcache.errors import ProxyURLError
    from shardcache.urls import proxied

    base = proxy.rstrip("/")
    known: dict[str, Any] | None = None
    out = []
    for item in items:
        scheme = urlsplit(item).scheme.lower()
        if (
            item.startswith(base + "/")
            or "://" not in item
            or scheme not in ("http", "https", "s3")
        ):
            out.append(proxy_url(proxy, item))
            continue
        if _same_loopback(item, base):  # localhost:PORT for 127.0.0.1:PORT
            out.append(proxy_url(proxy, urlsplit(item)._replace(scheme="", netloc="").geturl()))
            continue
        if known is None:
            known = stats()
        upstreams = known.get("upstreams")
        if not isinstance(upstreams, list):  # a proxy that does not say: as it comes
            out.append(proxy_url(proxy, item))
            continue
        names = {str(u).partition("=")[0] for u in upstreams if "=" in str(u).split("://")[0]}
        parts = urlsplit(item)
        if scheme == "s3" and parts.hostname in names:
            out.append(f"{base}/{parts.hostname}{parts.path}")  # a bucket of the S3 front
            continue
        try:
            out.append(str(proxied(item, base, upstream=upstreams)))
        except ProxyURLError:
            allowed = {h.lower() for h in known.get("allow_hosts") or ()}
            netloc = (parts.netloc.rpartition("@")[2]).lower()
            if scheme in ("http", "https") and (netloc in allowed or parts.hostname in allowed):
                out.append(proxy_url(proxy, item))  # the absolute-URL form, for this host
                continue
            listed = ", ".join(map(str, upstreams)) or "none"
            raise ToolError(
                f"{item}: under none of the proxy's upstreams ({listed}), and its host is not "
                "named with --allow-host; check the URL and the upstreams for a typo"
            ) from None
    return out


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def _same_loopback(url: str, base: str) -> bool:
    """Whether ``url`` is on the proxy at ``base`` under another loopback name."""
    a, b = urlsplit(url), urlsplit(base)
    try:
        same_port = (a.port or 80) == (b.port or 80)
    except ValueError:
        return False
    return (
        a.scheme.lower() == b.scheme.lower()
        and same_port
        and (a.hostname or "") in _LOOPBACK
        and (b.hostname or "") in _LOOPBACK
    )


def cmd_prefetch(args: argparse.Namespace) -> int:
    """``shardcache prefetch``: warm a pattern of shards through a running proxy."""
    from shardcache.cli.stats import fetch_stats

    proxy = _resolve_proxy(args.proxy)
    items = _expand(args.pattern)
    probe_proxy(proxy)  # one clear error instead of one per shard
    urls = proxy_urls(proxy, items, lambda: fetch_stats(proxy))
    err = sys.stderr
    console = None if args.quiet else _rich_console(err)
    t0 = time.monotonic()
    progress = Progress(n_total=len(urls))

    if console is not None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            # the mean rate of the summary, not rich's recent-window speed
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        task = bar.add_task("prefetch", total=None, rate="")

        def show(p: Progress) -> None:
            finished = p.done_shards == p.n_total
            bar.update(
                task,
                completed=p.done_bytes,
                total=p.done_bytes if finished else p.estimated_total(),
                description=f"{p.done_shards}/{p.n_total} shards"
                + (f" ({p.failed} failed)" if p.failed else ""),
                rate=f"{human_bytes(p.rate())}/s",
            )

        try:
            with bar:
                results = asyncio.run(
                    prefetch_urls(urls, args.concurrency, args.timeout, show, progress)
                )
        except KeyboardInterrupt:
            return _interrupted(proxy, progress, t0)
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

        try:
            results = asyncio.run(
                prefetch_urls(urls, args.concurrency, args.timeout, show, progress)
            )
        except KeyboardInterrupt:
            if interactive and not args.quiet:
                print(file=err)
            return _interrupted(proxy, progress, t0)
        if interactive and not args.quiet:
            print(file=err)

    wall = time.monotonic() - t0
    transfer = progress.elapsed()
    print_table(
        f"prefetch through {proxy}: {len(results)} shards in {transfer:.2f} s from the first "
        f"request to the last byte ({wall:.2f} s with start-up); rates are bytes over that "
        "transfer time",
        ["outcome", "shards", "bytes", "rate"],
        summarize(results, transfer),
        right=(1, 2, 3),
    )
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"shardcache prefetch: {len(failed)} of {len(results)} shards failed:", file=err)
        for r in failed:
            print(f"  {r.url}: {r.error}", file=err)
        return 1
    return 0


def _interrupted(proxy: str, progress: Progress, t0: float) -> int:
    """After Ctrl-C: the summary of the shards that ended, and what goes on at the proxy
    (the downloads it had started for this prefetch are not stopped by a client that
    leaves: it keeps downloading them into its cache). Exit status 130."""
    err = sys.stderr
    results = list(progress.results)
    asked = sorted(progress.asking)
    wall = time.monotonic() - t0
    transfer = progress.elapsed()
    print_table(
        f"prefetch through {proxy}, interrupted: {len(results)} of {progress.n_total} shards "
        f"ended in {transfer:.2f} s ({wall:.2f} s with start-up)",
        ["outcome", "shards", "bytes", "rate"],
        summarize(results, transfer),
        right=(1, 2, 3),
    )
    failed = sum(not r.ok for r in results)
    untouched = progress.n_total - len(results) - len(asked)
    print(
        f"shardcache prefetch: interrupted; {len(results)} of {progress.n_total} shards done"
        + (f" ({failed} failed)" if failed else "")
        + f". The proxy keeps downloading the {len(asked)} shards being fetched into its "
        f"cache (see `shardcache stats`, in_flight); the {untouched} not yet asked for are "
        "not fetched. Run the same command again to finish: what is cached comes back as HIT.",
        file=err,
    )
    for url in asked[:20]:
        print(f"  still downloading at the proxy: {url}", file=err)
    if len(asked) > 20:
        print(f"  ... and {len(asked) - 20} more", file=err)
    return 130


def register(subparsers: SubParsersAction) -> None:
    """Add the ``prefetch`` subcommand."""
    p = subparsers.add_parser(
        "prefetch",
        help="warm a brace pattern of shards through a running proxy",
        description="GET every shard of PATTERN through the proxy, discarding the bytes, "
        "so that later readers hit the cache. PATTERN is a brace pattern of paths on the "
        "proxy (e.g. '/shards/train-{000000..000099}.tar'), of URLs of the proxy, of "
        "upstream URLs (mapped to the proxy's paths, as by plan and shardcache.proxied), "
        "of s3://bucket/key names for the S3 front, or of URLs of hosts the proxy allows. "
        "Exits 1 naming the shards that failed.",
    )
    p.add_argument("pattern", metavar="PATTERN", help="brace pattern of shard paths or URLs")
    add_proxy_option(p)
    add_option(
        p, "--concurrency", "-j", type=_positive_int, default=8, help="shards fetched at once"
    )
    add_option(
        p,
        "--timeout",
        type=_positive_float,
        default=300.0,
        help="seconds without data before a shard counts as failed",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_prefetch)
