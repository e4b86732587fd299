"""A close-delimited upstream body (no Content-Length, not chunked: it ends where the
origin closes its connection) is relayed close-delimited: no Content-Length, no chunks,
``Connection: close``, and the proxy's connection closed at its end — an orderly close
for an orderly close, a reset for a reset. The proxy cannot tell such a body's end from
a cut (unless it confirms the size, which it does only before caching), so a chunked
answer with its terminating chunk would vouch for bytes nobody vouched for. A chunked
upstream body cut before its last chunk still resets the client's connection.

Every path such a body takes is read from the wire, with the framing and the way the
connection ended recorded: a miss (the download, not cached without a validator), a
follower of it, a bypass (``no-store``), and a pass-through (``--uncached-path``, the
Hub's API paths), on the threads and aiohttp transports.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass

import pytest
from support.faultclient import COMMON, TRANSPORTS, settle, stats
from support.origins import BadOrigin, Version

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

KiB = 1 << 10
SIZE = 1 << 20
CUT = 400 * KiB + 123
ETAG = '"v1-0123456789abcdef"'
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
WHOLE = ("threads", "aiohttp")  # the transports that read a whole body in one answer


@pytest.fixture(params=WHOLE)
def transport(request) -> str:
    """Each whole-body transport in turn; conftest's ``proxy_args`` gives the proxy its
    flags."""
    return request.param


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


@dataclass
class Wire:
    """One answer as it came over the connection."""

    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes
    framing: str  # "length", "chunked" or "close"
    complete: bool  # what the framing says: every byte of the length, the last chunk
    ended: str  # "close" (orderly), "reset", "timeout" or "open" (kept alive)

    def describe(self) -> str:
        return (
            f"status {self.status} framing {self.framing} complete {self.complete} "
            f"ended {self.ended} body {len(self.body)} X-Cache {self.headers.get('x-cache')} "
            f"connection {self.headers.get('connection')}"
        )


def get(port: int, path: str, method: str = "GET") -> Wire:
    """``method path`` over HTTP/1.1 on a fresh connection, read until the connection
    ends (or, for a length-framed or chunked answer kept alive, until it is complete)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        return ask(s, path, method)


def ask(s: socket.socket, path: str, method: str = "GET") -> Wire:
    """``method path`` on the open connection ``s``, read as :func:`get` says."""
    raw = b""
    ended = "timeout"
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            piece = s.recv(1 << 16)
            if not piece:
                ended = "close"
                break
            raw += piece
            if method == "HEAD" and b"\r\n\r\n" in raw:
                ended = "open"
                break
            w = _parse(raw, "open")
            if w is not None and w.framing != "close" and w.complete:
                ended = "open"
                break
    except ConnectionResetError:
        ended = "reset"
    except OSError as exc:
        ended = repr(exc)
    w = _parse(raw, ended)
    assert w is not None, f"no answer head ({ended}): {raw[:200]!r}"
    return w


