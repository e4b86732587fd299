"""Which cache entries to evict: LRU or FIFO (:func:`choose_victims`), or, with read plans,
the entry needed farthest in the future (Belady's MIN, :func:`choose_victims_planned`).

Readers may register a *read plan*: the order in which they will read shards. With plans
the cache knows, for each entry, how soon it will be read again, and the best entry to
evict is the one needed farthest in the future (Belady's MIN). An entry no plan mentions is
not needed as far as anyone knows, so it goes first, in LRU order.

Knowing the future also tells the cache when *not* to admit: an object read now and never
again (or only after every planned entry) is worth less than any planned entry it would
displace, so the caller streams it through uncached. Without that bypass a cyclic read
over a dataset larger than the cache misses every time, as under LRU; with it the cache
keeps a stable part of the dataset and hits it every epoch.

Everything here is pure: functions over rows and plan snapshots, no I/O and no clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

__all__ = [
    "POLICIES",
    "Row",
    "PlanSnapshot",
    "choose_victims",
    "choose_victims_planned",
    "eviction_order",
    "next_uses",
]


class Row(Protocol):
    """What eviction needs to know about a cache entry."""

    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def created(self) -> float: ...
    @property
    def last_access(self) -> float: ...


POLICIES: tuple[str, ...] = ("lru", "fifo", "keep")


def eviction_order(rows: Iterable[Row], policy: str) -> list:
    """Rows in the order they would be evicted (first = next victim).

    ``lru``: oldest ``last_access`` first; ``fifo``: oldest ``created`` first; ``keep``:
    nothing is ever evicted (empty list). Ties are broken by the other timestamp, then key,
    so the order is deterministic.
    """
    if policy == "keep":
        return []
    if policy == "lru":
        return sorted(rows, key=lambda r: (r.last_access, r.created, r.key))
    if policy == "fifo":
        return sorted(rows, key=lambda r: (r.created, r.last_access, r.key))
    raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")


def choose_victims(
    rows: Sequence[Row], policy: str, used: int, limit: int, need: int, exclude: Iterable[str] = ()
) -> list | None:
    """Which rows to evict so that ``used + need <= limit``.

    ``used`` counts entry bytes plus every reservation. Returns the victims (possibly empty)
    in eviction order, or None when even evicting every candidate would not make room (or
    the policy forbids eviction). Rows whose key is in ``exclude`` are never chosen.
    """
    if need > limit:
        return None
    excess = used + need - limit
    if excess <= 0:
        return []
    skip = set(exclude)
    victims = []
    for row in eviction_order((r for r in rows if r.key not in skip), policy):
        victims.append(row)
        excess -= row.size
        if excess <= 0:
            return victims
    return None


class PlanSnapshot(NamedTuple):
    """One reader's plan at a moment: ``keys`` in read order, ``position`` = index of the
    next unread key, ``window`` = how many keys from ``position`` on are protected."""

    keys: Sequence[str]
    position: int
    window: int = 0


def next_uses(
    plans: Iterable[tuple[Sequence[str], int, int]],
) -> tuple[dict[str, int], set[str]]:
    """The maps :func:`choose_victims_planned` needs, from plan snapshots.

    Each plan is ``(keys, position, window)`` (a :class:`PlanSnapshot` or any triple).
    Returns ``(next_use, protected)``:

    - ``next_use[key]``: distance from the plan's position to the key's first occurrence at
      or after it (``index - position``), the minimum over plans. Plans advance at their
      own pace, so distances from different plans are only comparable as "reads from now";
      the soonest claim is what makes an entry valuable. Keys no plan still has to read
      are absent.
    - ``protected``: the keys at indices ``[position, position + window)`` of some plan,
      the ones a reader is about to open (possibly already prefetching): evicting them
      would cost a refetch almost at once, whatever their distance says.

    One pass over each plan's unread part: O(total plan length). The first occurrence
    in a plan has the smallest distance, so a later one never lowers the minimum and
    needs no bookkeeping.
    """
    next_use: dict[str, int] = {}
    protected: set[str] = set()
    for keys, position, window in plans:
        start = max(0, position)
        protected.update(keys[start : start + max(0, window)])
        for index in range(start, len(keys)):
            key = keys[index]
            distance = index - start
            if distance < next_use.get(key, math.inf):
                next_use[key] = distance
    return next_use, protected


def choose_victims_planned(
    rows: Sequence[Row],
    used: int,
    limit: int,
    need: int,
    next_use: Mapping[str, float],
    protected: Collection[str] = (),
    exclude: Iterable[str] = (),
    incoming: float | None = None,
) -> list | None:
    """Which rows to evict so that ``used + need <= limit``, or None to not admit at all.

    ``next_use`` maps a key to the distance to its next planned read (smaller = sooner;
    absent = no plan reads it again). ``incoming`` is the next planned read of the object
    being admitted *after* the current one (None = none planned).

    Victims come in this order:

    1. unplanned rows, least recently used first (``last_access``, then ``created``, then
       ``key``): nobody said they will be read, so they cost least to lose;
    2. planned rows, farthest next use first (Belady's MIN), ties in LRU order.

    Rows in ``protected`` (inside some plan's lookahead window) or ``exclude`` (being
    read) are never chosen.

    Returns None, meaning "stream the object through uncached", when even evicting every
    candidate would not make room (or ``need > limit``), and also when making room would
    evict a planned row whose next use is sooner than ``incoming``: the cache would trade
    an entry needed soon for one needed later, which can only lose hits. An ``incoming``
    of None counts as infinitely far, so an object nobody plans to read again may displace
    only unplanned rows. A planned row needed exactly as late as the incoming object may
    be evicted (the two are worth the same). Returns ``[]`` when there is room already.
    """
    if need > limit:
        return None
    excess = used + need - limit
    if excess <= 0:
        return []
    skip = set(exclude)
    skip.update(protected)
    incoming_use = math.inf if incoming is None else incoming
    unplanned = []
    planned = []
    for row in rows:
        if row.key in skip:
            continue
        (planned if row.key in next_use else unplanned).append(row)
    unplanned.sort(key=lambda r: (r.last_access, r.created, r.key))
    planned.sort(key=lambda r: (-next_use[r.key], r.last_access, r.created, r.key))
    victims = []
    for row in unplanned:
        victims.append(row)
        excess -= row.size
        if excess <= 0:
            return victims
    for row in planned:
        if next_use[row.key] < incoming_use:
            return None
        victims.append(row)
        excess -= row.size
        if excess <= 0:
            return victims
    return None
