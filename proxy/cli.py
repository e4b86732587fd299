"""``shardcache serve`` (the proxy daemon) and ``shardcache check`` (store repair)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import ssl
import sys
from collections.abc import Callable

from proxy.config import (
    SIZE_UNITS,
    Settings,
    add_serve_arguments,
    configure_logging,
    settings_from_args,
)
from shardcache.errors import ConfigError, StoreUnusable

__all__ = ["register", "serve", "run_server", "tls_context"]

log = logging.getLogger("shardcache.proxy")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` and ``check`` subcommands."""
    p = subparsers.add_parser(
        "serve",
        help="run the caching proxy daemon",
        description="Serve shards from upstreams through an on-disk cache. Every flag also "
        "reads SHARDCACHE_<FLAG> from the environment and a key of the --config file; the "
        "flag wins over the environment, the environment over the file. " + SIZE_UNITS,
    )
    add_serve_arguments(p)
    p.set_defaults(func=_serve_command)

    c = subparsers.add_parser(
        "check",
        help="check (and repair) a cache directory",
        description="Reconcile the "
        "store's index with its directory and report problems; exit 1 if any remain.",
    )
    c.add_argument("--cache-dir", required=True, help="the cache directory")
    c.add_argument("--fix", action="store_true", help="repair what can be repaired")
    c.add_argument(
        "--verify",
        action="store_true",
        help="also read every entry and compare its bytes with the digests recorded when "
        "it was written (reads the whole cache); with --fix, entries that differ are removed",
    )
    c.set_defaults(func=_check_command)


def _serve_command(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"shardcache serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
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
        from proxy.workers import serve_workers

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


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The server-side TLS context of ``--tls-cert``/``--tls-key`` (TLS 1.2 or later), or
    None to serve plain HTTP. ConfigError naming ``--tls-cert`` when the pair cannot be
    loaded (a file replaced or unreadable since the settings were checked)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # never ask a terminal for a passphrase: an encrypted key is an error
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            "--tls-cert",
            f"cannot load the certificate {settings.tls_cert} with the key {settings.tls_key} "
            f"(PEM, the key unencrypted and matching the certificate): {exc}",
        ) from None
    return ctx


async def run_server(
    settings: Settings,
    stop: asyncio.Event | None = None,
    *,
    worker: int | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT arrives).

    As ``worker`` N of ``serve --workers``, listen on the shared port with SO_REUSEPORT,
    plus on a private 127.0.0.1 port where followers in other workers reach the
    downloads this worker owns; call ``ready`` once listening.

    With ``--tls-cert``/``--tls-key`` the port serves HTTPS (the proxy and the S3 front
    alike); a worker's private port stays plain HTTP, on loopback only."""
    from aiohttp import web

    from proxy.app import make_app

    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=64))
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    ssl_context = tls_context(settings)
    scheme = "https" if ssl_context is not None else "http"
    app = make_app(settings)
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=settings.grace_period, handle_signals=False
    )
    await runner.setup()
    try:
        site = web.TCPSite(
            runner,
            settings.host,
            settings.port,
            backlog=1024,
            reuse_port=worker is not None,
            ssl_context=ssl_context,
        )
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                "--port", f"cannot listen on {settings.host}:{settings.port}: {exc}"
            ) from None
        if worker is None:
            for addr in runner.addresses:
                host, port = addr[0], addr[1]
                log.info("shardcache serving on %s://%s:%d", scheme, host, port)
        else:
            from proxy.app import RUNTIME

            peer = web.TCPSite(runner, "127.0.0.1", 0)  # plain HTTP: loopback, workers only
            await peer.start()
            sockets = peer._server.sockets if peer._server is not None else ()
            app[RUNTIME]["internal_port"] = sockets[0].getsockname()[1]
            log.info("worker %d (pid %d) ready", worker, os.getpid())
            if ready is not None:
                ready()
        sys.stderr.flush()
        await stop.wait()
        log.info(
            "stopping: no new connections; %.0fs for responses in flight", settings.grace_period
        )
    finally:
        await runner.cleanup()
        _ignore_further_signals(loop)
        log.info("stopped")


def _ignore_further_signals(loop: asyncio.AbstractEventLoop) -> None:
    """After the drain, a repeated SIGTERM/SIGINT must not kill the exiting process with a
    signal status: closing the loop would restore the default handlers while thread pools
    are still being joined, so take the handlers off now and ignore the signals."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass


def _check_command(args: argparse.Namespace) -> int:
    from shardcache.store import INDEX_NAME, Store

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cache_dir = args.cache_dir
    if not os.path.isdir(cache_dir):
        raise ConfigError("--cache-dir", f"{cache_dir} is not a directory")
    if not os.path.exists(os.path.join(cache_dir, INDEX_NAME)):
        raise ConfigError("--cache-dir", f"{cache_dir} has no shardcache index ({INDEX_NAME})")
    store = Store(cache_dir, reconcile=False)  # report first; repair only with --fix
    try:
        report = store.check(fix=args.fix, verify=args.verify)
    finally:
        store.close()
    print(f"cache {cache_dir}: {report.entries} entries, {report.bytes} bytes")
    if args.verify:
        print(f"verified {report.verified} entries, {report.digest_mismatch} changed on disk")
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.fixed:
        print(f"fixed: {line}")
    if report.ok:
        print("ok")
        return 0
    if args.fix and report.fixed and len(report.fixed) >= len(report.problems):
        print("repaired")
        return 0
    return 1
