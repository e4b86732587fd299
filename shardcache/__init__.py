"""shardcache: make every training shard come over the network at most once.

Public names are listed in ``__all__`` and loaded lazily on first use, so that
``import shardcache`` stays cheap (no aiohttp, no torch) until a feature is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardcache._version import __version__
from shardcache.errors import (
    BadRequest,
    CacheError,
    ConfigError,
    Forbidden,
    GopenError,
    GopenException,
    HTTPStatusError,
    IncompleteDownloadError,
    MethodNotAllowed,
    NoRoomError,
    NotFound,
    ProxyError,
    ProxyURLError,
    RangeNotSatisfiable,
    ShardcacheError,
    ShardFormatError,
    UpstreamError,
    UpstreamTimeout,
)

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # urls
    "shard_uuid": "shardcache.urls",
    "guess_shard": "shardcache.urls",
    "expand_urls": "shardcache.urls",
    "shardlist": "shardcache.urls",
    "proxied": "shardcache.urls",
    # gopen
    "gopen": "shardcache.gopen",
    # handlers
    "reraise_exception": "shardcache.handlers",
    "ignore_and_continue": "shardcache.handlers",
    "ignore_and_stop": "shardcache.handlers",
    "warn_and_continue": "shardcache.handlers",
    "warn_and_stop": "shardcache.handlers",
    # tar pipeline
    "base_plus_ext": "shardcache.tariterators",
    "valid_sample": "shardcache.tariterators",
    "tar_file_iterator": "shardcache.tariterators",
    "tar_file_expander": "shardcache.tariterators",
    "group_by_keys": "shardcache.tariterators",
    "url_opener": "shardcache.tariterators",
    "tarfile_samples": "shardcache.tariterators",
    # on-disk store
    "Store": "shardcache.store",
    "Entry": "shardcache.store",
    "Partial": "shardcache.store",
    "CheckReport": "shardcache.store",
    # CacheStream
    "CacheStream": "shardcache.cachestream",
    "cache_shards": "shardcache.cachestream",
    "open_cached": "shardcache.cachestream",
    # sources
    "DataSource": "shardcache.sources",
    "URLSource": "shardcache.sources",
    "CachedSource": "shardcache.sources",
    # workers
    "split_by_node": "shardcache.workers",
    "split_by_worker": "shardcache.workers",
    "WorkerEnvironment": "shardcache.workers",
    # dataset
    "ShardDataset": "shardcache.dataset",
    # read plans
    "plan": "shardcache.plans",
    "Plan": "shardcache.plans",
    "PlanError": "shardcache.plans",
    # the SQLite sample store
    "DBCache": "dbcache",
    "DBCacheError": "dbcache",
    "get_uuid": "dbcache",
}

__all__ = [
    "__version__",
    "ShardcacheError",
    "GopenError",
    "GopenException",
    "HTTPStatusError",
    "ShardFormatError",
    "ProxyURLError",
    "CacheError",
    "IncompleteDownloadError",
    "NoRoomError",
    "ConfigError",
    "ProxyError",
    "BadRequest",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "RangeNotSatisfiable",
    "UpstreamError",
    "UpstreamTimeout",
    *_LAZY,
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from dbcache import DBCache, DBCacheError, get_uuid  # noqa: F401
    from shardcache.cachestream import CacheStream, cache_shards, open_cached  # noqa: F401
    from shardcache.dataset import ShardDataset  # noqa: F401
    from shardcache.gopen import gopen  # noqa: F401
    from shardcache.handlers import (  # noqa: F401
        ignore_and_continue,
        ignore_and_stop,
        reraise_exception,
        warn_and_continue,
        warn_and_stop,
    )
    from shardcache.plans import Plan, PlanError, plan  # noqa: F401
    from shardcache.sources import CachedSource, DataSource, URLSource  # noqa: F401
    from shardcache.store import CheckReport, Entry, Partial, Store  # noqa: F401
    from shardcache.tariterators import (  # noqa: F401
        base_plus_ext,
        group_by_keys,
        tar_file_expander,
        tar_file_iterator,
        tarfile_samples,
        url_opener,
        valid_sample,
    )
    from shardcache.urls import (  # noqa: F401
        expand_urls,
        guess_shard,
        proxied,
        shard_uuid,
        shardlist,
    )
    from shardcache.workers import (  # noqa: F401
        WorkerEnvironment,
        split_by_node,
        split_by_worker,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
