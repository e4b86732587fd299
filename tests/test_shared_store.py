"""The proxy and other processes on one cache directory: a hit path that keeps no state
another process can make wrong, and access records that survive a clean restart."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import pytest
from support.proxy_helpers import ProxyProcess
from support.wait import wait_until

from shardcache.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB = 1024


@pytest.fixture
def proxy(tmp_path, origin):
    started: list[ProxyProcess] = []

    def start(*args: str) -> ProxyProcess:
        p = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *args).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop(signal.SIGKILL)


def get(p: ProxyProcess, path: str) -> tuple[int, str | None, bytes]:
    with urllib.request.urlopen(p.url + path, timeout=30) as r:
        return r.status, r.headers.get("X-Cache"), r.read()


def in_other_process(code: str) -> None:
    """Run ``code`` in a separate Python process (not the proxy's, not this one's store)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("size", [8 * KiB, 1024 * KiB], ids=["ram-tier", "sendfile"])
def test_an_entry_evicted_by_another_process_becomes_a_miss(origin, proxy, tmp_path, size):
    data = bytes(range(256)) * (size // 256)
    origin.files["a.tar"] = data
    p = proxy()
    assert get(p, "/a.tar")[:2] == (200, "MISS")
    assert get(p, "/a.tar") == (200, "HIT", data)  # now in the proxy's memory (and RAM tier)
    in_other_process(
        f"from shardcache.store import Store; "
        f"assert Store({str(tmp_path / 'cache')!r}).remove({origin.url + '/a.tar'!r})"
    )
    for _ in range(2):  # a miss, never an error, and then a hit again
        status, cache, body = get(p, "/a.tar")
        assert status == 200 and body == data
    assert cache == "HIT"
    assert origin.gets["a.tar"] == 2


def test_an_entry_replaced_by_another_process_is_never_served_stale(origin, proxy, tmp_path):
    old, new = b"o" * (4 * KiB), b"n" * (6 * KiB)
    origin.files["b.tar"] = old
    p = proxy()
    get(p, "/b.tar")
    assert get(p, "/b.tar") == (200, "HIT", old)
    # another process re-downloads a new version under the same URL
    url = origin.url + "/b.tar"
    in_other_process(
        "from shardcache.store import Store\n"
        f"s = Store({str(tmp_path / 'cache')!r})\n"
        f"part = s.begin({url!r}, {len(new)})\n"
        f"part.path.write_bytes({new!r})\n"
        f"s.commit(part, {len(new)})\n"
    )
    status, cache, body = get(p, "/b.tar")
    assert (status, body) == (200, new)
    assert origin.gets["b.tar"] == 1


def test_an_entry_committed_by_another_process_is_a_hit(origin, proxy, tmp_path):
    data = b"c" * (300 * KiB)
    origin.files["c.tar"] = data
    p = proxy()
    url = origin.url + "/c.tar"
    in_other_process(
        "from shardcache.cachestream import cache_shards\n"
        f"for s in cache_shards([{url!r}], cache_dir={str(tmp_path / 'cache')!r}):\n"
        "    s['stream'].read()\n"
    )
    assert origin.gets["c.tar"] == 1
    assert get(p, "/c.tar") == (200, "HIT", data)
    assert origin.gets["c.tar"] == 1


def test_hits_reach_the_index_in_batches_and_survive_a_clean_restart(origin, proxy, tmp_path):
    origin.files["x.tar"] = b"x" * (2 * KiB)
    origin.files["y.tar"] = b"y" * (2 * KiB)
    p = proxy()
    get(p, "/x.tar")
    get(p, "/y.tar")
    for _ in range(5):
        assert get(p, "/x.tar")[1] == "HIT"
    with Store(tmp_path / "cache", reconcile=False) as store:
        hits: dict[str, int] = {}

        def recorded() -> bool:  # within about a second
            hits.clear()
            hits.update({e.url.rsplit("/", 1)[1]: e.hits for e in store.entries()})
            return hits.get("x.tar") == 5

        wait_until(recorded, 10, 0.2, what=lambda: f"the 5 hits of x.tar recorded: {hits}")
        assert hits == {"x.tar": 5, "y.tar": 0}
    assert get(p, "/y.tar")[1] == "HIT"
    assert p.stop(signal.SIGTERM) == 0  # a clean stop writes the last batch
    with Store(tmp_path / "cache", reconcile=False) as store:
        order = [e.url.rsplit("/", 1)[1] for e in store.entries()]  # next victim first
        hits = {e.url.rsplit("/", 1)[1]: e.hits for e in store.entries()}
    assert hits == {"x.tar": 5, "y.tar": 1}
    assert order == ["x.tar", "y.tar"]  # y was used last
