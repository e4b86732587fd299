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

import io
import os
import stat
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["members_ahead", "regular_file", "DEFAULT_READ_AHEAD"]

DEFAULT_READ_AHEAD = 8 << 20
"""Bytes of member data :class:`~shardcache.ShardDataset` reads ahead by default."""

_DONE = object()


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


def members_ahead(members: Iterator[dict[str, Any]], limit: int) -> Iterator[dict[str, Any]]:
    """Yield the items of ``members`` (dicts whose ``"data"`` is ``bytes``), which a
    thread reads ahead: at most ``limit`` bytes of ``data`` wait in the queue (always at
    least one item), plus the item being read. An exception of ``members`` is raised
    here once the items before it are yielded. Closing this generator stops the thread
    (after the read in progress) before it returns, so the caller may then close the
    stream ``members`` reads.

    A full queue is refilled once half of it is taken, not item by item: the thread
    reads several members in a row while the consumer is busy, instead of waking (and
    asking for the GIL) at every item the consumer takes."""
    cond = threading.Condition(threading.Lock())
    items: deque[Any] = deque()
    low = limit // 2
    # bytes queued; the thread waits for room; the consumer stopped
    state = {"bytes": 0, "full": False, "stop": False}

    def produce() -> None:
        end: Any = _DONE
        try:
            for item in members:
                n = len(item["data"])
                with cond:
                    while items and state["bytes"] + n > limit and not state["stop"]:
                        state["full"] = True
                        cond.wait()
                    if state["stop"]:
                        return
                    items.append(item)
                    state["bytes"] += n
                    cond.notify()
        except BaseException as exc:  # handed to the consumer, raised there
            end = exc
        finally:
            with cond:
                items.append(end)
                cond.notify()

    thread = threading.Thread(target=produce, name="shardcache-read-ahead", daemon=True)
    thread.start()
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
                state["bytes"] -= len(item["data"])
                if state["full"] and (state["bytes"] <= low or not items):
                    state["full"] = False
                    cond.notify()
            yield item
    finally:
        with cond:
            state["stop"] = True
            cond.notify()
        thread.join()
