"""Whether the store takes writes, and what the proxy does when it does not.

A write refused by the disk or the index (ENOSPC, EDQUOT, EIO, EROFS, a read-only index)
marks the store *unwritable*: downloads stop teeing to disk and their clients get the rest
from the upstream, new misses are served straight from the upstream (``X-Cache: BYPASS``)
and hits keep being served from disk. Every ``probe_interval`` seconds a probe (free space
above ``min_free``, a file write and fsync, an index write) decides whether the store is
writable again. The state is exported as ``shardcache_store_writable``, counted in
``shardcache_store_errors_total{op,errno}``, logged (at most one warning a minute while it
lasts) and shown in ``/-/stats`` and ``/-/healthz``. ``/-/readyz`` stays ready: the proxy
still answers every request correctly, only without caching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from proxy.metrics import ProxyMetrics
from shardcache.errors import CacheError, StoreWriteError
from shardcache.store import Store, store_write_error

__all__ = ["StoreHealth"]

log = logging.getLogger(__name__)

WARN_EVERY = 60.0  # seconds between repeated warnings while the store stays unwritable


class StoreHealth:
    """The writable/unwritable state of one store, shared by the whole proxy."""

    def __init__(self, store: Store, metrics: ProxyMetrics, probe_interval: float = 5.0) -> None:
        self.store = store
        self.metrics = metrics
        self.probe_interval = probe_interval
        self.writable = True
        self.error: StoreWriteError | None = None
        self.errors = 0
        self.since: float | None = None
        self._last_warning = -WARN_EVERY
        metrics.store_writable.set(1)

    def classify(self, op: str, exc: BaseException) -> StoreWriteError | None:
        """The store write error ``exc`` stands for, or None if it is something else."""
        path = self.store.cache_dir
        return store_write_error(op, path, exc)

    def failed(self, exc: StoreWriteError) -> None:
        """Record a refused write: the store is unwritable until a probe says otherwise."""
        self.errors += 1
        self.error = exc
        self.metrics.store_errors.labels(op=exc.op, errno=exc.errno_name).inc()
        now = time.monotonic()
        if self.writable or now - self._last_warning >= WARN_EVERY:
            self._last_warning = now
            log.warning(
                "cache %s: a store %s failed with %s (%s); not caching, serving from the "
                "upstream (X-Cache: BYPASS) until the store takes writes again",
                self.store.cache_dir,
                exc.op,
                exc.errno_name,
                exc,
            )
        if self.writable:
            self.since = time.time()
        self.writable = False
        self.metrics.store_writable.set(0)

    def probe(self) -> bool:
        """Blocking: whether the store takes writes now (free space above min_free, a
        file write, an index write). Flips the state back to writable on success."""
        try:
            _, free = self.store._disk()
            if free <= self.store.min_free:
                return False
            self.store.check_writable()
            self.store.flush_access()
        except (CacheError, OSError):
            return False
        if not self.writable:
            log.warning(
                "cache %s: the store takes writes again; caching resumes", self.store.cache_dir
            )
        self.writable = True
        self.error = None
        self.since = None
        self.metrics.store_writable.set(1)
        return True

    async def run(self, flush_every: float = 1.0) -> None:
        """Background task: write access batches every ``flush_every`` seconds, and while
        unwritable, probe every ``probe_interval`` seconds."""
        next_probe = 0.0
        while True:
            await asyncio.sleep(
                flush_every if self.writable else min(flush_every, self.probe_interval)
            )
            if self.writable:
                try:
                    await asyncio.to_thread(self.store.flush_access)
                except CacheError as exc:
                    err = self.classify("index", exc)
                    if err is None:
                        log.error("cache %s: cannot record accesses: %s", self.store.cache_dir, exc)
                    else:
                        self.failed(err)
                        next_probe = time.monotonic() + self.probe_interval
                continue
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.probe_interval
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.probe)

    def snapshot(self) -> dict:
        """The state for ``/-/stats`` and ``/-/healthz``."""
        return {
            "writable": self.writable,
            "error": None if self.error is None else str(self.error),
            "errno": None if self.error is None else self.error.errno_name,
            "errors": self.errors,
            "unwritable_since": self.since,
        }
