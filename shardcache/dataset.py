"""ShardDataset: shard list -> shuffle -> node/worker split -> (cache) -> tar -> samples.

It is a ``torch.utils.data.IterableDataset`` when torch is installed (so it plugs into a
``DataLoader`` with several workers, each reading its own shards) and a plain iterable
otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from shardcache.handlers import reraise_exception
from shardcache.workers import WorkerEnvironment, split_items

if TYPE_CHECKING:  # pragma: no cover
    from dbcache import DBCache

__all__ = ["ShardDataset"]

if importlib.util.find_spec("torch") is not None:
    from torch.utils.data import IterableDataset as _Base
else:  # pragma: no cover - exercised in environments without torch
    _Base = object  # type: ignore[assignment,misc]


class ShardDataset(_Base):  # type: ignore[misc,valid-type]
    """Samples (dicts with ``__key__``, ``__url__`` and one entry per extension) from tar
    shards.

    ``urls``: a brace pattern or a list of URLs. ``shuffle`` shuffles the shard order
    with ``random.Random(seed + epoch)`` (the same order on every node, so node splitting
    stays disjoint; see :meth:`set_epoch`). ``split_by_node``/``split_by_worker`` give
    each node and each DataLoader worker every n-th shard (``env`` overrides detection).
    ``cache_dir`` caches shards on local disk (:func:`~shardcache.cache_shards`, bounded
    by ``cache_size``). ``handler`` decides what a failing shard does (raise by default).
    Samples are not decoded.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        shuffle: bool = False,
        seed: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_size: float = 1e15,
        handler: Callable[[BaseException], bool] = reraise_exception,
        split_by_node: bool = True,
        split_by_worker: bool = True,
        env: WorkerEnvironment | None = None,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        from shardcache.urls import expand_urls

        self.urls: list[str] = list(expand_urls(urls))
        if not self.urls:
            raise ValueError(f"ShardDataset: no shards in {urls!r}")
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.epoch = 0
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.handler = handler
        self.split_by_node = split_by_node
        self.split_by_worker = split_by_worker
        self.env = env
        self.select_files = select_files
        self.rename_files = rename_files
        self.verbose = verbose

    def __repr__(self) -> str:
        return (
            f"ShardDataset({len(self.urls)} shards, shuffle={self.shuffle}, "
            f"cache_dir={self.cache_dir!r})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of this epoch (call before iterating, on every node)."""
        self.epoch = int(epoch)

    def shard_urls(self, env: WorkerEnvironment | None = None) -> list[str]:
        """The shards this process reads this epoch, in order."""
        urls = list(self.urls)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(urls)
        env = env or self.env or WorkerEnvironment.detect()
        if self.split_by_node:
            urls = list(split_items(urls, env.rank, env.world_size))
        if self.split_by_worker:
            urls = list(split_items(urls, env.worker, env.num_workers))
        return urls

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from shardcache.cachestream import cache_shards
        from shardcache.tariterators import group_by_keys, tar_file_expander

        shards = cache_shards(
            [{"url": url} for url in self.shard_urls()],
            cache_dir=self.cache_dir,
            cache_size=self.cache_size,
            verbose=self.verbose,
            handler=self.handler,
        )
        files = tar_file_expander(
            shards,
            handler=self.handler,
            select_files=self.select_files,
            rename_files=self.rename_files,
        )
        return group_by_keys(files, handler=self.handler)

    def dbcache(self, fname: str | os.PathLike, size: int, **kw: Any) -> DBCache:
        """Keep the first ``size`` samples in the SQLite file ``fname`` (a fixed validation
        set): ``dbcache.DBCache(fname, size, source=self, **kw)``."""
        from dbcache import DBCache

        return DBCache(fname, size, source=self, **kw)
