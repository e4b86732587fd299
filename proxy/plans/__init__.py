"""Read plans: a reader tells the proxy the order in which it will read shards.

A plan is a list of canonical upstream URLs (the same shard may appear more than once,
e.g. several epochs) and a position: the index of the first shard its reader has not
asked for yet. Each data request for a planned URL moves the position past it.

With plans registered the proxy

- keeps each plan's next shards downloading ahead of its reader (:class:`Scheduler`),
  enough for the next shard to be complete before the reader reaches it at its measured
  read rate, bounded by the plan's lookahead, the free cache and
  ``--prefetch-concurrency``; demand misses never wait for these downloads, and plan
  downloads go before plain ``POST /-/prefetch`` work;
- evicts the entry whose next planned use is farthest (Belady's rule; entries no plan
  needs go first, by LRU), never an entry inside a lookahead window, and streams a shard
  uncached when caching it would evict entries needed sooner than it
  (:meth:`Plans.planner`, used by the store for every eviction decision);
- measures the stall a reader feels: seconds its requests waited for bytes not yet
  downloaded.

A plan whose reader made no request for ``--plan-ttl`` seconds is dropped, so a crashed
job never pins the cache.

With ``serve --workers N`` the processes share their plans through the store's index
(:meth:`Plans.sync`, a few times a second): a plan registered on one worker is known to
all, every worker's requests move it, and its counters add up.
"""

from proxy.plans.plan import Plan, parse_lookahead
from proxy.plans.registry import Plans
from proxy.plans.scheduler import Scheduler
from shardcache.plans import PLAN_HEADER  # a data request naming the plan it reads for

__all__ = ["Plan", "Plans", "Scheduler", "parse_lookahead", "PLAN_HEADER"]
