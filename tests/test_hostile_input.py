"""Hostile requests against the proxy daemon: each stays the client's error.

The proxy runs as a subprocess (``--admin-token`` and the S3 front's keys set) and is sent
malformed requests over raw sockets: byte ranges of thousands of digits, numbers that are
not ASCII digits, bad request lines, oversized headers, NUL and CR inside header values,
and the credentials in every shape a client can put them (an ``Authorization`` header,
the query string, a bad request line, an over-long header or line). The rules:

- a malformed header value or parameter is answered 4xx (or, when it is a valid request
  after all, the right bytes), never 5xx;
- a malformed request is logged at most at INFO, as one line without a traceback, and a
  flood of them is rate-limited;
- no line of the log, at any level, contains a credential.

The filters themselves (:mod:`proxy.logs`) are also tested directly: a handler's real
bug stays an ERROR with its traceback, redacted.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from support.badorigin import BadOrigin, Scenario, Version
from support.proxy import wait_idle
from support.proxy_helpers import ProxyProcess

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "Adm1nTokenZq8Vw3Kx"  # --admin-token
AK = "AKIDHOSTILEFRONT01"  # --s3-front-access-key (an id, not a secret)
SK = "S3secretKeyJh5Rt9Lm2Wq7"  # --s3-front-secret-key
AWS_SK = "UpstreamAwsSecretPp4Nn6"  # an upstream credential in the proxy's environment
HUB = "hf_UpstreamBearerQq3Ee8"  # --upstream-auth (a bearer token sent upstream)
ORIGIN_KEY = "OriginKeyVv5Bb1Cc"  # --upstream-header (a header sent upstream)
SIG = "5ca1ab1e" * 8  # a SigV4 signature
GOOG = "600d5194a7e0" * 4  # a GCS signature
SAS = "AzureSasSigYy1Tt2"  # an Azure SAS sig
CREDENTIALS = (TOKEN, SK, AWS_SK, HUB, ORIGIN_KEY, SIG, GOOG, SAS, TOKEN[:9], TOKEN[9:])
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
DIGITS = 5000  # past int()'s 4,300-digit limit
SMALL = bytes(range(256)) * 400  # 102,400 bytes
BIG = bytes(reversed(range(256))) * (5 * 4096 + 7)  # past the proxy's direct-range offset


@pytest.fixture(scope="module")
def origin():
    """A well-behaved origin (every Range form answered) with small and big objects."""
    files = {"small.tar": SMALL, "big.tar": BIG}
    files.update({f"cold{i}.tar": SMALL for i in range(10)})
    files.update({f"coldbig{i}.tar": BIG for i in range(4)})
    o = BadOrigin()
    for name, data in files.items():
        o.add(name, Scenario([Version(data, etag=f'"{name}-v1"', last_modified=LM)]))
    o.start()
    yield o
    o.stop()


@pytest.fixture
def proxy(origin, tmp_path: Path, request):
    """The proxy with an admin token and S3 front keys, at the log level of the test's
    parameter (info by default)."""
    level = getattr(request, "param", "info")
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,  # plain clients: /NAME
        "--upstream",
        f"data={origin.url}",  # the S3 front's bucket: /data/NAME, signed
        "--admin-token",
        TOKEN,
        "--s3-front-access-key",
        AK,
        "--s3-front-secret-key",
        SK,
        "--min-free",
        "0",
        "--cache-size",
        "1G",
        "--grace-period",
        "1",
        "--log-level",
        level,
        "--upstream-auth",
        "env:HOSTILE_TEST_HUB",
        "--upstream-header",
        "data=X-Origin-Key:env:HOSTILE_TEST_KEY",
        env={
            "AWS_SECRET_ACCESS_KEY": AWS_SK,
            "HOSTILE_TEST_HUB": HUB,
            "HOSTILE_TEST_KEY": ORIGIN_KEY,
        },
    ).start()
    yield p
    p.stop()


def exchange(port: int, data: bytes, timeout: float = 10) -> tuple[int | None, bytes, bytes]:
    """Send ``data`` as is; (status or None, head, body) of what came back before the
    proxy closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:  # the proxy answered and closed while the request was going out
            pass
        chunks = []
        try:
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                chunks.append(b)
        except (TimeoutError, ConnectionResetError):
            pass
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return (int(m.group(1)) if m else None), head, body


