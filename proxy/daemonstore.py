"""The store as the daemon opens it: the library's :class:`~shardcache.store.Store`, its
messages naming the daemon's flags, and the daemon's own tables in the same index (claims
for one download per entry across workers, plans shared by workers).

The tables live in :mod:`proxy.claims_table` and :mod:`proxy.plans_table` and reach the
index only through the store's public hook (``add_schema``, ``transaction``,
``reading``); ``claim``, ``release_claim``, ``plan_put``, ``plan_delete``,
``plans_exist`` and ``plans_sync`` here are the tables' methods, so the request path,
the downloads and the read plans call one store object.
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy.claims_table import ClaimsTable
from proxy.plans_table import PlansTable
from shardcache.store import SettingNames, Store

__all__ = ["DAEMON_NAMES", "DaemonStore"]

# the flags that set what the store's messages speak of
DAEMON_NAMES = SettingNames(
    cache_dir="--cache-dir", min_free="--min-free", keep="--eviction keep", layout="--cache-layout"
)
# above this many entries, the name pass an open owes (after a crash, or at every open up
# to 100,000 entries) is made once the proxy is ready, in a thread
# (Store.reconcile_names): no restart waits for it; up to this many it takes a fraction
# of a second and is made before ready, as always
NAMES_LATER_ABOVE = 10_000


class DaemonStore(Store):
    """A :class:`~shardcache.store.Store` with the daemon's claims and plans tables."""

    names: ClassVar[SettingNames] = DAEMON_NAMES

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # Store's parameters
        kwargs.setdefault("defer_names_above", NAMES_LATER_ABOVE)
        super().__init__(*args, **kwargs)
        self.claims = ClaimsTable(self)
        self.plan_table = PlansTable(self)
        # the calls of the request path, the downloads and the read plans, to the tables
        self.claim = self.claims.claim
        self.release_claim = self.claims.release
        self.plan_put = self.plan_table.put
        self.plan_delete = self.plan_table.delete
        self.plans_exist = self.plan_table.exist
        self.plans_sync = self.plan_table.sync
