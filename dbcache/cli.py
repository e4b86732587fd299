"""``shardcache dbcache build|info|export``: make, inspect and unpack a DBCache file."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import logging
import os
import socket
import sqlite3
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any
from urllib.parse import urlsplit

from dbcache._db import DBCache, DBCacheError
from shardcache.compat import SubParsersAction
from shardcache.errors import ShardcacheError

log = logging.getLogger("shardcache.dbcache")


def register(subparsers: SubParsersAction) -> None:
    """Add the ``dbcache`` command and its ``build``, ``info`` and ``export`` subcommands."""
    parser = subparsers.add_parser(
        "dbcache",
        help="build, inspect or export a DBCache file (fixed validation samples in SQLite)",
        description="Build, inspect or export a DBCache file.",
    )
    sub = parser.add_subparsers(dest="dbcache_command", metavar="ACTION", required=True)

    build = sub.add_parser("build", help="fill a DBCache file from tar shards")
    build.add_argument("db", metavar="DB", help="the SQLite file to fill (created if missing)")
    build.add_argument(
        "urls", metavar="URLS", help="shard URL or brace pattern, e.g. http://h/val-{000..009}.tar"
    )
    build.add_argument("--size", type=int, required=True, help="number of samples to store")
    build.add_argument(
        "--proxy", metavar="URL", help="fetch the shards through a shardcache proxy at URL"
    )
    build.add_argument(
        "--upstream",
        metavar="URL|NAME=URL",
        action="append",
        default=[],
        help="with --proxy: the proxy's --upstream values (repeatable), so that URL/<path> "
        "is fetched as <proxy>/<path> (NAME=URL: <proxy>/NAME/<path>); without it the proxy "
        "is asked for its own (and a URL under none of them of a host it allows with "
        "--allow-host takes its absolute-URL form)",
    )
    build.add_argument(
        "--codec",
        choices=("safe", "pickle"),
        default="safe",
        help="record codec (default safe; pickle is for trusted files only)",
    )
    build.add_argument("--quiet", action="store_true", help="no progress output")
    build.set_defaults(func=cmd_build)

    info = sub.add_parser("info", help="show size, count, codec and bytes of a DBCache file")
    info.add_argument("db", metavar="DB")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.add_argument("--codec", choices=("safe", "pickle"), default="safe")
    info.set_defaults(func=cmd_info)

    export = sub.add_parser("export", help="write the stored samples to a WebDataset tar shard")
    export.add_argument("db", metavar="DB")
    export.add_argument("out", metavar="OUT.tar")
    export.add_argument(
        "--codec",
        choices=("safe", "pickle"),
        default="safe",
        help="the file's codec (pickle runs code from the file: trusted files only)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT.tar when it exists")
    export.set_defaults(func=cmd_export)


# -- build ---------------------------------------------------------------------------------


def expand(urls: str) -> list[str]:
    """The URLs of a brace pattern (``a-{000..002}.tar`` → three URLs)."""
    try:
        from shardcache.urls import expand_urls
    except ImportError:
        import braceexpand

        return list(braceexpand.braceexpand(urls))
    return list(expand_urls(urls))


def through_proxy(urls: Sequence[str], proxy: str, upstreams: Sequence[str] = ()) -> list[str]:
    """``urls`` as fetched through the proxy at ``proxy`` started with ``--upstream``
    ``upstreams``; none given: with the upstreams the proxy reports (``GET /-/where``,
    asked once), and in the absolute-URL form for the hosts it allows, as
    :func:`shardcache.proxied` maps them."""
    from shardcache.errors import ProxyURLError
    from shardcache.urls import proxied, proxy_upstreams

    ups = list(upstreams)
    absolute: bool | frozenset[str] = False
    if ups:
        named = f"--upstream {', '.join(ups)}"
        fix = (
            "give the proxy's own --upstream values (check both for a typo), or leave "
            "--upstream out to use those the proxy reports"
        )
    else:
        try:
            ups, hosts = proxy_upstreams(proxy)
        except ProxyURLError as exc:  # what failed, then this command's remedies
            raise DBCacheError(
                f"--proxy {proxy}: {str(exc).partition(';')[0]}; start it or check --proxy, "
                "or give dbcache build the proxy's --upstream values with --upstream"
            ) from None
        absolute = frozenset(hosts)
        named = f"the proxy's upstreams ({', '.join(ups) or 'none'})"
        fix = (
            "check the URL for a typo; its host is not one the proxy allows either "
            "(its --allow-host)"
        )
    out = []
    for url in urls:
        try:
            out.append(str(proxied(url, proxy, upstream=ups, absolute=absolute)))
        except ValueError as exc:
            try:
                proxied(url, proxy, upstream=ups, absolute=True)
            except ValueError:
                raise DBCacheError(f"--proxy {proxy}: {exc}") from exc
            # only the upstreams were wrong
            raise DBCacheError(f"{url} is under none of {named}: {fix}") from None
    return out


ERROR_TEXT_MAX = 300  # longer error bodies are pages, not messages


def _error_text(exc: urllib.error.HTTPError) -> str:
    """What the proxy said went wrong: its ``X-Shardcache-Error`` account of an upstream
    answer it passed on, else the body when it is one short line of text; "" for
    anything else, such as an origin's HTML error page."""
    said = exc.headers.get("X-Shardcache-Error") if exc.headers else None
    if said:
        return said.strip()[:ERROR_TEXT_MAX]
    try:
        body = exc.read(ERROR_TEXT_MAX + 1)
    except (OSError, http.client.HTTPException):
        return ""
    ctype = exc.headers.get("Content-Type", "") if exc.headers else ""
    if ctype and not ctype.startswith(("text/plain", "application/json")):
        return ""
    text = body.decode("utf-8", "replace").strip()
    if len(text) > ERROR_TEXT_MAX or "\n" in text or text.startswith("<"):
        return ""
    return text