def dechunk(body: bytes) -> bytes:
    """A chunked body's payload; AssertionError unless it ends with the last chunk."""
    out = []
    while True:
        size_line, sep, body = body.partition(b"\r\n")
        assert sep, "the chunked body broke off"
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def request(port: int, target: str, *headers: str, method: str = "GET") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", *headers, "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def get(port: int, target: str, *headers: str, method: str = "GET"):
    return exchange(port, request(port, target, *headers, method=method))


def settle(proxy: ProxyProcess) -> str:
    """The log, once the proxy has written it out (stopped)."""
    proxy.stop()
    return proxy.log_text()


def assert_quiet(log: str) -> None:
    """No traceback and no ERROR (or WARNING) from a client's bad request."""
    assert "Traceback" not in log, log[-4000:]
    assert not re.search(r" (ERROR|CRITICAL) ", log), log[-4000:]
    assert not re.search(r" WARNING (aiohttp|shardcache\.access)", log), log[-4000:]


def assert_no_credential(log: str) -> None:
    for secret in CREDENTIALS:
        assert secret not in log, f"{secret!r} in the log:\n" + "\n".join(
            line for line in log.splitlines() if secret in line
        )


# --------------------------------------------------------------- malformed header values


def _206(status, head: bytes, body: bytes, data: bytes, first: int, last: int) -> None:
    assert status == 206, head
    assert body == data[first : last + 1]
    assert f"content-range: bytes {first}-{last}/{len(data)}".encode() in head.lower()


def test_ranges_of_absurd_digit_counts_are_answered(proxy):
    """A position of thousands of digits means its value: zeros in front change nothing,
    a first byte past any object is 416, a last byte or suffix past it is clipped. The
    same on a hit, on a cold miss (the direct ranged path included) and while the object
    downloads; a digit that is not ASCII is a 416. Never a 500."""
    z, n = "0" * DIGITS, "9" * DIGITS
    port = proxy.port
    assert get(port, "/small.tar")[0] == 200  # a hit from now on
    for name, data in (("small.tar", SMALL), ("cold0.tar", SMALL), ("coldbig0.tar", BIG)):
        _206(*get(port, f"/{name}", f"Range: bytes={z}-1"), data, 0, 1)
    _206(*get(port, "/cold1.tar", f"Range: bytes=0-{n}"), SMALL, 0, len(SMALL) - 1)
    _206(*get(port, "/small.tar", f"Range: bytes=0-{n}"), SMALL, 0, len(SMALL) - 1)
    _206(*get(port, "/cold2.tar", f"Range: bytes=-{n}"), SMALL, 0, len(SMALL) - 1)
    _206(*get(port, "/small.tar", f"Range: bytes=-{n}"), SMALL, 0, len(SMALL) - 1)
    start = 5 << 20  # past the offset where a cold range is read from the upstream directly
    _206(
        *get(port, "/coldbig1.tar", f"Range: bytes={z}{start}-{start + 9}"),
        BIG,
        start,
        start + 9,
    )
    for name in ("small.tar", "cold3.tar", "coldbig2.tar"):
        status, head, body = get(port, f"/{name}", f"Range: bytes={n}-")
        assert status == 416, head
        assert body.count(b"\n") == 1 and len(body) < 300, body  # one line, cut short
    for name in ("small.tar", "cold4.tar"):
        for spec in ("\xb2-", "1-\xb9", "\xb3\xb3-\xb9\xb9", f"{n}-0"):
            status, head, body = get(port, f"/{name}", f"Range: bytes={spec}")
            assert status == 416, (spec, head)
    log = settle(proxy)
    assert_quiet(log)


