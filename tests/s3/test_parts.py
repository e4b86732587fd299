"""Parallel ranged fetches: part plan, in-order writes, lone retries, pinned versions."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from support.data import PARTS_OBJECT as DATA
from support.origins import RangedOrigin as Origin

from proxy.upstream.aio import AioTransport
from proxy.upstream.parts import can_fetch_in_parts, fetch_parts, parts_stream, plan_parts
from proxy.upstream.resume import backoff_delay
from proxy.upstream.stream import Policy, ask
from shardcache.errors import IncompleteDownloadError, ObjectChanged, UpstreamCut, UpstreamError
from shardcache.meta import ObjectMeta, parse_content_range

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
    ok = ObjectMeta(size=100, etag='"abc"', accept_ranges=True)
    assert can_fetch_in_parts(ok, 10)
    assert not can_fetch_in_parts(ok, 100)  # one part: nothing to parallelise
    assert not can_fetch_in_parts(ObjectMeta(size=None, etag='"a"', accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectMeta(size=100, etag=None, accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectMeta(size=100, etag='W/"a"', accept_ranges=True), 10)
    assert not can_fetch_in_parts(ObjectMeta(size=100, etag='"a"', accept_ranges=False), 10)


@given(st.integers(1, 20), st.floats(0, 1))
def test_backoff_is_bounded_and_grows(attempt, rand):
    d = backoff_delay(attempt, 0.1, cap=2.0, rand=rand)
    assert 0.05 * min(2 ** (attempt - 1), 20) - 1e-9 <= d <= 2.0
    assert backoff_delay(attempt + 1, 0.1, cap=100.0) >= backoff_delay(attempt, 0.1, cap=100.0)


# ----------------------------------------------------------------- a real ranged origin


PART = 128 * KIB
NPARTS = len(plan_parts(len(DATA), PART))


class Source:
    """One object behind a transport: ``url``, ``transport`` and its ``meta`` (a HEAD)."""

    def __init__(self, transport, url: str) -> None:
        self.transport = transport
        self.url = url

    async def stat(self) -> ObjectMeta:
        resp = await self.transport.request("HEAD", self.url, {})
        resp.close()
        return ObjectMeta.from_headers(resp.headers, 200)


@pytest.fixture
async def origin(aiohttp_server):
    o = Origin(DATA)
    app = web.Application()
    app.router.add_route("*", "/obj", o.handle)
    server = await aiohttp_server(app)
    transport = AioTransport(connect_timeout=5, read_timeout=5, chunk_size=16 * KIB)
    yield o, Source(transport, str(server.make_url("/obj")))
    await transport.close()


class _Cut:
    """A response whose body breaks off after ``after`` bytes (UpstreamCut)."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.after = inner, after
        self.status, self.reason, self.headers = inner.status, inner.reason, inner.headers

    async def chunks(self):
        sent = 0
        async for chunk in self.inner.chunks():
            if sent + len(chunk) > self.after:
                yield chunk[: self.after - sent]
                raise UpstreamCut("injected: connection reset mid-part")
            sent += len(chunk)
            yield chunk

    def pump(self, fd, hasher):  # pragma: no cover - parts read chunks
        raise NotImplementedError

    def close(self) -> None:
        self.inner.close()


class Flaky:
    """Fault injection around a transport: the GET whose range starts at ``fail_at``
    breaks after ``after`` bytes, ``times`` times. Records (start, end) of each GET."""

    def __init__(self, src: Source, fail_at: int, after: int, times: int = 1) -> None:
        self.inner = src.transport
        self.url = src.url
        self.fail_at = fail_at
        self.after = after
        self.times = times
        self.calls: list[tuple[int, int]] = []

    async def request(self, method, url, headers):
        resp = await self.inner.request(method, url, headers)
        rng = headers.get("Range")
        if method != "GET" or rng is None:
            return resp
        first, _, last = rng.removeprefix("bytes=").partition("-")
        start = int(first)
        self.calls.append((start, int(last) + 1 if last else len(DATA)))
        if start == self.fail_at and self.times > 0:
            self.times -= 1
            return _Cut(resp, self.after)
        return resp

    async def close(self) -> None:
        pass


def policy(retries: int = 3, backoff: float = 0.01) -> Policy:
    return Policy(retries, backoff)


async def fetch_to_file(transport, url, meta, path, **kw):
    with open(path, "wb") as f:

        async def sink(data: bytes) -> None:
            f.write(data)
            f.flush()

        n = await fetch_parts(transport, url, meta, sink, **kw)
    return n


