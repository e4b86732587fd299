"""Every way the proxy answers a data request goes through one response path: a hit from
RAM, a hit from its entry file, a miss (following its download, or cold), and the
pass-throughs (a directory-style path; ``Cache-Control: no-store``) give the same status,
headers and bytes for HEAD, an empty object, 304, 412, 416 and ranges, and count their
bytes and first byte alike; every body source that is cut after the headers ends in an
aborted connection, never a clean short response."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from support.data import blob
from support.proxy import downloads_done
from support.wait import until

from proxy.app import HITS, METRICS, make_app
from proxy.config import parse_settings
from proxy.hits import HitTier

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

ETAG = '"v1"'
LAST_MODIFIED = "Mon, 01 Jan 2024 00:00:00 GMT"
TYPE = "text/plain; charset=utf-8"  # a parameter that must survive every path


class Origin:
    """An in-process origin: ``/<name>`` answers ``files[name]`` (a single-range Range
    honoured; a trailing slash ignored), ``/nostore/<name>`` the same with
    ``Cache-Control: no-store``; a name in ``cut`` sends the body up to that byte of the
    object and then breaks the connection."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.cut: dict[str, int] = {}
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        nostore = tail.startswith("nostore/")
        name = tail.removeprefix("nostore/").rstrip("/")
        data = self.files.get(name)
        if data is None:
            return web.Response(status=404, text="not found\n")
        headers = {"ETag": ETAG, "Last-Modified": LAST_MODIFIED, "Content-Type": TYPE}
        if nostore:
            headers["Cache-Control"] = "no-store"
        status, start, end = 200, 0, len(data)
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and "," not in rng:
            first, _, last = rng[len("bytes=") :].partition("-")
            if first.isdigit() and int(first) < len(data):
                start = int(first)
                end = min(len(data), int(last) + 1) if last.isdigit() else len(data)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = end - start
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        body = data[start:end]
        cut = self.cut.get(name)
        if cut is not None:
            await resp.write(body[: max(0, cut - start)])
            await asyncio.sleep(0.05)
            request.transport.abort()  # type: ignore[union-attr]
            return resp
        await resp.write(body)
        return resp


@pytest.fixture
async def rig(aiohttp_client, tmp_path):
    origin = Origin()
    up = await aiohttp_client(origin.app)

    async def make(sendfile: bool = True):
        argv = ["--cache-dir", str(tmp_path / "cache"), "--upstream", str(up.make_url(""))]
        argv += ["--retries", "0"]
        settings = parse_settings(argv, {})
        return await aiohttp_client(make_app(settings, sendfile=sendfile))

    return origin, make


HEADERS = ("Content-Length", "Content-Range", "ETag", "Last-Modified", "Content-Type")


async def answer(client, method: str, path: str, headers: dict[str, str]) -> tuple:
    async with client.request(method, path, headers=headers) as r:
        body = await r.read()
        kept = {h: r.headers.get(h) for h in HEADERS}
        if r.status in (304, 412, 416):
            kept.pop("Content-Type")  # bodiless or an error line
            if r.status != 304:
                kept.pop("Content-Length")
        return r.status, kept, body, r.headers.get("X-Cache")


CASES = {
    "get": ("GET", {}),
    "head": ("HEAD", {}),
    "range": ("GET", {"Range": "bytes=100-199"}),
    "suffix": ("GET", {"Range": "bytes=-10"}),
    "not-modified": ("GET", {"If-None-Match": ETAG}),
    "head-not-modified": ("HEAD", {"If-None-Match": ETAG}),
    "precondition": ("GET", {"If-Match": '"other"'}),
    "unsatisfiable": ("GET", {"Range": "bytes=99999-"}),
    "if-range-other": ("GET", {"Range": "bytes=0-9", "If-Range": '"other"'}),
}
PATHS = ("ram", "file", "miss", "listing", "nostore")