def test_other_numeric_fields_are_client_errors(proxy):
    """The other numbers a client sends: conditional dates and a plan id of thousands of
    digits are ignored, a request body's length is refused by the parser, a presigned
    URL's X-Amz-Expires of thousands of digits (or a superscript two) is a 403."""
    port, n = proxy.port, "9" * DIGITS
    assert get(port, "/small.tar", f"If-Modified-Since: {n}")[0] == 200
    assert get(port, "/small.tar", f"If-Unmodified-Since: {n}")[0] in (200, 412)
    assert get(port, "/small.tar", f"If-Range: {n}", "Range: bytes=0-1")[0] in (200, 206)
    assert get(port, "/small.tar", f"X-Shardcache-Plan: {n}")[0] == 200
    assert get(port, "/small.tar", f"Content-Length: {n}")[0] == 400
    now = dt.datetime.now(dt.timezone.utc)
    for expires in (n, "%C2%B2"):
        query = (
            "X-Amz-Algorithm=AWS4-HMAC-SHA256"
            f"&X-Amz-Credential={AK}%2F{now:%Y%m%d}%2Fus-east-1%2Fs3%2Faws4_request"
            f"&X-Amz-Date={now:%Y%m%dT%H%M%SZ}&X-Amz-Expires={expires}"
            f"&X-Amz-SignedHeaders=host&X-Amz-Signature={SIG}"
        )
        status, head, body = get(port, f"/data/small.tar?{query}")
        assert status == 403 and b"X-Amz-Expires" in body, (expires, head, body)
    assert_quiet(settle(proxy))


def test_range_readings_of_absurd_digit_counts():
    """The pure readings behind the answers above: parse_range gives a position of any
    length its value; range_start (the cold shortcut) leaves an over-long or non-ASCII
    spec to the download; parse_decimal and parse_content_range refuse what int()
    cannot read."""
    from proxy.policy import parse_range, range_start
    from shardcache.errors import RangeNotSatisfiable
    from shardcache.meta import parse_content_range, parse_decimal

    z, n = "0" * DIGITS, "9" * DIGITS
    r = parse_range(f"bytes={z}7-{z}9", 100)
    assert (r.start, r.end) == (7, 9)
    r = parse_range(f"bytes=10-{n}", 100)
    assert (r.start, r.end) == (10, 99)
    r = parse_range(f"bytes=-{n}", 100)
    assert (r.start, r.end) == (0, 99)
    for spec in (f"{n}-", f"{n}-0", "\xb2-", "1-\u0663"):
        with pytest.raises(RangeNotSatisfiable) as ei:
            parse_range(f"bytes={spec}", 100)
        assert len(str(ei.value)) < 200
    assert range_start("bytes=5000000-") == 5000000
    assert range_start(f"bytes={z}5000000-") is None  # not forwarded as written
    assert range_start("bytes=\xb2-") is None
    assert parse_decimal(z + "12") == 12 and parse_decimal(n) is None
    assert parse_decimal("\xb2") is None and parse_decimal("1 2") is None
    for value in (f"bytes 0-{n}/*", f"bytes 0-1/{n}", "bytes \u0660-\u0661/2"):
        with pytest.raises(ValueError):
            parse_content_range(value)


class BadLengthOrigin:
    """An origin whose every answer is a 200 with ``Content-Length: <length>`` (not a
    number), 1,000 bytes and a close: raw sockets, as no server library sends that."""

    BODY = b"z" * 1000

    def __init__(self, length: bytes) -> None:
        self.length = length
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Length: " + self.length + b'\r\nETag: "e"\r\n'
                    b"Last-Modified: " + LM.encode() + b"\r\nConnection: close\r\n\r\n" + self.BODY
                )

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "transport",
    [("--http-transport", "threads"), ("--http-transport", "aiohttp"), ("--http-parts", "on")],
    ids=["threads", "aiohttp", "parts"],
)
def test_an_upstream_length_that_is_no_number_is_never_committed(tmp_path, transport):
    """An upstream's Content-Length of thousands of digits, or not a number at all, makes
    a body that runs to the close (as http.client reads it) or a 502 (aiohttp's parser):
    never an internal error, and never an entry, as the end cannot be confirmed."""
    for i, length in enumerate((b"9" * DIGITS, b"\xc2\xb2", b"12x")):
        origin = BadLengthOrigin(length)
        p = ProxyProcess(
            tmp_path / f"cache{i}",
            "--upstream",
            origin.url,
            *transport,
            "--retries",
            "0",
            "--grace-period",
            "1",
            "--min-free",
            "0",
            "--cache-size",
            "1G",
        ).start()
        try:
            status, head, body = get(p.port, "/x.tar")
            assert status in (200, 502), (length[:8], head)
            if status == 200:
                if b"transfer-encoding: chunked" in head.lower():
                    body = dechunk(body)
                assert body == BadLengthOrigin.BODY
            wait_idle(p.port)  # the download is over, committed or not
            stats = json.loads(get(p.port, "/-/stats")[2])
            assert stats["entries"] == 0, (length[:8], stats)
        finally:
            log = settle(p)
            origin.close()
        assert_quiet(log)


