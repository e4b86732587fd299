"""The tests' origins, in one place.

- :class:`Origin` (with :class:`Fault`): an aiohttp origin in a thread of its own, with
  fault modes per path (status, hang, truncate, drop once, trickle, gate); counts GETs.
- :class:`BadOrigin` (:mod:`support.badorigin`): a raw socket origin that misbehaves on
  purpose, scenario by scenario, for the trust-rule tests of every transport.
- :class:`ThreadedOrigin` (:mod:`support.httporigin`): http.server, drops mid-body or
  trickles; for blocking clients of the library.
- :class:`CountingOrigin` (:mod:`support.opshelpers`): http.server with HEAD and ETag,
  an optional delay between chunks; for the operator and deployment tests.
- :class:`RangedOrigin`: an aiohttp handler for one object with ETag, Range and
  If-Match, recording the ranges asked (the parts tests mount it in their own app).
- :class:`Hub` (:mod:`support.huborigin`): a Hugging Face Hub and its signed CDN.
- :func:`serve_directory` (:mod:`support.pipeline_helpers`): a directory over HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from .badorigin import BadOrigin, Request, Scenario, Version
from .httporigin import Origin as ThreadedOrigin
from .huborigin import Hub
from .opshelpers import Origin as CountingOrigin
from .pipeline_helpers import serve_directory
from .wait import until

__all__ = [
    "BadOrigin",
    "CountingOrigin",
    "Fault",
    "Hub",
    "Origin",
    "RangedOrigin",
    "Request",
    "Scenario",
    "ThreadedOrigin",
    "Version",
    "serve_directory",
]


@dataclass
class Fault:
    """How the origin misbehaves for one path."""

    status: int | None = None  # answer this status instead
    hang: bool = False  # accept, then never answer
    truncate_at: int | None = None  # every GET: send this many bytes, then drop
    drop_once_at: int | None = None  # the first GET drops here; later (Range) GETs work
    delay: float = 0.0  # seconds between chunks
    chunk: int = 64 << 10
    etag: bool = True  # send an ETag
    chunked: bool = False  # no Content-Length (Transfer-Encoding: chunked)
    bad_md5: bool = False  # send a wrong Content-MD5
    ignore_range: bool = False  # answer 200 to Range requests
    range_status: int | None = None  # answer this status to Range requests
    gate: threading.Event | None = None  # wait for this before sending the body


@dataclass
class Origin:
    """An HTTP origin on 127.0.0.1 serving ``files``; counts requests per path."""

    files: dict[str, bytes] = field(default_factory=dict)
    faults: dict[str, Fault] = field(default_factory=dict)
    gets: Counter = field(default_factory=Counter)
    ranges: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    if_ranges: list[str | None] = field(default_factory=list)  # If-Range of each GET
    port: int = 0
    active: int = 0  # GETs being answered now
    max_active: int = 0  # the most GETs answered at once
    # ("start" | "end", path, Range) of each GET, in the order they happened
    events: list[tuple[str, str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def etag(self, name: str) -> str:
        return '"' + hashlib.md5(self.files[name]).hexdigest() + '"'

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET":
            return await self._answer(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        what = (request.match_info["name"], request.headers.get("Range"))
        self.events.append(("start", *what))
        try:
            return await self._answer(request)
        finally:
            self.active -= 1
            self.events.append(("end", *what))

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        fault = self.faults.get(name, Fault())
        if request.method == "GET":
            self.gets[name] += 1
            self.ranges.append(
                (name, request.headers.get("Range"), request.headers.get("If-Match"))
            )
            self.if_ranges.append(request.headers.get("If-Range"))
        if fault.hang:
            await asyncio.sleep(3600)
        if fault.status is not None:
            return web.Response(status=fault.status, text=f"fault {fault.status}\n")
        data = self.files.get(name)
        if data is None:
            return web.Response(status=404, text="not found\n")
        etag = self.etag(name)
        start, status = 0, 200
        headers = {
            "Content-Type": "application/x-tar",
            "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
        }
        if fault.etag:
            headers["ETag"] = etag
        rng = request.headers.get("Range")
        if rng and fault.range_status is not None:
            return web.Response(status=fault.range_status, text=f"no ranges here: {rng}\n")
        if rng and not fault.ignore_range:
            im = request.headers.get("If-Match")
            if im is not None and im != etag:
                return web.Response(status=412, text="precondition failed\n")
            m = re.match(r"bytes=(\d+)-(\d*)$", rng)
            assert m, rng
            start, status = int(m.group(1)), 206
            end = min(int(m.group(2)) + 1, len(data)) if m.group(2) else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        else:
            end = len(data)
        body = data[start:end]
        if fault.bad_md5:
            headers["Content-MD5"] = "AAAAAAAAAAAAAAAAAAAAAA=="
        resp = web.StreamResponse(status=status, headers=headers)
        if not fault.chunked:
            resp.content_length = len(body)
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        if fault.gate is not None:  # a threading.Event the test sets
            await until(fault.gate.is_set, 60, what=f"the test to open {name}'s gate")
        cut = None
        if fault.truncate_at is not None:
            cut = fault.truncate_at - start
        elif fault.drop_once_at is not None and self.gets[name] == 1:
            cut = fault.drop_once_at
        limit = len(body) if cut is None else max(0, cut)
        pos = 0
        while pos < limit:
            piece = body[pos : min(limit, pos + fault.chunk)]
            await resp.write(piece)
            pos += len(piece)
            if fault.delay:
                await asyncio.sleep(fault.delay)
        if cut is not None:
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    def start(self) -> Origin:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{name:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="origin")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("origin did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            for f in self.faults.values():
                if f.gate is not None:
                    f.gate.set()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


class RangedOrigin:
    """Serves one object with ETag, Range and If-Match; records the ranges asked."""

    def __init__(self, data: bytes, honour_if_match: bool = True) -> None:
        self.set(data)
        self.honour_if_match = honour_if_match
        self.requests: list[tuple[str, str | None]] = []
        self.sent = 0  # body bytes handed to the connection (what an origin bills)

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
            for i in range(0, len(body), (64 << 10)):
                await resp.write(body[i : i + (64 << 10)])
                self.sent += len(body[i : i + (64 << 10)])
            await resp.write_eof()
            return resp
        first, _, last = rng.removeprefix("bytes=").partition("-")
        first, last = int(first), min(int(last or len(self.data) - 1), len(self.data) - 1)
        headers["Content-Range"] = f"bytes {first}-{last}/{len(self.data)}"
        if request.method != "HEAD":
            self.sent += last + 1 - first
        return web.Response(status=206, body=self.data[first : last + 1], headers=headers)