async def target(client, origin: Origin, path: str, name: str) -> str:
    """The URL that asks for ``name`` the ``path`` way (cached first for a hit)."""
    if path == "listing":  # a directory-style path: always passed through
        return f"/{name}/"
    if path == "nostore":
        return f"/nostore/{name}"
    if path == "miss":
        fresh = f"{name}.{len(origin.files)}"  # a cold copy for every request
        origin.files[fresh] = origin.files[name]
        return f"/{fresh}"
    client.server.app[HITS].max_bytes = (32 << 20) if path == "ram" else 0
    async with client.get(f"/{name}") as r:
        await r.read()
    await downloads_done(client.server.app)
    return f"/{name}"


async def ask(client, origin: Origin, path: str, name: str, method, headers) -> tuple:
    """One request for ``name`` answered the ``path`` way."""
    got = await answer(client, method, await target(client, origin, path, name), headers)
    await downloads_done(client.server.app)
    return got


@pytest.mark.parametrize("size", [5000, 0], ids=["5000", "empty"])
async def test_every_path_gives_the_same_answer(rig, size):
    origin, make = rig
    origin.files["o.txt"] = data = blob(size)
    client = await make()
    for case, (method, headers) in CASES.items():
        seen = {}
        for path in PATHS:
            status, kept, body, cache = await ask(client, origin, path, "o.txt", method, headers)
            want = {"ram": "HIT", "file": "HIT", "miss": "MISS"}.get(path, "BYPASS")
            if path == "nostore" and (method == "HEAD" or case == "suffix"):
                want = "MISS"  # answered cold: from an upstream HEAD, or a ranged GET
            if status != 416:
                assert cache == want, (case, path)
            if size == 0 and case == "suffix" and cache is None and path in ("miss", "nostore"):
                continue  # answered cold: see test_cold_range_of_an_empty_object_names_its_size
            seen[path] = (status, kept, body)
        assert len(set(map(repr, seen.values()))) == 1, (case, {k: v[:2] for k, v in seen.items()})
        status, kept, body = seen["ram"]
        if case == "unsatisfiable" or (size == 0 and case in ("range", "suffix")):
            assert (status, kept["Content-Range"]) == (416, f"bytes */{size}"), case
        elif case in ("not-modified", "head-not-modified"):
            assert (status, body, kept["ETag"]) == (304, b"", ETAG)
        elif case == "precondition":
            assert status == 412
        elif case in ("range", "suffix"):
            want = data[100:200] if case == "range" else data[-10:]
            assert (status, body, kept["Content-Type"]) == (206, want, TYPE)
        else:
            assert status == 200 and kept["Content-Length"] == str(size)
            assert body == (b"" if method == "HEAD" else data)
            assert kept["Content-Type"] == TYPE


async def test_bytes_and_first_byte_are_counted_on_every_path(rig):
    origin, make = rig
    origin.files["b.txt"] = data = blob(3000, 1)
    client = await make()
    m = client.server.app[METRICS]

    def first_bytes(cache: str) -> float:
        return sum(b.get() for b in m.ttfb.labels(cache=cache)._buckets)

    async def counted() -> tuple[int, float]:
        """Served bytes and first bytes once every answer so far is counted (the count
        is taken when the handler returns, which may be after the client has read it)."""

        def requests() -> float:
            return sum(
                s.value
                for metric in m.exposed.collect()
                for s in metric.samples
                if s.name == "shardcache_requests_total"
            )

        await until(lambda: requests() == len(seen), 5, what=f"{len(seen)} requests counted")
        return m.totals()["served_bytes"], first_bytes(cache)

    seen = []
    for path in PATHS:
        cache = {"ram": "HIT", "file": "HIT", "miss": "MISS"}.get(path, "BYPASS")
        url = await target(client, origin, path, "b.txt")
        seen += [path] if path in ("ram", "file") else []  # the warm-up GET
        before = await counted()
        status, _, body, _ = await answer(client, "GET", url, {})
        seen.append(path)
        after = await counted()
        assert (status, body) == (200, data)
        assert after[0] - before[0] == len(data), path
        assert after[1] - before[1] == 1, path


