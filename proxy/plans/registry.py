"""The plans registered with this proxy (:class:`Plans`): registering, ending and
expiring them, moving their positions with each request, keeping them in step with the
other workers through the store's index, and the next-use advice eviction asks for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from proxy.metrics import ProxyMetrics, multiprocess
from proxy.plans.plan import MAX_LOOKAHEAD, MAX_NAME, Plan, parse_lookahead
from shardcache.errors import BadRequest, NotFound
from shardcache.eviction import next_uses
from shardcache.store import Store

__all__ = ["Plans"]

log = logging.getLogger(__name__)

PLANNER_EVERY = 0.5  # seconds a snapshot of next uses serves while positions move
HORIZON = 4096  # shards of each plan looked at for next uses: beyond that, "far"


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
