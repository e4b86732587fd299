"""A client that tells a clean end of a response from a broken one, and the proxy's
bookkeeping after a fault: shared by the fault tests of every transport."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from proxy_helpers import ProxyProcess

KiB = 1 << 10

# the proxy's flags for each http transport (objects of 1 MiB: 16 parts of 64 KiB)
TRANSPORTS: dict[str, tuple[str, ...]] = {
    "threads": ("--http-transport", "threads"),
    "aiohttp": ("--http-transport", "aiohttp"),
    "parts": ("--http-parts", "on", "--part-size", "64KiB", "--parallel", "4"),
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# --- a client that tells a clean end from a broken one ------------------------------------


@dataclass
class Reply:
    """One response as a client saw it."""

    status: int | None = None  # None: no status line arrived
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased
    body: bytes = b""
    error: str | None = None  # how the response broke, if it did
    ttfb: float | None = None  # seconds from the request to the first body byte
    elapsed: float = 0.0

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("content-length")
        return int(v) if v is not None else None

    @property
    def clean(self) -> bool:
        """Ended the way a complete response does: a status, no error (a chunked body got
        its terminating chunk), every byte of the Content-Length."""
        return (
            self.status is not None
            and self.error is None
            and (self.content_length is None or len(self.body) == self.content_length)
        )

    def describe(self) -> str:
        return (
            f"status {self.status} X-Cache {self.headers.get('x-cache')} "
            f"Content-Length {self.content_length} "
            f"chunked {self.headers.get('transfer-encoding') == 'chunked'} "
            f"received {len(self.body)} (sha {sha(self.body)}) error {self.error} "
            f"elapsed {self.elapsed:.2f}s"
        )


def fetch(
    port: int,
    path: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    timeout: float = 15.0,
    body: bytes | None = None,
) -> Reply:
    """One request with http.client; never raises for a broken response (see ``error``).

    ``read1`` raises IncompleteRead on a chunked body cut short and returns b"" on a
    Content-Length body cut short (then ``clean`` compares the length)."""
    r = Reply()
    pieces: list[bytes] = []
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        r.status = resp.status
        r.headers = {k.lower(): v for k, v in resp.getheaders()}
        if method == "HEAD":
            resp.read()
        else:
            while True:
                piece = resp.read1(256 * KiB)
                if not piece:
                    break
                if r.ttfb is None:
                    r.ttfb = time.monotonic() - t0
                pieces.append(piece)
            r.body = b"".join(pieces)
        if r.content_length is not None and method != "HEAD" and len(r.body) < r.content_length:
            r.error = f"short body: {len(r.body)} of {r.content_length} bytes"
    except (OSError, http.client.HTTPException) as exc:
        r.error = repr(exc)
    finally:
        r.body = b"".join(pieces)
        conn.close()
        r.elapsed = time.monotonic() - t0
    return r


def check_rule(
    r: Reply, versions: list[bytes], tail: str = "", *, range_start: int | None = None
) -> bool:
    """Assert the trust rule for one response: True for a clean response (its bytes are
    exactly one version's, or of one version's range for a 206 starting at
    ``range_start``), False for a visible error (a 5xx before the body, or a broken
    body)."""
    what = r.describe() + "\n" + tail
    if r.clean and r.status is not None and r.status < 300:
        if r.status == 206:
            cr = r.headers.get("content-range", "")
            first, _, rest = cr.removeprefix("bytes ").partition("-")
            last, _, total = rest.partition("/")
            a, b = int(first), int(last) + 1
            assert range_start is None or a == range_start, "206 for another range: " + what
            wants = [v[a:b] for v in versions if str(len(v)) == total]
        else:
            assert r.status == 200, "unexpected success status: " + what
            wants = list(versions)
        matches = any(r.body == w for w in wants)
        assert matches, (
            "clean response whose bytes are no single version's (a splice or a short body): "
            + what
            + "\nversions: "
            + ", ".join(f"{len(v)} bytes sha {sha(v)}" for v in versions)
        )
        return True
    assert r.status is None or r.status >= 500 or not r.clean, (
        "neither a complete response nor a visible error: " + what
    )
    return False


# --- the proxy's bookkeeping ----------------------------------------------------------------


def stats(port: int) -> dict:
    r = fetch(port, "/-/stats", timeout=10)
    assert r.status == 200, r.describe()
    return json.loads(r.body)


def part_files(cache_dir: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(cache_dir) if n.endswith(".part"))
    except FileNotFoundError:
        return []


def settle(p: ProxyProcess, timeout: float = 5.0) -> dict:
    """Wait (bounded) until no download is in flight, nothing is reserved and no
    ``.part`` file is left; return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        st = stats(p.port)
        left = part_files(p.cache_dir)
        if not left and st["in_flight"] == 0 and st["reserved"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(
                f"left behind: .part files {left}, in_flight {st['in_flight']}, "
                f"reserved {st['reserved']}\n{p.log_text()[-3000:]}"
            )
        time.sleep(0.05)
