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

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.metrics import ProxyMetrics, multiprocess
from proxy.policy import parse_bound
from proxy.upstream.resume import backoff_delay
from shardcache.errors import BadRequest, NotFound
from shardcache.eviction import next_uses
from shardcache.plans import PLAN_HEADER  # a data request naming the plan it reads for
from shardcache.store import Store

__all__ = ["Plan", "Plans", "Scheduler", "parse_lookahead", "PLAN_HEADER"]

log = logging.getLogger(__name__)

MAX_NAME = 200
MAX_LOOKAHEAD = 1024  # shards a plan may keep ahead, at most (each pass walks them)
PLANNER_EVERY = 0.5  # seconds a snapshot of next uses serves while positions move
HORIZON = 4096  # shards of each plan looked at for next uses: beyond that, "far"
RATE_SAMPLES = 16  # the read rate is measured over a plan's last this many shards
TICK = 1.0  # seconds between scheduling passes when nothing wakes the scheduler
RETRY_FIRST, RETRY_MAX = 1.0, 60.0  # a failed background download waits before the next
# while the plans need more than the cache holds: the next shard and the one after it.
# The next is cached only in room no planned entry needs (its reader streams it anyway);
# the one after may push out the entry read farthest ahead.
PRESSED_WINDOW = 2
MIN_GAP = 0.02  # seconds between passes at least: a stream of hits must not keep it busy


def parse_lookahead(value: Any) -> tuple[int | None, int | None]:
    """``"lookahead"`` of a plan: an integer is a shard count, a string a size in bytes
    (``"2GiB"``). Returns (shards, bytes), one of them None."""
    if isinstance(value, bool):
        raise BadRequest('"lookahead" must be a shard count (integer) or a size ("2GiB")')
    if isinstance(value, int):
        if not 1 <= value <= MAX_LOOKAHEAD:
            raise BadRequest(f'"lookahead" must be 1 to {MAX_LOOKAHEAD} shards (got {value})')
        return value, None
    if isinstance(value, str):
        try:
            n = parse_bound(value)
        except ValueError as exc:
            raise BadRequest(f'"lookahead": {exc}') from None
        if n < 1:
            raise BadRequest(f'"lookahead" must be at least 1 byte (got {value!r})')
        return None, n
    raise BadRequest('"lookahead" must be a shard count (integer) or a size ("2GiB")')


