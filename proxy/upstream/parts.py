"""Parallel ranged parts of one object, handed over strictly in order.

A large object is fetched as ``part_size`` ranges by up to ``parallel`` concurrent
requests, each one :func:`proxy.upstream.stream.read` of the same version (so each part
is verified and resumed by the one rule), and handed to a sink in order, so a reader
following the growing partial file always sees a contiguous prefix. The part at the
write frontier streams straight through; parts ahead of it are held in memory (at most
``parallel - 1`` parts). Any part that fails for good fails the whole fetch: bytes of two
versions are never mixed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from proxy.upstream.options import DEFAULT_OPTIONS
from proxy.upstream.stream import Policy, read
from proxy.upstream.transport import Response, Transport
from shardcache.errors import UpstreamError
from shardcache.meta import ObjectMeta

__all__ = [
    "DEFAULT_PARALLEL",
    "DEFAULT_PART_SIZE",
    "PartsOrder",
    "can_fetch_in_parts",
    "fetch_parts",
    "parts_pump",
    "parts_stream",
    "plan_parts",
]

DEFAULT_PART_SIZE: int = DEFAULT_OPTIONS.part_size  # the settings table's --part-size
DEFAULT_PARALLEL: int = DEFAULT_OPTIONS.parallel  # and --parallel
DEFAULT_POLICY = Policy()
MAX_WRITE_BATCH = 4 * 1024 * 1024  # upper bound of one sink call when chunks are waiting


def can_fetch_in_parts(meta: ObjectMeta, part_size: int) -> bool:
    """Whether ``meta`` allows a parallel ranged fetch that is worth doing: a known size
    above one part, byte ranges, and a strong ETag to pin every part to one version."""
    return (
        meta.size is not None
        and meta.size > part_size
        and meta.accept_ranges
        and meta.strong_etag is not None
    )


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges that cover ``size`` bytes in ``part_size`` steps."""
    if part_size <= 0:
        raise ValueError(f"part_size must be positive, got {part_size}")
    if size < 0:
        raise ValueError(f"size must not be negative, got {size}")
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


class PartsOrder:
    """Which parts of a :func:`parts_pump` to fetch first, and how far each has arrived:
    shared by the pump and the readers of its file. A reader that needs bytes far ahead
    of the written prefix (a cold Range) asks for them with :meth:`prefer`; the next free
    part request takes the part holding them (after the part whose answer opened the
    download), so the range is answered at about a ranged request's latency from the
    object's one download, and no byte is fetched twice. :meth:`ready` tells how many
    bytes from a position are on disk; ``notify`` is called as a preferred part grows."""

    AHEAD = 2  # parts taken from a preferred position on: the one holding it, the next

    def __init__(self) -> None:
        self.wanted: list[int] = []
        self.notify: Callable[[], None] | None = None
        self._parts: list[tuple[int, int]] = []
        self._got: list[int] = []

    @property
    def active(self) -> bool:
        """Whether a pump writes by this order (parts at their offsets)."""
        return bool(self._parts)

    def prefer(self, pos: int) -> None:
        """Fetch the parts holding bytes ``pos`` on (the next :attr:`AHEAD`) first."""
        if self._parts:
            size = self._parts[0][1] - self._parts[0][0]
            pos -= pos % size  # one entry per part, however often its readers ask
        if pos not in self.wanted:
            self.wanted.append(pos)

    def ready(self, pos: int) -> int:
        """How many bytes from ``pos`` on are in the file (0 when none or unknown)."""
        parts, got = self._parts, self._got
        if not parts or pos < 0:
            return 0
        size = parts[0][1] - parts[0][0]
        i = pos // size
        n = 0
        while i < len(parts):
            start, end = parts[i]
            have = start + got[i]
            if have <= pos:
                break
            n += have - max(pos, start)
            if have < end:
                break
            i += 1
        return n

    def _next(self, started: list[bool]) -> int | None:
        """A preferred part not started yet, if any."""
        if not self._parts:
            return None
        size = self._parts[0][1] - self._parts[0][0]
        for pos in self.wanted:
            first = pos // size
            for i in range(first, min(first + self.AHEAD, len(self._parts))):
                if not started[i]:
                    return i
        return None


class _Part:
    __slots__ = ("start", "end", "chunks", "finished")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.chunks: collections.deque[bytes] = collections.deque()
        self.finished = False


