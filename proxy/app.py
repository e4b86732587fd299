"""The proxy's aiohttp application: routes, thin handlers, admin endpoints.

``make_app(settings)`` builds the application; the store, the upstream fetcher and the
download table live in ``web.AppKey`` slots and are opened/closed by ``cleanup_ctx``.
Handlers decide nothing themselves: :mod:`proxy.policy` maps paths, parses ranges and
evaluates conditional requests; :mod:`proxy.inflight` runs downloads.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiohttp import web
from braceexpand import braceexpand
from multidict import CIMultiDict
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.config import Settings
from proxy.hits import HitTier
from proxy.inflight import Download, DownloadFailed, Inflight, State
from proxy.metrics import ProxyMetrics
from proxy.plans import PLAN_HEADER, Plans, Scheduler
from proxy.policy import (
    ByteRange,
    conditional_status,
    map_request,
    map_url,
    must_revalidate_each_use,
    needs_revalidation,
    parse_range,
    range_applies,
    should_admit,
)
from proxy.s3front import S3_SERVICE_ROUTE, S3Front
from proxy.sendfile import send_file
from proxy.storehealth import StoreHealth
from proxy.upstream import Fetcher, ObjectMeta, S3Upstream, UpstreamBody
from proxy.upstream.cloud import CloudUpstream
from proxy.upstream.redirects import RedirectPolicy
from proxy.upstream.resume import can_resume
from shardcache.errors import (
    BadRequest,
    CacheError,
    Forbidden,
    IncompleteDownloadError,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    RangeNotSatisfiable,
    StoreUnusable,
    StoreWriteError,
    UpstreamError,
    error_answer,
)
from shardcache.meta import whole_body_only
from shardcache.store import Entry, Store, disk_full

__all__ = [
    "make_app",
    "SETTINGS",
    "STORE",
    "FETCHER",
    "INFLIGHT",
    "METRICS",
]

log = logging.getLogger(__name__)
access_log = logging.getLogger("shardcache.access")

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", ProxyMetrics)
STORE = web.AppKey("store", Store)
FETCHER = web.AppKey("fetcher", Fetcher)
INFLIGHT = web.AppKey("inflight", Inflight)
RUNTIME = web.AppKey("runtime", dict)
HEALTH = web.AppKey("health", StoreHealth)
HITS = web.AppKey("hits", HitTier)
PLANS = web.AppKey("plans", Plans)
SCHEDULER = web.AppKey("scheduler", Scheduler)
S3_CLIENT = web.AppKey("s3_client", object)
CLOUD_CLIENT = web.AppKey("cloud_client", object)

_RequestKey = getattr(web, "RequestKey", None)  # aiohttp >= 3.12


def _rkey(name: str, t: type) -> Any:
    return _RequestKey(name, t) if _RequestKey is not None else f"shardcache.{name}"


T_START = _rkey("start", float)
T_BYTES = _rkey("bytes", int)
T_RESP = _rkey("resp", web.StreamResponse)
T_ABORTED = _rkey("aborted", bool)
T_WAIT = _rkey("wait", float)  # seconds this request waited for bytes not yet downloaded
T_PLANS = _rkey("plans", list)  # the read plans this request advanced
T_READY = _rkey("ready", str)  # what a planned request found: hit, downloading, miss

ADMIN_ROUTES = {
    "/metrics": "GET, HEAD",
    "/-/healthz": "GET, HEAD",
    "/-/readyz": "GET, HEAD",
    "/-/stats": "GET, HEAD",
    "/-/prefetch": "POST",
    "/-/plans": "GET, HEAD, POST",
    "/-/cache": "DELETE",
}
MAX_PREFETCH = 100_000
MEMO_ENTRIES = 100_000  # entries kept in memory for hits, shared out among the workers
RAM_TIER_BYTES = 32 << 20  # small entries' bytes kept in RAM, shared out among the workers
DEFAULT_TYPE = "application/octet-stream"


# ---------------------------------------------------------------------------------------
# application


def make_app(settings: Settings, *, sendfile: bool = True) -> web.Application:
    """Build the proxy application for ``settings`` (store opened on startup)."""
    s3 = None
    if any(u.base.startswith("s3://") for u in settings.upstreams):
        # Started lazily on first use: credentials resolve inside the running loop.
        s3 = S3Upstream(
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            profile=settings.s3_profile,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_connections=max(64, 2 * settings.parallel),
        )
    cloud = None
    if any(u.base.startswith(("gs://", "az://")) for u in settings.upstreams):
        cloud = CloudUpstream(
            gcs_endpoint_url=settings.gcs_endpoint_url,
            azure_endpoint_url=settings.azure_endpoint_url,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_connections=max(64, 2 * settings.parallel),
        )
    front = S3Front(
        buckets={u.name: u.base for u in settings.upstreams if u.name},
        s3=s3,
        cloud=cloud,
        access_key=settings.s3_front_access_key,
        secret_key=settings.s3_front_secret_key,
        region=settings.s3_region or "us-east-1",
        domains=settings.s3_domains,
        catch_all=any(not u.name for u in settings.upstreams),
    )
    if not settings.admin_token and not loopback_only(settings.host):
        log.warning(
            "listening on %s without --admin-token: POST /-/prefetch, /-/plans and DELETE "
            "/-/cache "
            "answer 403 until a token is set (env SHARDCACHE_ADMIN_TOKEN)",
            settings.host,
        )
    app = web.Application(middlewares=[_observe, front.middleware], client_max_size=4 << 20)
    app.on_response_prepare.append(front.on_prepare)
    app[S3_CLIENT] = s3
    app[CLOUD_CLIENT] = cloud
    app[SETTINGS] = settings
    app[METRICS] = ProxyMetrics()
    app[RUNTIME] = {"ready": False, "sendfile": sendfile}
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    prom = make_aiohttp_handler(app[METRICS].exposed, disable_compression=True)

    async def metrics_handler(request: web.Request) -> web.StreamResponse:
        await _refresh_gauges(request.app)
        return await prom(request)

    r = app.router
    r.add_get("/metrics", metrics_handler)
    r.add_get("/-/healthz", _healthz)
    r.add_get("/-/readyz", _readyz)
    r.add_get("/-/stats", _stats)
    r.add_post("/-/prefetch", _prefetch)
    r.add_get("/-/plans", _plans_list)
    r.add_post("/-/plans", _plans_add)
    r.add_get("/-/plans/{id}", _plans_get)
    r.add_delete("/-/plans/{id}", _plans_delete)
    r.add_delete("/-/cache", _purge)
    r.add_route("*", "/{tail:.*}", _shard)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    m = app[METRICS]

    def on_evict(entry: Entry) -> None:
        m.evictions.inc()
        m.evicted_bytes.inc(entry.size)

    def open_store() -> tuple[Store, StoreWriteError | None]:
        st = Store(
            s.cache_dir,
            s.cache_size,
            s.eviction,
            on_evict,  # type: ignore[arg-type]
            min_free=s.min_free,
            memo_entries=MEMO_ENTRIES // s.workers,  # the bounds are per proxy, not per worker
        )
        try:
            st.check_writable()  # StoreUnusable (exit 2) before listening
        except StoreUnusable as exc:
            full = disk_full(exc)
            if full is None:
                raise
            return st, full  # writable but full: start passing through, probe for room
        return st, None

    store, full = await asyncio.to_thread(open_store)
    if store.size_warning:
        log.warning("%s", store.size_warning)
    m.cache_limit.set(store.cache_size)
    health = StoreHealth(store, m, s.store_probe_interval)
    if full is not None:
        health.failed(full)
    fetcher = Fetcher(
        connect_timeout=s.connect_timeout,
        read_timeout=s.read_timeout,
        retries=s.retries,
        retry_backoff=s.retry_backoff,
        chunk_size=s.chunk_size,
        observe=m.observe_upstream,
        on_bytes=m.upstream_bytes.inc,
        part_size=s.part_size,
        parallel=s.parallel,
        http_parts=s.http_parts,
        threaded=s.http_transport == "threads",
        s3=app[S3_CLIENT],  # type: ignore[arg-type]
        cloud=app[CLOUD_CLIENT],  # type: ignore[arg-type]
        redirects=RedirectPolicy(hosts=s.redirect_hosts, max_hops=s.max_redirects),
    )
    app[STORE] = store
    app[FETCHER] = fetcher
    app[HEALTH] = health
    app[HITS] = HitTier(store, max_bytes=RAM_TIER_BYTES // s.workers)
    app[INFLIGHT] = Inflight(store, fetcher, m, cache_size=store.cache_size, health=health)
    app[RUNTIME]["revalidating"] = {}
    plans = Plans(
        store,
        m,
        ttl=s.plan_ttl,
        default_lookahead=s.plan_lookahead,
        max_plans=s.max_plans,
        max_shards=s.max_plan_shards,
        shared=s.workers > 1,
    )
    store.planner = plans.planner
    app[PLANS] = plans

    async def start(url: str, reason: str) -> Download | None:
        return await _background(app, url, reason)

    app[SCHEDULER] = Scheduler(
        plans, store, app[INFLIGHT], m, concurrency=s.prefetch_concurrency, start=start
    )
    loop = asyncio.get_running_loop()
    background = loop.create_task(health.run(), name="store health")
    scheduling = loop.create_task(app[SCHEDULER].run(), name="background downloads")
    app[RUNTIME]["scheduling"] = scheduling
    app[RUNTIME]["ready"] = True
    log.info(
        "cache %s: limit %d bytes, %d kept free, policy %s, revalidate %s; upstreams: %s",
        s.cache_dir,
        store.cache_size,
        store.min_free,
        s.eviction,
        "never"
        if s.revalidate is None
        else ("always" if s.revalidate == 0 else f"after {s.revalidate:g}s"),
        ", ".join(str(u) for u in s.upstreams) or "(none)",
    )
    try:
        yield
    finally:
        app[RUNTIME]["ready"] = False
        app[RUNTIME]["not_ready"] = "shutting down: downloads are finishing"
        tasks = [background, scheduling]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        store.planner = None
        # downloads get up to the grace period (at most 10 s) to verify and commit
        await app[INFLIGHT].stop(finish_within=min(s.grace_period, 10.0))
        await fetcher.close()
        peers = app[RUNTIME].get("peers")
        if peers is not None:
            await peers.close()
        await asyncio.to_thread(store.close)


async def _on_shutdown(app: web.Application) -> None:
    app[RUNTIME]["ready"] = False
    app[RUNTIME]["not_ready"] = "shutting down: finishing the responses in flight"
    # no new background downloads while responses drain; those no client follows go
    scheduling = app[RUNTIME].get("scheduling")
    if scheduling is not None:
        scheduling.cancel()
        await asyncio.gather(scheduling, return_exceptions=True)
    if SCHEDULER in app:
        await app[SCHEDULER].stop()


# ---------------------------------------------------------------------------------------
# middleware: error bodies, access log, request metrics


def _error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    line = " ".join(message.split()) or "error"
    return web.Response(status=status, text=line + "\n", headers=headers)


@web.middleware
async def _observe(request: web.Request, handler: Any) -> web.StreamResponse:
    start = time.monotonic()
    request[T_START] = start
    request[T_BYTES] = 0
    resp: web.StreamResponse | None = None
    note = ""
    try:
        try:
            resp = await handler(request)
        except ProxyError as exc:
            headers = getattr(exc, "headers", None)
            if isinstance(exc, MethodNotAllowed):
                headers = {"Allow": getattr(exc, "allow", "GET, HEAD")}
            status, _ = error_answer(exc)
            if status == 401:
                headers = {"WWW-Authenticate": 'Bearer realm="shardcache"'}
            resp = _error_response(status, str(exc), headers)
        except web.HTTPException as exc:
            resp = _error_response(exc.status, exc.text or exc.reason, None)
        except DownloadFailed as exc:  # failed before this response started
            resp = _error_response(502, f"upstream failed: {exc}")
        except ConnectionError:
            note = " client-gone"
            resp = request.get(T_RESP)
            if resp is None:
                raise
        if request.get(T_ABORTED):
            note = " aborted"
        return resp
    finally:
        status = resp.status if resp is not None else 500
        cache = (resp.headers.get("X-Cache") if resp is not None else None) or "NONE"
        nbytes = request[T_BYTES]
        if resp is not None and not resp.prepared and isinstance(resp, web.Response):
            nbytes = 0 if request.method == "HEAD" else len(resp.body or b"")
        duration = time.monotonic() - start
        route = _service_route(request)
        if _forwarded(request):
            note += " for-worker"  # counted by the worker that received it
        elif route is not None:
            request.app[METRICS].observe_service(route, status)
        else:
            request.app[METRICS].observe_request(cache, status, nbytes)
            _account_wait(request, nbytes)
        access_log.log(
            logging.DEBUG if route in PROBES and status < 400 else logging.INFO,
            '%s "%s %s" %d %s %d %.3fs%s',
            request.remote,
            request.method,
            request.raw_path,
            status,
            cache,
            nbytes,
            duration,
            note,
        )


PROBES = frozenset({"healthz", "readyz", "metrics"})  # logged at DEBUG when they pass


def _waited(request: web.Request, since: float) -> None:
    """Count the time since ``since`` as this request waiting for upstream bytes."""
    request[T_WAIT] = request.get(T_WAIT, 0.0) + (time.monotonic() - since)


def _account_wait(request: web.Request, nbytes: int) -> None:
    """At the end of a data request: its stall and its read plans' progress."""
    m = request.app[METRICS]
    wait = request.get(T_WAIT, 0.0)
    if wait:
        m.client_wait.inc(wait)
    plans = request.get(T_PLANS)
    if not plans:
        return
    ready = request.get(T_READY, "miss")
    m.plan_requests.labels(ready=ready).inc()
    now = time.monotonic()
    for plan in plans:
        plan.wait_seconds += wait
        plan.note_read(nbytes, now, hit=ready == "hit")


