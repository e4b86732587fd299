"""The fast path for hits (:mod:`proxy.fastpath`) against the application it stands in
front of: two proxy subprocesses on one origin, ``--fast-hits on`` and ``off``, are sent
the same bytes over raw sockets, and answer the same bytes (but for ``Date``, ``Age``
and the S3 front's request ids): plain hits small (RAM tier) and large (sendfile), HEAD,
Range, every conditional, pipelined mixes of hits and requests the application answers,
a request with a body after a hit, ``Connection: close``, the S3 front, the admin routes,
a miss then hits, and malformed or unusual heads (a fixed set, then seeded random ones).
The fast path must have answered the plain hits itself (its counter), and the access log
and the request metrics must say the same on both. Also: an entry file cut short under a
``sendfile`` aborts the connection; a slow reader does not make the proxy buffer its
pipelined answers; shutdown closes idle connections and cuts a ``sendfile`` at the
grace period's end."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from support.proxy_helpers import Origin, ProxyProcess
from support.wait import wait_until

from shardcache.store import Store

pytestmark = [pytest.mark.timeout(300)]

SMALL = bytes(range(256)) * 256  # 64 KiB: the RAM tier
BIG = bytes(reversed(range(256))) * 4096 * 2  # 2 MiB: sendfile
EMPTY_LM = "Mon, 01 Jan 2024 00:00:00 GMT"
FILES = {
    "small.tar": SMALL,
    "big.tar": BIG,
    "other.tar": SMALL[:1000],
    "fresh.tar": b"f" * 5000,
    "fresh2.tar": b"g" * (1 << 20),
    "api/info": b'{"x": 1}',
}


def exchange(port: int, payload: bytes, idle: float = 1.0, limit: float = 15.0) -> bytes:
    """Send ``payload`` in one write; what comes back until the proxy closes, stays silent
    ``idle`` seconds, or resets the connection (marked ``<RESET>``)."""
    out = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=idle) as s:
        s.sendall(payload)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                out += b"<RESET>"
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


def normal(raw: bytes) -> bytes:
    """``raw`` without what differs between two proxies answering alike."""
    raw = re.sub(rb"\r\nDate: [^\r]*", b"", raw)
    raw = re.sub(rb"\r\nAge: \d+", b"\r\nAge: N", raw)
    raw = re.sub(rb"(?i)(x-amz-request-id: )[0-9A-F]+", rb"\1ID", raw)
    raw = re.sub(rb"<RequestId>[0-9A-F]+</RequestId>", b"<RequestId>ID</RequestId>", raw)
    return raw


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def samples(port: int, *names: str) -> dict[str, float]:
    """The request metrics' samples (but durations) of the proxy on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(names) and "_created" not in line:
            key, value = line.rsplit(" ", 1)
            if "_bucket" in key or key.endswith("_sum"):
                continue  # the durations themselves differ
            out[key] = float(value)
    return out


def get(port: int, path: str, idle: float = 1.0) -> bytes:
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    return exchange(port, head.encode(), idle=idle)


@pytest.fixture(scope="module")
def origin():
    o = Origin(files=dict(FILES)).start()
    yield o
    o.stop()


def _start(origin: Origin, tmp: Path, mode: str, *extra: str) -> ProxyProcess:
    return ProxyProcess(
        tmp / f"cache-{mode}",
        "--upstream",
        origin.url,
        "--upstream",
        f"data={origin.url}",
        "--fast-hits",
        mode,
        *extra,
    ).start()


@pytest.fixture(scope="module")
def pair(origin, tmp_path_factory):
    """(fast, application-only) proxies, each with small.tar, big.tar and other.tar
    cached."""
    tmp = tmp_path_factory.mktemp("fastpath")
    fast = _start(origin, tmp, "on")
    slow = _start(origin, tmp, "off")
    for p in (fast, slow):
        for name in ("small.tar", "big.tar", "other.tar"):
            assert get(p.port, "/" + name).startswith(b"HTTP/1.1 200 OK")
    yield fast, slow
    for p in (fast, slow):
        p.stop(timeout=10)


