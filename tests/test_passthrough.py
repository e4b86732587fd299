"""A full disk mid-download on each http transport, and an object replaced at the origin
just as the disk fills: the *passthrough* state of :mod:`proxy.inflight`.

When a write to the ``.part`` file fails with ENOSPC, every client of the download sends
the bytes already written, then fetches the rest of its range from the upstream through
``Fetcher.read_range``, which must prove that the continuation is the same version. The
outcome for each client is either its complete, correct range, or an aborted connection:
never a body that ends cleanly with too few bytes or with bytes of two versions.

The interleaving is deterministic: the origin sends the first ``PAUSE`` bytes of the
object, then holds the download's response until the test has filled the cache
filesystem (a tmpfs) — and, for the replaced-object cases, swapped the object. The
clients are then all waiting at the written prefix (except one that reads slowly), and
the proxy's next write fails. The proxy's log stays outside the tmpfs.
"""

from __future__ import annotations

import base64
import concurrent.futures
import email.utils
import hashlib
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from support.data import sha
from support.passthrough import (
    CLIENT_TIMEOUT,
    Client,
    Outcome,
    assert_complete,
    assert_old_or_aborted,
    check_bookkeeping,
    expected,
    wait_for,
)
from support.proxy import part_files, stats
from support.proxy_helpers import Origin
from support.store_faults import Rig, fill
from support.wait import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

KiB = 1 << 10
MiB = 1 << 20
SIZE = 16 * MiB
PAUSE = 5 * MiB + 12345  # not on a 2 MiB part boundary
LM_OLD = "Mon, 01 Jan 2024 00:00:00 GMT"
LM_NEW = "Mon, 01 Jan 2024 01:00:00 GMT"


# --- an origin whose object can be paused mid-body and replaced ---------------------------


@dataclass
class Spec:
    """How :class:`VersionedOrigin` serves one object."""

    etag: str | None = "strong"  # "strong", "weak" or None (no ETag header)
    last_modified: str | None = LM_OLD  # of the current version; None: no header
    honor_preconditions: bool = True  # False: If-Match / If-Unmodified-Since are ignored
    pause_at: int | None = None  # a response crossing this byte stops there until `gate`
    gate: threading.Event = field(default_factory=threading.Event)
    chunk: int = 256 * KiB
    # an ETag that stays whatever the bytes become (an origin whose storage changed them)
    etag_value: str | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)  # on every answer


