"""No answer depends on the race between a download's last byte and its commit.

- A client that received a clean end of the whole object finds the entry after the
  proxy is killed with SIGKILL right then: the entry is renamed into place and in the
  index before the last byte goes out.
- With ``--revalidate always``, a request that arrives after an earlier response ended
  asks the upstream first: it never joins the finished download as an unrevalidated HIT.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from support.badorigin import BadOrigin, Version
from support.faultclient import fetch, settle
from support.proxy_helpers import ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MiB = 1 << 20
LM = "Mon, 01 Jan 2024 00:00:00 GMT"
COMMON = ("--retries", "1", "--read-timeout", "5", "--grace-period", "1", "--min-free", "0")
TRANSPORTS = {
    "threads": ("--http-transport", "threads"),
    "aiohttp": ("--http-transport", "aiohttp"),
    "parts": ("--http-parts", "on", "--part-size", "1MiB", "--parallel", "4"),
}


def test_a_clean_end_survives_kill_9(transport, tmp_path):
    rounds = 8
    with BadOrigin() as origin:
        objects = {}
        for i in range(rounds):
            data = os.urandom(4 * MiB + i)
            objects[f"/o{i}.tar"] = data
            origin.add(f"/o{i}.tar", versions=[Version(data, etag=f'"e{i}"', last_modified=LM)])
        args = ("--upstream", origin.url, *COMMON, *TRANSPORTS[transport])
        cache = tmp_path / "cache"
        lost = []
        for path, data in objects.items():
            p = ProxyProcess(cache, *args).start()
            try:
                r = fetch(p.port, path)
                assert r.status == 200 and r.clean and r.body == data, r.describe()
            finally:
                p.stop(sig=signal.SIGKILL)  # at once, right after the clean end
            p = ProxyProcess(cache, *args).start()
            try:
                again = fetch(p.port, path)
                assert again.status == 200 and again.body == data, again.describe()
                if again.headers.get("x-cache") != "HIT":
                    lost.append(path)
            finally:
                p.stop(timeout=10)
        assert not lost, f"entries lost after kill -9 following a clean end: {lost}"


def test_revalidate_always_right_after_a_miss(transport, tmp_path):
    """The object is replaced as soon as the first GET has taken its version; the next
    request, sent the moment the first response ended, must get the new bytes."""
    rounds = 10
    with BadOrigin() as origin:
        pairs = {}
        for i in range(rounds):
            old, new = os.urandom(2 * MiB), os.urandom(2 * MiB)
            pairs[f"/r{i}.tar"] = (old, new)
            origin.add(
                f"/r{i}.tar",
                versions=[
                    Version(old, etag=f'"old{i}"', last_modified=LM),
                    Version(new, etag=f'"new{i}"', last_modified=LM),
                ],
                # replaced once the first download has taken its version (2 parts)
                advance_after=(2,) if transport == "parts" else (1,),
            )
        p = ProxyProcess(
            tmp_path / "cache",
            "--upstream",
            origin.url,
            "--revalidate",
            "always",
            *COMMON,
            *TRANSPORTS[transport],
        ).start()
        try:
            stale = []
            for path, (old, new) in pairs.items():
                first = fetch(p.port, path)
                assert first.status == 200 and first.body == old, first.describe()
                second = fetch(p.port, path)
                assert second.status == 200 and second.body in (old, new), second.describe()
                if second.body != new:
                    stale.append((path, second.headers.get("x-cache")))
            settle(p)
            assert not stale, f"served without revalidation after a miss: {stale}"
        finally:
            p.stop(timeout=10)


def test_clean_ends_of_many_small_misses_at_once_survive_kill_9(transport, tmp_path):
    """Sixteen clients miss small objects at once, so their commits are made in groups
    (one transaction and one directory fsync each); the proxy is killed with SIGKILL the
    moment the 120th clean end arrives, the other clients still in flight. Every object
    a client received with a clean end is an entry after the restart."""
    n, clients, kill_at = 400, 16, 120
    with BadOrigin() as origin:
        objects = {}
        for i in range(n):
            data = os.urandom(1024 + i % 13)
            objects[f"/small/{i:04d}.bin"] = data
            origin.add(f"/small/{i:04d}.bin", versions=[Version(data, etag=f'"s{i}"')])
        args = ("--upstream", origin.url, *COMMON, *TRANSPORTS[transport])
        cache = tmp_path / "cache"
        p = ProxyProcess(cache, *args).start()
        paths = list(objects)
        clean: list[str] = []
        lock = threading.Lock()
        killed = threading.Event()

        def client(i: int) -> None:
            for path in paths[i::clients]:
                if killed.is_set():
                    return
                r = fetch(p.port, path, timeout=20)
                if not (r.status == 200 and r.clean):
                    continue  # cut by the kill: no promise was made
                assert r.body == objects[path], r.describe()
                with lock:
                    clean.append(path)
                    if len(clean) == kill_at:
                        p.proc.send_signal(signal.SIGKILL)  # at once, the others mid-miss
                        killed.set()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            p.stop(sig=signal.SIGKILL)
        assert killed.is_set() and len(clean) >= kill_at, len(clean)
        p = ProxyProcess(cache, *args).start()
        try:
            lost = []
            for path in clean:
                again = fetch(p.port, path)
                assert again.status == 200 and again.body == objects[path], again.describe()
                if again.headers.get("x-cache") != "HIT":
                    lost.append(path)
        finally:
            p.stop(timeout=10)
        assert not lost, f"{len(lost)} of {len(clean)} clean ends lost after kill -9: {lost[:5]}"
