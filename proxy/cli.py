"""``shardcache serve``: the proxy daemon's command. The server itself (listening, TLS,
draining) is :mod:`proxy.server`, shared with the workers of ``--workers``
(:mod:`proxy.workers`), which this module starts: imports go cli -> workers -> server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from proxy.config import (
    SIZE_UNITS,
    Settings,
    add_serve_arguments,
    configure_logging,
    settings_from_args,
)
from proxy.server import run_server, tls_context
from proxy.workers import serve_workers
from shardcache.compat import SubParsersAction
from shardcache.errors import ConfigError, StoreUnusable

__all__ = ["register", "serve", "run_server", "tls_context"]

log = logging.getLogger("shardcache.proxy")


def register(subparsers: SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="run the caching proxy daemon",
        usage="%(prog)s --cache-dir PATH --upstream [NAME=]URL [OPTION ...]",
        description="Serve shards from upstreams through an on-disk cache. Every flag also "
        "reads SHARDCACHE_<FLAG> from the environment and a key of the --config file; the "
        "flag wins over the environment, the environment over the file. " + SIZE_UNITS,
    )
    add_serve_arguments(p)
    p.set_defaults(func=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"shardcache serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.access_log)
    from proxy import logs

    logs.install(settings)  # no credential in any line, no client's flood at ERROR
    return serve(settings)


def _limit_malloc_arenas() -> None:
    """Two glibc malloc arenas instead of up to eight per core: every pool thread that
    receives upstream bytes in 1 MiB batches otherwise gets an arena of its own that
    keeps freed batches, and the proxy's RSS grows with the number of threads rather
    than with what it holds. Left alone when MALLOC_ARENA_MAX is set."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


def serve(settings: Settings) -> int:
    """Run the proxy until SIGTERM/SIGINT; then drain for the grace period and exit 0.

    The proxy runs on asyncio's own event loop even when uvloop is installed: uvloop's
    ``loop.sendfile`` is not implemented, so hits would fall back to copying through
    Python, and bench/proxy.py measured warm throughput at about a third with uvloop.

    Exit code 2, before listening, when the settings or the cache directory cannot be
    used (the message names the flag, or the path, the uid and what to do).
    """
    _limit_malloc_arenas()
    if settings.workers > 1:
        try:
            return serve_workers(settings)
        except (ConfigError, StoreUnusable) as exc:
            print(f"shardcache serve: error: {exc}", file=sys.stderr)
            return 2
    try:
        asyncio.run(run_server(settings))
    except (ConfigError, StoreUnusable) as exc:
        print(f"shardcache serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
