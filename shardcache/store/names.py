"""Names in the cache directory and the processes behind them.

Layout of ``cache_dir``::

    <shard_uuid(url)>                     a complete entry (bytes exactly as the upstream sent)
    <key>.<pid>.<random>.part             a download in progress (never served as an entry)
    <key>.<random>.del                    an evicted entry waiting to be unlinked
    .shardcache.sqlite (+ -wal, -shm)     the index

That is the ``flat`` layout. In the ``fanout`` layout each of those entry, ``.part`` and
``.del`` files lives one level down, in the subdirectory named by the first two hex
digits of its key (``ab/ab12…``: 256 subdirectories), so that no directory holds more
than a 256th of the entries (ext4 without ``large_dir`` holds ~9.4M names in one
directory). A store's layout is chosen when its index is created and recorded there
(:func:`place` finds a file in either).

An entry's key is ``shard_uuid`` of its URL as ``key_url`` makes it (the daemon drops
signatures there). Rows the index keeps for a process (reservations, a user's claims)
name its pid and host: :func:`owner_gone` says when such a row may be taken over. How the
store's messages name its settings is :class:`SettingNames`, so a program on top (the
daemon) can have them speak of its own flags.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardcache.urls import shard_uuid

log = logging.getLogger("shardcache.store")

INDEX_NAME = ".shardcache.sqlite"
PART_SUFFIX = ".part"
DEL_SUFFIX = ".del"
STALE_AGE = 24 * 3600.0  # a .part or reservation older than this is stale whatever its pid

FLAT = "flat"
FANOUT = "fanout"
LAYOUTS = (FLAT, FANOUT)
FANOUT_CHARS = 2  # hex digits of the key naming its subdirectory: 256 subdirectories
FANOUT_DIRS = tuple(f"{i:02x}" for i in range(16**FANOUT_CHARS))


def place(base: str, layout: str, name: str) -> str:
    """Where the file ``name`` (an entry key, or a ``.part``/``.del`` name, which starts
    with its key) lives in the cache directory ``base`` of ``layout``."""
    if layout == FANOUT:
        return os.path.join(base, name[:FANOUT_CHARS], name)
    return os.path.join(base, name)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_uuid(name: str) -> bool:
    """Whether ``name`` is a canonical (lower-case, hyphenated) UUID, as shard_uuid makes."""
    return len(name) == 36 and _UUID_RE.fullmatch(name) is not None


class PathStr:
    """A directory entry's path, made into a Path only when a file is moved or removed."""

    __slots__ = ("base", "name")

    def __init__(self, base: str, name: str) -> None:
        self.base, self.name = base, name

    def __str__(self) -> str:
        return os.path.join(self.base, self.name)

    def __fspath__(self) -> str:
        return str(self)

    @property
    def path(self) -> Path:
        return Path(self.base, self.name)