def _service_route(request: web.Request) -> str | None:
    """The proxy's own route a request went to (metrics, health, admin, S3 listings),
    counted apart from data requests so that hit ratios count shard reads only; None for
    a data request."""
    path = request.path
    if path == "/metrics":
        return "metrics"
    if path.startswith("/-/"):
        name = path[3:].partition("/")[0]
        return name if f"/-/{name}" in ADMIN_ROUTES else "other"
    return request.get(S3_SERVICE_ROUTE)


def _abort_client(request: web.Request) -> None:
    """Break the client connection so a truncated body cannot look like a clean end."""
    request[T_ABORTED] = True
    transport = request.transport
    if transport is not None:
        transport.abort()


# ---------------------------------------------------------------------------------------
# shards


async def _shard(request: web.Request) -> web.StreamResponse:
    s = request.app[SETTINGS]
    raw = request.raw_path
    path_only = raw.partition("?")[0]
    if path_only.startswith("/-/") or path_only == "/metrics":
        if path_only in ADMIN_ROUTES:
            exc = MethodNotAllowed(f"method {request.method} not allowed on {path_only}")
            exc.allow = ADMIN_ROUTES[path_only]  # type: ignore[attr-defined]
            raise exc
        raise NotFound(f"no admin route {path_only}")
    if request.method not in ("GET", "HEAD"):
        raise MethodNotAllowed(f"method {request.method} not allowed; use GET or HEAD")
    url = map_request(raw, s.upstreams, s.allow_hosts, s.max_path_length)
    if path_only.endswith("/") and len(path_only) > 1:
        # a directory (listing), not a shard: forwarded with its slash, never cached
        base, sep, query = url.partition("?")
        return await _serve_bypass(
            request, (base if base.endswith("/") else base + "/") + sep + query
        )
    store = request.app[STORE]
    inflight = request.app[INFLIGHT]
    plans = request.app[PLANS]
    plan_id = request.headers.get(PLAN_HEADER)
    if plan_id and plans.shared and plan_id not in plans and not _forwarded(request):
        await plans.learn(plan_id)  # registered through another worker a moment ago
    if len(plans) and not _forwarded(request):  # counted by the worker it came to
        matched = plans.on_request(url, plan_id)
        if matched:
            request[T_PLANS] = matched
    for _ in range(3):
        dl = inflight.get(url)
        cache = "COALESCED"
        request[T_READY] = "downloading"
        if dl is None:
            request[T_READY] = "hit"
            try:
                entry = store.lookup(url)
            except CacheError as exc:  # the index cannot be read: answer from the upstream
                log.error("cache lookup of %s failed, passing it through: %s", url, exc)
                return await _serve_bypass(request, url)
            if entry is not None and (
                needs_revalidation(s.revalidate, entry.validated, time.time())
                or must_revalidate_each_use(entry.meta.cache_control)
            ):
                entry = await _revalidate(request, url, entry)
            if entry is not None:
                resp = await _serve_hit(request, entry)
                if resp is not None:
                    return resp
                # evicted (or replaced) by another process between lookup and open: drop
                # a row whose file is gone or has another size, then look again
                store.forget(entry.key)
                await asyncio.to_thread(store.get, url, touch=False)
                store.forget(entry.key)
                continue
            request[T_READY] = "miss"
            if not request.app[HEALTH].writable:
                return await _serve_bypass(request, url)
            resp = await _serve_cold(request, url)
            if resp is not None:
                return resp
            claimed = False
            if s.workers > 1 and not _forwarded(request):
                # one download per object across the workers of this port
                try:
                    state, owner = await asyncio.to_thread(
                        store.claim, url, request.app[RUNTIME].get("internal_port")
                    )
                except CacheError as exc:
                    log.warning("cannot claim %s, downloading it here: %s", url, exc)
                    state, owner = "mine", None
                if state == "cached":
                    continue
                if state == "owner" and owner is not None:
                    resp = await _forward(request, owner)
                    if resp is not None:
                        return resp
                    continue  # the owner is gone: its claim is taken over next time
                claimed = state == "mine"
            dl = inflight.get(url)
            if dl is None:
                dl = inflight.start(url, claimed=claimed)
                cache = "MISS"
            elif claimed:
                # started meanwhile by another request of this worker, under the same claim
                dl.hold_claim()
        if dl.verified:
            cache = "HIT"  # every byte is local already; only the commit is pending
            request[T_READY] = "hit"
        try:
            return await _serve_download(request, dl, cache)
        finally:
            dl.release()
    raise UpstreamError(f"{url}: entry keeps disappearing; try again")


