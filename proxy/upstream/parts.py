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

from proxy.config import DEFAULTS
from proxy.upstream.stream import Policy, read
from proxy.upstream.transport import Response, Transport
from shardcache.errors import UpstreamError
from shardcache.meta import ObjectMeta

__all__ = [
    "DEFAULT_PARALLEL",
    "DEFAULT_PART_SIZE",
    "can_fetch_in_parts",
    "fetch_parts",
    "parts_pump",
    "parts_stream",
    "plan_parts",
]

DEFAULT_PART_SIZE: int = DEFAULTS["part_size"]  # the settings table's --part-size
DEFAULT_PARALLEL: int = DEFAULTS["parallel"]  # and --parallel
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
) -> AsyncIterator[int]:
    """The parts written straight into the file ``fd`` at their offsets, each through a
    descriptor of its own (by the transport's worker thread where it has one), nothing
    held in memory; yields how far the contiguous prefix of written bytes grew. Parts
    start in order, up to ``parallel`` at once. Linux only (``/proc/self/fd``)."""
    if meta.size is None:
        raise ValueError(f"{url}: size unknown, cannot fetch in parts")
    parts = plan_parts(meta.size, part_size)
    got = [0] * len(parts)
    wake = asyncio.Event()
    quiet = Policy(policy.retries, policy.backoff, policy.observe)
    state = {"next": 0}

    async def fill(index: int) -> None:
        start, end = parts[index]
        pfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)  # its own file position
        try:
            os.lseek(pfd, start, os.SEEK_SET)
            first = initial if index == 0 else None
            stream = read(transport, url, meta, start, end, quiet, first=first, sink=(pfd, None))
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for n in stream:
                    got[index] += n
                    wake.set()
        finally:
            os.close(pfd)

    async def worker() -> None:
        while state["next"] < len(parts):
            index = state["next"]
            state["next"] += 1
            await fill(index)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(parallel, len(parts)))]
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
                yield frontier - reported
                reported = frontier
            if all(t.done() for t in tasks) and reported < meta.size:
                if all(got[i] == e - s for i, (s, e) in enumerate(parts)):
                    wake.set()  # all ended while the reader held the last batch: report them
                    continue
                raise UpstreamError(f"{url}: parts ended at byte {reported} of {meta.size}")
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if initial is not None:
            initial.close()
