"""A client that tells a clean end of a response from a broken one, the proxy's
bookkeeping after a fault, and the object, versions and flags the fault tests share
(every transport, http and s3)."""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass, field

from .badorigin import BadOrigin, Request, Version
from .data import short_sha as sha
from .proxy import ProxyProcess, part_files, settle, stats

__all__ = [
    "COMMON",
    "CUT40",
    "ETAG_NEW",
    "ETAG_OLD",
    "LM_NEW",
    "LM_OLD",
    "NAME",
    "SIZE",
    "KiB",
    "MiB",
    "TRANSPORTS",
    "Reply",
    "add_malformed_chunked",
    "check_rule",
    "fetch",
    "part_files",
    "pinned",
    "second_read",
    "settle",
    "sha",
    "stats",
    "tail_of",
]

KiB = 1 << 10

# the proxy's flags for each http transport (objects of 1 MiB: 16 parts of 64 KiB)
TRANSPORTS: dict[str, tuple[str, ...]] = {
    "threads": ("--http-transport", "threads"),
    "aiohttp": ("--http-transport", "aiohttp"),
    "parts": ("--http-parts", "on", "--part-size", "64KiB", "--parallel", "4"),
}


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


# --- the fault tests' object, its versions and the proxy's flags ---------------------------

MiB = 1 << 20
SIZE = 1 * MiB
CUT40 = int(SIZE * 0.4) + 123  # not on a part boundary
LM_OLD = "Mon, 01 Jan 2024 00:00:00 GMT"
LM_NEW = "Mon, 01 Jan 2024 01:00:00 GMT"
ETAG_OLD = '"v1-0123456789abcdef"'
ETAG_NEW = '"v2-fedcba9876543210"'
NAME = "obj.tar"

COMMON = (
    "--retries",
    "2",
    "--connect-timeout",
    "2",
    "--read-timeout",
    "5",
    "--grace-period",
    "1",
    "--min-free",
    "0",
    "--cache-size",
    "1G",
)


def pinned(req: Request, v: Version) -> bool:
    """Whether a resumed / ranged request names version ``v`` the way a resume must:
    ``If-Range`` with its strong ETag or its Last-Modified, or ``If-Match`` with its
    strong ETag (``If-Unmodified-Since`` alone does not count)."""
    strong = v.etag is not None and not v.etag.startswith("W/")
    if strong and v.etag in (req.header("if-match"), req.header("if-range")):
        return True
    return v.last_modified is not None and req.header("if-range") == v.last_modified


def second_read(p: ProxyProcess, versions: list[bytes], path: str = f"/{NAME}") -> Reply:
    """With the origin healthy: a clean 200 with one version's bytes, then settled."""
    r = fetch(p.port, path)
    assert r.status == 200 and r.clean, r.describe() + "\n" + p.log_text()[-3000:]
    assert check_rule(r, versions, p.log_text()[-3000:])
    settle(p)
    return r


def add_malformed_chunked(origin: BadOrigin, path: str, data: bytes, where: str, late: bool):
    """Serve ``data`` at ``path`` with a ``zz`` chunk-size line: ``first``, on every
    answer after 256 KiB of good chunks; ``ranged``, the first GET (plain, or ranged as
    the S3 parts ask for part 0) cut at 40 % and every later 206 chunked with the bad
    line first. ``late``: the bad line 50 ms after what
    precedes it, else in the same send()."""
    v = Version(data, etag=ETAG_OLD, last_modified=LM_OLD)
    if where == "first":
        sc = origin.add(path, versions=[v], framing="chunked", bad_chunk_at=256 * KiB)
    else:
        sc = origin.add(
            path,
            versions=[v],
            ranged_framing="chunked",
            bad_chunk_at=0,
            bad_chunk_on="later-ranged",
            cut_at=CUT40,
            cut_on="first",
        )
    sc.bad_chunk_delay = 0.05 if late else 0.0
    return sc


def tail_of(p: ProxyProcess) -> str:
    return p.log_text()[-3000:]