@dataclass(eq=False)
class Plan:
    """One reader's order and how far it got."""

    id: str
    name: str
    urls: tuple[str, ...]
    keys: tuple[str, ...]
    lookahead_shards: int
    lookahead_bytes: int | None = None
    created: float = field(default_factory=time.time)
    seen: float = field(default_factory=time.monotonic)
    position: int = 0
    wait_seconds: float = 0.0
    planned_hits: int = 0
    requests: int = 0
    behind_bytes: int = 0
    # filled by the scheduler's passes
    ready_ahead_shards: int = 0
    ready_ahead_bytes: int = 0
    downloading: int = 0
    window: int = 0
    _where: dict[str, list[int]] = field(default_factory=dict, repr=False)
    # the counters (wait_seconds, planned_hits, requests, behind_bytes) when last merged
    # with the other workers' (serve --workers N)
    _synced: tuple[float, int, int, int] = (0.0, 0, 0, 0)
    seen_wall: float = field(default_factory=time.time)
    _reads: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RATE_SAMPLES), repr=False
    )

    def __post_init__(self) -> None:
        for i, url in enumerate(self.urls):
            self._where.setdefault(url, []).append(i)
        self.window = 1

    @property
    def done(self) -> bool:
        return self.position >= len(self.urls)

    def match(self, url: str, *, reach: int) -> int | None:
        """The index a request for ``url`` reads in this plan, or None when it is not
        this plan's. In order of preference: an occurrence among the next shards (the
        window); one at most ``reach`` shards behind the position (a retry, or readers
        sharing one plan slightly out of order: the position stays); one at most
        ``reach`` shards ahead (the reader skipped some). So a plan holding several
        epochs never jumps to the next epoch's copy of a shard re-read in this one."""
        where = self._where.get(url)
        if not where:
            return None
        pos = self.position
        i = bisect.bisect_left(where, pos)
        ahead = where[i] if i < len(where) else None
        if ahead is not None and ahead - pos <= self.window:
            return ahead
        if i > 0 and pos - where[i - 1] <= reach:
            return where[i - 1]
        if ahead is not None and ahead - pos <= reach:
            return ahead
        return None

    def advance(self, idx: int, now: float) -> None:
        """The reader asked for shard ``idx``."""
        self.seen = now
        self.seen_wall = time.time()
        self.requests += 1
        if idx >= self.position:  # else it asked again for the shard just read
            self.position = idx + 1

    def note_read(self, nbytes: int, now: float, *, hit: bool) -> None:
        """A request of this plan ended after sending ``nbytes``."""
        self.seen = now
        self.seen_wall = time.time()
        if hit:
            self.planned_hits += 1
        if nbytes:
            self.behind_bytes += nbytes
            self._reads.append((now, nbytes))

    def doc(self) -> str:
        """The plan as the other workers need it (JSON)."""
        return json.dumps(
            {
                "name": self.name,
                "urls": self.urls,
                "lookahead_shards": self.lookahead_shards,
                "lookahead_bytes": self.lookahead_bytes,
                "created": self.created,
            }
        )

    def pending(self) -> tuple[int, float, float, int, int, int]:
        """(position, last seen, and each counter's growth since the last merge)."""
        w, h, r, b = self._synced
        return (
            self.position,
            self.seen_wall,
            self.wait_seconds - w,
            self.planned_hits - h,
            self.requests - r,
            self.behind_bytes - b,
        )

    def counters(self) -> tuple[float, int, int, int]:
        return (self.wait_seconds, self.planned_hits, self.requests, self.behind_bytes)

    def merged(
        self,
        row: tuple[int, float, float, int, int, int],
        now: float,
        sent: tuple[float, int, int, int] | None = None,
    ) -> None:
        """Take every worker's totals (a row of :meth:`Store.plans_sync`). ``sent``: this
        plan's counters when the merge began; what was counted here since then is not in
        the table yet, so it is kept on top of the totals and sent next time."""
        pos, seen_wall, wait, hits, reqs, behind = row
        self.position = max(self.position, int(pos))
        if seen_wall > self.seen_wall:  # another worker's request came later
            self.seen = now - max(0.0, time.time() - seen_wall)
            self.seen_wall = seen_wall
        gained = (0.0, 0, 0, 0)
        if sent is not None:
            gained = tuple(c - s for c, s in zip(self.counters(), sent, strict=True))  # type: ignore[assignment]
        self._synced = (float(wait), int(hits), int(reqs), int(behind))
        self.wait_seconds = float(wait) + gained[0]
        self.planned_hits = int(hits) + int(gained[1])
        self.requests = int(reqs) + int(gained[2])
        self.behind_bytes = int(behind) + int(gained[3])

    def read_rate(self) -> float | None:
        """Bytes per second the reader consumed over its last shards; None until known."""
        if len(self._reads) < 3:
            return None
        span = self._reads[-1][0] - self._reads[0][0]
        if span <= 0:
            return None
        return sum(n for _, n in list(self._reads)[1:]) / span

    def status(self, now: float) -> dict[str, Any]:
        rate = self.read_rate()
        return {
            "id": self.id,
            "name": self.name,
            "shards": len(self.urls),
            "position": self.position,
            "created": self.created,
            "idle_seconds": round(now - self.seen, 3),
            "ready_ahead_shards": self.ready_ahead_shards,
            "ready_ahead_bytes": self.ready_ahead_bytes,
            "downloading": self.downloading,
            "behind_bytes": self.behind_bytes,
            "read_bytes_per_second": None if rate is None else round(rate),
            "wait_seconds": round(self.wait_seconds, 6),
            "planned_hits": self.planned_hits,
            "requests": self.requests,
            # a lookahead in bytes has no shard count of its own
            "lookahead_shards": None if self.lookahead_bytes is not None else self.lookahead_shards,
            "lookahead_bytes": self.lookahead_bytes,
            "window_shards": self.window,
            "done": self.done,
        }


