"""One read plan: a reader's order of shards, how far it got (its position, matched
against each request) and its counters, merged across workers."""

from __future__ import annotations

import bisect
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.policy import parse_bound
from shardcache.errors import BadRequest

__all__ = ["Plan", "parse_lookahead"]

MAX_NAME = 200
MAX_LOOKAHEAD = 1024  # shards a plan may keep ahead, at most (each pass walks them)
RATE_SAMPLES = 16  # the read rate is measured over a plan's last this many shards


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
