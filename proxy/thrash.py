"""Tell the operator when the cache thrashes: entries evicted before anyone read them a
second time, at a sustained rate.

A cache smaller than the data read in a loop (epochs over a dataset larger than
``--cache-size``, with LRU) evicts every entry just before its next use: the hit ratio is
0 %, every byte comes from the upstream twice, and nothing else says so. The remedies are
known (a larger cache, ``--eviction keep``, read plans) but only useful once someone knows
the cache thrashes; this module says so in the log, at most once per quiet period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from shardcache.sizes import format_size

__all__ = ["ThrashWatch"]

log = logging.getLogger("proxy.thrash")

WINDOW = 60.0  # seconds over which the rate is judged
MIN_UNREAD = 8  # entries evicted unread within the window before it counts as sustained
MIN_SHARE = 0.5  # of the window's evictions, the part evicted unread
QUIET = 600.0  # seconds between two warnings


class ThrashWatch:
    """Count evictions (from any thread: the store evicts in worker threads) and log one
    WARNING when, within :data:`WINDOW` seconds, at least :data:`MIN_UNREAD` entries were
    evicted before their first re-use and they were at least half of the evictions. Then
    quiet for :data:`QUIET` seconds.

    ``bound``: what the message names as the bound in force (e.g. ``"the cache size,
    40.0 MiB"``); called when the warning is logged.
    """

    def __init__(
        self,
        bound: Callable[[], str] | None = None,
        *,
        window: float = WINDOW,
        min_unread: int = MIN_UNREAD,
        quiet: float = QUIET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound = bound
        self.window = window
        self.min_unread = min_unread
        self.quiet = quiet
        self.clock = clock
        self.warnings = 0
        self._events: deque[tuple[float, bool, int]] = deque()  # (when, unread, bytes)
        self._last_warning = -float("inf")
        self._lock = threading.Lock()

    def evicted(self, size: int, hits: int) -> None:
        """An entry of ``size`` bytes was evicted after ``hits`` re-uses."""
        now = self.clock()
        with self._lock:
            self._events.append((now, hits == 0, size))
            while self._events and self._events[0][0] < now - self.window:
                self._events.popleft()
            unread = [n for _, u, n in self._events if u]
            if (
                len(unread) < self.min_unread
                or len(unread) < MIN_SHARE * len(self._events)
                or now - self._last_warning < self.quiet
            ):
                return
            self._last_warning = now
            self.warnings += 1
        bound = self.bound() if self.bound is not None else "the cache's bound"
        log.warning(
            "cache thrashing: %d entries (%s) evicted in the last %.0f s before their first "
            "re-use; the data read in a loop is larger than %s, so every read is a miss. "
            "Remedies: a larger --cache-size; --eviction keep (what is cached stays, the rest "
            "is streamed through); or a read plan (shardcache plan, shardcache.plan()) so "
            "that eviction follows the readers' order",
            len(unread),
            format_size(sum(unread)),
            self.window,
            bound,
        )