class Plans:
    """The plans registered with this proxy, and what eviction needs to know of them."""

    def __init__(
        self,
        store: Store,
        metrics: ProxyMetrics,
        *,
        ttl: float,
        default_lookahead: int,
        max_plans: int,
        max_shards: int,
        shared: bool = False,
    ) -> None:
        self.store = store
        self.shared = shared  # several processes: plans meet in the store's index
        self._synced_at = 0.0
        self._asked: dict[str, float] = {}  # plan id -> when a request named it unknown
        self.metrics = metrics
        self.ttl = ttl
        self.default_lookahead = default_lookahead
        self.max_plans = max_plans
        self.max_shards = max_shards
        self._plans: dict[str, Plan] = {}
        self._memo: tuple[int, int, float, Any] | None = None  # (version, members, when, maps)
        self._version = 0  # bumped whenever a position, a window or the set of plans changes
        self._members = 0  # bumped whenever a plan is added or removed
        self._cost = 0.0  # seconds the last planner() computation took
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self):
        return iter(list(self._plans.values()))

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self._plans

    @property
    def members(self) -> int:
        """A count that changes whenever a plan is registered or removed."""
        return self._members

    def _touch(self, members: bool = False) -> None:
        self._version += 1
        if members:
            self._members += 1
        self.changed.set()

    # -- registry ------------------------------------------------------------------------

    async def register(
        self, urls: Sequence[str], name: Any, lookahead: Any = None, *, replace: bool = False
    ) -> Plan:
        """Add a plan; with several workers, make it known to all of them. ``replace``:
        the plans of the same name end once this one is registered (a reader's plan for
        its next epoch takes over from the one that still holds it, with no moment when
        neither does)."""
        if replace and not name:
            raise BadRequest('"replace" needs a "name": the plans of that name are replaced')
        if self.shared:
            await self.sync(force=True)
        replacing = len(self.named(name)) if replace else 0
        self.check_room(replacing)
        plan = await asyncio.to_thread(self.build, urls, name, lookahead, replacing)
        old = set(self.named(name)) if replace else set()
        self.insert(plan, len(old))
        if self.shared:
            # one transaction of the index: the count across processes, the old plans out
            # and the new one in (no worker ever sees both, or more than --max-plans)
            try:
                gone = await asyncio.to_thread(
                    lambda: self.store.plan_put(
                        plan.id,
                        plan.doc(),
                        replace_name=name if replace else None,
                        max_plans=self.max_plans,
                    )
                )
            except BaseException:
                self._drop(plan.id)
                raise
            if gone is None:  # other workers registered plans meanwhile
                self._drop(plan.id)
                raise self._full(self.max_plans)
            old.update(gone)
        for pid in old - {plan.id}:  # in this process, nothing awaited since insert()
            self._drop(pid, f"replaced by {plan.id}")
        return plan

    def named(self, name: Any) -> list[str]:
        """The ids of the plans named ``name`` (none for an empty name)."""
        return [p.id for p in self._plans.values() if name and p.name == name]

    async def learn(self, plan_id: str) -> None:
        """A request names plan ``plan_id``, unknown here: another worker may have just
        registered it, so merge with the others now rather than at the next pass (at
        most once a second for an id that stays unknown, e.g. a deleted plan's)."""
        if not self.shared or plan_id in self._plans:
            return
        now = time.monotonic()
        if now - self._asked.get(plan_id, -math.inf) < 1.0:
            return
        if len(self._asked) > 1000:
            self._asked.clear()
        self._asked[plan_id] = now
        await self.sync(force=True)

    async def unregister(self, plan_id: str) -> Plan:
        """Delete a plan (in every worker)."""
        if self.shared:
            await self.sync(force=True)
            self.get(plan_id)  # NotFound when no worker knows it
            await asyncio.to_thread(self.store.plan_delete, plan_id)
        return self.remove(plan_id)

    async def sync(self, *, force: bool = False) -> None:
        """Merge progress with the other workers (several processes only), at most five
        times a second unless ``force``."""
        if not self.shared:
            return
        now = time.monotonic()
        if not force and now - self._synced_at < 0.2:
            return
        self._synced_at = now
        if not self._plans and not force:
            # nothing of ours to merge: a read tells whether another worker has plans,
            # so an idle worker takes no write lock on the index several times a second
            if not await asyncio.to_thread(self.store.plans_exist):
                return
        known = dict(self._plans)
        updates = {pid: p.pending() for pid, p in known.items()}
        sent = {pid: p.counters() for pid, p in known.items()}
        rows, docs = await asyncio.to_thread(
            self.store.plans_sync, updates, time.time() - self.ttl, set(known)
        )
        # a plan registered here during the merge is not in its answer yet: only those
        # the table was asked about and no longer has are gone
        for pid in [pid for pid in known if pid not in rows]:
            self._drop(pid, "ended (deleted or expired)")
        new = [(pid, doc) for pid, doc in docs.items() if pid not in self._plans]
        if new:
            built = await asyncio.to_thread(lambda: [self._from_doc(p, d) for p, d in new])
            for plan in built:
                self._plans.setdefault(plan.id, plan)
            self._members += 1
        now = time.monotonic()
        for pid, row in rows.items():
            plan = self._plans.get(pid)
            if plan is not None:
                plan.merged(row, now, sent.get(pid) if known.get(pid) is plan else None)
        self.metrics.plans.set(len(self._plans))
        self._touch()

    def _from_doc(self, pid: str, doc: str) -> Plan:
        """A plan another worker registered (off the event loop: keys of every URL)."""
        d = json.loads(doc)
        urls = tuple(d["urls"])
        return Plan(
            id=pid,
            name=d.get("name") or "",
            urls=urls,
            keys=tuple(self.store.key(u) for u in urls),
            lookahead_shards=int(d["lookahead_shards"]),
            lookahead_bytes=d.get("lookahead_bytes"),
            created=float(d.get("created") or time.time()),
        )

    def check_room(self, replacing: int = 0) -> None:
        """400 when no further plan may be registered (before any work on its URLs);
        ``replacing``: how many plans the new one replaces (it takes their room)."""
        if len(self._plans) - replacing >= self.max_plans:
            raise self._full(len(self._plans))

    @staticmethod
    def _full(registered: int) -> BadRequest:
        return BadRequest(
            f"{registered} plans are registered, the most this proxy keeps "
            "(--max-plans): DELETE /-/plans/ID the plans that ended"
        )

    def build(
        self, urls: Sequence[str], name: Any, lookahead: Any = None, replacing: int = 0
    ) -> Plan:
        """A new plan, checked but not registered: safe off the event loop."""
        if not urls:
            raise BadRequest("a plan needs at least one URL")
        if len(urls) > self.max_shards:
            raise BadRequest(
                f"plan has {len(urls)} shards; at most {self.max_shards} are accepted "
                "(--max-plan-shards)",
                status_hint=413,
            )
        self.check_room(replacing)
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME):
            raise BadRequest(f'"name" must be a string of at most {MAX_NAME} characters')
        shards, nbytes = (
            (self.default_lookahead, None) if lookahead is None else parse_lookahead(lookahead)
        )
        plan = Plan(
            id="p-" + secrets.token_hex(6),
            name=name or "",
            urls=tuple(urls),
            keys=tuple(self.store.key(u) for u in urls),
            # a lookahead in bytes bounds the shards by their sizes (see Scheduler._window)
            lookahead_shards=shards if shards is not None else min(len(urls), MAX_LOOKAHEAD),
            lookahead_bytes=nbytes,
        )
        return plan

    def insert(self, plan: Plan, replacing: int = 0) -> None:
        """Register a plan made by :meth:`build` (the part that runs on the event loop);
        ``replacing``: how many plans it replaces (removed right after)."""
        self.check_room(replacing)
        self._plans[plan.id] = plan
        self.metrics.plans.set(len(self._plans))
        self._touch(members=True)
        log.info(
            "plan %s%s registered: %d shards, lookahead %s",
            plan.id,
            f" ({plan.name})" if plan.name else "",
            len(plan.urls),
            f"{plan.lookahead_bytes} bytes"
            if plan.lookahead_bytes is not None
            else f"{plan.lookahead_shards} shards",
        )

    def get(self, plan_id: str) -> Plan:
        plan = self._plans.get(plan_id)
        if plan is None:
            raise NotFound(f"no plan {plan_id!r} (it ended, was deleted or expired)")
        return plan

    def _drop(self, plan_id: str, why: str = "") -> None:
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            return
        self._forget_gauge(plan.id)
        self.metrics.plans.set(len(self._plans))
        self._touch(members=True)
        if why:
            log.info("plan %s %s", plan.id, why)

    def _forget_gauge(self, plan_id: str) -> None:
        if multiprocess():
            return  # one series for all plans there (prometheus_client cannot remove one)
        with contextlib.suppress(KeyError):
            self.metrics.plan_ready_ahead.remove(plan_id)

    def remove(self, plan_id: str, why: str = "deleted") -> Plan:
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            raise NotFound(f"no plan {plan_id!r} (it ended, was deleted or expired)")
        self._forget_gauge(plan.id)
        self.metrics.plans.set(len(self._plans))
        self._touch(members=True)
        log.info(
            "plan %s %s at %d of %d shards, %.2f s waited",
            plan.id,
            why,
            plan.position,
            len(plan.urls),
            plan.wait_seconds,
        )
        return plan

    def expire(self, now: float) -> list[Plan]:
        if self.shared:
            return []  # the shared table decides (sync), from every worker's requests
        gone = [p for p in self._plans.values() if now - p.seen > self.ttl]
        for p in gone:
            self.remove(p.id, f"expired after {self.ttl:g} s without a request")
        return gone

    # -- requests ------------------------------------------------------------------------

    def on_request(self, url: str, plan_id: str | None) -> list[Plan]:
        """A data request for ``url``: advance the plans it reads for (the one named by
        the request's ``X-Shardcache-Plan``, else every plan whose next shards include
        ``url``). Returns them."""
        if not self._plans:
            return []
        now = time.monotonic()
        if plan_id is not None:
            plan = self._plans.get(plan_id)
            candidates = [plan] if plan is not None else []
        else:
            candidates = list(self._plans.values())
        hit = []
        for plan in candidates:
            idx = plan.match(url, reach=max(64, 4 * plan.window))
            if idx is None:
                continue
            plan.advance(idx, now)
            hit.append(plan)
        if hit:
            self._touch()
        return hit

    # -- eviction ------------------------------------------------------------------------

    def planner(
        self,
    ) -> tuple[Mapping[str, float], Collection[str], Mapping[str, float]]:
        """What the store's eviction asks before choosing victims: (key -> shards until
        its next planned use, keys never to evict, key -> the use that admitting it serves).

        The last map covers each plan's next shard: its reader streams it as it arrives
        whether or not it is cached, so caching it is worth only its use after that one
        (infinitely far when there is none). Called from the store's thread; reads a
        consistent copy of the positions."""
        memo = self._memo
        version, members, now = self._version, self._members, time.monotonic()
        if memo is not None and (
            memo[0] == version
            or (memo[1] == members and now - memo[2] < min(PLANNER_EVERY, 20 * self._cost))
        ):
            # large plans: positions that moved since are at most PLANNER_EVERY old
            # rather than the advice being recomputed on every request (64 plans of 20k
            # shards: about 0.1 s); small ones are recomputed each time (well under 1 ms)
            return memo[3]
        # one consistent copy: (keys, position, window) of every plan
        views = [(p.keys, p.position, p.window) for p in list(self._plans.values())]
        windows = [(keys[pos : pos + HORIZON], 0, w) for keys, pos, w in views]
        next_use, protected = next_uses(windows)
        # each plan's next shard: worth caching only for its use after that read
        firsts = []
        for ahead, _, _ in windows:
            first: dict[str, int] = {}
            for i, key in enumerate(ahead):
                first.setdefault(key, i)
            firsts.append(first)
        admit: dict[str, float] = {}
        for j, (ahead, _, _) in enumerate(windows):
            if not ahead:
                continue
            key = ahead[0]
            later = ahead[1:]
            best = float(later.index(key) + 1) if key in later else math.inf
            for k, other in enumerate(firsts):
                if k != j and key in other and windows[k][0][0] != key:
                    best = min(best, float(other[key]))
            admit[key] = min(admit.get(key, math.inf), best)
        answer = (next_use, frozenset(protected), admit)
        self._memo = (version, members, now, answer)
        self._cost = time.monotonic() - now
        return answer


class Scheduler:
    """Background downloads: each plan's lookahead first, then plain prefetch work.

    ``start(url, reason)`` starts a download for the cache (None when it cannot start
    here: another worker has it, or it is cached) and returns it acquired.
    """

    def __init__(
        self,
        plans: Plans,
        store: Store,
        inflight: Any,
        metrics: ProxyMetrics,
        *,
        concurrency: int,
        start: Callable[[str, str], Awaitable[Any]],
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
            for dist, idx in enumerate(range(plan.position, end)):
                url = plan.urls[idx]
                entry = self.store.lookup(url)
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
                        tier = 0 if dist < needed else 1
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
        for _tier, _dist, url, reason in want:
            if plan_slots <= 0:
                break
            if url in running:
                continue
            if await self._launch(url, reason):
                plan_slots -= 1
                free -= 1
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
            if await self._launch(url, "prefetch"):
                slots -= 1

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

    async def _launch(self, url: str, reason: str) -> bool:
        wait = self._backoff.get(url)
        if wait is not None and time.monotonic() < wait[0]:
            return False
        try:
            dl = await self._start(url, reason)
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
