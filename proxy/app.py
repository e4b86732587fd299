"""The proxy's aiohttp application: :func:`make_app` builds it, with its routes, and
opens and closes the store, the upstream fetcher and the download table
(``cleanup_ctx``).

Where the rest lives: :mod:`proxy.context` (the application's and each request's state),
:mod:`proxy.observe` (the middleware: error answers, access log, request metrics),
:mod:`proxy.shard` (the data requests: the decision of :mod:`proxy.decide` carried out),
:mod:`proxy.answer` (the one response path and its body sources), :mod:`proxy.peers`
(worker-to-worker forwarding), :mod:`proxy.admin` (health, stats, prefetch, purge) and
:mod:`proxy.plans_api` (the read plans' routes) and :mod:`proxy.statuspage` (the live
status page and the read-only routes it reads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.admin import (
    _healthz,
    _prefetch,
    _purge,
    _readyz,
    _refresh_gauges,
    _stats,
    _where,
    loopback_only,
)
from proxy.config import Settings
from proxy.context import (
    CLOUD_CLIENT,
    FETCHER,
    HEALTH,
    HITS,
    INFLIGHT,
    METRICS,
    PLANS,
    RUNTIME,
    S3_CLIENT,
    S3_FRONT,
    SCHEDULER,
    SETTINGS,
    STORE,
    UPSTREAM_HEALTH,
    Runtime,
)
from proxy.credentials import Credentials
from proxy.daemonstore import DaemonStore
from proxy.hits import HitTier
from proxy.inflight import Download
from proxy.logs import SecretsRedactor
from proxy.metrics import ProxyMetrics
from proxy.observe import (
    _observe,
)
from proxy.plans import Plans, Scheduler
from proxy.plans_api import (
    _plans_add,
    _plans_delete,
    _plans_get,
    _plans_list,
)
from proxy.policy import (
    describe_revalidate,
    unsigned_url,
)
from proxy.s3front import S3Front
from proxy.shard import (
    _background,
    _shard,
)
from proxy.statuspage import add_routes as add_statuspage
from proxy.storehealth import StoreHealth
from proxy.thrash import ThrashWatch
from proxy.upstream import S3Upstream
from proxy.upstream.cloud import CloudUpstream
from proxy.upstream.redirects import RedirectPolicy
from proxy.upstream_health import (
    UpstreamHealth,
    WatchedFetcher,
    WatchedInflight,
    probe_upstreams,
)
from shardcache.errors import (
    CacheError,
    StoreUnusable,
    StoreWriteError,
)
from shardcache.sizes import format_size
from shardcache.store import Entry, disk_full

log = logging.getLogger(__name__)

__all__ = [
    "make_app",
    "SETTINGS",
    "STORE",
    "FETCHER",
    "INFLIGHT",
    "METRICS",
    "RUNTIME",
]
MEMO_ENTRIES = 100_000  # entries kept in memory for hits, shared out among the workers


def make_app(settings: Settings, *, sendfile: bool = True) -> web.Application:
    """Build the proxy application for ``settings`` (store opened on startup)."""
    s3 = None
    if any(u.base.startswith("s3://") for u in settings.upstreams):
        # Started lazily on first use: credentials resolve inside the running loop.
        s3 = S3Upstream(
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            profile=settings.s3_profile,
            options=settings.upstream_options,
        )
    cloud = None
    if any(u.base.startswith(("gs://", "az://")) for u in settings.upstreams):
        cloud = CloudUpstream(
            gcs_endpoint_url=settings.gcs_endpoint_url,
            azure_endpoint_url=settings.azure_endpoint_url,
            options=settings.upstream_options,
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
        store=any(u.whole_store for u in settings.upstreams),
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
    app[S3_FRONT] = front
    app[CLOUD_CLIENT] = cloud
    app[SETTINGS] = settings
    app[METRICS] = ProxyMetrics()
    app[RUNTIME] = Runtime(sendfile=sendfile)
    app[UPSTREAM_HEALTH] = UpstreamHealth(
        settings.upstreams,
        app[METRICS].upstream_failures,
        redacting=SecretsRedactor(settings),  # kept messages name no configured secret
    )
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
    r.add_get("/-/where", _where)
    r.add_post("/-/prefetch", _prefetch)
    r.add_get("/-/plans", _plans_list)
    r.add_post("/-/plans", _plans_add)
    r.add_get("/-/plans/{id}", _plans_get)
    r.add_delete("/-/plans/{id}", _plans_delete)
    r.add_delete("/-/cache", _purge)
    add_statuspage(app)  # /-/ (and / redirecting there), /-/downloads, /-/entries
    r.add_route("*", "/{tail:.*}", _shard)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    m = app[METRICS]

    thrash = ThrashWatch()

    def on_evict(entry: Entry) -> None:
        m.evictions.inc()
        m.evicted_bytes.inc(entry.size)
        if entry.hits == 0:
            m.evicted_unread.inc()
        thrash.evicted(entry.size, entry.hits)

    def open_store() -> tuple[DaemonStore, StoreWriteError | None]:
        st = DaemonStore(
            s.cache_dir,
            s.cache_size,
            s.eviction,
            on_evict,  # type: ignore[arg-type]
            min_free=s.min_free,
            layout=s.cache_layout,  # type: ignore[arg-type]
            memo_entries=MEMO_ENTRIES // s.workers,  # the bounds are per proxy, not per worker
        )
        if s.strip_signatures == "on" or (s.strip_signatures == "auto" and loopback_only(s.host)):
            st.key_url = unsigned_url  # a URL signed afresh is the same entry
        try:
            st.check_writable()  # StoreUnusable (exit 2) before listening
        except StoreUnusable as exc:
            full = disk_full(exc)
            if full is None:
                raise
            return st, full  # writable but full: start passing through, probe for room
        return st, None

    store, full = await asyncio.to_thread(open_store)
    thrash.bound = store.describe_bound
    if store.size_warning:
        log.warning("%s", store.size_warning)
    m.cache_limit.set(store.cache_size)
    health = StoreHealth(store, m, s.store_probe_interval)
    if full is not None:
        health.failed(full)
    fetcher = WatchedFetcher(
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
        credentials=Credentials(
            {
                u.base: [c for c in (*s.upstream_auth, *s.upstream_headers) if c.upstream == u.name]
                for u in s.upstreams
            }
        ),
    )
    fetcher.watch = app[UPSTREAM_HEALTH]
    app[STORE] = store
    app[FETCHER] = fetcher
    app[HEALTH] = health
    app[HITS] = HitTier(store, max_bytes=s.ram_tier // s.workers)  # shared out
    app[INFLIGHT] = inflight = WatchedInflight(
        store, fetcher, m, cache_size=store.cache_size, health=health
    )
    inflight.watch = app[UPSTREAM_HEALTH]
    app[RUNTIME].revalidating = {}
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

    async def start(
        url: str, reason: str, urgent: bool = False, one_stream: bool = False
    ) -> Download | None:
        return await _background(app, url, reason, urgent=urgent, one_stream=one_stream)

    app[SCHEDULER] = Scheduler(
        plans, store, app[INFLIGHT], m, concurrency=s.prefetch_concurrency, start=start
    )
    loop = asyncio.get_running_loop()
    background = loop.create_task(health.run(), name="store health")
    scheduling = loop.create_task(app[SCHEDULER].run(), name="background downloads")
    probe = loop.create_task(
        probe_upstreams(
            s.upstreams,
            app[UPSTREAM_HEALTH],
            timeout=s.connect_timeout,
            endpoints={
                "s3": s.s3_endpoint_url,
                "gs": s.gcs_endpoint_url,
                "az": s.azure_endpoint_url,
            },
        ),
        name="upstream probe",
    )
    app[RUNTIME].scheduling = scheduling
    names = loop.create_task(_reconcile_names(store), name="name pass")
    app[RUNTIME].ready = True
    log.info(
        "cache %s: limit %s, %s kept free, policy %s, revalidate %s; upstreams: %s",
        s.cache_dir,
        format_size(store.cache_size),
        format_size(store.min_free),
        s.eviction,
        describe_revalidate(s.revalidate),
        ", ".join(str(u) for u in s.upstreams) or "(none)",
    )
    try:
        yield
    finally:
        app[RUNTIME].ready = False
        app[RUNTIME].not_ready = "shutting down: downloads are finishing"
        tasks = [background, scheduling, probe]
        for t in tasks:
            t.cancel()
        store.stop_names()  # its thread ends at its next chunk; owed to the next open
        await asyncio.gather(*tasks, names, return_exceptions=True)
        store.planner = None
        await _stop_downloads(app)
        await fetcher.close()
        peers = app[RUNTIME].peers
        if peers is not None:
            await peers.close()
        await asyncio.to_thread(store.close)


async def _reconcile_names(store: DaemonStore) -> None:
    """The name pass the store's open left for later, if any, in a thread while serving."""
    if not store.names_owed:
        return
    try:
        await asyncio.to_thread(store.reconcile_names)
    except CacheError as exc:
        log.error("cache %s: the names could not be compared: %s", store.cache_dir, exc)


