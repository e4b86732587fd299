"""The upstream layer's receive paths (worker thread, aiohttp) against a real origin on
127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading

import pytest
from support.proxy_helpers import Fault, free_port

from proxy.upstream import Fetcher
from proxy.upstream import threaded as fetch
from proxy.upstream.redirects import RedirectRefused
from shardcache.errors import IncompleteDownloadError, NotFound, UpstreamError, UpstreamTimeout

pytestmark = pytest.mark.timeout(60)

KB = 1024


def blob(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"blob-{seed}".encode()).digest(n)


@pytest.fixture(autouse=True, params=["splice", "recv"])
def receive_path(request, monkeypatch):
    """Run each test with the body moved by splice (after a first small batch) and with
    recv_into plus write only."""
    if request.param == "splice":
        if not fetch.SPLICE:
            pytest.skip("no os.splice here")
        monkeypatch.setattr(fetch, "BATCH_BYTES", 64 * KB)
    else:
        monkeypatch.setattr(fetch, "SPLICE", False)
    return request.param


@pytest.fixture
async def fetcher():
    outcomes: list[str] = []
    f = Fetcher(read_timeout=5.0, retries=2, retry_backoff=0.01, observe=outcomes.append)
    f.outcomes = outcomes  # type: ignore[attr-defined]
    yield f
    await f.close()


async def pump_to_file(body, path) -> tuple[bytes, list[int]]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    batches = []
    try:
        async for n in body.pump(fd):
            batches.append(n)
    finally:
        os.close(fd)
        body.close()
    return path.read_bytes(), batches


async def test_pump_writes_in_a_thread_in_large_batches(
    origin, fetcher, tmp_path, receive_path, monkeypatch
):
    data = blob(3 << 20)
    origin.files["a.tar"] = data
    spliced = []
    real = fetch._ThreadedResponse._splice_rest

    def spy(self, fd, report):
        spliced.append(fd)
        return real(self, fd, report)

    monkeypatch.setattr(fetch._ThreadedResponse, "_splice_rest", spy)
    body = await fetcher.open(f"{origin.url}/a.tar")
    assert body.meta.size == len(data)
    got, batches = await pump_to_file(body, tmp_path / "a")
    assert got == data
    assert sum(batches) == len(data)
    assert len(batches) < len(data) // (32 * KB)  # batched, not one per socket read
    assert len(spliced) == (receive_path == "splice")
    assert fetcher.outcomes == ["ok"]


async def test_spliced_batches_span_several_pipefuls(
    origin, fetcher, tmp_path, receive_path, monkeypatch
):
    """A spliced body is reported in batches of up to SPLICE_BATCH_BYTES, each moved
    through the pipe in several pipefuls: the readers wake once per batch, not once per
    pipeful."""
    if receive_path != "splice":
        pytest.skip("splice only")
    monkeypatch.setattr(fetch, "PIPE_BYTES", 64 * KB)
    monkeypatch.setattr(fetch, "SPLICE_BATCH_BYTES", 1 << 20)
    monkeypatch.setattr(fetch, "BATCH_SECONDS", 1.0)  # batches end by size, not time
    reported: list[int] = []
    real = fetch._ThreadedResponse._splice_rest

    def spy(self, fd, report):
        def counted(n: int) -> None:
            reported.append(n)
            report(n)

        return real(self, fd, counted)

    monkeypatch.setattr(fetch._ThreadedResponse, "_splice_rest", spy)
    data = blob(6 << 20, 9)
    origin.files["p.tar"] = data
    body = await fetcher.open(f"{origin.url}/p.tar")
    got, batches = await pump_to_file(body, tmp_path / "p")
    assert got == data
    assert sum(batches) == len(data)
    assert reported and max(reported) <= 1 << 20
    assert max(reported) > 64 * KB  # several pipefuls in one batch


async def test_chunks_and_md5_match(origin, fetcher):
    data = blob(700 * KB, 1)
    origin.files["c.tar"] = data
    body = await fetcher.open(f"{origin.url}/c.tar")
    out = bytearray()
    async for chunk in body.chunks():
        out += chunk
    assert bytes(out) == data
    with pytest.raises(RuntimeError):
        body.pump(0)


async def test_unknown_length_body(origin, fetcher, tmp_path):
    data = blob(900 * KB, 2)
    origin.files["u.tar"] = data
    origin.faults["u.tar"] = Fault(chunked=True)
    body = await fetcher.open(f"{origin.url}/u.tar")
    assert body.meta.size is None
    got, _ = await pump_to_file(body, tmp_path / "u")
    assert got == data


async def test_mid_body_drop_resumes_with_range_and_if_match(origin, fetcher, tmp_path):
    data = blob(1500 * KB, 3)
    origin.files["d.tar"] = data
    origin.faults["d.tar"] = Fault(drop_once_at=300 * KB)
    body = await fetcher.open(f"{origin.url}/d.tar")
    got, _ = await pump_to_file(body, tmp_path / "d")
    assert got == data
    assert origin.gets["d.tar"] == 2
    name, rng, if_match = origin.ranges[1]
    assert rng == f"bytes={300 * KB}-" and if_match == origin.etag("d.tar")
    assert origin.if_ranges[1] == origin.etag("d.tar")  # an honest origin sends 200 if changed
    assert fetcher.outcomes == ["ok", "resumed"]


async def test_resume_refused_when_object_changed(origin, fetcher, tmp_path):
    data = blob(800 * KB, 4)
    origin.files["x.tar"] = data
    origin.faults["x.tar"] = Fault(drop_once_at=200 * KB, delay=0.01)
    body = await fetcher.open(f"{origin.url}/x.tar")
    origin.files["x.tar"] = blob(800 * KB, 5)  # new ETag: If-Match fails with 412
    with pytest.raises(IncompleteDownloadError) as ei:
        await pump_to_file(body, tmp_path / "x")
    assert ei.value.args  # names the URL
    assert "x.tar" in str(ei.value)
    assert (tmp_path / "x").read_bytes() == data[: 200 * KB]
    assert fetcher.outcomes[-1] == "aborted"


async def test_truncated_every_time_gives_up_after_retries(origin, fetcher, tmp_path):
    data = blob(600 * KB, 6)
    origin.files["t.tar"] = data
    origin.faults["t.tar"] = Fault(truncate_at=200 * KB)
    body = await fetcher.open(f"{origin.url}/t.tar")
    with pytest.raises(IncompleteDownloadError):
        await pump_to_file(body, tmp_path / "t")
    # the bytes before the cut were written, never more
    assert (tmp_path / "t").read_bytes() == data[: 200 * KB]
    assert origin.gets["t.tar"] == 3  # one GET plus two resume attempts


async def test_stall_before_any_byte_times_out(origin, tmp_path):
    data = blob(400 * KB, 7)
    origin.files["s.tar"] = data
    gate = threading.Event()
    origin.faults["s.tar"] = Fault(gate=gate)  # headers, then nothing until the gate opens
    f = Fetcher(read_timeout=0.3, retries=1, retry_backoff=0.01)
    try:
        body = await f.open(f"{origin.url}/s.tar")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(IncompleteDownloadError) as ei:
            await pump_to_file(body, tmp_path / "s")
        assert loop.time() - t0 < 3
        assert isinstance(ei.value.__cause__, UpstreamTimeout)
    finally:
        gate.set()
        await f.close()


async def test_stall_after_bytes_times_out_and_resumes(origin, tmp_path):
    data = blob(600 * KB, 8)
    origin.files["h.tar"] = data
    origin.faults["h.tar"] = Fault(drop_once_at=100 * KB)  # first GET: 100 KB, then close
    f = Fetcher(read_timeout=0.3, retries=1, retry_backoff=0.01)
    try:
        body = await f.open(f"{origin.url}/h.tar")
        gate = threading.Event()
        origin.faults["h.tar"] = Fault(gate=gate)  # the resume stalls after its headers
        with pytest.raises(IncompleteDownloadError):
            await asyncio.wait_for(pump_to_file(body, tmp_path / "h"), 10)
        assert (tmp_path / "h").read_bytes() == data[: 100 * KB]
    finally:
        gate.set()
        await f.close()


async def test_hang_before_headers_is_a_timeout(origin):
    origin.files["g.tar"] = b"x"
    origin.faults["g.tar"] = Fault(hang=True)
    f = Fetcher(read_timeout=0.3)
    try:
        with pytest.raises(UpstreamTimeout):
            await f.open(f"{origin.url}/g.tar")
    finally:
        await f.close()


async def test_error_mapping(origin, fetcher):
    origin.faults["500.tar"] = Fault(status=500)
    origin.faults["403.tar"] = Fault(status=403)
    with pytest.raises(NotFound):
        await fetcher.open(f"{origin.url}/missing.tar")
    with pytest.raises(UpstreamError):
        await fetcher.open(f"{origin.url}/500.tar")
    with pytest.raises(Exception) as ei:
        await fetcher.open(f"{origin.url}/403.tar")
    assert ei.value.status_hint == 403
    with pytest.raises(UpstreamError, match="unreachable"):
        await fetcher.open(f"http://127.0.0.1:{free_port()}/r.tar")


async def test_cancel_while_receiving_releases_the_thread(origin, fetcher, tmp_path):
    data = blob(300 * KB, 9)
    origin.files["w.tar"] = data
    gate = threading.Event()
    origin.faults["w.tar"] = Fault(gate=gate)
    body = await fetcher.open(f"{origin.url}/w.tar")
    task = asyncio.ensure_future(pump_to_file(body, tmp_path / "w"))
    await asyncio.sleep(0.2)
    task.cancel()
    # the blocked receive is shut down, so the task ends well before the read timeout
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    gate.set()


async def test_aiohttp_path_still_available(origin, tmp_path):
    data = blob(500 * KB, 10)
    origin.files["o.tar"] = data
    f = Fetcher(threaded=False)
    try:
        assert not isinstance(
            f.transport(f"{origin.url}/o.tar", stream=True), fetch.ThreadTransport
        )
        body = await f.open(f"{origin.url}/o.tar")
        got, _ = await pump_to_file(body, tmp_path / "o")
        assert got == data
    finally:
        await f.close()


class StallingOrigin:
    """A raw HTTP/1.1 origin: the first GET sends ``stall_at`` bytes of the body and then
    nothing (without closing); later GETs must carry Range + If-Match and get the rest."""

    def __init__(self, data: bytes, stall_at: int) -> None:
        self.data = data
        self.stall_at = stall_at
        self.requests: list[str] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.srv.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            req = b""
            while b"\r\n\r\n" not in req:
                got = conn.recv(4096)
                if not got:
                    return
                req += got
            text = req.decode()
            self.requests.append(text)
            size = len(self.data)
            if "Range: bytes=" in text:
                start = int(text.split("Range: bytes=")[1].split("-")[0])
                assert 'If-Match: "e1"' in text and 'If-Range: "e1"' in text
                head = (
                    f"HTTP/1.1 206 Partial Content\r\nContent-Length: {size - start}\r\n"
                    f"Content-Range: bytes {start}-{size - 1}/{size}\r\n"
                    f'ETag: "e1"\r\n\r\n'
                )
                conn.sendall(head.encode() + self.data[start:])
                return
            head = f'HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nETag: "e1"\r\n\r\n'
            conn.sendall(head.encode() + self.data[: self.stall_at])
            self.stop.wait(10)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.srv.close()


async def test_stall_mid_body_times_out_and_resumes(tmp_path):
    data = blob(1 << 20, 11)
    o = StallingOrigin(data, stall_at=300 * KB)
    outcomes: list[str] = []
    f = Fetcher(read_timeout=0.3, retries=2, retry_backoff=0.01, observe=outcomes.append)
    try:
        body = await f.open(f"http://127.0.0.1:{o.port}/z.tar")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, _ = await pump_to_file(body, tmp_path / "z")
        assert got == data
        assert 0.3 <= loop.time() - t0 < 5
        assert outcomes == ["ok", "resumed"]
        assert f"Range: bytes={300 * KB}-" in o.requests[1]
    finally:
        await f.close()
        o.close()


async def test_redirects_are_followed_to_safe_targets_only(aiohttp_server, tmp_path):
    """A redirect to the upstream's own host is followed (the bytes of the target, to be
    cached under the URL asked for); one to a host not allowed is refused, naming it."""
    from aiohttp import web

    async def moved(request):
        raise web.HTTPFound("/real.tar")

    async def away(request):
        raise web.HTTPFound("http://elsewhere.example/real.tar?sig=secret")

    async def real(request):
        return web.Response(body=b"the target", headers={"ETag": '"t"'})

    app = web.Application()
    app.router.add_get("/moved.tar", moved)
    app.router.add_get("/away.tar", away)
    app.router.add_get("/real.tar", real)
    server = await aiohttp_server(app)
    f = Fetcher()
    try:
        body = await f.open(f"http://127.0.0.1:{server.port}/moved.tar")
        got = b"".join([c async for c in body.chunks()])
        assert got == b"the target" and body.meta.etag == '"t"'
        with pytest.raises(RedirectRefused) as info:
            await f.open(f"http://127.0.0.1:{server.port}/away.tar")
        assert "elsewhere.example" in str(info.value) and "--redirect-host" in str(info.value)
        assert "secret" not in str(info.value)
    finally:
        await f.close()
