"""Prometheus metrics of the proxy, in a registry per application (tests don't clash).

Names (all prefixed ``shardcache_``)::

    requests_total{cache,code}        data requests (shard reads) answered, by X-Cache status
                                      and HTTP code: the base of the hit ratio
    service_requests_total{route,code} requests to the proxy's own routes (metrics, healthz,
                                      readyz, stats, prefetch, cache, s3-listing, s3-service,
                                      and the status page's: status, static, downloads, entries)
    response_bytes_total{cache}       body bytes sent to clients
    upstream_requests_total{outcome}  ok | not_found | error | timeout | resumed | aborted
    upstream_bytes_total              body bytes received from upstreams
    upstream_failures_total{upstream,reason}  failures of each configured upstream, by
                                      reason (proxy/upstream_health.py: REASONS)
    upstream_extra_bytes_total{reason} ... of them fetched twice: cold_range (a cold Range
                                      beside its download), ahead (a range far ahead of it)
    cache_size_bytes                  bytes in complete entries
    cache_limit_bytes                 the configured bound
    cache_effective_limit_bytes       the bound in force: the configured one, lowered while
                                      the filesystem holds less (free space above --min-free)
    cache_entries                     complete entries
    build_info{version}               1, labelled with the version of shardcache
    evictions_total                   entries evicted
    evicted_bytes_total               bytes evicted
    evicted_unread_total              entries evicted before their first re-use
    downloads_in_progress             downloads of this proxy running now
    time_to_first_byte_seconds        from request to the first body byte sent (histogram)
    failed_downloads_total            downloads abandoned mid-body (their clients aborted)
    unconfirmed_bodies_total          close-delimited bodies the upstream could not confirm
                                      complete (served, not cached)
    store_writable                    1 while the store takes writes, 0 while it passes through
    store_errors_total{op,errno}      writes the disk or index refused (ENOSPC, EIO, EROFS...)
    revalidations_total{result}       conditional requests for aged hits: fresh|changed|gone|error
    client_wait_seconds_total         seconds data requests waited for bytes not yet downloaded
                                      (upstream headers, a download's next bytes, pass-through
                                      chunks): the stall a reader feels
    prefetch_bytes_total{reason}      bytes downloaded in the background: plan | prefetch
    plan_requests_total{ready}        requests for a planned shard: hit (complete when asked),
                                      downloading, miss
    plan_ready_ahead_bytes{plan}      complete bytes ahead of each plan's reader
    plans                             read plans registered

With ``serve --workers N`` every worker writes its values to ``PROMETHEUS_MULTIPROC_DIR``
(set by the parent before any worker imports prometheus_client) and ``/metrics`` and
``/-/stats`` read all workers' values, so whichever worker answers, the totals add up.
Gauges of the shared store report the latest value; downloads in progress add up.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shardcache._version import __version__

__all__ = ["ProxyMetrics"]

MAX_CHILDREN = 256  # labelled children kept resolved per metric


class ProxyMetrics:
    """The proxy's counters, gauges and histogram, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shardcache_requests_total",
            "Data requests (shard reads) answered, by cache status and HTTP status code.",
            ["cache", "code"],
            registry=r,
        )
        self.service_requests = Counter(
            "shardcache_service_requests_total",
            "Requests to the proxy's own routes (metrics, health, admin, S3 listings), by "
            "route and HTTP status code; not in shardcache_requests_total.",
            ["route", "code"],
            registry=r,
        )
        self.response_bytes = Counter(
            "shardcache_response_bytes_total",
            "Body bytes sent to clients, by cache status.",
            ["cache"],
            registry=r,
        )
        self.upstream_requests = Counter(
            "shardcache_upstream_requests_total",
            "Upstream requests by outcome (ok, not_found, error, timeout, resumed, aborted).",
            ["outcome"],
            registry=r,
        )
        self.upstream_bytes = Counter(
            "shardcache_upstream_bytes_total", "Body bytes received from upstreams.", registry=r
        )
        self.upstream_failures = Counter(
            "shardcache_upstream_failures_total",
            "Failures of an upstream, by configured upstream and reason (refused, dns, "
            "tls, timeout, reset, cut, digest, throttled, http_5xx, http_4xx, "
            "unreachable, other).",
            ["upstream", "reason"],
            registry=r,
        )
        self.upstream_extra_bytes = Counter(
            "shardcache_upstream_extra_bytes_total",
            "Body bytes received from upstreams that the object's download fetches as well "
            "(cold_range: a cold Range answered from a ranged GET; ahead: a range far "
            "ahead of its download).",
            ["reason"],
            registry=r,
        )
        latest = "livemostrecent"  # one shared store: every worker sees the same values
        self.cache_size = Gauge(
            "shardcache_cache_size_bytes",
            "Bytes in complete cache entries.",
            registry=r,
            multiprocess_mode=latest,
        )
        self.cache_limit = Gauge(
            "shardcache_cache_limit_bytes",
            "Configured bound on cached bytes.",
            registry=r,
            multiprocess_mode=latest,
        )
        self.cache_effective_limit = Gauge(
            "shardcache_cache_effective_limit_bytes",
            "Bound on cached bytes in force: the configured one, lowered while the "
            "filesystem has less room (entries + free space - min free).",
            registry=r,
            multiprocess_mode=latest,
        )
        self.cache_entries = Gauge(
            "shardcache_cache_entries",
            "Number of complete cache entries.",
            registry=r,
            multiprocess_mode=latest,
        )
        self.build_info = Gauge(
            "shardcache_build_info",
            "Always 1; the label says which version of shardcache answers.",
            ["version"],
            registry=r,
            multiprocess_mode=latest,
        )
        self.build_info.labels(version=__version__).set(1)
        self.evictions = Counter("shardcache_evictions_total", "Cache entries evicted.", registry=r)
        self.evicted_bytes = Counter(
            "shardcache_evicted_bytes_total", "Bytes of evicted cache entries.", registry=r
        )
        self.evicted_unread = Counter(
            "shardcache_evicted_unread_total",
            "Cache entries evicted before their first re-use (a cache that thrashes).",
            registry=r,
        )
        self.fast_hits = Counter(
            "shardcache_fast_hits_total",
            "Hits answered by the fast path in front of the application (--fast-hits); "
            "counted in shardcache_requests_total too.",
            registry=r,
        )
        self.downloads_in_progress = Gauge(
            "shardcache_downloads_in_progress",
            "Upstream downloads running now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ttfb = Histogram(
            "shardcache_time_to_first_byte_seconds",
            "Time from request to the first body byte sent.",
            ["cache"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.failed_downloads = Counter(
            "shardcache_failed_downloads_total",
            "Downloads abandoned mid-body; their clients' connections were aborted.",
            registry=r,
        )
        self.unconfirmed = Counter(
            "shardcache_unconfirmed_bodies_total",
            "Close-delimited upstream bodies whose end the upstream could not confirm with a "
            "ranged probe: served, not cached.",
            registry=r,
        )
        self.digest_mismatches = Counter(
            "shardcache_digest_mismatches_total",
            "Downloads whose bytes lacked a digest the upstream declared (not committed; "
            "their clients' connections were aborted), by algorithm.",
            ["algorithm"],
            registry=r,
        )
        self.store_writable = Gauge(
            "shardcache_store_writable",
            "1 while the store takes writes; 0 while misses pass through uncached.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.store_errors = Counter(
            "shardcache_store_errors_total",
            "Writes refused by the disk or the index, by operation and errno.",
            ["op", "errno"],
            registry=r,
        )
        self.revalidations = Counter(
            "shardcache_revalidations_total",
            "Conditional requests for aged hits, by result (fresh, changed, gone, error).",
            ["result"],
            registry=r,
        )
        self.client_wait = Counter(
            "shardcache_client_wait_seconds_total",
            "Seconds data requests spent waiting for bytes not yet downloaded: the stall a "
            "reader feels.",
            registry=r,
        )
        self.prefetch_bytes = Counter(
            "shardcache_prefetch_bytes_total",
            "Bytes downloaded in the background, by reason (plan: a read plan's lookahead; "
            "prefetch: POST /-/prefetch).",
            ["reason"],
            registry=r,
        )
        self.plan_requests = Counter(
            "shardcache_plan_requests_total",
            "Requests for a shard of a read plan, by what they found (hit: complete; "
            "downloading; miss: not started).",
            ["ready"],
            registry=r,
        )
        self.plan_ready_ahead = Gauge(
            "shardcache_plan_ready_ahead_bytes",
            "Bytes of complete entries ahead of each read plan's reader, contiguous from "
            "its position.",
            ["plan"],
            registry=r,
            multiprocess_mode=latest,
        )
        self.plans = Gauge(
            "shardcache_plans",
            "Read plans registered.",
            registry=r,
            multiprocess_mode=latest,
        )
        # labelled children resolved once: ``labels()`` costs more than the increment
        self._children: dict[tuple[str, int], tuple[Counter, Counter]] = {}
        self._ttfb_children: dict[str, Histogram] = {}
        # what /metrics and the totals read: this registry, or every worker's values
        self.exposed = r
        if multiprocess():
            self.exposed = CollectorRegistry()
            _workers_collector(self.exposed)

    def observe_upstream(self, outcome: str) -> None:
        self.upstream_requests.labels(outcome=outcome).inc()

    def observe_service(self, route: str, code: int) -> None:
        self.service_requests.labels(route=route, code=str(code)).inc()

    def observe_request(self, cache: str, code: int, nbytes: int) -> None:
        children = self._children.get((cache, code))
        if children is None:
            children = (
                self.requests.labels(cache=cache, code=str(code)),
                self.response_bytes.labels(cache=cache),
            )
            if len(self._children) < MAX_CHILDREN:  # an upstream's X-Cache can be anything
                self._children[cache, code] = children
        children[0].inc()
        if nbytes:
            children[1].inc(nbytes)

    def observe_ttfb(self, cache: str, seconds: float) -> None:
        """A data request's time to its first body byte."""
        child = self._ttfb_children.get(cache)
        if child is None:
            child = self.ttfb.labels(cache=cache)
            if len(self._ttfb_children) < MAX_CHILDREN:
                self._ttfb_children[cache] = child
        child.observe(seconds)

    def totals(self) -> dict[str, int]:
        """Hits, misses (MISS, COALESCED, BYPASS), upstream and served bytes, evictions,
        across all workers."""
        out = {
            "hits": 0,
            "misses": 0,
            "upstream_bytes": 0,
            "served_bytes": 0,
            "evictions": 0,
            "evicted_bytes": 0,
            "evicted_unread": 0,
        }
        for metric in self.exposed.collect():
            for s in metric.samples:
                if s.name == "shardcache_requests_total":
                    cache = s.labels.get("cache")
                    if cache == "HIT":
                        out["hits"] += int(s.value)
                    elif cache in ("MISS", "COALESCED", "BYPASS"):
                        out["misses"] += int(s.value)
                elif s.name == "shardcache_upstream_bytes_total":
                    out["upstream_bytes"] += int(s.value)
                elif s.name == "shardcache_response_bytes_total":
                    out["served_bytes"] += int(s.value)
                elif s.name == "shardcache_evictions_total":
                    out["evictions"] += int(s.value)
                elif s.name == "shardcache_evicted_bytes_total":
                    out["evicted_bytes"] += int(s.value)
                elif s.name == "shardcache_evicted_unread_total":
                    out["evicted_unread"] += int(s.value)
        return out


def multiprocess() -> bool:
    """Whether metric values are shared between worker processes."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _workers_collector(registry: CollectorRegistry) -> object:
    """Register, in ``registry``, a collector of every worker's values."""
    from prometheus_client import multiprocess as mp

    class WorkersCollector(mp.MultiProcessCollector):
        """Every worker's values; a file a starting worker has just created (still empty)
        is skipped instead of failing the whole scrape."""

        def collect(self):  # type: ignore[no-untyped-def]
            import glob

            files = []
            for name in glob.glob(os.path.join(self._path, "*.db")):
                try:
                    if os.path.getsize(name) >= 8:  # the used-bytes header, at least
                        files.append(name)
                except OSError:
                    continue  # removed meanwhile (a dead worker's live gauges)
            return self.merge(files, accumulate=True)

    return WorkersCollector(registry)