def open_shard(url: str, timeout: float = 60.0, proxy: str | None = None) -> IO[bytes]:
    """Open one shard for reading: http(s) here, so that an error answer's text is kept
    (``HTTP 403 Forbidden: host h is not allowed (see --allow-host)``); everything else
    with :func:`shardcache.gopen.gopen`."""
    from shardcache._version import __version__
    from shardcache.gopen import HTTPStream, gopen

    if urlsplit(url).scheme.lower() not in ("http", "https"):
        return gopen(url, "rb")
    request = urllib.request.Request(url, headers={"User-Agent": f"shardcache/{__version__}"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        with exc:
            text = _error_text(exc)
        reason = f"HTTP {exc.code} {exc.reason or ''}".rstrip()
        raise DBCacheError(f"{url}: {reason}" + (f": {text}" if text else "")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        cause = getattr(exc, "reason", exc)
        if (
            isinstance(cause, ConnectionRefusedError)
            and proxy
            and url.startswith(proxy.rstrip("/"))
        ):
            raise DBCacheError(
                f"no proxy answers at {proxy}: connection refused; start one with "
                "`shardcache serve --upstream URL ...` or check --proxy"
            ) from None
        if isinstance(cause, (TimeoutError, socket.timeout)):
            raise DBCacheError(f"{url}: no answer within {timeout:g} s") from None
        text = (
            cause.strerror
            if isinstance(cause, OSError) and cause.strerror
            else str(cause) or type(cause).__name__
        )
        raise DBCacheError(f"{url}: cannot connect: {text}") from None
    return io.BufferedReader(HTTPStream(url, response, timeout), buffer_size=1 << 16)


class ShardReader:
    """The samples of the tar shards at ``urls``, in order (errors raise); ``opened``
    counts the shards read so far (a build stops reading once the file is full)."""

    def __init__(self, urls: list[str], proxy: str | None = None) -> None:
        self.urls = urls
        self.proxy = proxy
        self.opened = 0

    def _streams(self) -> Iterator[dict[str, Any]]:
        for url in self.urls:
            stream = open_shard(url, proxy=self.proxy)
            self.opened += 1
            yield {"url": url, "stream": stream}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from shardcache.tariterators import group_by_keys, tar_file_expander

        return _translated(group_by_keys(tar_file_expander(self._streams())), self.urls)


def _translated(samples: Iterable[dict[str, Any]], urls: list[str]) -> Iterator[dict[str, Any]]:
    """Re-raise a reader's errors as one ShardcacheError naming the shard."""
    try:
        yield from samples
    except ShardcacheError:
        raise
    except (OSError, tarfile.TarError, ValueError, EOFError) as exc:
        args = getattr(exc, "args", ())
        url = next((a for a in args if isinstance(a, str) and a in urls), None)
        cause = args[0] if args and isinstance(args[0], str) else str(exc) or type(exc).__name__
        where = url or "a shard of " + (urls[0] if len(urls) == 1 else f"{len(urls)} URLs")
        raise DBCacheError(f"{where}: cannot read the shard ({cause})") from exc


class Progress:
    """A rich progress bar on a terminal, else a log line every few seconds."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.total, self.n, self.enabled = total, initial, enabled
        self.bar: Any = None
        self.last = time.monotonic()
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("samples", total=total, completed=initial)
            self.bar.start()
        elif enabled:
            log.info("%d of %d samples held", initial, total)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n)
        elif self.enabled and time.monotonic() - self.last >= 2.0:
            self.last = time.monotonic()
            log.info("%d of %d samples held", self.n, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _setup_logging(quiet: bool) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING if quiet else logging.INFO,
            format="shardcache dbcache: %(message)s",
            stream=sys.stderr,
        )


def _remove_db(db: str) -> None:
    for path in (db, db + "-wal", db + "-shm", db + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def build(
    db: str,
    urls: Iterable[str],
    size: int,
    codec: str = "safe",
    progress: bool = True,
    proxy: str | None = None,
) -> tuple[int, int]:
    """Fill ``db`` with ``size`` samples from the shards at ``urls``.

    Returns (samples held, shards read). A build that fails before storing any sample
    leaves no file behind, unless ``db`` existed before. Shards that end before ``size``
    distinct samples are an error too: a file this build created is removed (the same
    shards could never fill it, and its size is fixed), one that existed keeps what it
    holds, and the message says which. A file left partly filled by another failure (a
    shard that could not be read) is kept: the same build resumes it. ``proxy`` makes
    the errors of a proxy say more.
    """
    existed = os.path.exists(db)
    cache: DBCache | None = None
    settled = False  # the file was dealt with and the error says how
    try:
        cache = DBCache(db, size, verbose=False, codec=codec)
        held = cache.count()
        if held >= size:
            log.info("%s: already full with %d samples", db, held)
            return held, 0
        reader = ShardReader(list(urls), proxy)
        cache.source_(reader)
        bar = Progress(size, held, progress)
        # The file's own advice when its source ends short ("the next pass reads the
        # source again") is for a training loop; a build makes one pass and says below
        # what came of it.
        db_log = logging.getLogger(DBCache.__module__)
        level = db_log.level
        db_log.setLevel(logging.ERROR)
        try:
            for _ in cache:
                bar.update()
        finally:
            db_log.setLevel(level)
            bar.close()
        held = cache.count()
        if held < size:
            short = f"the shards hold only {held} distinct samples, fewer than --size {size}"
            cache.close()
            settled = True
            if existed:
                raise DBCacheError(
                    f"{db}: {short}; the file keeps its {held} samples: build again with "
                    "more shards to fill it"
                )
            _remove_db(db)
            again = f"--size {held} or less, or with more shards" if held else "other shards"
            raise DBCacheError(
                f"{db}: {short}; removed the file this build created: build again with {again}"
            )
        return held, reader.opened
    except BaseException:
        if settled:
            raise
        kept = 0 if cache is None else _count_or_zero(cache)
        if cache is not None:
            cache.close()
        if not existed and kept == 0:
            _remove_db(db)
        raise


def _count_or_zero(cache: DBCache) -> int:
    try:
        return cache.count()
    except (DBCacheError, sqlite3.Error):
        return 0


def cmd_build(args: argparse.Namespace) -> int:
    _setup_logging(args.quiet)
    if args.size < 1:
        raise DBCacheError(f"--size must be at least 1, got {args.size}")
    if args.upstream and not args.proxy:
        raise DBCacheError("--upstream needs --proxy (the proxy started with those upstreams)")
    urls = expand(args.urls)
    if args.proxy:
        urls = through_proxy(urls, args.proxy, args.upstream)
    held, read = build(
        args.db,
        urls,
        args.size,
        codec=args.codec,
        progress=not args.quiet,
        proxy=args.proxy,
    )
    log.info("%s: %d samples held, %d of %d shard(s) read", args.db, held, read, len(urls))
    return 0


# -- info ----------------------------------------------------------------------------------


def describe(db: str, codec: str = "safe") -> dict[str, Any]:
    """What ``info`` shows: size, count, codec, bytes and the metadata of ``db``."""
    if not os.path.exists(db):
        raise DBCacheError(f"{db}: no such file")
    cache = DBCache(db, None, verbose=False, codec=codec)
    try:
        meta = cache.meta()
        return {
            "file": db,
            "size": cache.size,
            "count": cache.count(),
            "codec": meta.get("codec"),
            "format_version": int(meta.get("format_version", 0)),
            "bytes": cache.nbytes(),
            "file_bytes": sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p)),
            "meta": {
                k: v
                for k, v in sorted(meta.items())
                if k not in {"codec", "size", "format", "format_version"}
            },
        }
    finally:
        cache.close()


def cmd_info(args: argparse.Namespace) -> int:
    info = describe(args.db, args.codec)
    if args.json:
        print(json.dumps(info))
        return 0
    state = "full" if info["count"] >= info["size"] else "partly filled"
    print(f"file:    {info['file']}")
    print(f"size:    {info['size']}")
    print(f"count:   {info['count']} ({state})")
    print(f"codec:   {info['codec']}")
    print(f"format:  {info['format_version']}")
    print(f"bytes:   {info['bytes']} in records, {info['file_bytes']} on disk")
    for key, value in info["meta"].items():
        print(f"meta:    {key} = {value}")
    return 0


# -- export --------------------------------------------------------------------------------


def field_bytes(key: str, name: str, value: Any) -> bytes:
    """The bytes of tar member ``key.name``: bytes as they are, str as UTF-8, numpy as .npy,
    other values as JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if type(value).__module__ == "numpy":
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    try:
        return json.dumps(value).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise DBCacheError(
            f"sample {key!r} field {name!r}: a {type(value).__qualname__} has no tar form ({exc})"
        ) from None


def export(db: str, out: str, codec: str = "safe", *, force: bool = False) -> int:
    """Write the samples of ``db`` to the tar file ``out``; return the number written.

    The tar is written to ``out + ".part"`` and renamed into place when complete. An
    existing ``out`` is replaced only with ``force`` (a mistyped name could otherwise
    silently take the place of a shard or of the file itself); never ``db`` itself.
    """
    if not os.path.exists(db):
        raise DBCacheError(f"{db}: no such file")
    if os.path.exists(out):
        if os.path.samefile(db, out):
            raise DBCacheError(f"{out} is the DBCache file itself; name another tar file")
        if not force:
            raise DBCacheError(f"{out} exists; pass --force to replace it")
    cache = DBCache(db, None, verbose=False, codec=codec)
    part = out + ".part"
    count = 0
    try:
        with tarfile.open(part, "w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in cache.dbiter(shuffle=False):
                key = sample["__key__"]
                if "." in key.rsplit("/", 1)[-1]:
                    raise DBCacheError(
                        f"sample key {key!r} has a '.' in its last path component;"
                        " a tar shard cannot hold it (the reader would split the key there)"
                    )
                for name, value in sample.items():
                    if name.startswith("__"):
                        continue
                    data = field_bytes(key, name, value)
                    member = tarfile.TarInfo(f"{key}.{name}")
                    member.size = len(data)
                    member.mode = 0o444
                    member.mtime = int(time.time())
                    tar.addfile(member, io.BytesIO(data))
                count += 1
        os.replace(part, out)
    except BaseException:
        if os.path.exists(part):
            os.unlink(part)
        raise
    finally:
        cache.close()
    return count


def cmd_export(args: argparse.Namespace) -> int:
    _setup_logging(False)
    count = export(args.db, args.out, args.codec, force=args.force)
    log.info("%s: %d samples written to %s", args.db, count, args.out)
    return 0