async def fetch_parts(
    transport: Transport,
    url: str,
    meta: ObjectMeta,
    sink: Callable[[bytes], Awaitable[None]],
    *,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    policy: Policy = DEFAULT_POLICY,
    initial: Response | None = None,
) -> int:
    """Fetch the whole object ``meta`` as parallel parts, in order into ``sink``.

    ``initial`` may be an open, verified answer from byte 0 (the ranged GET of part 0):
    it serves the first part, so no request is wasted. Returns the number of bytes written; raises
    the error of a part that failed for good (the sink then holds an incomplete prefix
    that the caller must discard).
    """
    if meta.size is None:
        raise ValueError(f"{url}: size unknown, cannot fetch in parts")
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    parts = [_Part(s, e) for s, e in plan_parts(meta.size, part_size)]
    changed = asyncio.Condition()
    state = {"next": 0, "frontier": 0}
    quiet = Policy(policy.retries, policy.backoff, policy.observe)  # bytes counted once, below

    async def fill(part: _Part, index: int) -> None:
        first = initial if index == 0 else None
        stream = read(transport, url, meta, part.start, part.end, quiet, first=first)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for chunk in stream:
                part.chunks.append(chunk)
                async with changed:
                    changed.notify_all()
        part.finished = True
        async with changed:
            changed.notify_all()

    async def worker() -> None:
        while True:
            async with changed:
                index = state["next"]
                if index >= len(parts):
                    return
                state["next"] = index + 1
                # stay within `parallel` parts of the write frontier (bounded memory)
                await changed.wait_for(lambda i=index: i < state["frontier"] + parallel)
            await fill(parts[index], index)

    async def writer() -> int:
        written = 0
        for index, part in enumerate(parts):
            while True:
                async with changed:
                    await changed.wait_for(lambda p=part: bool(p.chunks) or p.finished)
                batch: list[bytes] = []
                size = 0
                while part.chunks and size < MAX_WRITE_BATCH:
                    chunk = part.chunks.popleft()
                    batch.append(chunk)
                    size += len(chunk)
                if batch:
                    await sink(batch[0] if len(batch) == 1 else b"".join(batch))
                    written += size
                elif part.finished:
                    break
            async with changed:
                state["frontier"] = index + 1
                changed.notify_all()
        return written

    workers = [asyncio.ensure_future(worker()) for _ in range(min(parallel, len(parts)))]
    write_task = asyncio.ensure_future(writer())
    pending = {write_task, *workers}
    try:
        while write_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        written = write_task.result()
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if initial is not None:
            initial.close()
    if written != meta.size:
        raise UpstreamError(f"{url}: wrote {written} of {meta.size} bytes")
    return written


_DONE = object()