def req(method: str, path: str, *fields: str, close: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", *fields]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


ETAG_FIELD = "If-None-Match: *"
CASES: dict[str, tuple[bytes, int]] = {
    # name: (the bytes sent, how many of its requests the fast path must answer itself)
    "get small": (req("GET", "/small.tar", close=True), 1),
    "get big": (req("GET", "/big.tar", close=True), 1),
    "head small": (req("HEAD", "/small.tar", close=True), 1),
    "head big": (req("HEAD", "/big.tar", close=True), 1),
    "keep-alive then close": (
        req("GET", "/small.tar", "Connection: keep-alive")
        + req("GET", "/big.tar")
        + req("GET", "/other.tar", close=True),
        3,
    ),
    "close ends the connection": (
        req("GET", "/small.tar", close=True) + req("GET", "/big.tar", close=True),
        0,
    ),
    "query": (req("GET", "/small.tar?x=1", close=True), 0),
    "client fields": (
        req(
            "GET",
            "/small.tar",
            "User-Agent: curl/8",
            "Accept: */*",
            "Accept-Encoding: gzip",
            "Cache-Control: no-cache",
            "Authorization: Bearer abc",
            close=True,
        ),
        1,
    ),
    "range": (req("GET", "/small.tar", "Range: bytes=10-19", close=True), 0),
    "range big": (req("GET", "/big.tar", "Range: bytes=100000-100099", close=True), 0),
    "range past the end": (req("GET", "/small.tar", "Range: bytes=999999-", close=True), 0),
    "if-none-match": (req("GET", "/small.tar", ETAG_FIELD, close=True), 0),
    "if-modified-since": (
        req("GET", "/big.tar", f"If-Modified-Since: {EMPTY_LM}", close=True),
        0,
    ),
    "if-match": (req("GET", "/small.tar", 'If-Match: "nope"', close=True), 0),
    "if-unmodified-since": (
        req("HEAD", "/small.tar", "If-Unmodified-Since: Sun, 01 Jan 2023 00:00:00 GMT", close=True),
        0,
    ),
    "if-range": (
        req("GET", "/small.tar", 'If-Range: "other"', "Range: bytes=0-9", close=True),
        0,
    ),
    "pipelined mix": (
        req("GET", "/small.tar")
        + req("GET", "/big.tar", "Range: bytes=0-99")
        + req("HEAD", "/big.tar")
        + req("GET", "/-/healthz")
        + req("GET", "/big.tar")
        + req("GET", "/small.tar", close=True),
        1,
    ),
    "pipelined hits then the rest": (
        req("GET", "/big.tar")
        + req("GET", "/small.tar")
        + req("HEAD", "/big.tar")
        + req("GET", "/small.tar", "Range: bytes=0-99")
        + req("GET", "/-/healthz")
        + req("GET", "/big.tar", close=True),
        3,
    ),
    # the application's parser reads a segment through: an error anywhere in it is its
    # one answer, for the requests before the error too
    "bytes after close": (
        req("GET", "/small.tar") + req("GET", "/big.tar", close=True) + b"JUNK",
        0,
    ),
    "malformed after hits": (
        req("GET", "/small.tar") + req("GET", "/big.tar") + b"G\x00T /\r\n\r\n",
        0,
    ),
    "body after a hit": (
        req("GET", "/small.tar")
        + b"POST /small.tar HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
        + req("GET", "/small.tar", close=True),
        1,
    ),
    "get with a body": (
        b"GET /small.tar HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
        0,
    ),
    "chunked get": (
        b"GET /small.tar HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n0\r\n\r\n",
        0,
    ),
    "s3 front path-style": (
        req("GET", "/data/small.tar", "x-amz-content-sha256: UNSIGNED-PAYLOAD", close=True),
        0,
    ),
    "s3 front plain client": (req("GET", "/data/small.tar", close=True), 0),
    "s3 front virtual host": (
        b"GET /small.tar HTTP/1.1\r\nHost: data.localhost\r\nConnection: close\r\n\r\n",
        0,
    ),
    "s3 front agent": (req("HEAD", "/small.tar", "User-Agent: Boto3/1.0", close=True), 1),
    "status page": (req("GET", "/", close=True), 0),
    "healthz": (req("GET", "/-/healthz", close=True), 0),
    "encoded admin path": (req("GET", "/%2D/healthz", close=True), 0),
    "unknown admin path": (req("GET", "/-/nothing", close=True), 0),
    "uncached path": (req("GET", "/api/info", close=True), 0),
    "directory": (req("GET", "/some/dir/", close=True), 0),
    "not cached": (req("GET", "/missing.tar", close=True), 0),
    "post": (
        b"POST /small.tar HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        0,
    ),
    "delete": (req("DELETE", "/small.tar", close=True), 0),
    "http/1.0": (b"GET /small.tar HTTP/1.0\r\nHost: x\r\n\r\n", 0),
    "http/1.0 keep-alive": (
        b"GET /small.tar HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
        + req("GET", "/small.tar", close=True),
        0,
    ),
    "absolute form": (req("GET", "http://x/small.tar", close=True), 0),
    "no host": (b"GET /small.tar HTTP/1.1\r\nConnection: close\r\n\r\n", 0),
    "duplicate host": (
        b"GET /small.tar HTTP/1.1\r\nHost: x\r\nHost: y\r\nConnection: close\r\n\r\n",
        0,
    ),
    "obs-fold": (
        b"GET /small.tar HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\nConnection: close\r\n\r\n",
        0,
    ),
    "nul in a value": (
        b"GET /small.tar HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\nConnection: close\r\n\r\n",
        0,
    ),
    "nul in the target": (
        b"GET /small\x00.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        0,
    ),
    "bare lf": (b"GET /small.tar HTTP/1.1\nHost: x\nConnection: close\n\n", 0),
    "lower-case method": (b"get /small.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0),
    "unknown method": (b"FROB /small.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0),
    "huge field": (req("GET", "/small.tar", "X-Big: " + "a" * 9000, close=True), 0),
    "huge head": (
        req("GET", "/small.tar", *[f"X-{i}: {'b' * 100}" for i in range(120)], close=True),
        0,
    ),
    "upgrade": (
        req("GET", "/small.tar", "Connection: Upgrade", "Upgrade: websocket", close=False),
        0,
    ),
    "expect": (req("GET", "/small.tar", "Expect: 100-continue", close=True), 0),
    "plan field": (req("GET", "/small.tar", "X-Shardcache-Plan: nope", close=True), 0),
    "worker field": (req("GET", "/small.tar", "X-Shardcache-Worker: 1", close=True), 0),
    "dot segment": (req("GET", "/x/../small.tar", close=True), 0),
    "fragment": (req("GET", "/small.tar#frag", close=True), 0),
    "non-ascii target": (
        "GET /smäll.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
        0,
    ),
    "leading empty line": (b"\r\n" + req("GET", "/small.tar", close=True), 1),
    "connection other": (req("GET", "/small.tar", "Connection: foo", close=False), 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_answers_like_the_application(pair, name):
    fast, slow = pair
    payload, served = CASES[name]
    before = metric(fast.port, "shardcache_fast_hits_total")
    got = exchange(fast.port, payload)
    want = exchange(slow.port, payload)
    assert normal(got) == normal(want), f"{name}:\nfast: {got[:600]!r}\napp:  {want[:600]!r}"
    assert metric(fast.port, "shardcache_fast_hits_total") - before == served
    assert metric(slow.port, "shardcache_fast_hits_total") == 0


def test_miss_then_hits(pair):
    fast, slow = pair
    for path in ("/fresh.tar", "/fresh2.tar"):
        for _ in range(3):
            got, want = get(fast.port, path), get(slow.port, path)
            assert normal(got) == normal(want)
    assert b"X-Cache: HIT" in get(fast.port, "/fresh2.tar")


def test_keep_alive_reuse_answer_by_answer(pair):
    """A client that waits for each answer before it asks again, over one connection."""
    fast, slow = pair
    answers = []
    for p in (fast, slow):
        got = []
        with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
            for path in ("/small.tar", "/big.tar", "/-/healthz", "/small.tar", "/big.tar"):
                s.sendall(req("GET", path))
                head = b""
                while b"\r\n\r\n" not in head:
                    head += s.recv(1)
                length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
                body = b""
                while len(body) < length:
                    body += s.recv(length - len(body))
                got.append(normal(head) + (body if "healthz" not in path else b""))
        answers.append(got)
    assert answers[0] == answers[1]


SEEDS = 40


def _mutations(rng: random.Random) -> list[bytes]:
    base = req("GET", "/small.tar", "User-Agent: t", "Accept: */*")
    out = []
    for _ in range(SEEDS):
        data = bytearray(base)
        kind = rng.randrange(7)
        if kind == 0:  # a byte flipped
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        elif kind == 1:  # random bytes inserted
            i = rng.randrange(len(data))
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif kind == 2:  # truncated
            data = data[: rng.randrange(1, len(data))]
        elif kind == 3:  # a field line repeated
            lines = bytes(data).split(b"\r\n")
            i = rng.randrange(1, 4)
            lines.insert(i, lines[i])
            data = bytearray(b"\r\n".join(lines))
        elif kind == 4:  # CRLF as LF here and there
            data = bytearray(bytes(data).replace(b"\r\n", b"\n", rng.randrange(1, 4)))
        elif kind == 5:  # a NUL, a CR or a space somewhere
            i = rng.randrange(len(data))
            data[i:i] = rng.choice([b"\x00", b"\r", b" ", b"\t", b":"])
        else:  # a method of random letters
            name = "".join(rng.choice("GETHADPOSX") for _ in range(rng.randrange(1, 6)))
            data = bytearray(name.encode()) + data[3:]
        out.append(bytes(data) + req("GET", "/other.tar", close=True))
    return out


def test_fuzzed_heads_answered_like_the_application(pair):
    fast, slow = pair
    rng = random.Random(20261126)
    for payload in _mutations(rng):
        got = exchange(fast.port, payload, idle=0.5)
        want = exchange(slow.port, payload, idle=0.5)
        assert normal(got) == normal(want), (
            f"{payload!r}:\nfast: {got[:400]!r}\napp:  {want[:400]!r}"
        )
    for p in (fast, slow):  # still healthy
        assert get(p.port, "/small.tar").startswith(b"HTTP/1.1 200 OK")
        assert p.proc.poll() is None


def _access_lines(p: ProxyProcess, count: int) -> list[str]:
    """The first ``count`` access-log lines, once written."""
    wait_until(
        lambda: p.log_text().count(" shardcache.access: ") >= count, 10, what="the access lines"
    )
    lines = [ln for ln in p.log_text().splitlines() if "shardcache.access" in ln][:count]
    # without the time stamp and the duration
    return [re.sub(r" \d+\.\d+s", "", ln.split(" INFO ", 1)[1]) for ln in lines]


def test_access_log_and_metrics_counted_alike(origin, tmp_path):
    fast = _start(origin, tmp_path, "on")
    slow = _start(origin, tmp_path, "off")
    try:
        names = (
            "shardcache_requests_total",
            "shardcache_response_bytes_total",
            "shardcache_time_to_first_byte_seconds_count",
            "shardcache_client_wait_seconds_total",
        )
        before = {}
        for p in (fast, slow):
            for name in ("/small.tar", "/big.tar"):
                assert get(p.port, name).startswith(b"HTTP/1.1 200 OK")  # misses
            before[p] = samples(p.port, *names)
            payload = (
                req("GET", "/small.tar")
                + req("GET", "/big.tar")
                + req("GET", "/small.tar")
                + req("HEAD", "/small.tar")
                + req("GET", "/big.tar")
                + req("HEAD", "/big.tar")
                + req("GET", "/small.tar", "Range: bytes=0-9")
                + req("GET", "/big.tar", close=True)
            )
            exchange(p.port, payload)
        assert _access_lines(fast, 10) == _access_lines(slow, 10)
        assert before[fast].keys() == before[slow].keys()
        after = {p: samples(p.port, *names) for p in (fast, slow)}
        assert after[fast].keys() == after[slow].keys()
        for key in after[fast]:
            assert after[fast][key] - before[fast].get(key, 0) == after[slow][key] - before[
                slow
            ].get(key, 0), key
        assert metric(fast.port, "shardcache_fast_hits_total") == 6
    finally:
        fast.stop(timeout=10)
        slow.stop(timeout=10)


def _entry_file(cache_dir: Path, size: int) -> Path:
    found = [p for p in cache_dir.rglob("*") if p.is_file() and p.stat().st_size == size]
    assert len(found) == 1, found
    return found[0]


def _slow_socket(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _drain(s: socket.socket, pause: float = 0.0, limit: float = 30.0) -> tuple[int, bool]:
    """Read ``s`` to its end: (the bytes read, whether it ended with a reset)."""
    got = 0
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:
            return got, True
        if not chunk:
            break
        got += len(chunk)
        time.sleep(pause)
    return got, False


def _read_head(s: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        assert chunk, head
        head += chunk
    return head


def test_entry_file_cut_short_aborts_the_connection(tmp_path):
    size = 48 << 20
    o = Origin(files={"huge.tar": os.urandom(size)}).start()
    p = ProxyProcess(tmp_path / "cache", "--upstream", o.url).start()
    try:
        assert get(p.port, "/huge.tar", idle=20).startswith(b"HTTP/1.1 200 OK")
        path = _entry_file(tmp_path / "cache", size)
        s = _slow_socket(p.port)
        with s:
            s.sendall(req("GET", "/huge.tar"))
            head = _read_head(s)
            assert b"X-Cache: HIT" in head
            time.sleep(0.3)  # sendfile is blocked on the client's window
            os.truncate(path, 1 << 20)
            got, reset = _drain(s)
        assert got < size
        assert reset, f"a clean end after {got} of {size} bytes"
        wait_until(lambda: "entry file ended at byte" in p.log_text(), 10, what="the abort logged")
        assert p.logged(r'"GET /huge.tar" 200 HIT \d+ [\d.]+s aborted')
        assert metric(p.port, "shardcache_fast_hits_total") == 1
    finally:
        p.stop(timeout=10)
        o.stop()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_a_slow_reader_is_not_buffered_for(pair):
    """300 pipelined 64 KiB hits (19 MiB) sent by a client that reads nothing for a
    while: the proxy stops at the transport's high-water mark instead of queueing
    them all, then answers every one, in order, once the client reads."""
    fast, _ = pair
    count = 300
    rss0 = _rss(fast.proc.pid)
    s = _slow_socket(fast.port)
    with s:
        s.sendall(req("GET", "/small.tar") * (count - 1) + req("GET", "/other.tar", close=True))
        time.sleep(1.5)
        grown = _rss(fast.proc.pid) - rss0
        data = bytearray()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    assert grown < 8 << 20, f"the proxy grew {grown} bytes for a client that does not read"
    assert data.count(b"HTTP/1.1 200 OK") == count
    assert data.count(SMALL) == count - 1
    assert data.endswith(SMALL[:1000])


def test_shutdown_closes_idle_connections_and_cuts_a_sendfile(tmp_path):
    size = 48 << 20
    o = Origin(files={"huge.tar": os.urandom(size), "small.tar": SMALL}).start()
    p = ProxyProcess(tmp_path / "cache", "--upstream", o.url, "--grace-period", "1").start()
    try:
        for path in ("/huge.tar", "/small.tar"):
            assert get(p.port, path, idle=20).startswith(b"HTTP/1.1 200 OK")
        idle = []
        for _ in range(3):  # keep-alive connections that had a hit and wait
            c = socket.create_connection(("127.0.0.1", p.port), timeout=10)
            c.sendall(req("GET", "/small.tar"))
            want = len(SMALL)
            _read_head(c)
            body = b""
            while len(body) < want:
                body += c.recv(want - len(body))
            idle.append(c)
        slow = _slow_socket(p.port)
        slow.sendall(req("GET", "/huge.tar"))
        _read_head(slow)
        assert metric(p.port, "shardcache_fast_hits_total") == 3  # the fourth counts at its end
        started = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        for c in idle:
            with c:
                assert c.recv(1) == b""  # closed at once, not at the grace period's end
        assert time.monotonic() - started < 1.0
        with slow:
            got, reset = _drain(slow, pause=0.01)  # a slow reader
        assert reset and got < size
        assert p.proc.wait(15) == 0
        assert time.monotonic() - started < 6
        assert re.search(r'"GET /huge.tar" 200 HIT \d+ [\d.]+s cut-off', p.log_text())
    finally:
        p.stop(timeout=10)
        o.stop()


def test_each_worker_answers_hits_itself(origin, tmp_path):
    p = _start(origin, tmp_path, "on", "--workers", "2")
    try:
        assert get(p.port, "/small.tar").startswith(b"HTTP/1.1 200 OK")
        for _ in range(10):
            got = get(p.port, "/small.tar")
            assert b"X-Cache: HIT" in got and got.endswith(SMALL)
        # /metrics adds up the workers
        assert metric(p.port, "shardcache_fast_hits_total") == 10
    finally:
        p.stop(timeout=15)


def test_a_hit_due_for_revalidation_is_the_applications(origin, tmp_path):
    p = _start(origin, tmp_path, "on", "--revalidate", "always")
    try:
        asked = origin.gets["other.tar"]
        for _ in range(3):
            got = get(p.port, "/other.tar")
            assert b"X-Cache: HIT" in got or b"X-Cache: MISS" in got
        assert origin.gets["other.tar"] - asked == 3  # the miss, then one question per hit
        assert metric(p.port, "shardcache_fast_hits_total") == 0
    finally:
        p.stop(timeout=10)


def _body(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize("ram", ["64MiB", "0"])
def test_an_entry_another_process_replaces_is_never_served_from_what_was_kept(tmp_path, ram):
    """The fast path keeps what a target's hits are answered from; another process
    sharing the directory that evicts the entry and commits a new version (same size,
    same path) makes the next hit answer the new bytes, never the kept version's: the
    RAM copy, the file opened or the head kept for it (ETag). With and without the RAM
    tier."""
    v1 = {"swap.tar": SMALL, "swapbig.tar": BIG}
    v2 = {"swap.tar": bytes(reversed(SMALL)), "swapbig.tar": bytes(reversed(BIG))}
    o = Origin(files=dict(v1)).start()
    cache = tmp_path / "cache"
    a = ProxyProcess(cache, "--upstream", o.url, "--ram-tier", ram).start()
    b = None
    try:
        for name, data in v1.items():
            assert _body(get(a.port, "/" + name, idle=5)) == data  # the miss
            for _ in range(3):
                got = get(a.port, "/" + name)
                assert b"X-Cache: HIT" in got and _body(got) == data
        kept = metric(a.port, "shardcache_fast_hits_total")
        assert kept == 6
        o.files.update(v2)
        b = ProxyProcess(cache, "--upstream", o.url, "--fast-hits", "off").start()
        for name in v1:
            with Store(cache) as other:  # another process evicts it
                assert other.remove(o.url + "/" + name)
            assert _body(get(b.port, "/" + name, idle=5)) == v2[name]  # and commits v2
        for name, data in v2.items():
            for _ in range(3):
                got = get(a.port, "/" + name, idle=5)
                assert _body(got) == data, name
                assert o.etag(name).encode() in got
        # found changed once each, then kept again
        assert metric(a.port, "shardcache_fast_hits_total") - kept >= 4
    finally:
        a.stop(timeout=10)
        if b is not None:
            b.stop(timeout=10)
        o.stop()


def test_kept_hits_go_to_the_application_once_revalidation_is_due(origin, tmp_path):
    """``--revalidate AGE``: hits are the fast path's (kept) until the entry is AGE old,
    then the application's (it asks the upstream), then the fast path's again."""
    p = _start(origin, tmp_path, "on", "--revalidate", "2")
    try:
        assert get(p.port, "/other.tar").startswith(b"HTTP/1.1 200 OK")
        asked = origin.gets["other.tar"]
        for _ in range(3):
            assert b"X-Cache: HIT" in get(p.port, "/other.tar")
        assert metric(p.port, "shardcache_fast_hits_total") == 3
        assert origin.gets["other.tar"] == asked
        time.sleep(2.2)
        assert get(p.port, "/other.tar").startswith(b"HTTP/1.1 200 OK")
        assert origin.gets["other.tar"] == asked + 1  # asked the upstream
        assert metric(p.port, "shardcache_fast_hits_total") == 3
        got = get(p.port, "/other.tar")
        assert b"X-Cache: HIT" in got and _body(got) == FILES["other.tar"]
        assert metric(p.port, "shardcache_fast_hits_total") == 4
    finally:
        p.stop(timeout=10)


def test_a_kept_hit_is_for_its_target_and_host_only(pair):
    """What a target's hits are answered from is kept per (target, Host): the same
    target with a Host the S3 front takes as a bucket (virtual-hosted style) or its
    path-style twin are not answered from it, but as the application answers them,
    between kept hits (another Host's spelling is kept apart)."""
    fast, slow = pair
    asked = [
        (req("GET", "/small.tar", close=True), 1),
        (b"GET /small.tar HTTP/1.1\r\nHost: data.localhost\r\nConnection: close\r\n\r\n", 0),
        (req("GET", "/data/small.tar", close=True), 0),
        (b"GET /small.tar HTTP/1.1\r\nHost: X\r\nConnection: close\r\n\r\n", 1),
        (req("HEAD", "/small.tar", close=True), 1),
    ]
    for _ in range(2):  # the second time, every target's answer is kept
        for payload, served in asked:
            before = metric(fast.port, "shardcache_fast_hits_total")
            got = exchange(fast.port, payload)
            want = exchange(slow.port, payload)
            assert normal(got) == normal(want), payload
            assert metric(fast.port, "shardcache_fast_hits_total") - before == served, payload
