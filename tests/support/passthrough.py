"""The pass-through tests' clients (one GET each, in a thread, that tells a clean end
from a broken one) and their checks: shared by the http and S3 pass-through tests."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .data import sha
from .proxy import part_files, stats
from .wait import wait_until

KiB = 1 << 10
CLIENT_TIMEOUT = 30.0


@dataclass
class Client:
    """One GET through the proxy, run in a thread; ``received`` grows as bytes arrive."""

    label: str
    start: int = 0
    end: int | None = None  # exclusive; None: to the end of the object
    ranged: bool = False
    read_delay: float = 0.0  # seconds between the headers and the first read
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    error: str | None = None
    got_headers: threading.Event = field(default_factory=threading.Event)
    done_at: float = 0.0  # time.monotonic() when the response ended either way

    @property
    def received(self) -> int:
        return len(self.body)

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("content-length")
        return int(v) if v is not None else None

    @property
    def clean(self) -> bool:
        """The response ended the way a complete one does: no error, every byte of its
        Content-Length (the proxy always sends one here, so a cut is always visible)."""
        return self.error is None and self.received == self.content_length

    def run(self, port: int, path: str) -> Client:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT)
        try:
            headers = {}
            if self.ranged:
                last = "" if self.end is None else str(self.end - 1)
                headers["Range"] = f"bytes={self.start}-{last}"
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            self.status = resp.status
            self.headers = {k.lower(): v for k, v in resp.getheaders()}
            self.got_headers.set()
            if self.read_delay:
                time.sleep(self.read_delay)
            while True:
                piece = resp.read1(256 * KiB)
                if not piece:
                    break
                self.body += piece
            if self.content_length is not None and self.received < self.content_length:
                self.error = f"short body: {self.received} of {self.content_length} bytes"
        except (OSError, http.client.HTTPException) as exc:
            self.error = repr(exc)
        finally:
            self.got_headers.set()
            conn.close()
            self.done_at = time.monotonic()
        return self

    def describe(self) -> str:
        return (
            f"{self.label}: status {self.status} X-Cache {self.headers.get('x-cache')} "
            f"length {self.content_length} received {self.received} error {self.error}"
        )


def expected(c: Client, data: bytes) -> bytes:
    return data[c.start : len(data) if c.end is None else c.end]


def wait_for(cond, timeout: float, what: str, tail=lambda: "") -> None:
    """:func:`support.wait.wait_until` polling every 5 ms, naming ``what`` and the
    proxy's log ``tail()`` on a timeout."""
    wait_until(cond, timeout, 0.005, what=lambda: f"{what}\n{tail()}")


@dataclass
class Outcome:
    clients: list[Client]
    log: str
    proxy_port: int


def check_bookkeeping(port: int, cache: Path, tail) -> None:
    """Once every request is done: no download in flight, no reservation, no .part file."""
    seen: dict = {}

    def clean() -> bool:
        st, left = seen["stats"], seen["left"] = stats(port), part_files(cache)
        return not left and st["reserved"] == 0 and st["in_flight"] == 0

    wait_until(
        clean,
        10,
        what=lambda: f"no leftovers: .part files {seen['left']}, stats {seen['stats']}\n{tail()}",
    )


def assert_complete(out: Outcome, data: bytes) -> None:
    for c in out.clients:
        want = expected(c, data)
        assert c.clean, c.describe() + "\n" + out.log[-4000:]
        assert c.status == (206 if c.ranged else 200), c.describe()
        assert (c.received, sha(c.body)) == (len(want), sha(want)), c.describe()


def assert_old_or_aborted(out: Outcome, old: bytes) -> None:
    """Each client has the complete old bytes of its range, or a visibly broken body;
    never a clean end after fewer bytes or after bytes of another version."""
    for c in out.clients:
        want = expected(c, old)
        if c.clean:
            assert sha(c.body) == sha(want), "clean response with wrong bytes: " + c.describe()
        else:
            assert c.received < len(want) or c.error, c.describe()
            # what did arrive is a prefix of the old version
            assert bytes(c.body) == want[: c.received], "wrong bytes before the abort"