async def test_cold_range_of_an_empty_object_names_its_size(rig):
    origin, make = rig
    origin.files["e.txt"] = b""
    client = await make()
    status, kept, _, _ = await answer(client, "GET", "/e.txt", {"Range": "bytes=-10"})
    assert (status, kept["Content-Range"]) == (416, "bytes */0")


@pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "no_sendfile"])
async def test_an_entry_file_cut_short_aborts_the_connection(rig, monkeypatch, tmp_path, sendfile):
    origin, make = rig
    origin.files["f.bin"] = blob(600 << 10, 2)
    client = await make(sendfile=sendfile)
    async with client.get("/f.bin") as r:
        await r.read()
    await downloads_done(client.server.app)
    opened = HitTier.open

    def open_then_shrink(self, entry):
        fobj = opened(self, entry)
        if fobj is not None:  # the file loses its tail once checked (replaced underneath)
            short = tmp_path / "short"
            short.write_bytes(blob(100 << 10, 2))
            fobj.close()
            fobj = open(short, "rb", buffering=0)  # noqa: SIM115 - closed by the proxy
        return fobj

    monkeypatch.setattr(HitTier, "open", open_then_shrink)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.get("/f.bin") as r:
            assert (r.status, r.headers["X-Cache"]) == (200, "HIT")
            await r.read()


@pytest.mark.parametrize(
    "path, rng",
    [
        ("/d.bin", None),  # the download fails: its followers are cut
        ("/nostore/d.bin", None),  # a pass-through body cut by the upstream
        ("/nostore/d.bin", "bytes=1000-"),  # ... and a range of it
        ("/d.bin", "bytes=4194400-"),  # a cold range far ahead, from a ranged upstream GET
    ],
)
async def test_an_upstream_cut_after_the_headers_aborts_the_connection(rig, path, rng):
    origin, make = rig
    size = 5 << 20
    origin.files["d.bin"] = blob(size, 3)
    origin.cut["d.bin"] = size - (200 << 10)
    client = await make()
    headers = {"Range": rng} if rng else {}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.get(path, headers=headers) as r:
            assert r.status == (206 if rng else 200)
            await r.read()
    await downloads_done(client.server.app)


@pytest.mark.parametrize("size", [10 << 10, 600 << 10], ids=["ram", "file"])
async def test_an_entry_another_process_replaced_is_served_as_its_new_version(rig, tmp_path, size):
    """Another process sharing the directory (a worker of ``--workers``, a library user)
    replaces an entry this proxy has read, with a new version of the same size: the hit
    is the new version's bytes under the new version's ETag, never the new bytes under
    the ETag this process remembers (a client's If-Range would splice two versions)."""
    from shardcache.meta import ObjectMeta
    from shardcache.store import Store

    origin, make = rig
    old, new = blob(size, 4), blob(size, 5)
    origin.files["r.bin"] = old
    client = await make()
    async with client.get("/r.bin") as r:
        assert await r.read() == old
    await downloads_done(client.server.app)
    for _ in range(2):  # hits: the entry is remembered, its bytes kept in RAM when small
        async with client.get("/r.bin") as r:
            assert (r.headers["X-Cache"], r.headers["ETag"], await r.read()) == ("HIT", ETAG, old)
    url = next(e.url for e in client.server.app[HITS].store.entries())
    other = Store(tmp_path / "cache", reconcile=False)  # another process's view
    try:
        partial = other.begin(url, size)
        assert partial is not None
        partial.path.write_bytes(new)
        other.commit(partial, size, meta=ObjectMeta(size=size, etag='"v2"', content_type=TYPE))
    finally:
        other.close()
    async with client.get("/r.bin", headers={"Range": "bytes=0-99", "If-Range": ETAG}) as r:
        body = await r.read()
        assert (r.status, r.headers["ETag"], body) in ((206, ETAG, old[:100]), (200, '"v2"', new))
    async with client.get("/r.bin") as r:
        assert (r.headers["ETag"], await r.read()) == ('"v2"', new)
