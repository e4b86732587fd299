"""Background downloads for the plans (:class:`Scheduler`): each plan's lookahead
window kept downloading ahead of its reader, within the free cache and the concurrency
left by demand misses, then plain prefetch work."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from proxy.metrics import ProxyMetrics, multiprocess
from proxy.plans.plan import Plan
from proxy.plans.registry import Plans
from proxy.upstream.fetcher import origin_of
from proxy.upstream.resume import backoff_delay
from shardcache.store import Store

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)

TICK = 1.0  # seconds between scheduling passes when nothing wakes the scheduler
RETRY_FIRST, RETRY_MAX = 1.0, 60.0  # a failed background download waits before the next
# while the plans need more than the cache holds: the next shard and the one after it.
# The next is cached only in room no planned entry needs (its reader streams it anyway);
# the one after may push out the entry read farthest ahead.
PRESSED_WINDOW = 2
MIN_GAP = 0.02  # seconds between passes at least: a stream of hits must not keep it busy


URGENT = -1  # the tier of a plan's next shard, neither cached nor downloading
START_GRACE = 1.0  # seconds a new plan's reader has to ask for its first shard


class Scheduler:
    """Background downloads: each plan's lookahead first, then plain prefetch work.

    ``start(url, reason, urgent, one_stream)`` starts a download for the cache (None
    when it cannot start here: another worker has it, or it is cached) and returns it
    acquired.

    Demanded bytes first: a plan's next shard (its reader asks for it next, or waits for
    it already) is *urgent*: fetched in parts where the upstream allows
    (:meth:`proxy.upstream.Fetcher.open`). While a reader follows an urgent download no
    other background download of the same origin starts, so the origin's bandwidth goes
    to the bytes a reader waits for; one started beside an urgent download comes in one
    stream (even with ``--http-parts on``), leaving it the part requests; and a plan just
    registered has only its first shard fetched until that is in or its reader follows
    it (for :data:`START_GRACE` at most).
    """

    def __init__(
        self,
        plans: Plans,
        store: Store,
        inflight: Any,
        metrics: ProxyMetrics,
        *,
        concurrency: int,
        start: Callable[[str, str, bool, bool], Awaitable[Any]],
    ) -> None:
        self.plans = plans
        self.store = store
        self.inflight = inflight
        self.metrics = metrics
        self.concurrency = concurrency
        self._start = start
        self._running: dict[str, Any] = {}  # url -> Download started here
        self._queue: collections.deque[str] = collections.deque()  # plain prefetch
        self._queued: set[str] = set()
        self._fetch_seconds: float | None = None  # a shard's download time, smoothed
        self._shard_bytes: float | None = None  # a shard's size, smoothed
        # (when, plans registered then, bytes) free for lookahead that costs no planned entry
        self._room: tuple[float, int, int] = (0.0, -1, 0)
        self.prefetched = {"ok": 0, "failed": 0}
        # url -> (monotonic time before which it is not tried again, failures so far): a
        # shard that fails or is not admitted is not asked for again on every pass
        self._backoff: dict[str, tuple[float, int]] = {}
        self._tasks: set[asyncio.Task] = set()  # following the downloads started here
        self._watched: set[int] = set()  # ids of waited-for download tasks that wake a pass

    # -- work ----------------------------------------------------------------------------

    def prefetch(self, urls: Iterable[str]) -> int:
        """Queue plain prefetch work (after every plan's lookahead). Returns the count."""
        n = 0
        for u in urls:
            if u not in self._queued:
                self._queued.add(u)
                self._queue.append(u)
                n += 1
        self.plans.changed.set()
        return n

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def run(self) -> None:
        changed = self.plans.changed
        while True:
            changed.clear()  # what happens from here on wakes the next pass
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a pass must never end the scheduler
                log.exception("read-plan scheduling pass failed")
            await asyncio.sleep(MIN_GAP)
            if changed.is_set():
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                # several workers learn each other's progress from the index
                tick = TICK / 4 if self.plans.shared else TICK
                await asyncio.wait_for(changed.wait(), tick)

    def _lookahead(self, plan: Plan) -> int:
        """``plan``'s lookahead in shards: its count, or its bytes over the typical shard
        size (the proxy's default count until a shard size is known)."""
        if plan.lookahead_bytes is None:
            return plan.lookahead_shards
        if not self._shard_bytes:
            return min(plan.lookahead_shards, self.plans.default_lookahead)
        return max(1, min(plan.lookahead_shards, int(plan.lookahead_bytes // self._shard_bytes)))

    def _window(self, plan: Plan, lookahead: int, pressed: bool) -> int:
        """Shards to have ready ahead of ``plan``'s reader: as many as it reads while one
        shard downloads, plus one, within its lookahead; until its read rate is known,
        the whole lookahead. While the plans need more than the cache holds, at most
        :data:`PRESSED_WINDOW`: every shard held ahead pushes out one read later."""
        rate = plan.read_rate()
        if rate is None or self._fetch_seconds is None or not self._shard_bytes:
            return min(lookahead, PRESSED_WINDOW) if pressed else lookahead
        need = math.ceil(rate * self._fetch_seconds / self._shard_bytes) + 1
        if pressed:
            need = min(need, PRESSED_WINDOW)
        return max(1, min(lookahead, need))

    async def step(self) -> None:
        await self.plans.sync()
        now = time.monotonic()
        self.plans.expire(now)
        running = self._running
        want: list[tuple[int, int, str, str]] = []  # (tier, distance, url, reason)
        all_ready = 0
        shared_metrics = multiprocess()  # no per-plan series: they could not be removed
        # the plans the advice covers: one registered while it is computed waits for the
        # next pass (its registration wakes it), never acted on with advice that lacks it
        members = self.plans.members
        current = list(self.plans)
        # the next-use advice of large plans takes a while: never on the event loop
        advice = await asyncio.to_thread(self.plans.planner)
        free = await self._free_room(now, advice, members)  # room no planned entry needs
        pressed = self._pressed(advice)
        room = 0 if pressed else free  # what lookahead beyond the windows may fill
        for plan in current:
            if plan.id not in self.plans:
                continue  # removed meanwhile
            lookahead = self._lookahead(plan)
            needed = self._window(plan, lookahead, pressed)
            if plan.window != needed:
                plan.window = needed
                self.plans._touch()
            ready_n = ready_b = 0
            contiguous = True
            downloading = 0
            budget = plan.lookahead_bytes
            end = min(len(plan.urls), plan.position + lookahead)
            # a plan just registered, not read from yet: its reader asks for its next
            # shard at once, which gets the origin to itself until that is in, the
            # reader follows it, or START_GRACE has passed (a plan registered ahead)
            starting = plan.requests == 0 and now - plan.seen < START_GRACE
            for dist, idx in enumerate(range(plan.position, end)):
                url = plan.urls[idx]
                entry = self.store.lookup(url)
                if dist == 0:
                    starting = starting and entry is None
                elif starting:
                    break
                if entry is not None:
                    if contiguous:
                        ready_n += 1
                        ready_b += entry.size
                    size = entry.size
                else:
                    contiguous = False
                    dl = self.inflight.get(url)
                    if dl is not None:
                        downloading += 1
                        size = dl.known_size or int(self._shard_bytes or 0)
                        dl.release()
                    else:
                        size = int(self._shard_bytes or 0)
                        # the reader's own window may evict entries needed later; the
                        # rest of the lookahead only fills room that costs no planned entry,
                        # and none while the plans need more than the cache holds
                        tier = (URGENT if dist == 0 else 0) if dist < needed else 1
                        if pressed and dist == 0:
                            if free < size:
                                continue  # not admitted: its reader streams it anyway
                            free -= size
                        if tier == 1:
                            if room < size:
                                continue
                            room -= size
                        want.append((tier, dist, url, "plan"))
                if budget is not None:
                    budget -= size
                    if budget <= 0:
                        break
            plan.ready_ahead_shards, plan.ready_ahead_bytes = ready_n, ready_b
            plan.downloading = downloading
            all_ready += ready_b
            if not shared_metrics:
                self.metrics.plan_ready_ahead.labels(plan=plan.id).set(ready_b)
        if shared_metrics:
            self.metrics.plan_ready_ahead.labels(plan="all").set(all_ready)
        want.sort(key=lambda w: (w[0], w[1]))
        demand = max(0, len(self.inflight) - len(running))
        free = self.concurrency - len(running)
        # demand misses first: plans get the slots they leave, and one when none runs
        plan_slots = max(1 if want and not running else 0, free - demand)
        urgent, waited = self._urgent_origins()
        for tier, _dist, url, reason in want:
            if plan_slots <= 0:
                break
            if url in running:
                continue
            origin = origin_of(url)
            if origin in waited:
                continue  # the origin's bandwidth is a waiting reader's
            # beside an urgent download: one stream, leaving it the part requests
            if await self._launch(
                url, reason, urgent=tier == URGENT, one_stream=tier != URGENT and origin in urgent
            ):
                plan_slots -= 1
                free -= 1
                if tier == URGENT:
                    urgent.add(origin)
        if want:
            return  # plain prefetch waits for every plan's lookahead
        slots = free - demand
        while slots > 0 and self._queue:
            url = self._queue.popleft()
            self._queued.discard(url)
            if url in running or self.inflight.running(url):
                continue
            if self.store.lookup(url) is not None:
                continue
            if origin_of(url) in waited:
                self._queue.appendleft(url)  # its turn comes when the reader has its bytes
                self._queued.add(url)
                break
            if await self._launch(url, "prefetch", one_stream=origin_of(url) in urgent):
                slots -= 1

    def _urgent_origins(self) -> tuple[set[str], set[str]]:
        """The origins of the urgent downloads in progress, and of those a client
        follows (a plan's reader waits for their bytes). Each followed one wakes the
        scheduler when it ends."""
        urgent: set[str] = set()
        waited: set[str] = set()
        for dl in self.inflight.in_progress():
            task = dl.task
            if not dl.urgent or dl.finished or task is None or task.done():
                continue
            urgent.add(origin_of(dl.url))
            mine = 1 if self._running.get(dl.url) is dl else 0
            if dl.holders - 1 - mine <= 0:
                continue  # nobody reads it yet
            waited.add(origin_of(dl.url))
            if id(task) not in self._watched:
                self._watched.add(id(task))
                task.add_done_callback(self._waited_ended)
        return urgent, waited

    def _waited_ended(self, task: asyncio.Task) -> None:
        self._watched.discard(id(task))
        self.plans.changed.set()

    def _pressed(self, advice: tuple[Mapping[str, float], Any, Any]) -> bool:
        """Whether the shards the plans still read add up to more than the cache holds.
        Then a shard fetched early, beyond its reader's window, is kept as "needed soon"
        and pushes out an entry read later in the epoch, which costs a download again:
        the lookahead stays at each reader's window."""
        if not self._shard_bytes:
            return False
        planned = advice[0]
        return len(planned) * self._shard_bytes > self.store.cache_size

    async def _free_room(self, now: float, advice: tuple[Any, Any, Any], members: int) -> int:
        """Bytes the cache can take without evicting an entry a plan needs; measured at
        most once a second (one scan of the index, on a thread), and again at once when
        plans come or go (``members``: :attr:`Plans.members` before ``advice`` was
        computed): a figure from before a plan was registered counts its shards as free."""
        when, seen, room = self._room
        if now - when < 1.0 and seen == members:
            return room
        planned, protected, _ = advice
        room, typical = await asyncio.to_thread(self.store.room_for, set(planned) | set(protected))
        if self._shard_bytes is None and typical is not None:
            # no background download measured a shard yet: the plans' own cached shards
            # say how large one is (whether the plans press on the cache depends on it)
            self._shard_bytes = typical
        self._room = (now, members, room)
        return room

    async def _launch(
        self, url: str, reason: str, *, urgent: bool = False, one_stream: bool = False
    ) -> bool:
        wait = self._backoff.get(url)
        if wait is not None and time.monotonic() < wait[0]:
            return False
        try:
            dl = await self._start(url, reason, urgent, one_stream)
        except Exception as exc:
            log.warning("cannot start background download of %s: %s", url, exc)
            return False
        if dl is None:
            # cached, running here already, or another worker's: not asked again at
            # once (with several workers each ask is a write to the shared index)
            _, n = self._backoff.get(url, (0.0, 0))
            self._backoff[url] = (time.monotonic() + RETRY_FIRST, n)
            return False
        self._running[url] = dl
        self._room = (0.0, -1, 0)  # the room it takes: measured again on the next pass
        began = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._follow(url, dl, reason, began))
        self._tasks.add(task)
        task.add_done_callback(self._followed)
        return True

    def _followed(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("following a background download failed", exc_info=task.exception())

    async def _follow(self, url: str, dl: Any, reason: str, began: float) -> None:
        from proxy.inflight import State  # the download states

        try:
            await dl.wait_finished()
            task = dl.task
            own = 1 if task is not None and not task.done() else 0  # the download's task
            if dl.holders - own <= 1:
                # not cached and nobody reading it: let the upstream go; a client that
                # joined the download meanwhile takes the body itself
                body = dl.take_bypass_body()
                if body is not None:
                    body.close()
            ok = dl.state is State.DONE
            if not ok:
                _, n = self._backoff.get(url, (0.0, 0))
                delay = backoff_delay(n + 1, RETRY_FIRST, cap=RETRY_MAX)  # the upstream's, longer
                self._backoff[url] = (time.monotonic() + delay, n + 1)
                if len(self._backoff) > 100_000:
                    self._backoff.clear()
                log.info(
                    "background download of %s ended %s; next try in %.0f s",
                    url,
                    dl.state.name.lower(),
                    delay,
                )
            else:
                self._backoff.pop(url, None)
            if ok:
                self.metrics.prefetch_bytes.labels(reason=reason).inc(dl.written)
                took = time.monotonic() - began
                if not dl.urgent:  # the windows are sized by one stream's time
                    self._fetch_seconds = _smooth(self._fetch_seconds, took)
                self._shard_bytes = _smooth(self._shard_bytes, float(dl.written))
            if reason == "prefetch":
                self.prefetched["ok" if ok else "failed"] += 1
        finally:
            dl.release()
            self._running.pop(url, None)
            self.plans.changed.set()

    async def stop(self) -> None:
        """Start nothing more; cancel the downloads started here that no client
        follows (their partial files are discarded); forget the queue."""
        self._queue.clear()
        self._queued.clear()
        self.plans.changed.set()
        for dl in list(self._running.values()):
            task = dl.task
            own = 1 if task is not None and not task.done() else 0
            if task is not None and dl.holders - own <= 1:
                task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _smooth(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else old + weight * (new - old)
