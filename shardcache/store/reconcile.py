"""Reconciliation: the index and the directory brought to agree, at open (names only)
and by :meth:`Reconcile.check` (sizes, and with ``verify`` the recorded digests).

Stale downloads and reservations of dead processes are dropped, leftover ``.del`` files
removed, rows without a file dropped, and files named like entries but without a row
**removed**, not adopted: their URL is unknown, so they could never be served. Then the
size bound is enforced (``cache_size`` may have been lowered between runs).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from shardcache.errors import CacheError
from shardcache.store.downloads import Downloads
from shardcache.store.entry import Entry
from shardcache.store.names import PathStr, is_del, is_uuid, owner_gone, parse_part, size_of

log = logging.getLogger("shardcache.store")


@dataclass
class CheckReport:
    """What :meth:`Store.check` found (``problems``) and repaired (``fixed``)."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    entries: int = 0
    bytes: int = 0
    orphans: int = 0
    missing: int = 0
    size_mismatch: int = 0
    stale_partials: int = 0
    verified: int = 0  # entries whose bytes were read and matched their digests (--verify)
    digest_mismatch: int = 0  # entries whose bytes no longer have their recorded digests


class Indexed(NamedTuple):
    """What reconciliation needs of a row: no Entry objects for 100,000 rows."""

    url: str
    size: int


class Reconcile(Downloads):
    """The index and the directory made to agree (a part of :class:`Store`)."""

    def check(self, fix: bool = False, *, verify: bool = False) -> CheckReport:
        """Reconcile the index with the directory; report (and with ``fix``, repair).

        Problems: rows whose file is missing or has the wrong size, entry files with no row
        (orphans: their URL is unknown, so they are removed), stale ``.part`` files and
        reservations of dead processes, leftover ``.del`` files, totals over ``cache_size``.
        With ``verify``, also every entry whose bytes no longer have the digests recorded
        when they were written (a disk or a hand changed them; the size alone cannot
        tell): read in full, so it costs a read of the whole cache.
        """
        report = self._reconcile(fix=fix)
        if verify:
            self._verify_contents(report, fix)
            report.ok = not report.problems
        return report

    def _verify_contents(self, report: CheckReport, fix: bool) -> None:
        """Recompute each entry's recorded digests from its file; a mismatch is reported
        and, with ``fix``, its entry removed (the next request fetches it again)."""
        from shardcache.digests import file_digests

        for entry in self.entries():
            if not entry.digests:
                continue  # written before digests were recorded
            try:
                got = file_digests(str(entry.path), [a for a, _ in entry.digests])
            except FileNotFoundError:
                continue  # removed since (or reported missing above)
            except OSError as exc:
                report.problems.append(f"entry {entry.path.name} ({entry.url}) unreadable: {exc}")
                continue
            bad = [
                f"{a} recorded {want}, file has {got[a]}"
                for a, want in entry.digests
                if a in got and got[a] != want
            ]
            if not bad:
                report.verified += 1
                continue
            report.digest_mismatch += 1
            report.problems.append(
                f"entry {entry.path.name} ({entry.url}) changed on disk: " + "; ".join(bad)
            )
            if fix and self.remove(entry.url):
                report.fixed.append(f"dropped entry {entry.path.name} ({entry.url})")
                log.info(
                    "cache %s: dropped %s: its bytes changed on disk", self.cache_dir, entry.url
                )

    def _reconcile(self, fix: bool, verify_sizes: bool = True) -> CheckReport:
        report = CheckReport(ok=True)
        to_unlink: list[Path] = []
        evicted: list[tuple[Entry, Path | None]] = []
        now = time.time()
        with self._tx() as conn:
            # Reservations of dead processes.
            live_parts: set[str] = set()
            for name, pid, host, created in conn.execute(
                "SELECT name, pid, host, created FROM reservations"
            ).fetchall():
                if owner_gone(pid, host, created, now):
                    report.problems.append(f"stale reservation {name} (pid {pid})")
                    if fix:
                        conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
                        report.fixed.append(f"released reservation {name}")
                else:
                    live_parts.add(name)
            # Files in the directory (key -> (url, size): no Entry objects for 100k rows)
            rows = {
                r[0]: Indexed(r[1], r[2])
                for r in conn.execute("SELECT key, url, size FROM entries").fetchall()
            }
            seen: set[str] = set()
            base = str(self.cache_dir)
            try:
                names = os.listdir(self.cache_dir)
            except OSError as exc:
                raise CacheError(f"{self.cache_dir}: cannot list cache directory: {exc}") from exc
            for name in names:
                if not verify_sizes and name in rows:
                    seen.add(name)  # an indexed entry: nothing more to learn without a stat
                    continue
                path = PathStr(base, name)
                if parse_part(name) is not None:
                    # No live reservation: its writer is gone (begin reserves before it
                    # creates the file; commit and abort remove both together).
                    if name in live_parts:
                        continue
                    report.stale_partials += 1
                    report.problems.append(f"stale partial download {name}")
                    if fix:
                        to_unlink.append(path.path)
                        report.fixed.append(f"removed {name}")
                elif is_del(name):
                    report.problems.append(f"leftover evicted file {name}")
                    if fix:
                        to_unlink.append(path.path)
                        report.fixed.append(f"removed {name}")
                elif is_uuid(name):
                    seen.add(name)
                    entry = rows.get(name)
                    if entry is not None and not verify_sizes:
                        continue
                    size = size_of(str(path))
                    if size is None:
                        continue
                    if entry is None:
                        report.orphans += 1
                        report.problems.append(
                            f"orphan entry file {name} ({size} bytes, not in the index)"
                        )
                        if fix:
                            moved = self._move_aside(path.path)
                            if moved is not None:
                                to_unlink.append(moved)
                            report.fixed.append(f"removed orphan {name}")
                    elif size != entry.size:
                        report.size_mismatch += 1
                        report.problems.append(
                            f"entry {name} ({entry.url}) is {size} bytes, index says {entry.size}"
                        )
                        if fix:
                            conn.execute("DELETE FROM entries WHERE key = ?", (name,))
                            moved = self._move_aside(path.path)
                            if moved is not None:
                                to_unlink.append(moved)
                            report.fixed.append(f"dropped entry {name} ({entry.url})")
            for key, entry in rows.items():
                if key not in seen:
                    report.missing += 1
                    report.problems.append(f"entry {key} ({entry.url}) has no file")
                    if fix:
                        conn.execute("DELETE FROM entries WHERE key = ?", (key,))
                        report.fixed.append(f"dropped row {key} ({entry.url})")
            # The size bound (e.g. after cache_size was lowered between runs).
            entries_bytes, reserved = self._used(conn)
            if entries_bytes + reserved > self.cache_size:
                report.problems.append(
                    f"cache holds {entries_bytes} bytes + {reserved} reserved, over the "
                    f"limit of {self.cache_size}"
                )
                if fix:
                    made = self._make_room(conn, 0)
                    if made is not None:
                        evicted = made
                        report.fixed.append(f"evicted {len(made)} entries to fit the limit")
            n, nbytes = conn.execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()
            report.entries, report.bytes = int(n), int(nbytes)
        self._mem.clear()  # rows may have been dropped: read them again
        for path in to_unlink:
            self._unlink(path)
        self._finish_evictions(evicted)
        report.ok = not report.problems
        for line in report.fixed:
            log.info("cache %s: %s", self.cache_dir, line)
        return report
