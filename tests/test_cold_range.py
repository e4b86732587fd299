"""A Range deep into an object neither cached nor downloading ("cold"), read through the
proxy daemon from a real origin (:mod:`badorigin`) on each http transport.

- A ranged answer the proxy cannot use (an origin that answers a range ending past the
  object, or starting at its end, with a 206 that names bytes it does not have) is not
  an error: the range, or its 416, is served from the object's download.
- Bytes over the network: with parts the download fetches the part holding the range
  first and answers the range from it (every byte of the object crosses once, the first
  request is for that part); over one stream ``--cold-range once`` serves the range from
  the download (once), ``fast`` from a ranged GET beside it (the range twice, counted in
  ``shardcache_upstream_extra_bytes_total{reason="cold_range"}``).

The origin records every request and the body bytes it sent (``Request.sent``).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import pytest
from support.faultclient import COMMON, ETAG_OLD, LM_OLD, fetch, settle, tail_of
from support.origins import BadOrigin, Version
from support.proxy import ProxyProcess
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

MiB = 1 << 20
SIZE = 12 * MiB  # 12582912 bytes
NAME = "big.tar"
PART = 1 * MiB

TRANSPORTS: dict[str, tuple[str, ...]] = {
    "threads": ("--http-transport", "threads"),
    "aiohttp": ("--http-transport", "aiohttp"),
    "parts": ("--http-parts", "on", "--part-size", "1MiB", "--parallel", "4"),
}
MODES = ("fast", "once")


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(SIZE)


@pytest.fixture
def origin(bad_origin: BadOrigin) -> BadOrigin:
    return bad_origin


def start_proxy(tmp_path, origin: BadOrigin, transport: str, mode: str) -> ProxyProcess:
    return ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,
        *COMMON,
        *TRANSPORTS[transport],
        "--cold-range",
        mode,
    ).start()


def extra_bytes(p: ProxyProcess, reason: str = "cold_range") -> int:
    text = fetch(p.port, "/metrics").body.decode()
    name = "shardcache_upstream_extra_bytes_total"
    m = re.search(rf'^{name}\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def sent(origin: BadOrigin) -> int:
    return sum(q.sent for q in origin.log(NAME, "GET"))


def wait_cached(p: ProxyProcess) -> None:
    """The object's download committed: a plain GET is a HIT."""

    def hit() -> bool:
        settle(p, timeout=20)
        return fetch(p.port, f"/{NAME}", "HEAD").headers.get("x-cache") == "HIT"

    wait_until(hit, 20, interval=0.1, what=lambda: "the object to be cached\n" + tail_of(p))


# --- a ranged answer the proxy cannot use --------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_sloppy_ranged_answer_falls_back_to_the_download(origin, data, tmp_path, transport, mode):
    """The origin answers ``bytes=12582902-12583912`` with ``206 Content-Range: bytes
    12582902-12583912/12582912`` (past the object's end) and ``bytes=12582912-`` with a
    206 for a range starting at its end. The proxy answers what the object allows: 206
    with its last 10 bytes, and 416 ``bytes */12582912`` — not 502."""
    origin.add(
        NAME, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], sloppy_ranges=True
    )
    p = start_proxy(tmp_path, origin, transport, mode)
    try:
        r = fetch(p.port, f"/{NAME}", headers={"Range": "bytes=12582902-12583912"})
        assert r.status == 206 and r.clean, r.describe() + "\n" + tail_of(p)
        assert r.headers.get("content-range") == f"bytes 12582902-12582911/{SIZE}", r.headers
        assert r.body == data[12582902:], r.describe()
        r = fetch(p.port, f"/{NAME}", headers={"Range": f"bytes={SIZE}-"})
        assert r.status == 416, r.describe() + "\n" + tail_of(p)
        assert r.headers.get("content-range") == f"bytes */{SIZE}", r.headers
        wait_cached(p)
        whole = fetch(p.port, f"/{NAME}")
        assert whole.status == 200 and whole.body == data, whole.describe()
    finally:
        p.stop(timeout=10)


# --- bytes over the network ----------------------------------------------------------------

RANGES = {
    "tail": (5 * MiB, None),  # wget -c resuming at 5 MiB
    "middle": (8 * MiB + 12345, 9 * MiB + 999),  # a member read from a tar index
}