def test_listing_parameters_of_absurd_digit_counts_are_400():
    """The S3 front's max-keys (a listing of an S3-backed bucket) of thousands of digits,
    or of digits that are not ASCII, is InvalidArgument."""
    from proxy.s3front import S3Error, list_params

    assert list_params({"max-keys": "0" * DIGITS + "7"}, "")["MaxKeys"] == 7
    for value in ("9" * DIGITS, "\xb2", "\u0663", "-1", "1e3", " "):
        with pytest.raises(S3Error) as ei:
            list_params({"max-keys": value}, "")
        assert ei.value.status == 400 and ei.value.code == "InvalidArgument"


def test_a_bad_token_is_refused_whatever_its_bytes(proxy):
    """A mutating call whose token has bytes that are not ASCII (no valid UTF-8 even) is
    a 403, not a 500."""
    port = proxy.port
    for token in ("\xff\xfe", "\xe9t\xe9", TOKEN + "\xa0"):
        auth = f"Authorization: Bearer {token}"
        status, head, _ = get(port, "/-/cache", auth, method="DELETE")
        assert status == 403, (token, head)
    assert get(port, "/-/cache", f"Authorization: Bearer {TOKEN}", method="DELETE")[0] == 200
    assert_quiet(settle(proxy))


# ---------------------------------------------------------------------- the log


MALFORMED = [
    b"GET /small.tar HTTP/1.1 extra\r\nHost: x\r\n\r\n",  # bad request line
    b"GET /sm all.tar HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /small.tar HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET\x00 / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",  # space in a field name
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",  # NUL in a value
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",  # bare CR in a value
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n",  # header too long
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line too long
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Many: y\r\n" * 200 + b"\r\n",  # too many fields
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked, x\r\n\r\n0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # TLS to a plain port
    b"\r\n\r\n\r\n",
]


def test_malformed_requests_are_one_info_line_each(proxy):
    """Requests aiohttp cannot parse are answered 400 (or closed), and logged as one
    INFO line naming the kind of error: no traceback, no ERROR, no request bytes."""
    for data in MALFORMED:
        status, head, _ = exchange(proxy.port, data)
        assert status is None or 400 <= status < 500, (data[:60], head)
    log = settle(proxy)
    assert_quiet(log)
    lines = [line for line in log.splitlines() if "malformed request" in line]
    assert lines and all(" INFO aiohttp.server: " in line for line in lines), lines
    assert not any("aaaaaaaa" in line or "X-Many" in line for line in log.splitlines())


def test_a_flood_of_malformed_requests_is_rate_limited(proxy):
    """300 bad request lines in a burst give a few log lines a second, and the next line
    after the burst says how many were not logged."""
    from proxy.logs import PER_SECOND

    bad = b"GET /x HTTP/1.1 extra\r\nHost: x\r\n\r\n"
    start = time.monotonic()
    for _ in range(300):
        assert exchange(proxy.port, bad)[0] == 400
    elapsed = time.monotonic() - start
    time.sleep(1.1)
    assert exchange(proxy.port, bad)[0] == 400
    log = settle(proxy)
    lines = [line for line in log.splitlines() if "malformed request" in line]
    assert len(lines) <= PER_SECOND * (elapsed + 3), (elapsed, len(lines))
    assert re.search(r"\((\d+) more like it not logged\)", lines[-1]), lines[-3:]
    shown = sum(int(m) for m in re.findall(r"\((\d+) more like it not logged\)", log))
    assert shown + len(lines) == 301, (shown, len(lines))
    assert_quiet(log)


