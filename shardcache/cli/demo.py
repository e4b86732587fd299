"""``shardcache demo``: see the cache at work on this machine, no internet needed.

By default the demo runs the proxy (:func:`shardcache.cli.proxydemo.proxy_demo`): an origin and
``shardcache serve`` on 127.0.0.1, shards read through the proxy twice, cold then warm.
The library demo (``--library``) writes a few tar shards to a temporary directory, serves them from a
local HTTP origin on 127.0.0.1, and reads them through :func:`shardcache.cache_shards`
twice: the first pass downloads every shard once (and caches it), the second is served
from the cache without touching the origin.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from shardcache.cli.common import add_option
from shardcache.cli.demodata import make_shards, origin
from shardcache.compat import SubParsersAction

__all__ = ["register", "library_demo", "make_shards", "origin"]


def library_demo(
    shards: int = 8, samples: int = 250, workdir: str | Path | None = None, passes: int = 2
) -> int:
    """Run the library demo and print what happened; returns the exit code (0)."""
    from shardcache.cachestream import cache_shards
    from shardcache.store import Store
    from shardcache.tariterators import group_by_keys, tar_file_expander

    with tempfile.TemporaryDirectory(prefix="shardcache-demo-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        origin_dir, cache_dir = root / "origin", root / "cache"
        paths = make_shards(origin_dir, shards, samples)
        total = sum(p.stat().st_size for p in paths)
        print(f"made {shards} shards x {samples} samples ({total / 2**20:.1f} MiB) in {origin_dir}")
        with origin(origin_dir) as (base, counts):
            urls = [f"{base}/{p.name}" for p in paths]
            print(f"origin: {base}/demo-{{000000..{shards - 1:06d}}}.tar")
            print(f"cache:  {cache_dir}")
            for n in range(1, passes + 1):
                before = counts["requests"]
                hits_before = _hits(cache_dir)
                start = time.perf_counter()
                count = 0
                stream = cache_shards(urls, cache_dir=cache_dir)
                for _sample in group_by_keys(tar_file_expander(stream)):
                    count += 1
                elapsed = time.perf_counter() - start
                hits = _hits(cache_dir) - hits_before
                fetched = counts["requests"] - before
                print(
                    f"pass {n}: {count} samples in {elapsed:.3f} s = "
                    f"{count / elapsed:,.0f} samples/s; origin requests: {fetched}, "
                    f"cache hits: {hits}"
                )
        stats = Store(cache_dir).stats()
        print(
            f"cache holds {stats['entries']} shards, {stats['bytes'] / 2**20:.1f} MiB "
            "(1 MiB = 2^20 bytes); pass 1 fetched each shard once, every later pass is all "
            "cache hits"
        )
    return 0


def _hits(cache_dir: Path) -> int:
    from shardcache.store import Store

    if not cache_dir.exists():
        return 0
    store = Store(cache_dir)
    try:
        return sum(e.hits for e in store.entries())
    finally:
        store.close()


def _run(args: argparse.Namespace) -> int:
    if args.library:
        return library_demo(shards=args.shards, samples=args.samples, workdir=args.dir)
    from shardcache.cli.proxydemo import proxy_demo

    return proxy_demo(shards=args.shards, samples=args.samples)


def register(subparsers: SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="show the cache at work on this machine (no internet needed)",
        description="See the cache at work on this machine, no internet needed: an origin "
        "and the proxy on 127.0.0.1, shards read through it twice, cold then warm "
        "(--library: the same with cache_shards in this process).",
    )
    parser.add_argument(
        "--library",
        action="store_true",
        help="run the in-process library demo (cache_shards over a local HTTP origin)",
    )
    add_option(parser, "--shards", type=int, default=8, help="number of shards")
    add_option(parser, "--samples", type=int, default=250, help="samples per shard")
    add_option(
        parser,
        "--dir",
        default=None,
        help="library demo: keep the shards and the cache here",
        shown_default="a temp dir",
    )
    parser.set_defaults(func=_run)
