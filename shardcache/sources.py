"""Where shards come from: the :class:`DataSource` protocol and two implementations.

A data source names its shards (``list_shards``), opens one by name (``open_shard``,
``KeyError`` for a name it does not have) and iterates over all of them (``shards``,
yielding ``(identifier, stream)`` pairs). :class:`URLSource` reads URLs or brace
patterns with :func:`~shardcache.gopen.gopen`; :class:`CachedSource` puts the on-disk
store in front of any source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import BinaryIO, Protocol, runtime_checkable

from shardcache.cachestream import open_cached
from shardcache.store import DEFAULT_CACHE_SIZE, DEFAULT_POLICY, Store

__all__ = ["DataSource", "URLSource", "CachedSource"]


@runtime_checkable
class DataSource(Protocol):
    """A named collection of shards."""

    @property
    def shards(self) -> Iterator[tuple[str, BinaryIO]]:
        """``(identifier, stream)`` for every shard, in ``list_shards`` order, each opened
        only when reached."""
        ...

    def list_shards(self) -> list[str]:
        """The identifiers of all shards."""
        ...

    def open_shard(self, shard_id: str) -> BinaryIO:
        """A readable byte stream of one shard; ``KeyError`` if the id is unknown."""
        ...


def _expand(urls: str | Iterable[str]) -> list[str]:
    from shardcache.urls import expand_urls

    if isinstance(urls, os.PathLike):
        urls = os.fspath(urls)
    return list(expand_urls(urls))


class URLSource:
    """Shards named by URLs (paths, ``file://``, ``http(s)://``, ``pipe:``) or brace
    patterns such as ``https://host/train-{000000..000099}.tar``. Identifiers are the URLs.

    ``gopen_kw`` (e.g. ``timeout=``) is passed to :func:`~shardcache.gopen.gopen`.
    """

    def __init__(self, urls: str | Iterable[str], **gopen_kw: object) -> None:
        self._urls = _expand(urls)
        self._known = set(self._urls)
        self._gopen_kw = gopen_kw

    def __repr__(self) -> str:
        return f"URLSource({len(self._urls)} shards)"

    def __len__(self) -> int:
        return len(self._urls)

    def list_shards(self) -> list[str]:
        return list(self._urls)

    def open_shard(self, shard_id: str) -> BinaryIO:
        if shard_id not in self._known:
            raise KeyError(shard_id)
        from shardcache.gopen import gopen

        return gopen(shard_id, **self._gopen_kw)  # type: ignore[arg-type]

    @property
    def shards(self) -> Iterator[tuple[str, BinaryIO]]:
        return ((url, self.open_shard(url)) for url in self._urls)


class CachedSource:
    """Any :class:`DataSource` (or URLs / a brace pattern) behind the on-disk store.

    A shard is read from ``cache_dir`` when cached; otherwise it is opened from the
    source and copied into the store while being read, becoming an entry only when
    complete (see :class:`~shardcache.cachestream.CacheStream`). Entries are named by
    ``shard_uuid`` of the shard identifier, so identifiers should be globally unique
    (URLs are); ``cache_size`` bounds the directory (LRU, ``policy``).
    """

    def __init__(
        self,
        source_or_urls: DataSource | str | Iterable[str],
        cache_dir: str | os.PathLike,
        cache_size: float = DEFAULT_CACHE_SIZE,
        *,
        policy: str = DEFAULT_POLICY,
        verbose: bool = False,
    ) -> None:
        if isinstance(source_or_urls, DataSource):
            self.source: DataSource = source_or_urls
        else:
            self.source = URLSource(source_or_urls)  # type: ignore[arg-type]
        self.store = Store(cache_dir, int(cache_size), policy=policy)  # type: ignore[arg-type]
        self.verbose = verbose

    def __repr__(self) -> str:
        return f"CachedSource({self.source!r}, {str(self.store.cache_dir)!r})"

    def list_shards(self) -> list[str]:
        return self.source.list_shards()

    def open_shard(self, shard_id: str) -> BinaryIO:
        if shard_id not in set(self.source.list_shards()):
            raise KeyError(shard_id)
        return open_cached(self.store, shard_id, self.source.open_shard, verbose=self.verbose)

    @property
    def shards(self) -> Iterator[tuple[str, BinaryIO]]:
        return ((sid, self.open_shard(sid)) for sid in self.source.list_shards())

    def close(self) -> None:
        """Close the store's index connection."""
        self.store.close()