@pytest.mark.parametrize("proxy", ["info", "debug"], indirect=True)
def test_no_credential_reaches_the_log(proxy):
    """The admin token, the S3 front's secret, signatures and presigned queries, sent in
    every malformed shape (and in well-formed requests, which the access log records),
    appear in no line of the log, at the default level or at debug (where a SigV4
    mismatch logs the canonical request)."""
    port = proxy.port
    now = dt.datetime.now(dt.timezone.utc)
    presigned = (
        f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={AK}%2F{now:%Y%m%d}%2Fus-east-1"
        f"%2Fs3%2Faws4_request&X-Amz-Date={now:%Y%m%dT%H%M%SZ}&X-Amz-Expires=60"
        f"&X-Amz-SignedHeaders=host&X-Amz-Signature={SIG}&X-Amz-Security-Token={SK}"
    )
    queries = [
        f"token={TOKEN}",
        f"access_token={TOKEN}",
        presigned,
        f"X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=x&X-Goog-Signature={GOOG}",
        f"sv=2022-11-02&se=2030-01-01&sig={SAS}",
        f"Signature={SIG}&Expires=1&Key-Pair-Id=K",
        f"password={SK}",
        f"x={TOKEN}",  # an unknown parameter: the known value is still caught
        f"y={HUB}&z={ORIGIN_KEY}",
    ]
    auths = [
        f"Bearer {TOKEN}\x00",
        f"Bearer {TOKEN[:9]}\x00{TOKEN[9:]}",
        f"Bearer {TOKEN}\rX-Evil: 1",
        f"Bearer \x00{TOKEN}",
        f"Bearer {TOKEN}" + "A" * 9000,
        f"AWS4-HMAC-SHA256 Credential={AK}/20240101/us-east-1/s3/aws4_request, "
        f"SignedHeaders=host, Signature={SIG}\x00",
        f"Basic {TOKEN}:{SK}\x01",
    ]
    sent: list[bytes] = []
    for q in queries:
        for path in ("/small.tar", "/data/small.tar", "/data", "/-/cache", "/missing.tar"):
            sent.append(request(port, f"{path}?{q}"))
            sent.append(request(port, f"{path}?{q}", method="DELETE"))
        sent.append(f"GET /small.tar?{q} HTTP/1.1 x\r\nHost: y\r\n\r\n".encode())
        sent.append(f"GET /{'a' * 9000}?{q} HTTP/1.1\r\nHost: y\r\n\r\n".encode())
        sent.append(request(port, f"/{'c' * 3000}?{q}"))  # long, yet parsed: access-logged
        sent.append(f"GET /\x00?{q} HTTP/1.1\r\nHost: y\r\n\r\n".encode())
    for auth in auths:
        for method, path in (("DELETE", "/-/cache"), ("POST", "/-/prefetch"), ("GET", "/data")):
            sent.append(request(port, path, f"Authorization: {auth}", method=method))
    for header in ("X-Amz-Security-Token", "Cookie", "Proxy-Authorization", "X-Origin-Key"):
        sent.append(request(port, "/small.tar", f"{header}: {TOKEN}\x00"))
        sent.append(request(port, "/small.tar", f"{header}: {TOKEN}" + "B" * 9000))
    stamp = f"{now:%Y%m%dT%H%M%SZ}"
    sigv4 = (
        f"Authorization: AWS4-HMAC-SHA256 Credential={AK}/{now:%Y%m%d}/us-east-1/s3/"
        f"aws4_request, SignedHeaders=host;x-amz-date;x-amz-security-token, Signature={SIG}"
    )
    for target in ("/data/small.tar", f"/data/small.tar?{presigned}"):  # wrong signatures
        sent.append(
            request(port, target, sigv4, f"X-Amz-Date: {stamp}", f"X-Amz-Security-Token: {SK}")
        )
    sent.append(request(port, "/-/cache", f"Authorization: Bearer {TOKEN}", method="DELETE"))
    sent.append(request(port, "/-/cache", "Authorization: Bearer wrong" + SK, method="DELETE"))
    sent.append(request(port, "/-/cache", f"Authorization: {TOKEN}", method="DELETE"))
    for data in sent:
        status, head, _ = exchange(port, data)
        assert status is None or status < 500, (data[:120], head)
    log = settle(proxy)
    assert_no_credential(log)
    assert_quiet(log)
    assert "[REDACTED]" in log  # the shapes were logged, without their values
    if "debug" in proxy.args:  # the SigV4 mismatches logged their canonical requests
        assert "canonical request was:" in log
    assert "ccc...(" in log  # a long target is logged cut short
    assert max(len(line) for line in log.splitlines()) < 2400