async def parts_stream(
    transport: Transport,
    url: str,
    meta: ObjectMeta,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    policy: Policy = DEFAULT_POLICY,
    initial: Response | None = None,
) -> AsyncIterator[bytes]:
    """:func:`fetch_parts` as an async iterator of in-order chunks. It ends cleanly only
    after all ``meta.size`` bytes; any failure is raised from it. Closing it early
    cancels the part requests."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=4)

    async def sink(data: bytes) -> None:
        await queue.put(data)

    async def run() -> None:
        try:
            await fetch_parts(
                transport,
                url,
                meta,
                sink,
                part_size=part_size,
                parallel=parallel,
                policy=policy,
                initial=initial,
            )
        except BaseException as exc:  # handed to the consumer
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(exc)
            raise
        await queue.put(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while True:
            if queue.empty():
                if task.done():
                    # failed (or cancelled) with a full queue: raise, never wait in silence
                    raise task.exception() or UpstreamError(f"{url}: parts ended early")
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                item = get.result()
            else:
                item = queue.get_nowait()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            if policy.on_bytes is not None:
                policy.on_bytes(len(item))
            yield item
        await task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def parts_pump(
    transport: Transport,
    url: str,
    meta: ObjectMeta,
    fd: int,
    *,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    policy: Policy = DEFAULT_POLICY,
    initial: Response | None = None,
    initial_index: int = 0,
    order: PartsOrder | None = None,
    hasher: Any = None,
) -> AsyncIterator[int]:
    """The parts written straight into the file ``fd`` at their offsets, each through a
    descriptor of its own (by the transport's worker thread where it has one), nothing
    held in memory; yields how far the contiguous prefix of written bytes grew. Parts
    start in order, up to ``parallel`` at once — the one ``initial`` answers
    (``initial_index``) first, then those ``order`` prefers. Linux only
    (``/proc/self/fd``).

    ``hasher`` (``update(bytes)``) is fed the object in order: a worker thread reads the
    contiguous prefix back as it grows (from the page cache, where the bytes were just
    written) while later parts still arrive; the fetch ends once it has caught up."""
    if meta.size is None:
        raise ValueError(f"{url}: size unknown, cannot fetch in parts")
    parts = plan_parts(meta.size, part_size)
    got = [0] * len(parts)
    started = [False] * len(parts)
    wake = asyncio.Event()
    quiet = Policy(policy.retries, policy.backoff, policy.observe)
    state = {"next": 0}
    if order is not None:
        order._parts, order._got = parts, got

    def take() -> int | None:
        if not started[initial_index]:
            started[initial_index] = True
            return initial_index
        index = None if order is None else order._next(started)
        if index is None:
            while state["next"] < len(parts) and started[state["next"]]:
                state["next"] += 1
            if state["next"] >= len(parts):
                return None
            index = state["next"]
        started[index] = True
        return index

    async def fill(index: int) -> None:
        start, end = parts[index]
        pfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)  # its own file position
        try:
            os.lseek(pfd, start, os.SEEK_SET)
            first = initial if index == initial_index else None
            stream = read(transport, url, meta, start, end, quiet, first=first, sink=(pfd, None))
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for n in stream:
                    got[index] += n
                    wake.set()
                    if order is not None and order.wanted and order.notify is not None:
                        order.notify()  # a reader may wait for this part, ahead of the prefix
        finally:
            os.close(pfd)

    async def worker() -> None:
        while (index := take()) is not None:
            await fill(index)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(parallel, len(parts)))]
    hashed = _Follower(fd, hasher, meta.size) if hasher is not None else None
    if hashed is not None:
        tasks.append(hashed.task)
    for t in tasks:
        t.add_done_callback(lambda _: wake.set())  # a failure wakes the loop too
    reported = 0
    done_parts = 0
    try:
        while reported < meta.size:
            await wake.wait()
            wake.clear()
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            while (
                done_parts < len(parts)
                and got[done_parts] == parts[done_parts][1] - parts[done_parts][0]
            ):
                done_parts += 1
            frontier = (
                meta.size if done_parts == len(parts) else parts[done_parts][0] + got[done_parts]
            )
            if frontier > reported:
                if policy.on_bytes is not None:
                    policy.on_bytes(frontier - reported)
                if hashed is not None:
                    hashed.advance(frontier)
                yield frontier - reported
                reported = frontier
            if all(t.done() for t in tasks) and reported < meta.size:
                if all(got[i] == e - s for i, (s, e) in enumerate(parts)):
                    wake.set()  # all ended while the reader held the last batch: report them
                    continue
                raise UpstreamError(f"{url}: parts ended at byte {reported} of {meta.size}")
        await asyncio.gather(*tasks)
    finally:
        if hashed is not None:
            hashed.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if initial is not None:
            initial.close()


HASH_READ = 4 << 20  # bytes read back per call while following the prefix


class _Follower:
    """Feeds ``hasher`` the file's bytes ``[0, size)`` in order as the contiguous prefix
    grows (:meth:`advance`), read back in a worker thread through a descriptor of its
    own; its task ends once all ``size`` bytes are hashed (or raises what failed)."""

    def __init__(self, fd: int, hasher: Any, size: int) -> None:
        self.rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        self.hasher = hasher
        self.size = size
        self.done = 0
        self.frontier = 0
        self._more = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    def advance(self, frontier: int) -> None:
        self.frontier = frontier
        self._more.set()

    def _hash(self, start: int, end: int) -> None:
        pos = start
        while pos < end:
            data = os.pread(self.rfd, min(HASH_READ, end - pos), pos)
            if not data:
                raise UpstreamError(f"hashing: file ended at byte {pos} of {end}")
            self.hasher.update(data)
            pos += len(data)

    async def _run(self) -> None:
        while self.done < self.size:
            await self._more.wait()
            self._more.clear()
            end = self.frontier
            if end > self.done:
                fut = asyncio.get_running_loop().run_in_executor(None, self._hash, self.done, end)
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    # the descriptor is closed when this task ends: not under a read
                    with contextlib.suppress(BaseException):
                        await fut
                    raise
                self.done = end

    def close(self) -> None:
        if self.rfd >= 0:
            fd, self.rfd = self.rfd, -1
            if self.task.done():
                os.close(fd)
            else:  # a read may still run in its thread: close the descriptor after it
                self.task.add_done_callback(lambda _: os.close(fd))
