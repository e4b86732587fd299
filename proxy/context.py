"""The application's and each request's state: the ``web.AppKey`` slots, a typed
:class:`Runtime`, the per-request keys, and the small helpers every handler module
shares (waiting time, aborting a client, the one-line error answer)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.config import Settings
from proxy.daemonstore import DaemonStore
from proxy.hits import HitTier
from proxy.inflight import Inflight
from proxy.metrics import ProxyMetrics
from proxy.plans import Plans, Scheduler
from proxy.storehealth import StoreHealth
from proxy.upstream import Fetcher
from proxy.upstream_health import UpstreamHealth

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the application knows at run time besides its components."""

    sendfile: bool = True  # send hits and followers with sendfile (tests turn it off)
    ready: bool = False
    not_ready: str = ""  # why /-/readyz fails, when it does
    internal_port: int | None = None  # this worker's private loopback port (--workers)
    revalidating: dict[str, asyncio.Task] = field(default_factory=dict)  # url -> its revalidation
    scheduling: asyncio.Task | None = None  # the background downloads' task
    peers: Any = None  # the client session to other workers, made on first use
    # shutting down: when the grace period ends (loop time), the requests being answered
    # (cancelled when it ends), and the event set then or at a second signal
    deadline: float | None = None
    handlers: set[asyncio.Task] = field(default_factory=set)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    fast: Any = None  # the fast path for hits on the public port (proxy.fastpath), if on


SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", ProxyMetrics)
STORE = web.AppKey("store", DaemonStore)
FETCHER = web.AppKey("fetcher", Fetcher)
INFLIGHT = web.AppKey("inflight", Inflight)
RUNTIME = web.AppKey("runtime", Runtime)
HEALTH = web.AppKey("health", StoreHealth)
HITS = web.AppKey("hits", HitTier)
PLANS = web.AppKey("plans", Plans)
SCHEDULER = web.AppKey("scheduler", Scheduler)
S3_CLIENT = web.AppKey("s3_client", object)
CLOUD_CLIENT = web.AppKey("cloud_client", object)
UPSTREAM_HEALTH = web.AppKey("upstream_health", UpstreamHealth)
S3_FRONT = web.AppKey("s3_front", object)  # the S3 front (its middleware's object)
T_START = web.RequestKey("start", float)
T_BYTES = web.RequestKey("bytes", int)
T_RESP = web.RequestKey("resp", web.StreamResponse)
T_ABORTED = web.RequestKey("aborted", bool)
T_WAIT = web.RequestKey("wait", float)  # seconds this request waited for bytes not yet downloaded
T_PLANS = web.RequestKey("plans", list)  # the read plans this request advanced
T_READY = web.RequestKey("ready", str)  # what a planned request found: hit, downloading, miss


ADMIN_ROUTES = {
    "/metrics": "GET, HEAD",
    "/-/healthz": "GET, HEAD",
    "/-/readyz": "GET, HEAD",
    "/-/stats": "GET, HEAD",
    "/-/where": "GET, HEAD",
    "/-/prefetch": "POST",
    "/-/plans": "GET, HEAD, POST",
    "/-/cache": "DELETE",
    "/-/": "GET, HEAD",  # the status page, its files and the read-only routes it reads
    "/-/static": "GET, HEAD",
    "/-/downloads": "GET, HEAD",
    "/-/entries": "GET, HEAD",
}
DEFAULT_TYPE = "application/octet-stream"


def _error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    line = " ".join(message.split()) or "error"
    return web.Response(status=status, text=line + "\n", headers=headers)


def _waited(request: web.Request, since: float) -> None:
    """Count the time since ``since`` as this request waiting for upstream bytes."""
    request[T_WAIT] = request.get(T_WAIT, 0.0) + (time.monotonic() - since)


def _abort_client(request: web.Request) -> None:
    """Break the client connection so a truncated body cannot look like a clean end:
    with a reset (RST), not the orderly close (FIN) that ``transport.abort()`` alone
    makes. An HTTP/1.0 client's body of unknown size has no Content-Length and no chunks:
    the close is its end, so a FIN would end a body cut short cleanly."""
    request[T_ABORTED] = True
    transport = request.transport
    if transport is not None:
        abort_transport(transport)


def abort_transport(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` with a reset (RST), as :func:`_abort_client` does."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


FORWARDED = "X-Shardcache-Worker"  # a request one worker passes to the download's owner


def _forwarded(request: web.Request) -> bool:
    """A request another worker passed on (it arrived on this worker's private port)."""
    if FORWARDED not in request.headers:
        return False
    port = request.app[RUNTIME].internal_port
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return bool(port) and bool(sockname) and sockname[1] == port