@dataclass
class VersionedOrigin(Origin):
    """An origin with byte ranges (``bytes=N-`` and ``bytes=N-M``), ``Accept-Ranges``,
    strong/weak/no ETag, Last-Modified, honoured or ignored preconditions, optional Basic
    auth, and a per-object pause point. ``log`` records every request and its answer."""

    specs: dict[str, Spec] = field(default_factory=dict)
    log: list[dict] = field(default_factory=list)
    auth: tuple[str, str] | None = None

    def etag_of(self, name: str) -> str | None:
        spec = self.specs.get(name, Spec())
        if spec.etag_value is not None:
            return spec.etag_value
        if spec.etag is None:
            return None
        tag = '"' + hashlib.md5(self.files[name]).hexdigest() + '"'
        return "W/" + tag if spec.etag == "weak" else tag

    def requests(self, name: str) -> list[dict]:
        return [r for r in self.log if r["name"] == name and r["method"] == "GET"]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        spec = self.specs.get(name, Spec())
        h = request.headers
        rec = {
            "name": name,
            "method": request.method,
            "range": h.get("Range"),
            "if_match": h.get("If-Match"),
            "if_unmodified_since": h.get("If-Unmodified-Since"),
            "authorization": h.get("Authorization"),
            "status": None,
            "etag": None,
            "last_modified": None,
            "sent": 0,
        }
        self.log.append(rec)
        if request.method == "GET":
            self.gets[name] += 1
        if self.auth is not None:
            token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            if h.get("Authorization") != f"Basic {token}":
                rec["status"] = 401
                return web.Response(status=401, text="who are you\n")
        data = self.files.get(name)
        if data is None:
            rec["status"] = 404
            return web.Response(status=404, text="not found\n")
        etag, lm = self.etag_of(name), spec.last_modified
        headers = {"Content-Type": "application/x-tar", "Accept-Ranges": "bytes"}
        headers.update(spec.extra_headers)
        if etag:
            headers["ETag"] = etag
        if lm:
            headers["Last-Modified"] = lm
        if spec.honor_preconditions:
            im, ius = h.get("If-Match"), h.get("If-Unmodified-Since")
            failed = False
            if im is not None:  # strong comparison only
                failed = etag is None or etag.startswith("W/") or im.strip() != etag
            elif ius is not None and lm is not None:
                failed = email.utils.parsedate_to_datetime(lm) > email.utils.parsedate_to_datetime(
                    ius
                )
            if failed:
                rec["status"] = 412
                return web.Response(status=412, text="precondition failed\n")
        start, stop, status = 0, len(data), 200
        rng = h.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            assert m, rng
            start = int(m.group(1))
            if m.group(2):
                stop = min(stop, int(m.group(2)) + 1)
            if start >= len(data) or stop <= start:
                rec["status"] = 416
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
        rec.update(status=status, etag=etag, last_modified=lm)
        body = data[start:stop]  # a version swapped later does not change this response
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(body)
        try:
            await resp.prepare(request)
            if request.method == "HEAD":
                return resp
            await self._send(resp, spec, body, start, rec)
        except ConnectionResetError:  # the proxy let go (a part taken, a client aborted)
            pass
        return resp

    async def _send(
        self, resp: web.StreamResponse, spec: Spec, body: bytes, start: int, rec: dict
    ) -> None:
        pos, stop = start, start + len(body)
        while pos < stop:
            piece_end = min(stop, pos + spec.chunk)
            if spec.pause_at is not None and not spec.gate.is_set():
                if pos == spec.pause_at:
                    await until(spec.gate.is_set, 60, 0.005, what="the test to open the gate")
                elif pos < spec.pause_at < piece_end:
                    piece_end = spec.pause_at
            await resp.write(body[pos - start : piece_end - start])
            rec["sent"] += piece_end - pos
            pos = piece_end
        await resp.write_eof()

    def stop(self) -> None:
        for spec in self.specs.values():
            spec.gate.set()
        super().stop()


# --- clients -------------------------------------------------------------------------------


def standard_clients() -> list[Client]:
    """Two whole-object readers, a tail range, a range ending past the pause point (its
    continuation names an explicit end), and a reader that is still behind when the disk
    fills (it sends the rest of the unlinked prefix first)."""
    return [
        Client("first"),
        Client("second"),
        Client("tail", start=1000, ranged=True),
        Client("window", start=100, end=PAUSE + 3 * MiB, ranged=True),
        Client("slow", read_delay=1.0),
    ]


# --- the scenario ------------------------------------------------------------------------


@pytest.fixture
def origin():
    o = VersionedOrigin().start()
    yield o
    o.stop()


def part_size_now(cache: Path) -> int:
    total = 0
    for n in part_files(cache):
        try:
            total += os.path.getsize(cache / n)
        except FileNotFoundError:
            pass
    return total


