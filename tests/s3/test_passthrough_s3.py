"""A full disk mid-download of an ``s3://`` upstream (SeaweedFS): the proxy's clients go
on with verified ranges of the same version (``Fetcher.read_range`` over S3, pinned by
the ETag), or are aborted when the object was replaced meanwhile.

SeaweedFS cannot be paused, so the proxy talks to it through a byte relay on loopback
that holds the S3 responses after a budget of bytes until the test has filled the cache
filesystem (a tmpfs): the proxy's next write to its ``.part`` file then fails with ENOSPC,
deterministically mid-download. The relay passes bytes verbatim, so SigV4 signatures
(computed for the relay's Host) verify at SeaweedFS.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import BUCKET

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.passthrough import (  # noqa: E402
    CLIENT_TIMEOUT,
    Client,
    Outcome,
    assert_complete,
    assert_old_or_aborted,
    check_bookkeeping,
    wait_for,
)
from support.proxy import aws_env  # noqa: E402
from support.store_faults import fill  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MiB = 1 << 20
SIZE = 24 * MiB
BUDGET = 7 * MiB  # response bytes the relay lets through before it holds


class Relay:
    """A TCP relay 127.0.0.1:port -> target. After :meth:`hold` it passes ``after`` more
    response bytes (target -> client), then holds every response until :meth:`release`
    (at most 60 s)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.down = 0
        self.limit: int | None = None
        self.released = threading.Event()
        self.released.set()
        self.closed = threading.Event()
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True, name="relay")
        self.thread.start()

    def hold(self, after: int) -> None:
        with self.lock:
            self.down, self.limit = 0, after
            self.released.clear()

    def release(self) -> None:
        self.released.set()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(None)
            with self.lock:
                self.socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        try:
            while True:
                data = src.recv(256 << 10)
                if not data:
                    break
                if response:
                    with self.lock:
                        self.down += len(data)
                        over = self.limit is not None and self.down > self.limit
                    if over:
                        self.released.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed.set()
        self.released.set()
        self.server.close()
        self.thread.join(5)
        with self.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()


def _proxy_env(seaweed, tmp: Path) -> dict[str, str]:
    return aws_env(seaweed.access_key, seaweed.secret_key, tmp)


@pytest.fixture
def relay(seaweed):
    port = int(seaweed.endpoint_url.rsplit(":", 1)[1])
    r = Relay(port)
    yield r
    r.close()


def run_s3_disk_full(rig, seaweed, boto, relay, key: str, data: bytes, replace_with=None):
    """Clients of one s3:// download; the relay holds S3 after BUDGET bytes; once the
    written prefix stops growing (and the clients have it), optionally replace the object
    in S3, fill the cache filesystem, release the relay."""
    boto.put_object(Bucket=BUCKET, Key=f"pt/{key}", Body=data)
    fs = rig.mount_tmpfs("fs", "size=64m")
    cache = fs / "cache"
    p = rig.proxy(
        cache,
        "--upstream",
        f"pt=s3://{BUCKET}/pt",
        "--s3-endpoint-url",
        f"http://127.0.0.1:{relay.port}",
        "--part-size",
        "2MiB",
        "--parallel",
        "4",
        "--min-free",
        "0",
        env=_proxy_env(seaweed, rig.tmp_path),
    )
    tail = lambda: p.log_text()[-4000:]  # noqa: E731
    clients = [
        Client("first"),
        Client("second"),
        Client("tail", start=1000, ranged=True),
        Client("window", start=100, end=12 * MiB, ranged=True),  # past what BUDGET allows
        Client("slow", read_delay=1.0),
    ]
    relay.hold(BUDGET)
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as ex:
        futures = [ex.submit(c.run, p.port, f"/pt/{key}") for c in clients]
        wait_for(lambda: all(c.got_headers.is_set() for c in clients), 20, "headers", tail)
        for c in clients:
            assert c.status in (200, 206), c.describe() + "\n" + tail()
        # the written prefix stops growing while the relay holds (parts land at their
        # offsets, so the .part file's size may run ahead of it: the clients show it)
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + 20
        while True:
            now = max(c.start + c.received for c in clients if not c.read_delay)
            if now != last:
                last, since = now, time.monotonic()
            elif now >= MiB and time.monotonic() - since > 0.5:
                break
            assert time.monotonic() < deadline, f".part stuck at {now} bytes\n{tail()}"
            time.sleep(0.02)
        written = last
        assert written < SIZE
        wait_for(
            lambda: all(
                c.received >= min(written, c.end or SIZE) - c.start
                for c in clients
                if not c.read_delay
            ),
            20,
            "the clients to catch up with the written prefix",
            lambda: "\n".join(c.describe() for c in clients) + "\n" + tail(),
        )
        if replace_with is not None:
            boto.put_object(Bucket=BUCKET, Key=f"pt/{key}", Body=replace_with)
        fill(fs / "filler")
        relay.release()
        released = time.monotonic()
        for f in futures:
            f.result(timeout=CLIENT_TIMEOUT + 15)
    for c in clients:
        assert c.done_at - released < 10 + c.read_delay, c.describe()
    log = p.log_text()
    check_bookkeeping(p.port, cache, tail)
    return Outcome(clients, log, p.port), written


def test_s3_disk_full_mid_download_every_client_completes(rig, seaweed, boto, relay):
    data = os.urandom(SIZE)
    out, written = run_s3_disk_full(rig, seaweed, boto, relay, "big.bin", data)
    assert re.search(rf"store write failed after {written} bytes", out.log), out.log[-4000:]
    assert_complete(out, data)


def test_s3_object_replaced_as_the_disk_fills_never_splices(rig, seaweed, boto, relay):
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    out, _ = run_s3_disk_full(rig, seaweed, boto, relay, "swapped.bin", old, replace_with=new)
    # Whether the held download first hits the full disk (passthrough: each continuation
    # is refused by If-Match / the ETag check) or S3 stops serving the old version's parts
    # (the download fails), every client needs bytes S3 no longer has: aborted, never a
    # clean end with new bytes spliced in.
    assert_old_or_aborted(out, old)
    for c in out.clients:
        assert not c.clean, c.describe() + "\n" + out.log[-4000:]
