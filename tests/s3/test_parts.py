"""Parallel ranged fetches: part plan, in-order writes, lone retries, pinned versions."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random

import pytest
from aiohttp import ClientSession, web
from hypothesis import given
from hypothesis import strategies as st

from proxy.parts import (
    FileSink,
    HTTPRangedSource,
    ObjectChanged,
    ObjectInfo,
    backoff_delay,
    can_fetch_in_parts,
    fetch_parts,
    info_from_headers,
    parse_content_range,
    parts_stream,
    plan_parts,
    response_chunks,
)
from shardcache.errors import UpstreamError

KIB = 1024


# ----------------------------------------------------------------- pure policy


@given(st.integers(0, 10_000), st.integers(1, 3000))
def test_plan_parts_covers_exactly(size, part_size):
    parts = plan_parts(size, part_size)
    assert sum(e - s for s, e in parts) == size
    pos = 0
    for s, e in parts:
        assert s == pos and 0 < e - s <= part_size
        pos = e


def test_plan_parts_rejects_nonsense():
    with pytest.raises(ValueError):
        plan_parts(10, 0)
    with pytest.raises(ValueError):
        plan_parts(-1, 10)


def test_parse_content_range():
    assert parse_content_range("bytes 0-9/100") == (0, 9, 100)
    assert parse_content_range("bytes 5-5/*") == (5, 5, None)
    for bad in ("", "bytes 9-0/100", "bytes 0-100/100", "items 0-1/2", "bytes=0-1/2"):
        with pytest.raises(ValueError):
            parse_content_range(bad)


def test_can_fetch_in_parts():
    ok = ObjectInfo(size=100, etag='"abc"', accept_ranges=True)
    assert can_fetch_in_parts(ok, 10)
    assert not can_fetch_in_parts(ok, 100)  # one part: nothing to parallelise
    assert not can_fetch_in_parts(ObjectInfo(size=None, etag='"a"', accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectInfo(size=100, etag=None, accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectInfo(size=100, etag='W/"a"', accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectInfo(size=100, etag='"a"', accept_ranges=False), 10)


@given(st.integers(0, 20), st.floats(0, 1))
def test_backoff_is_bounded_and_grows(attempt, rand):
    d = backoff_delay(attempt, 0.1, cap=2.0, rand=rand)
    assert 0.05 * min(2**attempt, 20) - 1e-9 <= d <= 2.0
    assert backoff_delay(attempt + 1, 0.1, cap=100.0) >= backoff_delay(attempt, 0.1, cap=100.0)


# ----------------------------------------------------------------- a real ranged origin


class Origin:
    """Serves one object with ETag, Range and If-Match; records the ranges asked."""

    def __init__(self, data: bytes, honour_if_match: bool = True) -> None:
        self.set(data)
        self.honour_if_match = honour_if_match
        self.requests: list[tuple[str, str | None]] = []

    def set(self, data: bytes) -> None:
        self.data = data
        self.etag = '"' + hashlib.md5(data).hexdigest() + '"'

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range")
        self.requests.append((request.method, rng))
        headers = {"ETag": self.etag, "Accept-Ranges": "bytes"}
        im = request.headers.get("If-Match")
        if self.honour_if_match and im and im != self.etag:
            return web.Response(status=412, headers=headers)
        if rng is None:
            body = b"" if request.method == "HEAD" else self.data
            headers["Content-Length"] = str(len(self.data))
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            for i in range(0, len(body), 64 * KIB):
                await resp.write(body[i : i + 64 * KIB])
            await resp.write_eof()
            return resp
        first, _, last = rng.removeprefix("bytes=").partition("-")
        first, last = int(first), min(int(last), len(self.data) - 1)
        headers["Content-Range"] = f"bytes {first}-{last}/{len(self.data)}"
        return web.Response(status=206, body=self.data[first : last + 1], headers=headers)


DATA = random.Random(7).randbytes(1000 * KIB + 123)
PART = 128 * KIB
NPARTS = len(plan_parts(len(DATA), PART))


@pytest.fixture
async def origin(aiohttp_server):
    o = Origin(DATA)
    app = web.Application()
    app.router.add_route("*", "/obj", o.handle)
    server = await aiohttp_server(app)
    async with ClientSession() as session:
        yield o, HTTPRangedSource(session, str(server.make_url("/obj")), chunk_size=16 * KIB)


class Flaky:
    """Fault injection around a ranged source: part starting at ``fail_at`` breaks
    after ``after`` bytes, ``times`` times."""

    def __init__(self, inner, fail_at: int, after: int, times: int = 1) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_at = fail_at
        self.after = after
        self.times = times
        self.calls: list[tuple[int, int]] = []

    async def stat(self):
        return await self.inner.stat()

    async def read_range(self, start, end, etag):
        self.calls.append((start, end))
        sent = 0
        async for chunk in self.inner.read_range(start, end, etag):
            if start == self.fail_at and self.times > 0 and sent + len(chunk) > self.after:
                self.times -= 1
                yield chunk[: self.after - sent]
                raise UpstreamError("injected: connection reset mid-part")
            sent += len(chunk)
            yield chunk


async def fetch_to_file(source, info, path, **kw):
    seen: list[int] = []

    def progress(n: int) -> None:
        # The file holds exactly the contiguous prefix reported so far.
        assert os.path.getsize(path) == n
        assert not seen or n > seen[-1]
        seen.append(n)

    with open(path, "wb") as f:
        n = await fetch_parts(source, info, FileSink(f), on_progress=progress, **kw)
    return n, seen


async def test_parts_in_order_to_a_file(origin, tmp_path):
    o, src = origin
    info = await src.stat()
    assert info == ObjectInfo(len(DATA), o.etag, None, "application/octet-stream", True) or (
        info.size == len(DATA) and info.etag == o.etag and info.accept_ranges
    )
    path = tmp_path / "out.part"
    n, seen = await fetch_to_file(src, info, path, part_size=PART, parallel=4)
    assert n == len(DATA) and seen[-1] == len(DATA)
    assert path.read_bytes() == DATA
    ranges = sorted(r for m, r in o.requests if m == "GET")
    assert len(ranges) == NPARTS  # one request per part, none repeated


async def test_failed_part_is_retried_alone(origin, tmp_path):
    o, src = origin
    info = await src.stat()
    flaky = Flaky(src, fail_at=3 * PART, after=40 * KIB)
    path = tmp_path / "out.part"
    await fetch_to_file(flaky, info, path, part_size=PART, parallel=4, backoff=0.01)
    assert path.read_bytes() == DATA
    starts = [s for s, _ in flaky.calls]
    assert len(starts) == NPARTS + 1
    # every part once, and the broken one resumed from where it stopped
    assert sorted(set(starts) - {3 * PART + 40 * KIB}) == [
        s for s, _ in plan_parts(len(DATA), PART)
    ]
    assert (3 * PART + 40 * KIB, 4 * PART) in flaky.calls


async def test_part_failing_every_time_fails_the_fetch(origin, tmp_path):
    o, src = origin
    info = await src.stat()
    flaky = Flaky(src, fail_at=PART, after=0, times=100)
    with pytest.raises(UpstreamError, match="injected"):
        await fetch_to_file(
            flaky, info, tmp_path / "x", part_size=PART, parallel=2, retries=2, backoff=0.01
        )
    assert sum(1 for s, _ in flaky.calls if s == PART) == 3  # one try + two retries


class ReplaceAfterFirstPart:
    """Replaces the origin's object once the first part has been read."""

    def __init__(self, inner, origin: Origin, new: bytes) -> None:
        self.inner, self.origin, self.new, self.url = inner, origin, new, inner.url

    async def read_range(self, start, end, etag):
        if start > 0:
            self.origin.set(self.new)
        async for chunk in self.inner.read_range(start, end, etag):
            yield chunk


