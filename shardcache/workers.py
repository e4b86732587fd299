"""Which shards this process reads: node (rank) and DataLoader-worker splitting.

:meth:`WorkerEnvironment.detect` asks torch when it is already imported (the
distributed rank and world size when ``torch.distributed`` is initialised; the worker
id and count inside a ``DataLoader`` worker), and otherwise falls back to the
environment variables ``RANK``/``WORLD_SIZE`` and ``WORKER``/``NUM_WORKERS`` (as
webdataset does), and otherwise to a single process. torch is never imported here.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from shardcache.errors import ConfigError

__all__ = ["WorkerEnvironment", "split_by_node", "split_by_worker", "split_items"]

T = TypeVar("T")


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(name, f"expected an integer, got {value!r}") from None


@dataclass(frozen=True)
class WorkerEnvironment:
    """Where this process sits: node ``rank`` of ``world_size`` and DataLoader ``worker``
    of ``num_workers``."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad node rank {self.rank} of world size {self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"bad worker id {self.worker} of {self.num_workers} workers")

    @property
    def global_worker(self) -> int:
        """This worker's index among all ``world_size * num_workers`` workers."""
        return self.rank * self.num_workers + self.worker

    @property
    def total_workers(self) -> int:
        return self.world_size * self.num_workers

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> WorkerEnvironment:
        """The current environment (see the module docstring for the sources consulted)."""
        env = os.environ if environ is None else environ
        rank = _env_int(env, "RANK", 0)
        world_size = _env_int(env, "WORLD_SIZE", 1)
        worker = _env_int(env, "WORKER", 0)
        num_workers = _env_int(env, "NUM_WORKERS", 1)
        if "torch" in sys.modules:  # only if the program uses torch already
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    rank, world_size = dist.get_rank(), dist.get_world_size()
            except ImportError:
                pass
            try:
                from torch.utils.data import get_worker_info

                info = get_worker_info()
            except ImportError:
                info = None
            if info is not None:
                worker, num_workers = info.id, info.num_workers
        try:
            return cls(rank, world_size, worker, num_workers)
        except ValueError as exc:
            raise ConfigError("RANK/WORLD_SIZE/WORKER/NUM_WORKERS", str(exc)) from None


def split_items(items: Iterable[T], index: int, count: int) -> Iterator[T]:
    """Every ``count``-th item starting at ``index`` (``items[index::count]``)."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"bad split {index} of {count}")
    return itertools.islice(items, index, None, count)


def split_by_node(urls: Iterable[T], env: WorkerEnvironment | None = None) -> Iterator[T]:
    """The shards of this node: every ``world_size``-th one starting at ``rank``."""
    env = env or WorkerEnvironment.detect()
    return split_items(urls, env.rank, env.world_size)


def split_by_worker(urls: Iterable[T], env: WorkerEnvironment | None = None) -> Iterator[T]:
    """The shards of this DataLoader worker: every ``num_workers``-th one from ``worker``."""
    env = env or WorkerEnvironment.detect()
    return split_items(urls, env.worker, env.num_workers)