@pytest.mark.parametrize("where", list(RANGES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_cold_range_bytes_over_the_network(origin, data, tmp_path, transport, mode, where):
    """The range is answered exactly; once the object is cached, the origin sent its
    bytes once (parts, or ``once``), or once plus the range (``fast`` over one stream:
    exactly the bytes counted as extra)."""
    origin.add(NAME, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)])
    a, b = RANGES[where]
    want = data[a : None if b is None else b + 1]
    p = start_proxy(tmp_path, origin, transport, mode)
    try:
        rng = f"bytes={a}-" + ("" if b is None else str(b))
        r = fetch(p.port, f"/{NAME}", headers={"Range": rng})
        assert r.status == 206 and r.clean, r.describe() + "\n" + tail_of(p)
        assert r.body == want, r.describe()
        wait_cached(p)
        got = sent(origin)
        extra = extra_bytes(p)
        twice = mode == "fast" and transport != "parts"
        assert got == SIZE + (len(want) if twice else 0), (
            f"origin sent {got} bytes for a {SIZE}-byte object and a {len(want)}-byte range: "
            + ", ".join(f"{q.range} -> {q.status} {q.sent}" for q in origin.log(NAME, "GET"))
        )
        assert extra == (len(want) if twice else 0), extra
        if transport == "parts":
            first = origin.log(NAME, "GET")[0]
            assert first.range_start == a - a % PART, (
                f"the first request was {first.range}, not the part holding byte {a}"
            )
    finally:
        p.stop(timeout=10)


@pytest.mark.parametrize("mode", MODES)
def test_parts_answer_a_cold_range_before_the_prefix_arrives(origin, data, tmp_path, mode):
    """2 MB/s per connection, 4 parts at once: the 10 MiB before the range would take
    over a second; the part holding it comes first, so the range starts arriving at
    about one request's latency."""
    origin.add(
        NAME,
        versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)],
        rate=2e6,
        first_byte_delay=0.02,
    )
    p = start_proxy(tmp_path, origin, "parts", mode)
    try:
        a = 10 * MiB + 777
        r = fetch(p.port, f"/{NAME}", headers={"Range": f"bytes={a}-{a + 99_999}"})
        assert r.status == 206 and r.body == data[a : a + 100_000], r.describe()
        assert r.ttfb is not None and r.ttfb < 0.6, f"first byte after {r.ttfb}s: " + ", ".join(
            f"{q.range} -> {q.status}" for q in origin.log(NAME, "GET")
        )
    finally:
        p.stop(timeout=10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_range_far_ahead_of_a_running_download(origin, data, tmp_path, transport, mode):
    """A client reads the whole object from a slow origin (4 MB/s per connection);
    another asks 100 kB at 10 MiB meanwhile. Over one stream ``fast`` reads it from the
    upstream (counted as ``reason="ahead"``), ``once`` waits for the download; in parts
    its part is fetched next. Both answers exact; the origin sent the object once, plus
    the range with ``fast`` over one stream."""
    origin.add(NAME, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], rate=4e6)
    p = start_proxy(tmp_path, origin, transport, mode)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(fetch, p.port, f"/{NAME}", timeout=30)
            wait_until(lambda: origin.log(NAME, "GET"), 5, 0.01, "the download's GET")
            time.sleep(0.2)  # a delay on purpose: the download is under way, not at its start
            a = 10 * MiB
            r = fetch(p.port, f"/{NAME}", headers={"Range": f"bytes={a}-{a + 99_999}"})
            w = whole.result()
        assert r.status == 206 and r.clean and r.body == data[a : a + 100_000], r.describe()
        assert w.status == 200 and w.clean and w.body == data, w.describe()
        wait_cached(p)
        twice = mode == "fast" and transport != "parts"
        assert sent(origin) == SIZE + (100_000 if twice else 0), [
            (q.range, q.status, q.sent) for q in origin.log(NAME, "GET")
        ]
        assert extra_bytes(p, "ahead") == (100_000 if twice else 0)
    finally:
        p.stop(timeout=10)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_once_for_an_object_the_cache_does_not_take(origin, data, tmp_path, transport):
    """With ``once`` (or parts) a cold range goes through the object's download; when
    the store does not take the object (here: bigger than the cache), that download
    is not kept, so the range is read alone from the upstream — not the whole object
    streamed through for it (the origin at 20 MB/s per connection: the download's
    opening GET, closed once the store said no, sends little)."""
    origin.add(NAME, versions=[Version(data, etag=ETAG_OLD, last_modified=LM_OLD)], rate=20e6)
    p = ProxyProcess(
        tmp_path / "cache",
        "--upstream",
        origin.url,
        *COMMON[: COMMON.index("--cache-size")],
        "--cache-size",
        "4MiB",
        *TRANSPORTS[transport],
        "--cold-range",
        "once",
    ).start()
    try:
        a = 10 * MiB
        r = fetch(p.port, f"/{NAME}", headers={"Range": f"bytes={a}-{a + 99_999}"})
        assert r.status == 206 and r.clean and r.body == data[a : a + 100_000], (
            r.describe() + "\n" + tail_of(p)
        )
        settle(p)
        got = sent(origin)
        assert got < SIZE // 2, (
            f"the origin sent {got} bytes for a 100 kB range of an uncached object: "
            + ", ".join(f"{q.range} -> {q.status} {q.sent}" for q in origin.log(NAME, "GET"))
        )
    finally:
        p.stop(timeout=10)