@pytest.mark.parametrize("honour_if_match", [True, False])
async def test_replaced_object_never_mixes_versions(origin, tmp_path, honour_if_match):
    o, src = origin
    o.honour_if_match = honour_if_match  # without If-Match, the ETag check still catches it
    info = await src.stat()
    new = bytes(len(DATA))
    path = tmp_path / "out.part"
    with pytest.raises(ObjectChanged):
        await fetch_to_file(
            ReplaceAfterFirstPart(src, o, new), info, path, part_size=PART, parallel=1
        )
    got = path.read_bytes()
    assert got == DATA[: len(got)]  # only a prefix of the old version, never new bytes


async def test_parts_stream_with_initial_get(origin, aiohttp_server):
    o, src = origin
    async with src.session.get(src.url) as resp:
        info = info_from_headers(resp.headers)
        assert can_fetch_in_parts(info, PART)
        counted: list[int] = []
        out = bytearray()
        async for chunk in parts_stream(
            src,
            info,
            part_size=PART,
            parallel=3,
            initial=response_chunks(resp, 16 * KIB),
            on_bytes=counted.append,
        ):
            out += chunk
    assert bytes(out) == DATA and sum(counted) == len(DATA)
    gets = [r for m, r in o.requests if m == "GET"]
    assert gets.count(None) == 1 and len(gets) == NPARTS  # part 0 came from the first GET


async def test_parts_stream_raises_on_failure_and_closes_early(origin):
    o, src = origin
    info = await src.stat()
    with pytest.raises(UpstreamError):
        async for _ in parts_stream(
            Flaky(src, fail_at=0, after=0, times=10), info, part_size=PART, retries=0
        ):
            pass
    agen = parts_stream(src, info, part_size=PART, parallel=4)
    first = await agen.__anext__()
    assert first == DATA[: len(first)]
    await agen.aclose()  # cancels the remaining part requests without hanging
    await asyncio.sleep(0)


async def test_origin_ignoring_range_is_an_error(aiohttp_server):
    async def handler(request):
        return web.Response(body=b"x" * 100, headers={"ETag": '"e"', "Accept-Ranges": "bytes"})

    app = web.Application()
    app.router.add_get("/o", handler)
    server = await aiohttp_server(app)
    async with ClientSession() as session:
        src = HTTPRangedSource(session, str(server.make_url("/o")))
        with pytest.raises(UpstreamError, match="ignored the Range"):
            async for _ in src.read_range(0, 10, '"e"'):
                pass
