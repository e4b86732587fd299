"""What the upstream layer is told by its user: timeouts, sizes and how hard to retry.

The transports and :class:`~proxy.upstream.fetcher.Fetcher` take their defaults from
:data:`DEFAULT_OPTIONS` here; the daemon's settings table (:mod:`proxy.config`) takes the same
values from here for its flags. Imports go one way: the daemon reads this module, nothing
in ``proxy.upstream`` reads the daemon's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_OPTIONS", "NO_RETRY", "RetryPolicy", "UpstreamOptions"]


@dataclass(frozen=True)
class RetryPolicy:
    """How often one request is tried again, and after which pauses: ``retries`` more
    tries after the first, each after :func:`~proxy.upstream.resume.backoff_delay` of
    ``backoff``. Built once from the daemon's settings, so that every transport (S3
    included) retries the same way, in one loop per request
    (:func:`proxy.upstream.stream.retrying`, :func:`proxy.upstream.stream.read`)."""

    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry, doubling after


NO_RETRY = RetryPolicy(retries=0)  # one try: the caller retries


@dataclass(frozen=True)
class UpstreamOptions:
    """The upstream layer's tunables with their defaults (the daemon's flags of the same
    names show and override these)."""

    connect_timeout: float = 10.0  # seconds
    read_timeout: float = 60.0  # idle seconds between bytes
    retries: int = RetryPolicy.retries
    retry_backoff: float = RetryPolicy.backoff
    chunk_size: int = 1 << 20  # bytes read at a time
    part_size: int = 8 * 1024 * 1024  # ranged part size for large objects; 0: one stream
    parallel: int = 8  # concurrent ranged parts per object
    http_parts: bool = False  # http(s) objects in parts too (s3:// always are)
    http_transport: str = "threads"  # "threads" or "aiohttp" for one http(s) stream

    @property
    def retry(self) -> RetryPolicy:
        """``retries`` and ``retry_backoff`` as the one policy the retry loops take."""
        return RetryPolicy(self.retries, self.retry_backoff)

    @property
    def connections(self) -> int:
        """The connection pool of a backend with one (S3, GCS, Azure): room for every
        part of two objects at once, and never fewer than 64."""
        return max(64, 2 * self.parallel)


DEFAULT_OPTIONS = UpstreamOptions()
