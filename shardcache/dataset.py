"""ShardDataset: shard list -> shuffle -> node/worker split -> (cache) -> tar -> samples.

It is a ``torch.utils.data.IterableDataset`` when torch is installed (so it plugs into a
``DataLoader`` with several workers, each reading its own shards) and a plain iterable
otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import re
import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from shardcache.handlers import reraise_exception
from shardcache.readahead import DEFAULT_READ_AHEAD
from shardcache.store import DEFAULT_CACHE_SIZE
from shardcache.workers import WorkerEnvironment, split_items

if TYPE_CHECKING:  # pragma: no cover
    from dbcache import DBCache
    from shardcache.plans import Plan

__all__ = ["ShardDataset"]

log = logging.getLogger(__name__)

if importlib.util.find_spec("torch") is not None:
    from torch.utils.data import IterableDataset as _Base
else:  # pragma: no cover - exercised in environments without torch
    _Base = object  # type: ignore[assignment,misc]


def _plan_proxy(urls: list[str], plan: bool | None) -> str | None:
    """Where to register read plans for ``urls``: the proxy of ``SHARDCACHE_PROXY`` when
    every URL is on it; with ``plan=True`` otherwise the one http(s) host all URLs share."""
    from urllib.parse import urlsplit

    from shardcache.urls import PROXY_ENV, _proxy_base

    if os.environ.get(PROXY_ENV):
        try:
            base: str | None = _proxy_base(None)
        except ValueError:
            if plan:
                raise
            base = None  # not a proxy address: the URLs cannot be on it
        if base is not None and all(url.startswith(base + "/") for url in urls):
            return base
    if not plan:
        return None
    origins = set()
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            origins.add(None)
        else:
            origins.add(f"{parts.scheme}://{parts.netloc}")
    if len(origins) != 1 or None in origins:
        raise ValueError(
            "ShardDataset(plan=True): the shard URLs must all be on one shardcache proxy "
            f"(http(s)://host:port/...), or on the proxy named by {PROXY_ENV}"
        )
    return origins.pop()


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

    Read plans: when the shards are read through a shardcache proxy, each iteration (in
    each DataLoader worker) registers its exact shard order as a read plan
    (:func:`shardcache.plan`), sends its id with every shard request, and deletes the plan
    when the iteration ends or is abandoned. ``plan=None`` (the default) does so when
    every URL is on the proxy named by ``SHARDCACHE_PROXY``, and logs a warning instead
    of failing when the proxy refuses the plan; ``plan=True`` registers at that proxy, or
    else at the host all URLs share, and raises if it cannot; ``plan=False`` never does.
    Plans are named ``"<plan_name>/worker-<k>"`` (``"/node-<r>"`` added on several nodes;
    without ``plan_name``, the process id and a token of this dataset); ``plan_lookahead``
    overrides the proxy's ``--plan-lookahead``.
    ``plan_epochs`` (default 1): each iteration's plan also holds the orders of the next
    ``plan_epochs - 1`` epochs (``seed + epoch + 1``, ...: call :meth:`set_epoch` before
    each epoch). With a dataset larger than the cache, ``plan_epochs=2`` lets the proxy
    keep, at the end of an epoch, the shards the next epoch reads first instead of the
    ones it reads last. Such a plan outlives an iteration that reads to its end (it still
    holds what comes next) and is replaced by the next iteration's; after the last epoch
    it ends ``--plan-ttl`` seconds after its last request, or at :meth:`end_plans`.

    Same-node direct reads: ``proxy_cache_dir`` (default: the ``SHARDCACHE_PROXY_CACHE_DIR``
    environment variable, read here) names the proxy's ``--cache-dir`` as this process
    sees it (a volume the sidecar and the trainer share). Committed entries are then read
    straight from it, without HTTP; misses still go through the proxy
    (:mod:`shardcache.direct`).

    ``read_ahead`` (bytes, default 8 MiB; 0 turns it off): a shard that is a local file
    (a cache hit, a direct read, a local path) is read by a thread, at most that many
    bytes of member data ahead of the consumer, so the reads happen while the consumer
    is busy with the previous samples (:mod:`shardcache.readahead`). The samples, errors
    and their order are the same. Not with ``select_files`` or ``rename_files``.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        shuffle: bool = False,
        seed: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_size: float = DEFAULT_CACHE_SIZE,
        handler: Callable[[BaseException], bool] = reraise_exception,
        split_by_node: bool = True,
        split_by_worker: bool = True,
        env: WorkerEnvironment | None = None,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        verbose: bool = False,
        plan: bool | None = None,
        plan_name: str | None = None,
        plan_lookahead: int | str | None = None,
        plan_epochs: int = 1,
        proxy_cache_dir: str | os.PathLike | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
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
        if plan_name is not None and len(plan_name) > 150:
            raise ValueError("ShardDataset: plan_name longer than 150 characters")
        self.plan_name = plan_name
        self.plan_lookahead = plan_lookahead
        if isinstance(plan_epochs, bool) or not isinstance(plan_epochs, int) or plan_epochs < 1:
            raise ValueError(f"ShardDataset: plan_epochs must be an int >= 1, not {plan_epochs!r}")
        self.plan_epochs = plan_epochs
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"ShardDataset: read_ahead must be an int >= 0, not {read_ahead!r}")
        self.read_ahead = read_ahead
        self.plan_required = plan is True
        if proxy_cache_dir is None:
            from shardcache.direct import PROXY_CACHE_DIR_ENV

            proxy_cache_dir = os.environ.get(PROXY_CACHE_DIR_ENV) or None
        self.proxy_cache_dir = proxy_cache_dir
        # decided once, here: DataLoader workers get a copy of this object
        self.plan_proxy: str | None = None if plan is False else _plan_proxy(self.urls, plan)
        # the plans' name when plan_name is not given: the process id, and a token of this
        # dataset (picked here, so every DataLoader worker and every epoch shares it):
        # two datasets of one process, or two jobs whose processes share an id (pid 1 in
        # containers), never replace or end each other's plans
        self._label = f"{os.getpid()}-{secrets.token_hex(3)}"

    def __repr__(self) -> str:
        return (
            f"ShardDataset({len(self.urls)} shards, shuffle={self.shuffle}, "
            f"cache_dir={self.cache_dir!r})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of this epoch (call before iterating, on every node)."""
        self.epoch = int(epoch)

    def shard_urls(
        self, env: WorkerEnvironment | None = None, epoch: int | None = None
    ) -> list[str]:
        """The shards this process reads in ``epoch`` (default: this epoch), in order."""
        urls = list(self.urls)
        if self.shuffle:
            random.Random(self.seed + (self.epoch if epoch is None else epoch)).shuffle(urls)
        env = env or self.env or WorkerEnvironment.detect()
        if self.split_by_node:
            urls = list(split_items(urls, env.rank, env.world_size))
        if self.split_by_worker:
            urls = list(split_items(urls, env.worker, env.num_workers))
        return urls

    def __iter__(self) -> Iterator[dict[str, Any]]:
        env = self.env or WorkerEnvironment.detect()
        urls = self.shard_urls(env)
        planned = list(urls)
        for ahead in range(1, self.plan_epochs if self.plan_proxy is not None else 1):
            planned += self.shard_urls(env, self.epoch + ahead)
        plan = self._register_plan(planned, env)
        finished = False
        try:
            yield from self._samples(urls, plan.headers if plan is not None else None)
            finished = True
        finally:
            if plan is not None:
                if finished and len(planned) > len(urls):
                    plan.release()  # it holds the next epoch until that one's replaces it
                else:
                    plan.close()

    def _samples(self, urls: list[str], headers: dict[str, str] | None) -> Iterator[dict]:
        from shardcache.cachestream import cache_shards
        from shardcache.tariterators import group_by_keys, tar_file_expander

        gopen_kw: dict[str, Any] = {"headers": headers} if headers else {}
        if self.proxy_cache_dir is not None:
            gopen_kw["proxy_cache_dir"] = self.proxy_cache_dir
        shards = cache_shards(
            [{"url": url} for url in urls],
            cache_dir=self.cache_dir,
            cache_size=self.cache_size,
            verbose=self.verbose,
            handler=self.handler,
            **gopen_kw,
        )
        files = tar_file_expander(
            shards,
            handler=self.handler,
            select_files=self.select_files,
            rename_files=self.rename_files,
            read_ahead=self.read_ahead,
        )
        return group_by_keys(files, handler=self.handler)

    def plan_label(self, env: WorkerEnvironment) -> str:
        """The name of the read plan of worker ``env``."""
        label = self.plan_name or self._label
        if env.world_size > 1:
            label += f"/node-{env.rank}"
        return f"{label}/worker-{env.worker}"

    def _register_plan(self, urls: list[str], env: WorkerEnvironment) -> Plan | None:
        if self.plan_proxy is None or not urls:
            return None
        from shardcache.plans import Plan, PlanError

        try:
            return Plan(
                urls,
                self.plan_proxy,
                self.plan_label(env),
                self.plan_lookahead,
                replace=self.plan_epochs > 1,
            )
        except PlanError as exc:
            if self.plan_required:
                raise
            log.warning("reading without a read plan: %s", exc)
            return None

    def end_plans(self) -> int:
        """Delete this dataset's read plans that outlived their iteration
        (``plan_epochs > 1``): call it after the last epoch, when no iteration of this
        dataset is running (a running one's plan has the same name). Returns how many were
        deleted. Plans of other datasets and other nodes are left alone (they are told
        apart by their names: ``plan_name``, by default the process id and a token of the
        dataset, and the node)."""
        if self.plan_proxy is None:
            return 0
        from shardcache.plans import PlanError, delete_plan, list_plans

        env = self.env or WorkerEnvironment.detect()
        mine = re.compile(re.escape(self.plan_label(env).rsplit("/", 1)[0]) + r"/worker-\d+")
        n = 0
        for p in list_plans(self.plan_proxy):
            if mine.fullmatch(str(p.get("name") or "")):
                try:
                    delete_plan(str(p["id"]), self.plan_proxy)
                    n += 1
                except PlanError as exc:
                    if exc.status != 404:
                        raise
        return n

    def dbcache(self, fname: str | os.PathLike, size: int, **kw: Any) -> DBCache:
        """Keep the first ``size`` samples in the SQLite file ``fname`` (a fixed validation
        set): ``dbcache.DBCache(fname, size, source=self, **kw)``."""
        from dbcache import DBCache

        return DBCache(fname, size, source=self, **kw)