def size_of(path: str | os.PathLike) -> int | None:
    """The size of the file at ``path``, None when there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def parse_part(name: str) -> tuple[str, int] | None:
    """``<key>.<pid>.<random>.part`` -> (key, pid), or None if not one of ours."""
    if not name.endswith(PART_SUFFIX):
        return None
    parts = name[: -len(PART_SUFFIX)].split(".")
    if len(parts) != 3 or not is_uuid(parts[0]) or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def part_name(key: str) -> str:
    """A unique name for a download of ``key`` by this process (see :func:`parse_part`)."""
    return f"{key}.{os.getpid()}.{secrets.token_hex(6)}{PART_SUFFIX}"


def is_del(name: str) -> bool:
    if not name.endswith(DEL_SUFFIX):
        return False
    parts = name[: -len(DEL_SUFFIX)].split(".")
    return len(parts) == 2 and is_uuid(parts[0])


HOST = socket.gethostname()


START_MARGIN = 5.0  # seconds of clock error allowed between a row's time and its process's start


def process_started(pid: int) -> float | None:
    """When process ``pid`` of this host started, by the wall clock (Linux ``/proc``: its
    start in ticks since boot against the uptime); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the fields after the command name, which is in parentheses and may hold spaces:
        # the 22nd field of the line, the start time, is the 20th of them
        ticks = int(stat.rpartition(b")")[2].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (uptime - ticks / hz)


def owner_gone(pid: int, host: str, created: float, now: float) -> bool:
    """Whether a row a process wrote (``pid`` on ``host`` at ``created``) has outlived it:
    a dead pid on this host, a pid of this host whose process started after the row was
    written (another process with the same pid: in a container, a restarted program
    often gets its predecessor's pid and host name), or older than :data:`STALE_AGE`
    wherever it runs."""
    if now - created > STALE_AGE:
        return True
    if host != HOST:
        return False
    if not pid_alive(pid):
        return True
    started = process_started(pid)
    return started is not None and created < started - START_MARGIN


_GONE = -1.0  # OwnerCheck: a pid with no live process


class OwnerCheck:
    """:func:`owner_gone` for the rows of one read (every reservation, on each download's
    start): each pid of this host is looked up once, however many rows name it, and this
    process's own rows need no system call (its start is read once per process). The
    verdicts are those of :func:`owner_gone` at ``now``."""

    _own: tuple[int, float | None] | None = None  # (pid, its start) of this process

    def __init__(self, now: float) -> None:
        self.now = now
        self._started: dict[int, float | None] = {}

    @classmethod
    def _own_start(cls, pid: int) -> float | None:
        own = cls._own
        if own is None or own[0] != pid:  # first use, or a forked child
            own = cls._own = (pid, process_started(pid))
        return own[1]

    def gone(self, pid: int, host: str, created: float) -> bool:
        if self.now - created > STALE_AGE:
            return True
        if host != HOST:
            return False
        started = self._started.get(pid, _GONE)
        if pid not in self._started:
            if pid == os.getpid():
                started = self._own_start(pid)
            else:
                started = process_started(pid) if pid_alive(pid) else _GONE
            self._started[pid] = started
        if started == _GONE:
            return True
        return started is not None and created < started - START_MARGIN


@dataclass(frozen=True)
class SettingNames:
    """How the store's messages name its settings: the library's parameter names by
    default; a program that sets them from its own flags gives their names instead."""

    cache_dir: str = "cache_dir"
    min_free: str = "min_free"
    keep: str = 'the "keep" policy'  # the policy that never evicts
    layout: str = "layout"


class Naming:
    """Keys, entry paths and the file operations on entry files (a part of :class:`Store`)."""

    cache_dir: Path
    key_url: Callable[[str], str] | None
    layout: str  # FLAT or FANOUT, as the index records it

    def _place(self, name: str) -> Path:
        """The path of the file ``name`` (an entry key, a ``.part`` or ``.del`` name)."""
        if self.layout == FANOUT:
            return self.cache_dir / name[:FANOUT_CHARS] / name
        return self.cache_dir / name

    def key(self, url: str) -> str:
        """The entry key of ``url``: ``shard_uuid`` of the full URL (as ``key_url`` makes
        it, when set)."""
        return shard_uuid(self.recorded_url(url))

    def entry_path(self, url: str) -> Path:
        """Where the entry of ``url`` lives (whether or not it exists)."""
        return self._place(self.key(url))

    def recorded_url(self, url: str) -> str:
        """The URL an entry of ``url`` is keyed and recorded by (``key_url``'s, when set)."""
        return self.key_url(url) if self.key_url is not None else url

    def _move_aside(self, path: Path) -> Path | None:
        """Rename an entry file to a unique ``.del`` name (inside a transaction)."""
        target = path.with_name(f"{path.name}.{secrets.token_hex(6)}{DEL_SUFFIX}")
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.error("cannot move evicted cache file %s aside: %s", path, exc)
            return path  # try to unlink it in place
        return target

    def _unlink(self, path: Path) -> bool:
        """Delete a file (missing is fine); False, logged, when it cannot be deleted."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.error("cannot delete cache file %s: %s", path, exc)
            return False
        return True
