"""The proxy server: listen (HTTP, or HTTPS with ``--tls-cert``), serve the app until told
to stop, drain for the grace period. Used by ``shardcache serve`` (:mod:`proxy.cli`) for
one process and by each worker of ``--workers`` (:mod:`proxy.workers`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
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
    from proxy.fastpath import KEEPALIVE_SECONDS, FastHits, FastSite, unusable

    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=64))
    from proxy.context import RUNTIME

    guard = stop is None and threading.current_thread() is threading.main_thread()
    stop = stop or asyncio.Event()
    ssl_context = tls_context(settings)
    scheme = "https" if ssl_context is not None else "http"
    app = make_app(settings)
    runtime = app[RUNTIME]

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            stop.set()
        elif not runtime.hurry.is_set():
            log.warning("%s again: stopping now, cancelling responses and downloads", sig.name)
            runtime.hurry.set()

    # a worker of --workers hears from its parent only (SIGTERM, forwarded once for each
    # signal the parent gets): a Ctrl-C reaches the whole process group
    for sig in (signal.SIGTERM,) if worker is not None else (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    # aiohttp's own wait (for the handlers, then again after cancelling them) is a
    # fallback: the deadline below cancels what is left when the grace period ends
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=settings.grace_period + CUT_SECONDS,
        handle_signals=False,
        keepalive_timeout=KEEPALIVE_SECONDS,  # the fast path's too
    )
    await runner.setup()
    try:
        site: web.BaseSite
        why = unusable() if settings.fast_hits and ssl_context is None else None
        if why is not None:
            log.warning("the fast path for hits is off: %s", why)
        if settings.fast_hits and ssl_context is None and why is None:
            # plain GET/HEAD hits answered in front of the application, the rest handed
            # to it (proxy.fastpath)
            fast = FastHits(app, runner.server)  # type: ignore[arg-type]
            runtime.fast = fast
            site = FastSite(
                runner,
                fast,
                settings.host,
                settings.port,
                backlog=1024,
                reuse_port=worker is not None,
            )
        else:
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
            "stopping: no new connections; %gs for responses and downloads in flight "
            "(a second signal stops at once)",
            settings.grace_period,
        )
    finally:
        runtime.deadline = loop.time() + settings.grace_period
        cutter = loop.create_task(_cut_at_deadline(app), name="grace period")
        done = threading.Event()
        if guard:
            _exit_guard(runtime, done)
        try:
            await runner.cleanup()
        finally:
            cutter.cancel()
            await asyncio.gather(cutter, return_exceptions=True)
        _ignore_further_signals(loop)
        log.info("stopped")
        done.set()


CUT_SECONDS = 1.0  # past the grace period, the most any stop may take
EXIT_SECONDS = 0.5  # past the grace period, a stopped process ends even if threads are blocked


async def _cut_at_deadline(app: object) -> None:
    """When the grace period ends (or a second signal comes first), cancel the responses
    still being sent; their downloads are cancelled next, with the same deadline
    (:func:`proxy.app._lifecycle`), so nothing partial is committed."""
    from proxy.context import RUNTIME

    runtime = app[RUNTIME]  # type: ignore[index]
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(runtime.hurry.wait(), max(0.0, runtime.deadline - loop.time()))
    except asyncio.TimeoutError:
        runtime.hurry.set()
    runtime.deadline = loop.time()
    cut = [t for t in runtime.handlers if not t.done()]
    if cut:
        log.warning("cutting off %d responses in flight", len(cut))
    for t in cut:
        t.cancel("shutting down")


def _exit_guard(runtime: object, done: threading.Event) -> None:
    """End the process :data:`EXIT_SECONDS` past the grace period (or past a second
    signal) if it is still there once stopped: an upstream read blocked in a worker
    thread (waiting for headers that never come, up to --read-timeout) would otherwise
    hold the exit, joined by asyncio and by the thread pools at exit. By then the
    downloads were cancelled and their partial files deleted. A stop that has not ended
    :data:`CUT_SECONDS` past the period ends there, with status 1."""

    def watch() -> None:
        while True:
            deadline = getattr(runtime, "deadline", None)
            now = time.monotonic()
            past = now - (deadline if deadline is not None else now)
            if past >= CUT_SECONDS or (past >= EXIT_SECONDS and done.is_set()):
                break
            time.sleep(0.05)
        if done.is_set():
            log.info("upstream reads still blocked in threads are abandoned")
        else:
            log.error("not stopped %.0fs past the grace period; exiting now", CUT_SECONDS)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if done.is_set() else 1)

    threading.Thread(target=watch, name="exit guard", daemon=True).start()


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
