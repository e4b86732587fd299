"""The proxy server: listen (HTTP, or HTTPS with ``--tls-cert``), serve the app until told
to stop, drain for the grace period. Used by ``shardcache serve`` (:mod:`proxy.cli`) for
one process and by each worker of ``--workers`` (:mod:`proxy.workers`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

from proxy.config import Settings, tls_context
from shardcache.errors import ConfigError

__all__ = ["run_server", "tls_context"]

log = logging.getLogger("shardcache.proxy")


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

            # plain HTTP on a loopback port of its own, for the other workers only; the
            # socket is made here so that its port is known without the site's internals
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            peer = web.SockSite(runner, sock)
            await peer.start()
            app[RUNTIME].internal_port = sock.getsockname()[1]
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