def _parse(raw: bytes, ended: str) -> Wire | None:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body, complete = _dechunk(rest)
        return Wire(status, headers, body, "chunked", complete, ended)
    if "content-length" in headers:
        n = int(headers["content-length"])
        return Wire(status, headers, rest[:n], "length", len(rest) >= n, ended)
    return Wire(status, headers, rest, "close", ended == "close", ended)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out = []
    pos = 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return b"".join(out), False
        size = int(data[pos:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out), True
        start = line_end + 2
        if len(data) < start + size + 2:
            out.append(data[start : start + size])
            return b"".join(out), False
        out.append(data[start : start + size])
        pos = start + size + 2


def assert_by_close(w: Wire, data: bytes, *, cut: bool, how: str = "close") -> None:
    """``w`` relayed close-delimited; whole and closed in order, or (``cut``) a prefix
    ended as the origin ended it (``how``)."""
    what = w.describe()
    assert w.status == 200, what
    assert w.framing == "close", "a close-delimited body relayed with framing: " + what
    assert w.headers.get("connection", "").lower() == "close", what
    if how == "rst":
        # a reset is a cut the proxy sees: resumed (every byte, with a validator), or
        # relayed as a reset
        if w.ended == "close":
            assert w.body == data, "an upstream reset relayed as an orderly close: " + what
        else:
            assert w.ended == "reset" and data.startswith(w.body), what
    elif cut:
        # the origin's orderly close: what it said, and all a client can be told
        assert w.ended == "close" and w.body == data[:CUT], what
    else:
        assert w.ended == "close" and w.body == data, what


def test_a_whole_unconfirmable_body_is_relayed_close_delimited(origin, proxy):
    data = os.urandom(SIZE)
    origin.add("/anon.tar", versions=[Version(data)], framing="close")
    w = get(proxy.port, "/anon.tar")
    assert_by_close(w, data, cut=False)
    assert settle(proxy)["entries"] == 0  # no validator: nothing confirms its size


@pytest.mark.parametrize("how", ["close", "rst"])
def test_a_cut_unconfirmable_body_ends_as_the_origin_ended_it(origin, proxy, how):
    """Cut at 40 %: an orderly close is what a complete body looks like too, so the
    client gets the same (and nothing is cached); a reset is relayed as a reset."""
    data = os.urandom(SIZE)
    origin.add("/anon.tar", versions=[Version(data)], framing="close", cut_at=CUT, cut_mode=how)
    w = get(proxy.port, "/anon.tar")
    assert_by_close(w, data, cut=True, how=how)
    assert settle(proxy)["entries"] == 0


def test_a_confirmed_body_is_relayed_close_delimited_then_cached(origin, proxy):
    """With a validator the probe of its last byte confirms the size: the miss still
    ends as its upstream's did (by the close), the hit has a Content-Length."""
    data = os.urandom(SIZE)
    origin.add("/ok.tar", versions=[Version(data, etag=ETAG, last_modified=LM)], framing="close")
    assert_by_close(get(proxy.port, "/ok.tar"), data, cut=False)
    settle(proxy)
    hit = get(proxy.port, "/ok.tar")
    assert hit.headers.get("x-cache") == "HIT" and hit.framing == "length", hit.describe()
    assert hit.complete and hit.body == data, hit.describe()


def test_a_body_proved_cut_resets_the_client(origin, proxy):
    """An orderly close at 40 % of a version whose end probe states a larger size: a
    cut, proved — the client's connection is reset, nothing cached."""
    data = os.urandom(SIZE)
    sc = origin.add(
        "/obj.tar",
        versions=[Version(data, etag=ETAG, last_modified=LM)],
        framing="close",
        cut_at=CUT,
        cut_on="first",
    )
    w = get(proxy.port, "/obj.tar")
    assert w.framing == "close" and w.ended == "reset", w.describe()
    assert settle(proxy)["entries"] == 0
    sc.heal()
    again = get(proxy.port, "/obj.tar")
    assert again.headers.get("x-cache") == "MISS", again.describe()
    assert_by_close(again, data, cut=False)


@pytest.mark.parametrize("how", ["close", "rst"])
def test_followers_of_a_close_delimited_download(origin, proxy, how):
    """Two clients of one slow download (the second joins it): both relayed
    close-delimited, and cut the way the origin cut it."""
    data = os.urandom(SIZE)
    origin.add(
        "/slow.tar",
        versions=[Version(data)],
        framing="close",
        rate=4 << 20,
        cut_at=CUT if how == "rst" else None,
        cut_mode=how,
    )
    got: dict[str, Wire] = {}
    first = threading.Thread(target=lambda: got.__setitem__("a", get(proxy.port, "/slow.tar")))
    first.start()
    time.sleep(0.1)
    got["b"] = get(proxy.port, "/slow.tar")
    first.join(30)
    assert len(origin.log("/slow.tar", "GET")) == 1, "the second client did not join"
    for w in got.values():
        assert_by_close(w, data, cut=how == "rst", how=how)


@pytest.mark.parametrize("how", ["close", "rst"])
def test_a_bypassed_body_ends_as_the_origin_ended_it(origin, proxy, how):
    data = os.urandom(SIZE)
    v = Version(data, etag=ETAG, last_modified=LM, headers={"Cache-Control": "no-store"})
    origin.add("/private.tar", versions=[v], framing="close", cut_at=CUT, cut_mode=how)
    w = get(proxy.port, "/private.tar")
    assert w.headers.get("x-cache") == "BYPASS", w.describe()
    assert_by_close(w, data, cut=True, how=how)
    assert stats(proxy.port)["entries"] == 0


@pytest.mark.parametrize("where", ["/obj.tar", "/api/models/x"])
def test_a_chunked_body_cut_before_its_last_chunk_resets_the_client(origin, proxy, where):
    data = os.urandom(SIZE)
    origin.add(where, versions=[Version(data)], framing="chunked", cut_at=CUT)
    w = get(proxy.port, where)
    assert w.ended == "reset" or (w.framing == "chunked" and not w.complete), w.describe()
    assert not (w.complete and w.ended in ("close", "open")), w.describe()


@pytest.mark.parametrize("how", ["whole", "close", "rst"])
def test_a_passed_through_body_ends_as_the_origin_ended_it(origin, proxy, how):
    """``--uncached-path`` (default ``api/*``): forwarded for every request, never
    cached; a reset at the end of a close-delimited body (which aiohttp reads as its
    end) is relayed as a reset, not as the last chunk."""
    data = os.urandom(256 * KiB)
    cut = None if how == "whole" else 100 * KiB
    origin.add(
        "/api/datasets/x",
        versions=[Version(data, content_type="application/json")],
        framing="close",
        cut_at=cut,
        cut_mode="rst" if how == "rst" else "close",
    )
    w = get(proxy.port, "/api/datasets/x")
    assert w.headers.get("x-cache") == "BYPASS", w.describe()
    assert w.framing == "close", w.describe()
    assert w.headers.get("connection", "").lower() == "close", w.describe()
    if how == "rst":
        assert w.ended == "reset", "an upstream reset relayed as a clean end: " + w.describe()
    else:
        assert w.ended == "close" and w.body == (data if cut is None else data[:cut]), w.describe()


def _pin_workers(port: int, workers: int = 2, tries: int = 200) -> dict[int, socket.socket]:
    """One open connection to each worker (a connection stays with the worker that
    accepted it, which ``/-/stats`` names): {pid: socket}."""
    pinned: dict[int, socket.socket] = {}
    for _ in range(tries):
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        w = ask(s, "/-/stats")
        pid = json.loads(w.body)["pid"]
        if pid in pinned or w.ended != "open":
            s.close()
        else:
            pinned[pid] = s
        if len(pinned) == workers:
            return pinned
    for s in pinned.values():
        s.close()
    raise AssertionError(f"{tries} connections reached {len(pinned)} workers")


@pytest.mark.parametrize("how", ["whole", "rst"])
def test_a_client_of_another_workers_download(origin, proxies, transport, how):
    """``--workers 2``: a client on the worker that does not download is answered by
    the one that does, over loopback, and relayed: close-delimited as the upstream's
    body was, its reset relayed as a reset (no validator: nothing can resume it)."""
    data = os.urandom(SIZE)
    origin.add(
        "/w.tar",
        versions=[Version(data)],
        framing="close",
        rate=1 << 20,
        cut_at=CUT if how == "rst" else None,
        cut_mode="rst",
    )
    p = proxies("--upstream", origin.url, "--workers", "2", *COMMON, *TRANSPORTS[transport])
    pinned = list(_pin_workers(p.port).values())
    got: dict[int, Wire] = {}
    try:
        first = threading.Thread(target=lambda: got.__setitem__(0, ask(pinned[0], "/w.tar")))
        first.start()
        for _ in range(100):  # until the first worker's download has begun
            if origin.log("/w.tar", "GET"):
                break
            time.sleep(0.02)
        time.sleep(0.1)
        got[1] = ask(pinned[1], "/w.tar")
        first.join(30)
    finally:
        for s in pinned:
            s.close()
    assert got[1].headers.get("x-cache") == "COALESCED", got[1].describe()
    assert len(origin.log("/w.tar", "GET")) == 1
    for w in got.values():
        assert_by_close(w, data, cut=how == "rst", how="rst" if how == "rst" else "close")