async def test_parts_in_order_to_a_file(origin, tmp_path):
    o, src = origin
    meta = await src.stat()
    assert meta.size == len(DATA) and meta.etag == o.etag and meta.accept_ranges
    path = tmp_path / "out.part"
    n = await fetch_to_file(src.transport, src.url, meta, path, part_size=PART, parallel=4)
    assert n == len(DATA)
    assert path.read_bytes() == DATA
    ranges = sorted(r for m, r in o.requests if m == "GET")
    assert len(ranges) == NPARTS  # one request per part, none repeated


async def test_failed_part_is_resumed_alone(origin, tmp_path):
    o, src = origin
    meta = await src.stat()
    flaky = Flaky(src, fail_at=3 * PART, after=40 * KIB)
    path = tmp_path / "out.part"
    await fetch_to_file(flaky, src.url, meta, path, part_size=PART, parallel=4, policy=policy())
    assert path.read_bytes() == DATA
    starts = [s for s, _ in flaky.calls]
    assert len(starts) == NPARTS + 1
    # every part once, and the broken one resumed from where it stopped
    assert sorted(set(starts) - {3 * PART + 40 * KIB}) == [
        s for s, _ in plan_parts(len(DATA), PART)
    ]
    assert (3 * PART + 40 * KIB, 4 * PART) in flaky.calls
    resumed = [h for m, h in o.requests if h == f"bytes={3 * PART + 40 * KIB}-{4 * PART - 1}"]
    assert len(resumed) == 1


async def test_part_failing_every_time_fails_the_fetch(origin, tmp_path):
    o, src = origin
    meta = await src.stat()
    flaky = Flaky(src, fail_at=PART, after=0, times=100)
    with pytest.raises(IncompleteDownloadError):
        await fetch_to_file(
            flaky, src.url, meta, tmp_path / "x", part_size=PART, parallel=2, policy=policy(2)
        )
    assert sum(1 for s, _ in flaky.calls if s == PART) == 3  # one try + two retries


class ReplaceAfterFirstPart:
    """Replaces the origin's object once a part past the first is asked for."""

    def __init__(self, src: Source, origin: Origin, new: bytes) -> None:
        self.inner, self.origin, self.new = src.transport, origin, new

    async def request(self, method, url, headers):
        if (headers.get("Range") or "bytes=0-").removeprefix("bytes=")[:2] != "0-":
            self.origin.set(self.new)
        return await self.inner.request(method, url, headers)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("honour_if_match", [True, False])
async def test_replaced_object_never_mixes_versions(origin, tmp_path, honour_if_match):
    o, src = origin
    o.honour_if_match = honour_if_match  # without If-Match, the ETag check still catches it
    meta = await src.stat()
    new = bytes(len(DATA))
    path = tmp_path / "out.part"
    with pytest.raises(ObjectChanged):
        await fetch_to_file(
            ReplaceAfterFirstPart(src, o, new), src.url, meta, path, part_size=PART, parallel=1
        )
    got = path.read_bytes()
    assert got == DATA[: len(got)]  # only a prefix of the old version, never new bytes


async def test_parts_stream_with_initial_get(origin):
    o, src = origin
    counted: list[int] = []
    resp, meta = await ask(src.transport, src.url, None, 0, None, policy())
    assert can_fetch_in_parts(meta, PART)
    out = bytearray()
    async for chunk in parts_stream(
        src.transport,
        src.url,
        meta,
        part_size=PART,
        parallel=3,
        initial=resp,
        policy=Policy(3, 0.01, on_bytes=counted.append),
    ):
        out += chunk
    assert bytes(out) == DATA and sum(counted) == len(DATA)
    gets = [r for m, r in o.requests if m == "GET"]
    assert gets.count(None) == 1 and len(gets) == NPARTS  # part 0 came from the first GET


async def test_parts_stream_raises_on_failure_and_closes_early(origin):
    o, src = origin
    meta = await src.stat()
    with pytest.raises(IncompleteDownloadError):
        async for _ in parts_stream(
            Flaky(src, fail_at=0, after=0, times=10),
            src.url,
            meta,
            part_size=PART,
            policy=policy(0),
        ):
            pass
    agen = parts_stream(src.transport, src.url, meta, part_size=PART, parallel=4)
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
    transport = AioTransport(connect_timeout=5, read_timeout=5, chunk_size=KIB)
    meta = ObjectMeta(size=100, etag='"e"', accept_ranges=True)
    try:
        with pytest.raises(UpstreamError, match="ignores Range"):
            await ask(transport, str(server.make_url("/o")), meta, 10, 20, policy())
    finally:
        await transport.close()
