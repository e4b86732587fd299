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
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from shardcache.errors import CacheError
from shardcache.store.downloads import Downloads
from shardcache.store.entry import Entry
from shardcache.store.names import (
    FANOUT,
    FANOUT_CHARS,
    FANOUT_DIRS,
    HOST,
    PathStr,
    is_del,
    is_uuid,
    owner_gone,
    parse_part,
    size_of,
)

NAMES_PER_QUERY = 5000  # directory names looked up in the index at a time, when opening
# up to this many entries opening always compares every name (about a second); above it,
# only after an unclean end (a process that opened the store died without closing it, or
# left a reservation behind)
SCAN_ALWAYS = 100_000
FIXES_PER_TRANSACTION = 1000  # repairs of the deferred pass per write transaction

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


class _Stopped(Exception):
    """The deferred name pass was asked to stop (the store is closing)."""


class Reconcile(Downloads):
    """The index and the directory made to agree (a part of :class:`Store`)."""

    # the name pass of an open is left to reconcile_names() above this many entries
    defer_names_above: int | None
    # the deferred pass: None (none owed), "pending", "running", "done", "stopped",
    # "failed: <why>"
    names_pass: str | None
    _names_stop: threading.Event

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

    def _listing(self) -> Iterator[str]:
        """The names in the cache directory, as the directory yields them (streamed); in
        the fan-out layout, those of each subdirectory that belong there (a name under
        another subdirectory is not the store's: ``shardcache check`` lists it as stray)."""
        if self.layout != FANOUT:
            try:
                with os.scandir(self.cache_dir) as it:
                    for de in it:
                        yield de.name
            except OSError as exc:
                raise CacheError(f"{self.cache_dir}: cannot list cache directory: {exc}") from exc
            return
        for sub in FANOUT_DIRS:
            path = os.path.join(self.cache_dir, sub)
            try:
                with os.scandir(path) as it:
                    for de in it:
                        if de.name.startswith(sub):
                            yield de.name
            except FileNotFoundError:
                continue  # removed by hand: its entries are missing, made again on use
            except OSError as exc:
                raise CacheError(f"{path}: cannot list cache directory: {exc}") from exc

    def _base_of(self, name: str) -> str:
        """The directory of the file ``name`` (an entry key, a ``.part`` or ``.del``)."""
        if self.layout == FANOUT:
            return os.path.join(self.cache_dir, name[:FANOUT_CHARS])
        return str(self.cache_dir)

    def _leftover(
        self, name: str, report: CheckReport, fix: bool, live: set[str], to_unlink: list[Path]
    ) -> bool:
        """Whether ``name`` is a download or an evicted file (dealt with here: a ``.part``
        without a live reservation and a ``.del`` are removed), not an entry name."""
        if parse_part(name) is not None:
            # No live reservation: its writer is gone (begin reserves before it creates
            # the file; commit and abort remove both together).
            if name not in live:
                report.stale_partials += 1
                report.problems.append(f"stale partial download {name}")
                if fix:
                    to_unlink.append(self._place(name))
                    report.fixed.append(f"removed {name}")
            return True
        if is_del(name):
            report.problems.append(f"leftover evicted file {name}")
            if fix:
                to_unlink.append(self._place(name))
                report.fixed.append(f"removed {name}")
            return True
        return False

    def _orphan(self, name: str, report: CheckReport, fix: bool, to_unlink: list[Path]) -> None:
        """An entry file without an index row: reported, and with ``fix`` removed."""
        path = PathStr(self._base_of(name), name)
        size = size_of(str(path))
        if size is None:
            return
        report.orphans += 1
        report.problems.append(f"orphan entry file {name} ({size} bytes, not in the index)")
        if fix:
            moved = self._move_aside(path.path)
            if moved is not None:
                to_unlink.append(moved)
            report.fixed.append(f"removed orphan {name}")

    def _missing(
        self, report: CheckReport, fix: bool, conn: sqlite3.Connection, key: str, url: str
    ) -> None:
        report.missing += 1
        report.problems.append(f"entry {key} ({url}) has no file")
        if fix:
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
            report.fixed.append(f"dropped row {key} ({url})")

    def _scan_names(
        self,
        conn: sqlite3.Connection,
        report: CheckReport,
        fix: bool,
        live: set[str],
        to_unlink: list[Path],
    ) -> None:
        """The directory against the index by names alone (the open-time pass), in memory
        bounded whatever the number of entries: the names are streamed and looked up in
        the index a chunk at a time; rows without a file are looked for (one ``lstat`` per
        row) only when fewer names had rows than the index holds."""
        rows = conn.execute("SELECT entries FROM totals WHERE id = 0").fetchone()[0]
        found = 0
        chunk: list[str] = []
        orphans: list[str] = []  # moved aside after the listing, which must not see them

        def settle() -> None:
            nonlocal found
            marks = ",".join("?" * len(chunk))
            have = {
                r[0] for r in conn.execute(f"SELECT key FROM entries WHERE key IN ({marks})", chunk)
            }
            found += len(have)
            orphans.extend(name for name in chunk if name not in have)
            chunk.clear()

        for name in self._listing():
            if len(name) == 36 and "." not in name:  # maybe an entry: looked up below
                chunk.append(name)
                if len(chunk) >= NAMES_PER_QUERY:
                    settle()
            else:
                self._leftover(name, report, fix, live, to_unlink)
        if chunk:
            settle()
        for name in orphans:
            if is_uuid(name):
                self._orphan(name, report, fix, to_unlink)
        if found >= rows:
            return
        gone = []
        cur = conn.execute("SELECT key, url FROM entries")
        try:
            for key, url in cur:
                if not os.path.lexists(os.path.join(self._base_of(key), key)):
                    gone.append((key, url))
                    if found + len(gone) >= rows:
                        break
        finally:
            cur.close()
        for key, url in gone:
            self._missing(report, fix, conn, key, url)

    def _scan_sizes(
        self,
        conn: sqlite3.Connection,
        report: CheckReport,
        fix: bool,
        live: set[str],
        to_unlink: list[Path],
    ) -> None:
        """The directory against the index, every entry file's size too (``check``)."""
        # key -> (url, size): no Entry objects for every row
        rows = {
            r[0]: Indexed(r[1], r[2])
            for r in conn.execute("SELECT key, url, size FROM entries").fetchall()
        }
        seen: set[str] = set()
        for name in list(self._listing()):  # a snapshot: files are moved aside below
            if self._leftover(name, report, fix, live, to_unlink) or not is_uuid(name):
                continue
            seen.add(name)
            entry = rows.get(name)
            if entry is None:
                self._orphan(name, report, fix, to_unlink)
                continue
            path = PathStr(self._base_of(name), name)
            size = size_of(str(path))
            if size is None or size == entry.size:
                continue
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
                self._missing(report, fix, conn, key, entry.url)

    def _sessions(self, conn: sqlite3.Connection, now: float) -> bool:
        """Register this process as having the store open; drop the rows of processes
        that died with it open. True when there were any (an unclean end)."""
        unclean = False
        for rowid, pid, host, started in conn.execute(
            "SELECT rowid, pid, host, started FROM sessions"
        ).fetchall():
            # a negative pid: a name pass owed and under way in that process (its own
            # row is there too); owed by nobody once that process is gone
            if pid == 0 or owner_gone(abs(pid), host, started, now):
                unclean = True
                conn.execute("DELETE FROM sessions WHERE rowid = ?", (rowid,))
        conn.execute(
            "INSERT INTO sessions (pid, host, started) VALUES (?, ?, ?)", (os.getpid(), HOST, now)
        )
        self._session_pid = os.getpid()
        return unclean

    def _end_session(self) -> None:
        """This process no longer has the store open (a clean end): its sessions row goes.
        A deferred name pass it has not finished stays owed (a row of pid 0): the next
        open compares the names."""
        if getattr(self, "_session_pid", None) != os.getpid():
            return
        with self._tx() as conn:
            conn.execute(
                "DELETE FROM sessions WHERE rowid = (SELECT rowid FROM sessions "
                "WHERE pid = ? AND host = ? LIMIT 1)",
                (os.getpid(), HOST),
            )
            conn.execute(
                "UPDATE sessions SET pid = 0 WHERE pid = ? AND host = ?", (-os.getpid(), HOST)
            )
        self._session_pid = None

    def _reconcile(
        self, fix: bool, verify_sizes: bool = True, *, opening: bool = False
    ) -> CheckReport:
        report = CheckReport(ok=True)
        to_unlink: list[Path] = []
        evicted: list[tuple[Entry, Path | None]] = []
        now = time.time()
        with self._tx() as conn:
            # Reservations of dead processes.
            live_parts: set[str] = set()
            stale = False
            for name, pid, host, created in conn.execute(
                "SELECT name, pid, host, created FROM reservations"
            ).fetchall():
                if owner_gone(pid, host, created, now):
                    stale = True
                    report.problems.append(f"stale reservation {name} (pid {pid})")
                    if fix:
                        conn.execute("DELETE FROM reservations WHERE name = ?", (name,))
                        report.fixed.append(f"released reservation {name}")
                else:
                    live_parts.add(name)
            unclean = self._sessions(conn, now) if opening else True
            if verify_sizes:
                self._scan_sizes(conn, report, fix, live_parts, to_unlink)
            elif (
                unclean
                or stale
                or conn.execute("SELECT entries FROM totals WHERE id = 0").fetchone()[0]
                <= SCAN_ALWAYS
            ):
                later = getattr(self, "defer_names_above", None)
                if (
                    opening
                    and later is not None
                    and conn.execute("SELECT entries FROM totals WHERE id = 0").fetchone()[0]
                    > later
                ):
                    # owed until reconcile_names() ends, whoever closes or dies before
                    conn.execute(
                        "INSERT INTO sessions (pid, host, started) VALUES (?, ?, ?)",
                        (-os.getpid(), HOST, now),
                    )
                    self.names_pass = "pending"
                    log.info("%s: names to be compared once the store is open", self.cache_dir)
                else:
                    self._scan_names(conn, report, fix, live_parts, to_unlink)
            else:
                log.debug("%s: clean end, names not compared", self.cache_dir)
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

    @property
    def names_owed(self) -> bool:
        """Whether this open left its name pass to :meth:`reconcile_names`."""
        return getattr(self, "names_pass", None) == "pending"

    def stop_names(self) -> None:
        """Ask a :meth:`reconcile_names` under way to stop soon (it stays owed)."""
        self._names_stop.set()

    def reconcile_names(self) -> CheckReport:
        """The name pass an open left for later (``defer_names_above``), made while the
        store serves: what the open-time pass guarantees, once it returns — entry files
        without a row removed, rows without a file dropped, ``.part`` files without a
        reservation and ``.del`` files removed.

        Meanwhile trust does not rest on it (a row whose file is gone is a miss, a file
        without a row is never served, a new download never writes to a leftover's name):
        until it ends, leftovers cost only disk space. The directory is compared with one
        snapshot of the index, outside the write lock; each repair is then checked again
        and made under it, so a download committed or begun meanwhile is left alone.
        Stopped by :meth:`stop_names` (then still owed: the next open compares again).
        """
        report = CheckReport(ok=True)
        if not self.names_owed:
            return report
        self.names_pass = "running"
        t0 = time.monotonic()
        try:
            self._names_live(report)
        except _Stopped:
            self.names_pass = "stopped"
            return report
        except CacheError as exc:
            self.names_pass = f"failed: {exc}"
            raise
        with self._tx() as conn:
            conn.execute("DELETE FROM sessions WHERE pid = ? AND host = ?", (-os.getpid(), HOST))
        self.names_pass = "done"
        report.ok = not report.problems
        log.info(
            "cache %s: names compared in %.1f s: %d orphan files removed, %d rows without a "
            "file dropped, %d stale partial downloads removed",
            self.cache_dir,
            time.monotonic() - t0,
            report.orphans,
            report.missing,
            report.stale_partials,
        )
        return report

    def _names_live(self, report: CheckReport) -> None:
        stop = self._names_stop
        orphans: list[str] = []  # names without a row in the snapshot
        others: list[str] = []  # .part and .del names
        gone: list[str] = []  # rows of the snapshot whose file was not there
        try:
            conn = self._open_read_only()
        except sqlite3.Error as exc:
            raise self._index_error(exc, "cannot open index") from exc
        try:
            conn.execute("PRAGMA cache_size = -65536")  # 64 MiB at most, for this pass
            conn.execute("BEGIN")  # one snapshot of the index for the whole comparison
            rows = conn.execute("SELECT entries FROM totals WHERE id = 0").fetchone()[0]
            found = 0
            chunk: list[str] = []

            def settle() -> None:
                nonlocal found
                if stop.is_set():
                    raise _Stopped
                marks = ",".join("?" * len(chunk))
                have = {
                    r[0]
                    for r in conn.execute(f"SELECT key FROM entries WHERE key IN ({marks})", chunk)
                }
                found += len(have)
                orphans.extend(name for name in chunk if name not in have)
                chunk.clear()

            for name in self._listing():
                if len(name) == 36 and "." not in name:
                    chunk.append(name)
                    if len(chunk) >= NAMES_PER_QUERY:
                        settle()
                elif parse_part(name) is not None or is_del(name):
                    others.append(name)
            if chunk:
                settle()
            # a row of the snapshot not listed: its file was missing, or the store
            # removed or replaced it since (checked again below)
            if found < rows:
                cur = conn.execute("SELECT key FROM entries")
                try:
                    for i, (key,) in enumerate(cur):
                        if i % NAMES_PER_QUERY == 0 and stop.is_set():
                            raise _Stopped
                        if not os.path.lexists(os.path.join(self._base_of(key), key)):
                            gone.append(key)
                            if found + len(gone) >= rows:
                                break
                finally:
                    cur.close()
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise self._index_error(exc, "cannot read index") from exc
        finally:
            conn.close()
        todo = [(0, n) for n in orphans if is_uuid(n)] + [(1, n) for n in others]
        todo += [(2, k) for k in gone]
        for start in range(0, len(todo), FIXES_PER_TRANSACTION):
            if stop.is_set():
                raise _Stopped
            to_unlink: list[Path] = []
            fixed = len(report.fixed)
            with self._tx() as wconn:
                for kind, name in todo[start : start + FIXES_PER_TRANSACTION]:
                    self._fix_live(wconn, kind, name, report, to_unlink)
            for path in to_unlink:
                self._unlink(path)
            for line in report.fixed[fixed:]:
                log.info("cache %s: %s", self.cache_dir, line)

    def _fix_live(
        self,
        conn: sqlite3.Connection,
        kind: int,
        name: str,
        report: CheckReport,
        to_unlink: list[Path],
    ) -> None:
        """One repair of the deferred pass, its cause checked again under the write lock
        (``kind``: 0 a name without a row, 1 a ``.part`` or ``.del`` file, 2 a row
        without a file)."""
        if kind == 0:
            if conn.execute("SELECT 1 FROM entries WHERE key = ?", (name,)).fetchone() is None:
                self._orphan(name, report, True, to_unlink)  # committed since: has a row
        elif kind == 1:
            live = conn.execute("SELECT 1 FROM reservations WHERE name = ?", (name,)).fetchone()
            if live is None:  # begun since the open: reserved before its file was made
                self._leftover(name, report, True, set(), to_unlink)
        else:
            row = conn.execute("SELECT url FROM entries WHERE key = ?", (name,)).fetchone()
            if row is not None and not os.path.lexists(self._place(name)):
                self._missing(report, True, conn, name, row[0])
                self._mem.pop(name, None)