async def _stop_downloads(app: web.Application) -> None:
    """Downloads get what is left of the grace period (started by the signal, shared with
    the responses in flight; at most 10 s when there was none) to verify and commit;
    the rest are cancelled, their partial files deleted. A second signal cancels them
    at once."""
    runtime = app[RUNTIME]
    loop = asyncio.get_running_loop()
    if runtime.deadline is None:
        left = min(app[SETTINGS].grace_period, 10.0)
    else:
        left = max(0.0, runtime.deadline - loop.time())
    inflight = app[INFLIGHT]
    if left > 0 and len(inflight) and not runtime.hurry.is_set():
        finishing = loop.create_task(inflight.stop(finish_within=left))
        hurry = loop.create_task(runtime.hurry.wait())
        await asyncio.wait({finishing, hurry}, return_when=asyncio.FIRST_COMPLETED)
        for t in (finishing, hurry):
            t.cancel()
        await asyncio.gather(finishing, hurry, return_exceptions=True)
    await inflight.stop(finish_within=0)


async def _on_shutdown(app: web.Application) -> None:
    app[RUNTIME].ready = False
    app[RUNTIME].not_ready = "shutting down: finishing the responses in flight"
    # no new background downloads while responses drain; those no client follows go
    scheduling = app[RUNTIME].scheduling
    if scheduling is not None:
        scheduling.cancel()
        await asyncio.gather(scheduling, return_exceptions=True)
    if SCHEDULER in app:
        await app[SCHEDULER].stop()
    fast = app[RUNTIME].fast
    if fast is not None:  # hits the fast path is sending, cut at the grace period's end
        await fast.drain()