def run_disk_full(
    rig: Rig,
    origin: VersionedOrigin,
    name: str,
    data: bytes,
    spec: Spec,
    *,
    upstream: str | None = None,
    proxy_args: tuple[str, ...] = (),
    clients: list[Client] | None = None,
    replace_with: bytes | None = None,
    new_last_modified: str | None = None,
) -> Outcome:
    """Start the clients of one download, let it write ``spec.pause_at`` bytes, then
    (optionally) replace the object at the origin, fill the cache filesystem and let the
    origin go on: the proxy's next write fails with ENOSPC. Returns when every client is
    done (each bounded by CLIENT_TIMEOUT)."""
    fs = rig.mount_tmpfs("fs", "size=64m")
    cache = fs / "cache"
    origin.files[name] = data
    origin.specs[name] = spec
    p = rig.proxy(cache, "--upstream", upstream or origin.url, "--min-free", "0", *proxy_args)
    tail = lambda: p.log_text()[-4000:]  # noqa: E731
    clients = clients if clients is not None else standard_clients()
    pause = spec.pause_at or 0
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as ex:
        futures = [ex.submit(c.run, p.port, f"/{name}") for c in clients]
        wait_for(lambda: all(c.got_headers.is_set() for c in clients), 20, "response headers", tail)
        for c in clients:
            assert c.status in (200, 206), c.describe() + "\n" + tail()
            assert c.content_length == len(expected(c, data)), c.describe()
        wait_for(lambda: part_size_now(cache) >= pause, 20, f".part at {pause} bytes", tail)
        # every reader that is not slow has all the written bytes of its range
        wait_for(
            lambda: all(
                c.received >= max(0, min(pause, len(data) if c.end is None else c.end) - c.start)
                for c in clients
                if not c.read_delay
            ),
            20,
            "the clients to catch up with the written prefix",
            lambda: "\n".join(c.describe() for c in clients) + "\n" + tail(),
        )
        if "--http-parts" in proxy_args:
            # parts land at their offsets: the file may hold parts past the paused one
            assert part_size_now(cache) >= pause
        else:
            assert part_size_now(cache) == pause, "the origin did not pause where asked"
        if replace_with is not None:
            assert len(replace_with) == len(data)  # the same size: only validators tell
            origin.files[name] = replace_with
            if new_last_modified is not None:
                spec.last_modified = new_last_modified
        fill(fs / "filler")
        spec.gate.set()
        released = time.monotonic()
        for f in futures:
            f.result(timeout=CLIENT_TIMEOUT + 15)
    # each response ends promptly, complete or aborted: none waits for a read timeout
    for c in clients:
        assert c.done_at - released < 10 + c.read_delay, c.describe()
    log = p.log_text()
    assert re.search(r"store write failed after \d+ bytes", log), (
        "the download never saw the full disk\n" + log[-4000:]
    )
    check_bookkeeping(p.port, cache, tail)
    return Outcome(clients, log, p.port)


# --- 1: a full disk on each transport, the upstream healthy -------------------------------


@pytest.mark.parametrize(
    "transport",
    [
        "threaded",  # the default: a worker thread receives the body (also test_store_trust)
        "parts",  # aiohttp, parallel ranged parts
        "credentials",  # user:pass in the upstream URL: aiohttp, one stream
    ],
)
def test_disk_full_mid_download_every_client_completes(rig, origin, transport):
    data = os.urandom(SIZE)
    args: tuple[str, ...] = ()
    upstream = None
    if transport == "parts":
        args = ("--http-parts", "on", "--part-size", "2MiB", "--parallel", "4")
    if transport == "credentials":
        origin.auth = ("u", "p")
        upstream = f"http://u:p@127.0.0.1:{origin.port}"
    out = run_disk_full(
        rig, origin, "obj.tar", data, Spec(pause_at=PAUSE), upstream=upstream, proxy_args=args
    )
    assert_complete(out, data)
    reqs = origin.requests("obj.tar")
    etag = origin.etag_of("obj.tar")
    if transport == "parts":
        assert any(r["range"] and r["if_match"] == etag for r in reqs[1:]), reqs
    else:
        assert reqs[0]["range"] is None
    if transport == "credentials":
        assert all(r["authorization"] for r in reqs), reqs
    assert all(r["status"] in (200, 206) for r in reqs), reqs
    # the continuations: exactly one per client, from the end of the written prefix (not
    # a part boundary), pinned to the version
    late = [r for r in reqs if _range_start(r) == PAUSE]
    assert all(r["if_match"] == etag for r in late), late
    want = Counter(
        f"bytes={PAUSE}-" + ("" if c.end is None else str(c.end - 1)) for c in out.clients
    )
    assert Counter(r["range"] for r in late) == want, late
    assert stats(out.proxy_port)["store"]["writable"] is False


def _range_start(rec: dict) -> int:
    m = re.match(r"bytes=(\d+)-", rec["range"] or "")
    return int(m.group(1)) if m else 0


# --- 2: the object is replaced at the origin as the disk fills ---------------------------


