"""``shardcache serve --workers N``: several processes on one port, one store.

The parent checks the store (exit 2 before listening, as with one process), reserves the
port, and forks N workers. Each worker is a complete proxy (its own event loop, aiohttp
app, store handle and upstream pools) listening on the port with ``SO_REUSEPORT``, so the
kernel spreads connections over them and hits never cross a process boundary.

Misses stay at one upstream GET per object: before downloading, a worker claims the
entry in the shared index (:class:`proxy.claims_table.ClaimsTable`). A worker that finds
another worker's live claim forwards the request to that worker's private loopback port
and streams its answer (``X-Cache: COALESCED``), so every reader follows the one
download, with the same verification and abort rules. A claim of a dead worker is taken
over.

Metrics add up across workers through prometheus_client's multiprocess mode: the parent
sets ``PROMETHEUS_MULTIPROC_DIR`` to a private directory before any worker imports
prometheus_client, and removes it on exit.

With ``--tls-cert``/``--tls-key`` every worker serves HTTPS on the shared port (each
loads the certificate itself); the private loopback ports stay plain HTTP.

The parent forwards SIGTERM/SIGINT to the workers as SIGTERM, once for each signal it
gets (a second one makes them stop at once), and waits for them to drain; a worker
that dies is replaced (unless workers keep dying at startup, then the parent stops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

from proxy.config import Settings, tls_context
from proxy.daemonstore import DaemonStore
from proxy.server import run_server
from shardcache.errors import ConfigError, StoreUnusable
from shardcache.store import disk_full

__all__ = ["serve_workers"]

log = logging.getLogger("proxy.workers")

START_TIMEOUT = 60.0
FAST_DEATHS = 5  # this many deaths within FAST_DEATH_SECONDS of starting: give up
FAST_DEATH_SECONDS = 5.0


def _preflight(settings: Settings) -> None:
    """The checks a single process makes before listening, once, in the parent."""
    tls_context(settings)  # each worker loads its own; a bad pair stops all, here
    store = DaemonStore(
        settings.cache_dir,
        settings.cache_size,
        settings.eviction,
        min_free=settings.min_free,
        layout=settings.cache_layout,  # type: ignore[arg-type]
    )
    try:
        store.check_writable()
    except StoreUnusable as exc:
        if disk_full(exc) is None:
            raise
    finally:
        store.close()


def _reserve_port(settings: Settings) -> socket.socket:
    """A socket bound (not listening) to the port with SO_REUSEPORT: it holds the port,
    resolves port 0, and lets the workers bind beside it."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("--workers", "needs SO_REUSEPORT, which this system lacks")
    infos = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            "--port", f"cannot listen on {settings.host}:{settings.port}: {exc}"
        ) from None
    return sock


def _temp_parent() -> str:
    """Where the workers' metrics directory goes: tempfile's directory, unless tempfile
    fell back to the working directory (possibly the cache) because $TMPDIR, /tmp,
    /var/tmp and /usr/tmp are all unwritable, as on a read-only root filesystem."""
    try:
        tmp = tempfile.gettempdir()
    except OSError:  # not even the working directory
        tmp = ""
    named = [os.environ.get(v, "") for v in ("TMPDIR", "TEMP", "TMP")]
    named += ["/tmp", "/var/tmp", "/usr/tmp"]
    if not tmp or os.path.abspath(tmp) not in {os.path.abspath(n) for n in named if n}:
        raise ConfigError(
            "--workers",
            "no writable temporary directory for the workers' metrics files ($TMPDIR, "
            "/tmp, /var/tmp and /usr/tmp all fail): set TMPDIR to a writable directory, "
            "or mount one at /tmp (an emptyDir under readOnlyRootFilesystem)",
        )
    return tmp


def _run_worker(settings: Settings, index: int, ready_fd: int) -> None:
    """In the child: serve until SIGTERM; never returns."""
    import asyncio

    code = 0
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a Ctrl-C reaches the whole process group: the parent forwards it as SIGTERM (once
    # for each signal, the second one stopping at once), so the worker ignores its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def ready() -> None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, b"r")
            os.close(ready_fd)

    try:
        asyncio.run(run_server(settings, worker=index, ready=ready))
    except (ConfigError, StoreUnusable) as exc:
        print(f"shardcache serve: worker {index}: error: {exc}", file=sys.stderr)
        code = 2
    except BaseException:  # noqa: BLE001 - a worker reports and exits, whatever happened
        traceback.print_exc()
        code = 1
    finally:
        from proxy.logs import flush_handlers

        flush_handlers()  # the access lines kept in memory: os._exit skips logging.shutdown
        sys.stderr.flush()
        os._exit(code)


def serve_workers(settings: Settings) -> int:
    """Run ``settings.workers`` worker processes on one port until SIGTERM/SIGINT."""
    _preflight(settings)
    temp_parent = _temp_parent()
    holder = _reserve_port(settings)
    port = holder.getsockname()[1]
    settings = dataclasses.replace(settings, port=port)
    metrics_dir = tempfile.mkdtemp(prefix="shardcache-metrics-", dir=temp_parent)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    children: dict[int, tuple[int, float]] = {}  # pid -> (worker index, started)
    stopping = False
    deaths: list[float] = []

    def spawn(index: int, ready_w: int) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            holder.close()
            _run_worker(settings, index, ready_w)
        children[pid] = (index, time.monotonic())
        return pid

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            log.info("stopping %d workers", len(children))
        else:
            log.info("stopping %d workers now", len(children))
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    ready_r, ready_w = os.pipe()
    exit_code = 0
    try:
        for index in range(settings.workers):
            spawn(index, ready_w)
        os.close(ready_w)
        ready_w = -1
        got = 0
        deadline = time.monotonic() + START_TIMEOUT
        while got < settings.workers and time.monotonic() < deadline and not stopping:
            r, _, _ = select.select([ready_r], [], [], 0.2)
            if r:
                data = os.read(ready_r, 64)
                if not data:
                    break  # every worker exited before it was ready
                got += len(data)
        if got < settings.workers:
            log.error("only %d of %d workers started", got, settings.workers)
            stop(signal.SIGTERM, None)
            exit_code = 1
        else:
            log.info(
                "shardcache serving on %s://%s:%d (%d workers)",
                "https" if settings.tls_cert is not None else "http",
                settings.host,
                port,
                settings.workers,
            )
            sys.stderr.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            index, started = children.pop(pid, (None, 0.0))
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(Exception):
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(pid)
            if stopping:
                continue
            log.error("worker %d (pid %d) exited with %d; starting another", index, pid, code)
            now = time.monotonic()
            if now - started < FAST_DEATH_SECONDS:
                deaths.append(now)
            if code == 2 or len(deaths) >= FAST_DEATHS:
                log.error("workers keep failing at startup; stopping")
                exit_code = 2 if code == 2 else 1
                stop(signal.SIGTERM, None)
                continue
            r, w = os.pipe()
            spawn(index, w)
            os.close(w)
            os.close(r)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for fd in (ready_r, ready_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("stopped")
    return exit_code
