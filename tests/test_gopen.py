"""gopen against real files, a real HTTP server on 127.0.0.1 and real shell commands."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time

import pytest

from shardcache import GopenError, GopenException, HTTPStatusError, ShardcacheError
from shardcache.gopen import gopen

pytestmark = pytest.mark.fast

BODY = os.urandom(3 * 1024 * 1024 + 17)
FIRST = 64 * 1024


class Origin(http.server.BaseHTTPRequestHandler):
    """Routes with the behaviours gopen must handle."""

    protocol_version = "HTTP/1.1"
    gate = threading.Event()
    release = threading.Event()  # set at teardown so no handler thread waits long

    def log_message(self, format, *args):  # noqa: A002
        pass

    def _headers(self, status, length=None, extra=()):
        self.send_response(status)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()

    def do_GET(self):  # noqa: N802 - http.server's naming
        path = self.path
        if path == "/ok":
            self._headers(200, len(BODY))
            self.wfile.write(BODY)
        elif path == "/gated":
            # the first part, then wait for the client to have read it: proves streaming
            self._headers(200, len(BODY))
            self.wfile.write(BODY[:FIRST])
            self.wfile.flush()
            Origin.gate.wait(10)
            self.wfile.write(BODY[FIRST:])
        elif path in ("/404", "/500"):
            self._headers(int(path[1:]), 9, [("Content-Type", "text/plain")])
            self.wfile.write(b"not here\n")
        elif path == "/short":
            self._headers(200, 100_000)
            self.wfile.write(BODY[:40_000])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif path == "/chunked-short":
            self._headers(200, None, [("Transfer-Encoding", "chunked")])
            self.wfile.write(b"1000\r\n" + BODY[:4096] + b"\r\n" + b"1000\r\n" + BODY[:100])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif path == "/chunked":
            self._headers(200, None, [("Transfer-Encoding", "chunked")])
            for i in range(0, 20000, 5000):
                chunk = BODY[i : i + 5000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/hang":
            Origin.release.wait(10)
            self.close_connection = True
        elif path == "/stall-body":
            self._headers(200, len(BODY))
            self.wfile.write(BODY[:1000])
            self.wfile.flush()
            Origin.release.wait(10)
            self.close_connection = True
        elif path == "/redirect":
            self._headers(302, 0, [("Location", "/ok")])
        else:
            self._headers(404, 0)


@pytest.fixture(scope="module")
def origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Origin.release.set()
    Origin.gate.set()
    server.shutdown()
    server.server_close()


def _read_all(stream, chunk=65536):
    parts = []
    while True:
        data = stream.read(chunk)
        if not data:
            return b"".join(parts)
        parts.append(data)


# ---------------------------------------------------------------------------
# local files


def test_plain_path_and_file_url(tmp_path):
    path = tmp_path / "a b.bin"
    with gopen(str(path), "wb") as f:
        f.write(b"hello")
    with gopen(str(path)) as f:
        assert f.read() == b"hello"
    with gopen("file://" + str(path).replace(" ", "%20")) as f:
        assert f.read() == b"hello"


def test_missing_file_names_the_url(tmp_path):
    url = str(tmp_path / "missing.tar")
    with pytest.raises(GopenError, match="missing.tar.*no such file") as info:
        gopen(url)
    assert info.value.url == url
    assert isinstance(info.value, OSError) and isinstance(info.value, ShardcacheError)
    assert GopenException is GopenError


def test_directory_and_unknown_scheme_and_bad_mode(tmp_path):
    with pytest.raises(GopenError, match="directory"):
        gopen(str(tmp_path))
    with pytest.raises(GopenError, match="gs://bucket/x.tar.*scheme 'gs'"):
        gopen("gs://bucket/x.tar")
    with pytest.raises(GopenError, match="mode"):
        gopen(str(tmp_path / "x"), "r")
    with pytest.raises(GopenError, match="reading"):
        gopen("http://127.0.0.1:1/x", "wb")


# ---------------------------------------------------------------------------
# HTTP


def test_http_200(origin):
    with gopen(origin + "/ok") as f:
        assert _read_all(f) == BODY


def test_http_follows_redirects_and_reads_chunked(origin):
    with gopen(origin + "/redirect") as f:
        assert f.read() == BODY
    with gopen(origin + "/chunked") as f:
        assert f.read() == BODY[:20000]


def test_http_streams_without_buffering_the_body(origin):
    Origin.gate.clear()
    try:
        with gopen(origin + "/gated", timeout=10) as f:
            first = f.read(FIRST)  # returns while the server still holds the rest back
            assert first == BODY[:FIRST]
            Origin.gate.set()
            assert _read_all(f) == BODY[FIRST:]
    finally:
        Origin.gate.set()


@pytest.mark.parametrize("status", [404, 500])
def test_http_error_status(origin, status):
    url = f"{origin}/{status}"
    with pytest.raises(HTTPStatusError) as info:
        gopen(url)
    assert info.value.status == status
    assert url in str(info.value) and str(status) in str(info.value)
    assert isinstance(info.value, GopenError)


def test_short_body_raises_not_eof(origin):
    url = origin + "/short"
    with gopen(url) as f, pytest.raises(GopenError, match="short.*(truncated|closed)") as info:
        _read_all(f)
    assert "100000" in str(info.value)
    with gopen(url) as f, pytest.raises(GopenError):
        f.read()


def test_truncated_chunked_body_raises(origin):
    with gopen(origin + "/chunked-short") as f, pytest.raises(GopenError, match="chunked-short"):
        _read_all(f)


def test_timeout_waiting_for_headers(origin):
    start = time.monotonic()
    with pytest.raises(GopenError, match="hang.*timed out"):
        gopen(origin + "/hang", timeout=0.3)
    assert time.monotonic() - start < 3


def test_timeout_mid_body(origin):
    start = time.monotonic()
    with gopen(origin + "/stall-body", timeout=0.3) as f:
        assert f.read(1000) == BODY[:1000]
        with pytest.raises(GopenError, match="stall-body.*timed out"):
            f.read(1000)
    assert time.monotonic() - start < 3


def test_connection_refused():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}/x.tar"
    with pytest.raises(GopenError, match="cannot connect") as info:
        gopen(url, timeout=5)
    assert info.value.url == url


# ---------------------------------------------------------------------------
# pipe:


def test_pipe_reads_a_command(tmp_path):
    (tmp_path / "f").write_bytes(BODY)
    with gopen(f"pipe:cat {tmp_path / 'f'}") as f:
        assert _read_all(f) == BODY


def test_pipe_nonzero_exit_raises_at_eof(tmp_path):
    url = "pipe:printf abc; exit 3"
    with gopen(url) as f:
        assert f.read(3) == b"abc"
        with pytest.raises(GopenError, match="exit 3.*status 3") as info:
            f.read(10)
    assert info.value.url == url


def test_pipe_missing_command():
    with gopen("pipe:no-such-command-xyz") as f, pytest.raises(GopenError, match="status 127"):
        f.read()


def test_pipe_closed_early_is_not_an_error():
    f = gopen("pipe:yes")
    assert f.read(10) == b"y\ny\ny\ny\ny\n"
    f.close()  # yes dies of SIGPIPE: not an error
    start = time.monotonic()
    g = gopen("pipe:sleep 30", timeout=0.3)
    g.close()  # not writing, so it is killed after the short grace period
    assert time.monotonic() - start < 3


def test_pipe_write(tmp_path):
    dest = tmp_path / "out"
    with gopen(f"pipe:cat > {dest}", "wb") as f:
        f.write(b"written")
    assert dest.read_bytes() == b"written"
    with pytest.raises(GopenError, match="status 4"):
        with gopen("pipe:cat > /dev/null; exit 4", "wb") as f:
            f.write(b"x")
