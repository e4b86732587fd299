"""``shardcache dbcache build|info|export``: make, inspect and unpack a DBCache file."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tarfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

from dbcache._db import DBCache, DBCacheError
from shardcache.errors import ShardcacheError

log = logging.getLogger("shardcache.dbcache")


def register(subparsers: argparse._SubParsersAction) -> None:
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


def through_proxy(url: str, proxy: str) -> str:
    """``url`` as fetched through the proxy at ``proxy``."""
    try:
        from shardcache.urls import proxied
    except ImportError:
        return proxy.rstrip("/") + "/" + url
    try:
        return str(proxied(url, proxy))
    except ValueError as exc:
        raise DBCacheError(f"--proxy {proxy}: {exc}") from exc


def tar_samples(urls: list[str]) -> Iterator[dict[str, Any]]:
    """Samples of the tar shards at ``urls``, in order (errors raise)."""
    try:
        from shardcache.tariterators import tarfile_samples
    except ImportError:
        try:
            from webdataset.tariterators import tarfile_samples
        except ImportError as exc:
            raise DBCacheError(
                "reading tar shards needs the shardcache tar pipeline or webdataset"
            ) from exc
    return _translated(tarfile_samples(iter([{"url": url} for url in urls])), urls)


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


def build(
    db: str, urls: Iterable[str], size: int, codec: str = "safe", progress: bool = True
) -> int:
    """Fill ``db`` with ``size`` samples from the shards at ``urls``; return the count held."""
    cache = DBCache(db, size, verbose=False, codec=codec)
    held = cache.count()
    if held >= size:
        log.info("%s: already full with %d samples", db, held)
        return held
    cache.source_(tar_samples(list(urls)))
    bar = Progress(size, held, progress)
    try:
        for _ in cache:
            bar.update()
    finally:
        bar.close()
    held = cache.count()
    if held < size:
        raise DBCacheError(
            f"{db}: the shards hold only {held} distinct samples, fewer than --size {size}"
        )
    return held


def cmd_build(args: argparse.Namespace) -> int:
    _setup_logging(args.quiet)
    if args.size < 1:
        raise DBCacheError(f"--size must be at least 1, got {args.size}")
    urls = expand(args.urls)
    if args.proxy:
        urls = [through_proxy(url, args.proxy) for url in urls]
    held = build(args.db, urls, args.size, codec=args.codec, progress=not args.quiet)
    log.info("%s: %d samples from %d shard(s)", args.db, held, len(urls))
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


def export(db: str, out: str, codec: str = "safe") -> int:
    """Write the samples of ``db`` to the tar file ``out``; return the number written.

    The tar is written to ``out + ".part"`` and renamed into place when complete.
    """
    if not os.path.exists(db):
        raise DBCacheError(f"{db}: no such file")
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
    count = export(args.db, args.out, args.codec)
    log.info("%s: %d samples written to %s", args.db, count, args.out)
    return 0