# ------------------------------------------------------------ the filters, directly


def _record(level: int, msg: str, *args: object, exc: BaseException | None = None):
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("aiohttp.server", level, __file__, 1, msg, args, info)


def test_redactor_shapes_and_known_secrets():
    from proxy.logs import Redactor

    r = Redactor(["s3cr3t/value+x", TOKEN, "ab"])  # too short a secret is left to shapes
    cases = {
        f"GET /a?X-Amz-Signature={SIG}&b=1": "GET /a?X-Amz-Signature=[REDACTED]&b=1",
        f"b'Authorization: Bearer {TOKEN}\\x00'": "b'Authorization: [REDACTED]'",
        f"{{'authorization': 'AWS4-HMAC-SHA256 Credential=a, Signature={SIG}'}}": (
            "{'authorization': '[REDACTED]'}"
        ),
        f"token bearer {SAS}, rest": "token bearer [REDACTED], rest",
        "https://user:pa55@host/x and http://127.0.0.1:80/y": (
            "https://user:[REDACTED]@host/x and http://127.0.0.1:80/y"
        ),
        "/a?k=s3cr3t%2Fvalue%2Bx and s3cr3t/value+x": "/a?k=[REDACTED] and [REDACTED]",
        f"Credential={AK}/2024/us-east-1/s3/aws4_request, Signature={SIG}": (
            "Credential=[REDACTED], Signature=[REDACTED]"
        ),
        "plain line: GET /data/a.tar 200 HIT ab": "plain line: GET /data/a.tar 200 HIT ab",
        # a one-token credential field as a query parameter: the rest of the line stays
        f"GET /a?X-Amz-Security-Token={TOKEN}&n=1 answered 500": (
            "GET /a?X-Amz-Security-Token=[REDACTED]&n=1 answered 500"
        ),
        f"X-Amz-Security-Token: {TOKEN} x": "X-Amz-Security-Token: [REDACTED]",
        "cookie=a=b; c=d rest": "cookie=[REDACTED]",
    }
    for text, want in cases.items():
        assert r(text) == want, text
    r = Redactor([], fields=["X-Origin-Key"])  # an --upstream-header field
    assert r("sent x-origin-key: abc to h") == "sent x-origin-key: [REDACTED]"


def test_client_errors_filter_keeps_real_bugs_at_error():
    """A malformed request becomes one INFO line; a handler's exception stays an ERROR
    with its traceback, redacted by the handler filter."""
    server = logging.getLogger("aiohttp.server")
    level = server.level
    server.setLevel(logging.INFO)  # the daemon's default
    try:
        _check_client_errors_filter()
    finally:
        server.setLevel(level)


def _check_client_errors_filter() -> None:
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    from proxy.logs import ClientErrors, RateLimit, Redact, Redactor

    clock = [0.0]
    f = ClientErrors(RateLimit(2, clock=lambda: clock[0]))
    bad = BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer {TOKEN}'")
    rec = _record(logging.ERROR, "Error handling request from %s", "10.0.0.1", exc=bad)
    assert f.filter(rec)
    assert rec.levelno == logging.INFO and rec.exc_info is None
    assert rec.getMessage() == (
        "malformed request from 10.0.0.1: BadHttpMessage: Invalid header value char"
    )
    long = LineTooLong(b"x" * 100, 8190)
    kinds = [f.filter(_record(logging.ERROR, "e %s", "r", exc=long)) for _ in range(4)]
    assert kinds == [True, True, False, False]  # two a second of this kind
    clock[0] = 1.5
    rec = _record(logging.ERROR, "e %s", "r", exc=long)
    assert f.filter(rec) and "(2 more like it not logged)" in rec.getMessage()

    try:
        raise ValueError(f"bug while answering Bearer {TOKEN}")
    except ValueError as exc:
        bug = _record(logging.ERROR, "Error handling request from %s", "r", exc=exc)
    assert f.filter(bug) and bug.levelno == logging.ERROR and bug.exc_info is not None
    assert Redact(Redactor([TOKEN])).filter(bug)
    text = logging.Formatter().format(bug)
    assert "Traceback" in text and "ValueError: bug while answering" in text
    assert TOKEN not in text
