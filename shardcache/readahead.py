"""Read a shard's members ahead of the consumer, in a thread.

A reader that consumes samples slower than a local file yields them (a training step, a
DataLoader worker waiting for its next index) otherwise pays for every member's read
when it asks for the next sample: the copy from the page cache, the page faults of the
new ``bytes``, the tar headers. :func:`members_ahead` does that work in a thread while
the consumer is busy elsewhere (file reads release the GIL), at most ``limit`` bytes of
member data ahead, and hands the members over in the same order, then the same end: the
exception the members iterator raised, raised again in the consumer, after every member
read before it.

Only regular files are read ahead (:func:`regular_file`): their reads cannot block for
long, so a consumer that stops early waits at most for the read in progress, and their
streams have no side effects of their own (a download being cached, a pipe's exit
status) that would happen in another thread.
"""

from __future__ import annotations

import atexit
import io
import os
import stat
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["ReadAhead", "members_ahead", "regular_file", "DEFAULT_READ_AHEAD"]

DEFAULT_READ_AHEAD = 8 << 20
"""Bytes of member data :class:`~shardcache.ShardDataset` reads ahead by default."""

_DONE = object()

_live: weakref.WeakSet[ReadAhead] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop the threads of iterations still open at exit (an iterator kept in a global),
    while the interpreter still runs them: a daemon thread frozen at shutdown in the
    middle of a read would hold its stream's lock when the stream is closed."""
    for reader in list(_live):
        reader.close()


def regular_file(stream: Any) -> bool:
    """True for a local regular file opened by :func:`open` (a ``FileIO``, buffered or
    not): a stream safe to read from another thread, whose reads never wait on a peer."""
    raw = stream.raw if isinstance(stream, io.BufferedReader) else stream
    if not isinstance(raw, io.FileIO) or stream.closed:
        return False
    try:
        return stat.S_ISREG(os.fstat(raw.fileno()).st_mode)
    except (OSError, ValueError):
        return False


class ReadAhead:
    """A thread reading the items of ``members`` (dicts whose ``"data"`` is ``bytes``)
    ahead of the consumer, started at once: at most ``limit`` bytes of ``data`` wait in
    the queue (always at least one item), plus the item being read. :meth:`items`
    yields them in order; an exception of ``members`` is raised there once the items
    before it are yielded. :attr:`read_all` turns true once ``members`` ended without
    error: its stream is not read any more. :meth:`close` (also at the end of
    :meth:`items`) stops the thread after the read in progress and waits for it, so the
    caller may then close the stream ``members`` reads.

    A full queue is refilled once half of it is taken, not item by item: the thread
    reads several members in a row while the consumer is busy, instead of waking (and
    asking for the GIL) at every item the consumer takes."""

    def __init__(self, members: Iterator[dict[str, Any]], limit: int) -> None:
        self.read_all = False
        self._members = members
        self._limit = limit
        self._low = limit // 2
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[Any] = deque()
        self._bytes = 0  # of the items queued
        self._full = False  # the thread waits for room
        self._stop = False
        self._thread = threading.Thread(
            target=self._produce, name="shardcache-read-ahead", daemon=True
        )
        self._thread.start()  # RuntimeError when no thread can be started
        _live.add(self)

    def _produce(self) -> None:
        cond, items, limit = self._cond, self._items, self._limit
        end: Any = _DONE
        try:
            for item in self._members:
                n = len(item["data"])
                with cond:
                    while items and self._bytes + n > limit and not self._stop:
                        self._full = True
                        cond.wait()
                    if self._stop:
                        return
                    items.append(item)
                    self._bytes += n
                    cond.notify()
            self.read_all = True
        except BaseException as exc:  # handed to the consumer, raised there
            end = exc
        finally:
            with cond:
                items.append(end)
                cond.notify()

    def items(self) -> Iterator[dict[str, Any]]:
        cond, items = self._cond, self._items
        try:
            while True:
                with cond:
                    while not items:
                        cond.wait()
                    item = items.popleft()
                    if item is _DONE:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    self._bytes -= len(item["data"])
                    if self._full and (self._bytes <= self._low or not items):
                        self._full = False
                        cond.notify()
                yield item
        finally:
            self.close()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()


def members_ahead(members: Iterator[dict[str, Any]], limit: int) -> Iterator[dict[str, Any]]:
    """The items of ``members``, read ahead by a :class:`ReadAhead` thread (at most
    ``limit`` bytes of ``data`` queued); closing the generator stops the thread."""
    yield from ReadAhead(members, limit).items()
