"""The plans table: the read plans of a proxy with several processes (``serve --workers
N``), kept in the store's index so that a plan registered on one worker is known to all.

The table is the daemon's own: created through
:meth:`~shardcache.store.Store.add_schema` and written through
:meth:`~shardcache.store.Store.transaction`. It is not part of the entry format: an
index without it, or a shardcache that does not know it, works the same.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Collection, Mapping

from shardcache.store import Store

__all__ = ["PLANS_SCHEMA", "PlansTable", "Progress"]

PLANS_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    id TEXT PRIMARY KEY,            -- read plans of a proxy with several processes
    doc TEXT NOT NULL,              -- JSON: name, urls, lookahead
    created REAL NOT NULL,
    seen REAL NOT NULL,             -- the reader's last request (wall clock)
    position INTEGER NOT NULL DEFAULT 0,
    wait REAL NOT NULL DEFAULT 0,
    hits INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0,
    behind INTEGER NOT NULL DEFAULT 0
)
"""

# a plan's progress: position, last seen, wait seconds, planned hits, requests, bytes read
Progress = tuple[int, float, float, int, int, int]


class PlansTable:
    """Read plans shared by every process of the store's directory."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.add_schema(PLANS_SCHEMA)

    def put(
        self,
        plan_id: str,
        doc: str,
        now: float | None = None,
        *,
        replace_name: str | None = None,
        max_plans: int | None = None,
    ) -> list[str] | None:
        """Register plan ``plan_id`` (``doc``: its JSON description) for every process, in
        one transaction with removing the plans named ``replace_name`` (their ids are
        returned) and checking that at most ``max_plans`` are left (else nothing changes
        and the answer is None). So concurrent registrations in several processes never
        leave more than ``max_plans``, and a replacement is never seen beside its old plan.
        """
        now = time.time() if now is None else now
        with self.store.transaction() as conn:
            replaced: list[str] = []
            if replace_name:
                for pid, other in conn.execute("SELECT id, doc FROM plans").fetchall():
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        if json.loads(other).get("name") == replace_name:
                            replaced.append(pid)
            if max_plans is not None:
                (n,) = conn.execute("SELECT COUNT(*) FROM plans").fetchone()
                if n - len(replaced) >= max_plans:
                    return None
            conn.executemany("DELETE FROM plans WHERE id = ?", [(p,) for p in replaced])
            conn.execute(
                "INSERT INTO plans (id, doc, created, seen) VALUES (?, ?, ?, ?)",
                (plan_id, doc, now, now),
            )
            return replaced

    def delete(self, plan_id: str) -> bool:
        """Remove plan ``plan_id``; False when no process knew it."""
        with self.store.transaction() as conn:
            return conn.execute("DELETE FROM plans WHERE id = ?", (plan_id,)).rowcount > 0

    def exist(self) -> bool:
        """Whether any process has registered a read plan (a read: no write lock)."""
        with self.store.reading() as conn:
            try:
                return conn.execute("SELECT 1 FROM plans LIMIT 1").fetchone() is not None
            except sqlite3.OperationalError:  # no plans table yet: none ever registered
                return False

    def sync(
        self,
        updates: Mapping[str, Progress],
        expire_before: float,
        known: Collection[str],
    ) -> tuple[dict[str, Progress], dict[str, str]]:
        """Merge this process's plan progress into the shared table and read everyone's.

        ``updates``: plan id -> (position, last seen, and the wait seconds, planned hits,
        requests and bytes read since the last sync). Positions and last-seen times take
        the largest value, the rest add up. Plans not seen since ``expire_before`` are
        dropped. Returns (id -> the merged row, id -> the JSON description of each plan
        not in ``known``).
        """
        with self.store.transaction() as conn:
            for pid, (pos, seen, wait, hits, reqs, behind) in updates.items():
                conn.execute(
                    "UPDATE plans SET position = MAX(position, ?), seen = MAX(seen, ?), "
                    "wait = wait + ?, hits = hits + ?, requests = requests + ?, "
                    "behind = behind + ? WHERE id = ?",
                    (pos, seen, wait, hits, reqs, behind, pid),
                )
            conn.execute("DELETE FROM plans WHERE seen < ?", (expire_before,))
            rows = conn.execute(
                "SELECT id, position, seen, wait, hits, requests, behind FROM plans"
            ).fetchall()
            merged = {r[0]: tuple(r[1:]) for r in rows}
            docs = {}
            for pid in merged:
                if pid not in known:
                    docs[pid] = conn.execute(
                        "SELECT doc FROM plans WHERE id = ?", (pid,)
                    ).fetchone()[0]
        return merged, docs  # type: ignore[return-value]