@pytest.mark.parametrize(
    "validators",
    [
        "etag",  # strong ETag: If-Match, answered 412
        "last-modified",  # no ETag: If-Unmodified-Since, answered 412
        "weak-etag+last-modified",  # a weak ETag cannot pin a range: Last-Modified does
        "last-modified-ignored",  # If-Unmodified-Since ignored: the new Last-Modified tells
        "none",  # nothing pins the version: clients mid-body must be aborted
        "etag-ignored",  # If-Match ignored: 206 with the new bytes and the new ETag
    ],
)
def test_object_replaced_as_the_disk_fills_never_splices(rig, origin, validators):
    old = os.urandom(SIZE)
    new = os.urandom(SIZE)
    spec = Spec(pause_at=PAUSE)
    new_lm = LM_NEW
    if validators in ("last-modified", "last-modified-ignored"):
        spec.etag = None
    if validators == "weak-etag+last-modified":
        spec.etag = "weak"
    if validators == "none":
        spec.etag, spec.last_modified, new_lm = None, None, None
    if validators in ("etag-ignored", "last-modified-ignored"):
        spec.honor_preconditions = False
    if validators == "etag-ignored":
        new_lm = None  # the same Last-Modified: only the ETag tells
    out = run_disk_full(
        rig, origin, "obj.tar", old, spec, replace_with=new, new_last_modified=new_lm
    )
    assert_old_or_aborted(out, old)
    # every client needs bytes past the written prefix, which the origin no longer has
    for c in out.clients:
        assert not c.clean, c.describe()
    reqs = origin.requests("obj.tar")
    first, later = reqs[0], reqs[1:]
    assert first["range"] is None and first["status"] == 200
    old_etag = first["etag"]
    if validators == "none":
        assert later == [], "asked the upstream for a range it cannot pin to a version"
        return
    assert 1 <= len(later) <= len(out.clients), later
    for r in later:
        if validators in ("etag", "etag-ignored"):
            assert r["if_match"] == old_etag and r["if_unmodified_since"] is None, r
        else:
            assert r["if_match"] is None and r["if_unmodified_since"] == LM_OLD, r
        ignored = validators.endswith("-ignored")
        assert r["status"] == (206 if ignored else 412), r


# --- the byte-0 rule: no validator, the disk full before the first byte ---------------------


def test_no_validator_disk_full_before_any_byte(rig, origin):
    """With nothing written yet, a client of the whole object may take it from the
    upstream again from byte 0; a client of a range starting later cannot be pinned to the
    version its headers announced, and is aborted."""
    data = os.urandom(4 * MiB)
    spec = Spec(etag=None, last_modified=None, pause_at=0)
    clients = [
        Client("first"),
        Client("second"),
        Client("tail", start=1000, ranged=True),
    ]
    out = run_disk_full(rig, origin, "zero.tar", data, spec, clients=clients)
    by = {c.label: c for c in out.clients}
    for label in ("first", "second"):
        c = by[label]
        assert c.clean and c.status == 200, c.describe() + "\n" + out.log[-3000:]
        assert sha(c.body) == sha(data), c.describe()
    tail = by["tail"]
    assert not tail.clean and tail.received == 0, tail.describe()
    reqs = origin.requests("zero.tar")
    assert [r["range"] for r in reqs[1:]] == [None, None], reqs


# --- 4: the continuation is checked against the digest the first answer declared -------


def test_continuation_with_a_changed_byte_fails_the_declared_digest(rig, origin):
    """The origin declared the object's Content-MD5; after the disk fills, the rest that
    the clients read from the upstream has one byte changed under the same ETag (so no
    validator can tell). Every client reading to the end is aborted, none ends cleanly
    with that byte; the range that does not reach it is served whole."""
    data = os.urandom(SIZE)
    bad = bytearray(data)
    bad[SIZE - 1000] ^= 0xFF
    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    spec = Spec(pause_at=PAUSE, etag_value='"fixed"', extra_headers={"Content-MD5": md5})
    out = run_disk_full(rig, origin, "obj.tar", data, spec, replace_with=bytes(bad))
    assert_old_or_aborted(out, data)
    for c in out.clients:
        if c.end is None:
            assert not c.clean, c.describe()
        else:
            assert c.clean, c.describe()
    assert "digest mismatch" in out.log