FORWARDED = "X-Shardcache-Worker"  # a request one worker passes to the download's owner
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    }
)


def _forwarded(request: web.Request) -> bool:
    """A request another worker passed on (it arrived on this worker's private port)."""
    if FORWARDED not in request.headers:
        return False
    port = request.app[RUNTIME].get("internal_port")
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return bool(port) and bool(sockname) and sockname[1] == port


async def _forward(request: web.Request, port: int) -> web.StreamResponse | None:
    """Let the worker that owns the download of this request's object answer it, and
    stream its answer. None when that worker cannot be reached (it died)."""
    import aiohttp

    session = request.app[RUNTIME].get("peers")
    if session is None:
        session = request.app[RUNTIME]["peers"] = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None),
            connector=aiohttp.TCPConnector(limit=0),
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers[FORWARDED] = str(os.getpid())
    request[T_READY] = "downloading"  # another worker's download, followed from here
    since = time.monotonic()
    try:
        peer = await session.request(
            request.method,
            f"http://127.0.0.1:{port}{request.raw_path}",
            headers=headers,
            allow_redirects=False,
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.info("worker on port %d unreachable (%s); taking over", port, exc)
        return None
    finally:
        _waited(request, since)
    async with peer:
        out = {k: v for k, v in peer.headers.items() if k.lower() not in _HOP_BY_HOP}
        if out.get("X-Cache") == "MISS":
            out["X-Cache"] = "COALESCED"  # this client joined another's download
        resp = web.StreamResponse(status=peer.status, reason=peer.reason, headers=out)
        if "Content-Length" in peer.headers:
            resp.content_length = int(peer.headers["Content-Length"])
        request[T_RESP] = resp
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
            return resp
        try:
            chunks = aiter(peer.content.iter_chunked(1 << 20))
            while True:
                since = time.monotonic()
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                finally:
                    _waited(request, since)
                await resp.write(chunk)
                request[T_BYTES] += len(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # the owner aborted (its download failed) or died: never end cleanly
            log.warning(
                "aborting %s %s: worker answer cut: %s", request.method, request.raw_path, exc
            )
            _abort_client(request)
            return resp
        await resp.write_eof()
        return resp


async def _revalidate(request: web.Request, url: str, entry: Entry) -> Entry | None:
    """Ask the upstream whether an aged entry is current (one request however many
    clients ask at once). The entry when it is (a 304); None when it changed (it is
    removed, the caller fetches the new version like a miss); NotFound when it is gone.
    When the upstream cannot answer, the cached copy is served (and a warning logged)."""
    app = request.app
    pending: dict[str, asyncio.Task] = app[RUNTIME]["revalidating"]
    task = pending.get(url)
    if task is None:
        task = asyncio.get_running_loop().create_task(_ask_upstream(app, url, entry))
        pending[url] = task
        task.add_done_callback(lambda _: pending.pop(url, None))
    return await asyncio.shield(task)


async def _ask_upstream(app: web.Application, url: str, entry: Entry) -> Entry | None:
    m, store = app[METRICS], app[STORE]
    try:
        result = await app[FETCHER].revalidate(url, entry.meta)
    except ProxyError as exc:
        m.revalidations.labels(result="error").inc()
        log.warning("cannot revalidate %s (%s); serving the cached copy", url, exc)
        return entry
    m.revalidations.labels(result=result).inc()
    if result == "fresh":
        return store.mark_validated(entry)
    log.info("%s %s at the upstream; dropping the cached copy", url, result)
    store.forget(entry.key)
    try:
        await asyncio.to_thread(store.remove, url)
    except CacheError as exc:
        err = app[HEALTH].classify("index", exc)
        if err is not None:
            app[HEALTH].failed(err)
    if result == "gone":
        raise NotFound(f"upstream {url} is gone; removed from the cache")
    return None


async def _serve_hit(request: web.Request, entry: Entry) -> web.StreamResponse | None:
    """Serve a hit; None when the entry file turned out missing or replaced (the caller
    forgets the entry and looks again)."""
    body = _EntryBody(request, entry)
    if not body.open():
        return None
    # how long ago the upstream last vouched for these bytes (RFC 9111 5.1)
    age = {"Age": str(max(0, int(time.time() - entry.validated)))}
    return await _answer(request, entry.meta, "HIT", entry.size, body, age)


async def _serve_download(request: web.Request, dl: Download, cache: str) -> web.StreamResponse:
    if dl.state is State.OPENING:
        since = time.monotonic()
        try:
            await dl.wait_headers()
        finally:
            _waited(request, since)
    if dl.state is State.BYPASS:
        return await _serve_bypass(request, dl.url, dl)
    return await _answer(request, dl.meta, cache, dl.known_size, _DownloadBody(dl))


async def _serve_bypass(
    request: web.Request, url: str, dl: Download | None = None
) -> web.StreamResponse:
    """Stream ``url`` from the upstream to this client alone, uncached (X-Cache: BYPASS):
    the body a bypassed download already opened, or a request of its own."""
    fetcher = request.app[FETCHER]
    body: UpstreamBody | None = None
    if request.method == "GET" or dl is None:
        body = dl.take_bypass_body() if dl is not None else None
        if body is None:
            since = time.monotonic()
            try:
                body = await fetcher.open(url)
            finally:
                _waited(request, since)
    try:
        meta: ObjectMeta = body.meta if body is not None else dl.meta  # type: ignore[union-attr]
        source = _NoBody() if body is None else _ChunkBody(body.chunks())
        return await _answer(request, meta, "BYPASS", meta.size, source)
    finally:
        if body is not None:
            body.close()


# ---------------------------------------------------------------------------------------
# one response path: _answer decides, a body source sends


def _decide(
    request: web.Request, size: int | None, etag: str | None, last_modified: str | None
) -> tuple[int | None, ByteRange | None]:
    """(status for a bodiless answer or None, byte range or None for the whole object)."""
    cond = conditional_status(request.method, request.headers, etag, last_modified)
    if cond is not None:
        return cond, None
    rng = request.headers.get("Range")
    if rng is None or size is None or not range_applies(request.headers, etag, last_modified):
        return None, None
    try:
        return None, parse_range(rng, size)
    except RangeNotSatisfiable as exc:
        exc.headers = {"Content-Range": f"bytes */{size}"}  # type: ignore[attr-defined]
        raise


def _first_byte(request: web.Request, cache: str) -> None:
    """Observe this request's time to first byte."""
    request.app[METRICS].ttfb.labels(cache=cache).observe(time.monotonic() - request[T_START])


async def _answer(
    request: web.Request,
    meta: ObjectMeta,
    cache: str,
    size: int | None,
    body: _Body,
    extra: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Answer with version ``meta`` of the object (``size`` bytes, None while unknown)
    and its bytes from ``body``: headers built, conditionals and Range decided (a 304/412
    without a body, RangeNotSatisfiable for a 416), the response prepared, the byte range
    sent and the response ended — or the connection aborted when ``body`` reports a
    cut. ``body`` is closed when the answer ends."""
    try:
        own = {"X-Cache": cache, "Accept-Ranges": "bytes"}
        if meta.etag:
            own["ETag"] = meta.etag
        if meta.last_modified:
            own["Last-Modified"] = meta.last_modified
        own.update(extra or {})
        cond, brange = _decide(request, size, meta.etag, meta.last_modified)
        if cond == 304:
            return web.Response(status=304, headers=_with_fields(meta, own, NOT_MODIFIED_FIELDS))
        if cond is not None:
            return _error_response(412, "precondition failed", own)
        # the upstream's type as it was sent: web.Response(content_type=) refuses one
        # with parameters ("text/plain; charset=utf-8")
        own["Content-Type"] = meta.content_type or DEFAULT_TYPE
        status, start, end = 200, 0, size
        if brange is not None:
            status, start, end = 206, brange.start, brange.end + 1
            own["Content-Range"] = brange.content_range
        headers = _with_fields(meta, own, None, whole=brange is None)
        if body.data is not None:
            resp: web.StreamResponse = web.Response(
                body=body.data[start:end], status=status, headers=headers
            )
            _first_byte(request, cache)
            return resp
        resp = web.StreamResponse(status=status, headers=headers)
        if end is not None:
            resp.content_length = end - start  # else chunked
        request[T_RESP] = resp
        await resp.prepare(request)
        if request.method == "HEAD" or start == end:
            await resp.write_eof()
            return resp
        cut = await body.send(request, resp, start, end, lambda: _first_byte(request, cache))
        if cut is not None:
            log.warning("aborting %s %s: %s", request.method, request.raw_path, cut)
            _abort_client(request)
            return resp
        await resp.write_eof()
        return resp
    finally:
        body.close()


# the stored fields a 304 carries (RFC 9110 15.4.5); the rest describe a body it lacks
NOT_MODIFIED_FIELDS = frozenset({"cache-control", "content-location", "date", "expires", "vary"})


def _with_fields(
    meta: ObjectMeta,
    own: dict[str, str],
    only: frozenset[str] | None,
    *,
    whole: bool = True,
) -> CIMultiDict[str]:
    """The answer's headers: the upstream's stored end-to-end fields (those in ``only``
    when given; on a part of the body, none that describes the whole body), then the
    proxy's own (``own``), which replace fields of the same name."""
    out: CIMultiDict[str] = CIMultiDict()
    mine = {k.lower() for k in own}
    for k, v in meta.fields:
        low = k.lower()
        if low in mine:
            continue
        if only is not None and low not in only:
            continue
        if not whole and whole_body_only(k):
            continue
        out.add(k, v)
    out.update(own)
    return out


class _Body:
    """Where the bytes of an answer come from. :func:`_answer` decides the response
    (headers, conditionals, Range, HEAD, an empty body) and hands the byte range to
    :meth:`send`; a source whose bytes are all in memory sets ``data`` and is answered
    as one ``web.Response`` instead."""

    data: bytes | None = None

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        """Send the object's bytes ``[start, end)`` (``end`` None: to its end) through the
        prepared ``resp``, count them in ``request[T_BYTES]`` and call ``first_byte()``
        as the first one goes out. None when every byte went out; otherwise why the body
        was cut, and the caller aborts the connection (never a clean end)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _NoBody(_Body):
    """The body of an answer that has none (HEAD without an upstream body)."""


class _EntryBody(_Body):
    """A cache entry: a small one from the RAM tier (one ``web.Response``, no
    streaming), a larger one from its file with ``sendfile`` on the loop."""

    def __init__(self, request: web.Request, entry: Entry):
        self.tier = request.app[HITS]
        self.entry = entry
        self.fobj: Any = None

    def open(self) -> bool:
        """Find the entry's bytes (and record the access); False when its file is gone
        or replaced."""
        tier, entry = self.tier, self.entry
        if tier.cacheable(entry):
            self.data = tier.small(entry)
            if self.data is None:
                self.data = tier.load(entry)
            found = self.data is not None
        else:
            self.fobj = tier.open(entry)
            found = self.fobj is not None
        if found:
            tier.store.touch(entry)
        return found

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        count = (self.entry.size if end is None else end) - start
        first_byte()
        sent = await _send_file(request, resp, self.fobj, start, count)
        return None if sent == count else f"entry file ended at byte {start + sent}"

    def close(self) -> None:
        if self.fobj is not None:
            self.fobj.close()


class _DownloadBody(_Body):
    """A download in progress: the written prefix of its ``.part`` file by threaded
    ``sendfile`` (``write`` when the response is chunked), the object's last byte held
    back until the entry is committed; a range far ahead of the download straight from
    the upstream."""

    def __init__(self, dl: Download):
        self.dl = dl

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        dl = self.dl
        if (
            end is not None
            and dl.state is State.STREAMING
            and start > dl.written + DIRECT_RANGE_AHEAD
            and can_resume(dl.meta)
        ):
            # far ahead of the download: read this version's bytes straight from the upstream
            chunks = request.app[FETCHER].read_range(dl.url, start, end, meta=dl.meta)
            return await _ChunkBody(chunks, start).send(request, resp, start, end, first_byte)

        async def write(data: bytes) -> None:
            await resp.write(data)
            request[T_BYTES] += len(data)

        async def send(fobj: Any, offset: int, count: int) -> int:
            return await _send_file(request, resp, fobj, offset, count, threaded=True)

        # followers send the written prefix of the .part file straight from the page cache;
        # a chunked response (size unknown) needs the writer's framing, so it gets write()
        framed = resp.content_length is None
        try:
            await dl.stream(
                write,
                start,
                end,
                first_byte,
                send=None if framed else send,
                on_wait=lambda since: _waited(request, since),
            )
        except DownloadFailed as exc:
            return str(exc)
        return None


class _ChunkBody(_Body):
    """An upstream body streamed to one client; its first chunk starts at the object's
    byte ``first``. The wait for every chunk counts as the client waiting."""

    def __init__(self, chunks: AsyncIterator[bytes], first: int = 0):
        self.chunks = chunks
        self.first = first

    async def send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        start: int,
        end: int | None,
        first_byte: Callable[[], None],
    ) -> str | None:
        lo = start - self.first
        hi = None if end is None else end - self.first
        pos = 0
        first = True
        it = aiter(self.chunks)
        try:
            while True:
                since = time.monotonic()
                try:
                    chunk = await anext(it)
                except StopAsyncIteration:
                    break
                finally:
                    _waited(request, since)
                a, b = pos, pos + len(chunk)
                pos = b
                if b <= lo:
                    continue
                piece = chunk[max(0, lo - a) : (len(chunk) if hi is None else max(0, hi - a))]
                if piece:
                    if first:
                        first = False
                        first_byte()
                    await resp.write(piece)
                    request[T_BYTES] += len(piece)
                if hi is not None and pos >= hi:
                    break
        except (IncompleteDownloadError, ProxyError) as exc:
            request.app[METRICS].failed_downloads.inc()
            return str(exc)
        if hi is not None and pos < hi:
            return f"upstream ended at byte {self.first + pos}"
        return None


async def _send_file(
    request: web.Request,
    resp: web.StreamResponse,
    fobj: Any,
    offset: int,
    count: int,
    *,
    threaded: bool = False,
) -> int:
    """Send ``count`` bytes of ``fobj`` from ``offset``: ``sendfile`` on a plain transport,
    else (TLS, no native sendfile, ``sendfile=False``) ``pread`` into ``resp.write``.
    ``threaded``: each ``sendfile`` call on a worker thread (followers of a download: many
    clients copying at once spread over the cores; measured 1.13 s against 1.50 s for 16
    clients of one cold 256 MiB shard) rather than on the event loop (hits: one call
    usually sends it all, and the thread hop costs more than it spreads: 1 MiB hits at
    0.58x nginx threaded against 0.80x on the loop).

    Returns the bytes sent; fewer than ``count`` only when the file ended early, in which
    case the client connection has been aborted (never a clean end). The response must
    not be chunked: sendfile bypasses the writer's framing.
    """
    loop = asyncio.get_running_loop()
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client gone")
    if request.app[RUNTIME]["sendfile"]:
        try:
            sent = await send_file(transport, fobj, offset, count) if threaded else None
            if sent is None:
                sent = await loop.sendfile(transport, fobj, offset, count, fallback=False)
            request[T_BYTES] += sent
            if sent < count:
                _abort_client(request)  # the file shrank under us: never end cleanly
            return sent
        except (NotImplementedError, RuntimeError):
            pass
    fd = fobj.fileno()
    pos, end = offset, offset + count
    while pos < end:
        data = await loop.run_in_executor(None, os.pread, fd, min(1 << 20, end - pos), pos)
        if not data:
            _abort_client(request)  # the file shrank under us: never end cleanly
            break
        await resp.write(data)
        pos += len(data)
        request[T_BYTES] += len(data)
    return pos - offset


# ---------------------------------------------------------------------------------------
# cold requests answered at their own cost

DIRECT_RANGE_AHEAD = 4 << 20  # a range this far past a download's bytes is read directly

_CONDITIONALS = (
    "If-Range",
    "If-Match",
    "If-None-Match",
    "If-Modified-Since",
    "If-Unmodified-Since",
)


def _range_start(header: str) -> int | None:
    """Where a single ``bytes=`` range starts (-1 for a suffix range); None when the
    header is not one such range (several ranges, another unit: the download serves it)."""
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    first = spec.partition("-")[0].strip()
    if not first:
        return -1
    return int(first) if first.isdigit() else None


async def _serve_cold(request: web.Request, url: str) -> web.StreamResponse | None:
    """Answer a request for an object neither cached nor downloading without waiting
    for a download: HEAD from an upstream HEAD; a Range that starts past the first few
    MiB from a ranged upstream GET (a 416 from the object's size, with no body fetched),
    the download of the whole object starting meanwhile. None: the caller starts (or
    joins) the download as usual."""
    if request.method == "HEAD":
        since = time.monotonic()
        try:
            meta = await request.app[FETCHER].head(url)
        except (UpstreamError, ProxyError) as exc:
            if exc.status_hint in (405, 501):
                return None  # an origin without HEAD: the download answers
            raise
        finally:
            _waited(request, since)
        return await _answer(request, meta, "MISS", meta.size, _NoBody())
    header = request.headers.get("Range")
    if request.method != "GET" or header is None:
        return None
    if any(h in request.headers for h in _CONDITIONALS):
        return None
    start = _range_start(header)
    if start is None or 0 <= start < DIRECT_RANGE_AHEAD:
        return None
    since = time.monotonic()
    try:
        answer = await request.app[FETCHER].open_range(url, header)
    finally:
        _waited(request, since)
    try:
        meta = answer.meta
        if should_admit(meta.size, request.app[INFLIGHT].cache_size):
            await _start_background(request, url)
        # the upstream's answer starts at the range's first byte, or at 0 when it ignored Range
        first = 0 if answer.brange is None else answer.wanted.start
        source = _ChunkBody(answer.body.chunks(), first)
        return await _answer(request, meta, "MISS", meta.size, source)
    finally:
        answer.body.close()


async def _start_background(request: web.Request, url: str) -> None:
    """Start downloading ``url`` for the cache (no client follows it), once per object
    across the workers of this port."""
    dl = await _background(request.app, url, "demand", forwarded=_forwarded(request))
    if dl is not None:
        dl.release()


async def _background(
    app: web.Application, url: str, reason: str, *, forwarded: bool = False
) -> Download | None:
    """Start downloading ``url`` for the cache, no client following it, once per object
    across the workers of this port; the download (acquired for the caller), or None
    when it runs already, is cached, or the store takes no writes."""
    inflight = app[INFLIGHT]
    if inflight.running(url) or not app[HEALTH].writable:
        return None
    claimed = False
    if app[SETTINGS].workers > 1 and not forwarded:
        try:
            state, _ = await asyncio.to_thread(
                app[STORE].claim, url, app[RUNTIME].get("internal_port")
            )
        except CacheError:
            return None
        if state != "mine":
            return None
        claimed = True
    if inflight.running(url):
        return None
    dl = inflight.start(url, claimed=claimed)
    dl.reason = reason
    return dl


# ---------------------------------------------------------------------------------------
# admin


async def _healthz(request: web.Request) -> web.Response:
    health = request.app.get(HEALTH)
    if health is None or health.writable:
        return web.Response(text="ok\nstore: writable\n")
    return web.Response(
        text=f"ok\nstore: not writable ({health.error}); serving from the upstream uncached\n"
    )


async def _readyz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    if runtime["ready"]:
        return web.Response(text="ready\n")
    why = runtime.get("not_ready") or "starting: the store is being opened"
    return _error_response(503, f"not ready: {why}")


async def _refresh_gauges(app: web.Application) -> dict[str, Any]:
    st = await asyncio.to_thread(app[STORE].stats)
    m = app[METRICS]
    m.cache_size.set(st["bytes"])
    m.cache_entries.set(st["entries"])
    m.cache_limit.set(st["limit"])
    m.cache_effective_limit.set(st["effective_limit"])
    return st


async def _stats(request: web.Request) -> web.Response:
    st = await _refresh_gauges(request.app)
    m = request.app[METRICS]
    t = m.totals()
    total = t["hits"] + t["misses"]
    body = {
        "entries": st["entries"],
        "bytes": st["bytes"],
        "limit": st["limit"],
        "reserved": st["reserved"],
        "policy": st["policy"],
        "in_flight": len(request.app[INFLIGHT]),
        "downloads_all_processes": st["downloads"],
        "hits": t["hits"],
        "misses": t["misses"],
        "hit_ratio": (t["hits"] / total) if total else 0.0,
        "upstream_bytes": t["upstream_bytes"],
        "served_bytes": t["served_bytes"],
        "workers": request.app[SETTINGS].workers,
        "pid": os.getpid(),
        "store": {
            **request.app[HEALTH].snapshot(),
            "free_bytes": st["free_bytes"],
            "min_free_bytes": st["min_free_bytes"],
            "filesystem_bytes": st["filesystem_bytes"],
            "effective_limit": st["effective_limit"],
            "pending_access_records": request.app[STORE].pending_access(),
        },
        "ram_tier": {"entries": len(request.app[HITS]), "bytes": request.app[HITS].bytes},
    }
    return web.json_response(body)


def loopback_only(host: str) -> bool:
    """Whether listening on ``host`` accepts connections from this machine only."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "" / 0.0.0.0 / ::): reachable from the network


def _require_admin(request: web.Request) -> None:
    settings = request.app[SETTINGS]
    token = settings.admin_token
    if not token:
        if loopback_only(settings.host):
            return
        raise Forbidden(
            f"mutating admin routes are disabled: this proxy listens on {settings.host} "
            "without --admin-token; set --admin-token (env SHARDCACHE_ADMIN_TOKEN) and send "
            "Authorization: Bearer <token>"
        )
    auth = request.headers.get("Authorization")
    if not auth:
        raise ProxyError("admin token required (Authorization: Bearer <token>)", status_hint=401)
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise Forbidden("wrong admin token")


def _canonical(request: web.Request, url: str) -> str:
    s = request.app[SETTINGS]
    if not isinstance(url, str) or not url:
        raise BadRequest("each URL must be a non-empty string")
    try:
        return map_url(url, s.upstreams, s.allow_hosts, s.max_path_length)
    except ProxyError as exc:
        raise type(exc)(f"{url}: {exc}") from None


def _expand(body: Any) -> Iterator[str]:
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"urls": [...]} or {"pattern": "..."}')
    if "urls" in body:
        urls = body["urls"]
        if not isinstance(urls, list):
            raise BadRequest('"urls" must be a list of strings')
        yield from urls
    elif "pattern" in body:
        pattern = body["pattern"]
        if not isinstance(pattern, str):
            raise BadRequest('"pattern" must be a string')
        yield from braceexpand(pattern)
    else:
        raise BadRequest('body needs "urls" or "pattern"')


async def _prefetch(request: web.Request) -> web.Response:
    _require_admin(request)
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    urls: list[str] = []
    for u in _expand(body):
        if len(urls) >= MAX_PREFETCH:
            raise BadRequest(f"more than {MAX_PREFETCH} URLs in one prefetch")
        urls.append(_canonical(request, u))
    app = request.app
    store = app[STORE]
    # What is cached when the request is answered is not fetched again, even if it is
    # purged before the prefetch task gets to it.
    todo = await asyncio.to_thread(
        lambda: [u for u in dict.fromkeys(urls) if store.get(u, touch=False) is None]
    )
    app[SCHEDULER].prefetch(todo)
    return web.json_response({"accepted": len(urls)}, status=202)


# ---------------------------------------------------------------------------------------
# read plans


async def _plans_here(request: web.Request) -> Plans:
    """The plans, up to date with the other workers' progress."""
    plans = request.app[PLANS]
    await plans.sync(force=True)
    return plans


async def _plans_list(request: web.Request) -> web.Response:
    plans = await _plans_here(request)
    now = time.monotonic()
    return web.json_response({"plans": [p.status(now) for p in plans]})


async def _plans_get(request: web.Request) -> web.Response:
    plan = (await _plans_here(request)).get(request.match_info["id"])
    return web.json_response(plan.status(time.monotonic()))


async def _plans_add(request: web.Request) -> web.Response:
    _require_admin(request)
    plans = request.app[PLANS]
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    replace = body.get("replace", False) if isinstance(body, dict) else False
    if not isinstance(replace, bool):
        raise BadRequest(f'"replace" must be true or false, not {replace!r}')
    # before any work on the URLs (a replacing plan takes the room of those it replaces)
    plans.check_room(len(plans.named(body.get("name"))) if replace else 0)
    limit = plans.max_shards

    def canonical() -> list[str]:  # a large plan maps its URLs off the event loop
        urls: list[str] = []
        for u in _expand(body):
            if len(urls) >= limit:
                raise BadRequest(
                    f"plan has more than {limit} shards (--max-plan-shards)", status_hint=413
                )
            urls.append(_plan_url(request, u))
        return urls

    urls = await asyncio.to_thread(canonical)
    plan = await plans.register(urls, body.get("name"), body.get("lookahead"), replace=replace)
    status = plan.status(time.monotonic())
    return web.json_response(
        {
            "id": plan.id,
            "name": plan.name,
            "shards": len(plan.urls),
            "lookahead": {
                "shards": status["lookahead_shards"],
                "bytes": status["lookahead_bytes"],
            },
            "plan": status,
        },
        status=201,
    )


def _plan_url(request: web.Request, url: Any) -> str:
    """The canonical upstream URL of a plan entry: a proxy path, a URL of this proxy, an
    upstream URL, or ``s3://BUCKET/KEY`` of a bucket of the S3 front."""
    if isinstance(url, str) and not url.startswith("/"):
        s = request.app[SETTINGS]
        under = any(url.startswith(u.base + "/") for u in s.upstreams)
        if not under:
            scheme, sep, rest = url.partition("://")
            host, slash, path = rest.partition("/")
            if sep and scheme.lower() in ("http", "https") and _is_me(request, scheme, host):
                url = slash + path  # a URL of this proxy
            elif sep and scheme.lower() == "s3" and any(u.name == host for u in s.upstreams):
                url = f"/{host}/{path}"  # a bucket of the S3 front
    try:
        return _canonical(request, url)
    except Forbidden as exc:
        raise BadRequest(str(exc)) from None


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def _is_me(request: web.Request, scheme: str, netloc: str) -> bool:
    """Whether ``scheme://netloc`` names this proxy: the Host the request came to, or a
    loopback name or this proxy's address on the port it listens on (default ports
    written or not)."""
    from urllib.parse import urlsplit

    default = 443 if scheme.lower() == "https" else 80
    try:
        there = urlsplit(f"{scheme}://{netloc}")
        port = there.port or default
        here = urlsplit(f"{request.scheme}://{request.host}")
        here_port = here.port or (443 if request.scheme == "https" else 80)
    except ValueError:
        return False
    name = (there.hostname or "").lower()
    if name == (here.hostname or "").lower() and port == here_port:
        return True
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    listen_port = sock[1] if sock else here_port
    mine = _LOOPBACK_NAMES | {request.app[SETTINGS].host.lower()}
    if sock:
        mine |= {str(sock[0]).lower()}
    return port == listen_port and name in mine


async def _plans_delete(request: web.Request) -> web.Response:
    _require_admin(request)
    await request.app[PLANS].unregister(request.match_info["id"])
    return web.json_response({"removed": True})


async def _purge(request: web.Request) -> web.Response:
    _require_admin(request)
    store = request.app[STORE]
    url = request.query.get("url")
    if url is not None:
        removed = int(await asyncio.to_thread(store.remove, _canonical(request, url)))
    else:
        removed = await asyncio.to_thread(store.clear)
    return web.json_response({"removed": removed})
