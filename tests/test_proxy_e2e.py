"""The proxy daemon as a real subprocess, read by curl and webdataset."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid

import pytest
from support.proxy_helpers import Fault, make_shard
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def curl(url: str, *args: str, timeout: float = 60) -> tuple[int, bytes, str]:
    """curl -sS: (exit code, body, response headers)."""
    res = subprocess.run(
        ["curl", "-sS", "-D", "-", "-o", "-", "--max-time", str(int(timeout)), *args, url],
        capture_output=True,
        timeout=timeout + 10,
    )
    head, _, body = res.stdout.partition(b"\r\n\r\n")
    return res.returncode, body, head.decode("latin-1")


def parts(cache_dir) -> list[str]:
    return [n for n in os.listdir(cache_dir) if n.endswith(".part")]


def test_curl_and_webdataset_read_through_the_proxy(origin, proxies, tmp_path):
    import webdataset as wds

    from shardcache.urls import proxied

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        data = make_shard(20, seed=i, size=2000)
        origin.files[f"shard-{i:03d}.tar"] = data
        (src / f"shard-{i:03d}.tar").write_bytes(data)
    p = proxies(env={"SHARDCACHE_UPSTREAM": origin.url, "SHARDCACHE_CACHE_SIZE": "10MiB"})

    rc, body, head = curl(f"{p.url}/shard-000.tar", "-f")
    assert rc == 0 and body == origin.files["shard-000.tar"] and "X-Cache: MISS" in head
    rc, body, head = curl(f"{p.url}/shard-000.tar", "-f")
    assert rc == 0 and body == origin.files["shard-000.tar"] and "X-Cache: HIT" in head
    rc, body, head = curl(f"{p.url}/shard-000.tar", "-f", "-r", "0-8388607")
    assert rc == 0 and body == origin.files["shard-000.tar"] and "206" in head.split("\r\n")[0]

    def samples(url):
        return [
            {k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")}
            for s in wds.WebDataset(url, shardshuffle=False)
        ]

    direct = samples(str(src / "shard-{000..002}.tar"))
    via = samples(proxied(f"{origin.url}/shard-{{000..002}}.tar", p.url, upstream=origin.url))
    assert len(direct) == 60 and via == direct
    again = samples(f"{p.url}/shard-{{000..002}}.tar")
    assert again == direct
    assert dict(origin.gets) == {f"shard-{i:03d}.tar": 1 for i in range(3)}
    log = p.logged('"GET /shard-001.tar" 200 HIT')
    assert '"GET /shard-001.tar" 200 MISS' in log and '"GET /shard-001.tar" 200 HIT' in log


def test_concurrent_curl_clients_coalesce(origin, proxies):
    data = os.urandom(2 << 20)
    origin.files["hot.tar"] = data
    origin.faults["hot.tar"] = Fault(delay=0.01)
    p = proxies("--upstream", origin.url)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda _: curl(f"{p.url}/hot.tar", "-f"), range(8)))
    assert all(rc == 0 and body == data for rc, body, _ in results)
    caches = sorted(h.split("X-Cache: ")[1].split("\r\n")[0] for _, _, h in results)
    assert caches.count("MISS") == 1 and caches.count("COALESCED") >= 1
    assert origin.gets["hot.tar"] == 1


def test_truncated_upstream_is_an_error_for_curl(origin, proxies):
    origin.files["cut.tar"] = os.urandom(1 << 20)
    origin.faults["cut.tar"] = Fault(truncate_at=300_000)
    p = proxies("--upstream", origin.url, "--retries", "1")
    rc, body, head = curl(f"{p.url}/cut.tar")
    assert rc != 0 and len(body) < (1 << 20)
    rc, body, head = curl(f"{p.url}/-/stats")
    assert b'"entries": 0' in body
    assert parts(p.cache_dir) == []


def test_kill_9_mid_download_then_restart(origin, proxies, tmp_path):
    warm = os.urandom(300_000)
    slow = os.urandom(3 << 20)
    origin.files["warm.tar"] = warm
    origin.files["slow.tar"] = slow
    origin.faults["slow.tar"] = Fault(delay=0.02, chunk=32 << 10)
    cache = tmp_path / "cache"
    p = proxies("--upstream", origin.url, cache_dir=cache)
    assert curl(f"{p.url}/warm.tar", "-f")[1] == warm
    # the last byte may reach the client before the commit (fsync, rename) is over
    wait_until(lambda: not parts(cache), 10, 0.02, "the commit")
    assert not parts(cache)
    got: dict = {}

    def reader():
        got["result"] = curl(f"{p.url}/slow.tar")

    t = threading.Thread(target=reader)
    t.start()

    def under_way() -> bool:
        ps = parts(cache)
        return bool(ps) and os.path.getsize(cache / ps[0]) > 200_000

    wait_until(under_way, 20, 0.02, "200 kB of the download on disk")
    p.stop(signal.SIGKILL)
    t.join(30)
    rc, body, _ = got["result"]
    assert rc != 0 and len(body) < len(slow)  # the client saw the failure
    assert len(parts(cache)) == 1  # the crash left a partial behind

    origin.faults.pop("slow.tar")
    p2 = proxies("--upstream", origin.url, cache_dir=cache)
    assert parts(cache) == []  # removed at startup
    rc, body, head = curl(f"{p2.url}/warm.tar", "-f")
    assert rc == 0 and body == warm and "X-Cache: HIT" in head
    rc, body, head = curl(f"{p2.url}/slow.tar", "-f")
    assert rc == 0 and body == slow and "X-Cache: MISS" in head


def test_sigterm_lets_responses_finish(origin, proxies):
    data = os.urandom(1 << 20)
    origin.files["s.tar"] = data
    origin.faults["s.tar"] = Fault(delay=0.03, chunk=64 << 10)  # about 0.5 s
    p = proxies("--upstream", origin.url, "--grace-period", "20")
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("r", curl(f"{p.url}/s.tar", "-f")))
    t.start()
    wait_until(lambda: parts(p.cache_dir), 20, 0.01, "the download's .part file")
    p.proc.send_signal(signal.SIGTERM)
    t.join(30)
    rc, body, head = got["r"]
    assert rc == 0 and body == data
    assert p.stop() == 0
    assert parts(p.cache_dir) == []
    assert "stopped" in p.log_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{p.url}/-/healthz", timeout=2)


def test_sigterm_grace_expires_without_partial_entry(origin, proxies):
    data = os.urandom(2 << 20)
    origin.files["long.tar"] = data
    origin.faults["long.tar"] = Fault(delay=0.1, chunk=64 << 10)  # about 3 s
    p = proxies("--upstream", origin.url, "--grace-period", "0.5")
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("r", curl(f"{p.url}/long.tar")))
    t.start()
    wait_until(lambda: parts(p.cache_dir), 20, 0.01, "the download's .part file")
    p.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert p.stop() == 0
    rc, body, _ = got["r"]
    assert rc != 0 and len(body) < len(data)
    assert parts(p.cache_dir) == []
    names = [n for n in os.listdir(p.cache_dir) if not n.startswith(".")]
    assert names == []


def test_check_command(origin, proxies, tmp_path):
    origin.files["ok.tar"] = b"x" * 1000
    cache = tmp_path / "cache"
    p = proxies("--upstream", origin.url, cache_dir=cache)
    assert curl(f"{p.url}/ok.tar", "-f")[0] == 0
    wait_until(lambda: not parts(cache), 10, what="the commit")
    p.stop()
    (cache / str(uuid.uuid4())).write_bytes(b"orphan")

    def check(*args):
        return subprocess.run(
            [sys.executable, "-m", "shardcache", "check", "--cache-dir", str(cache), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    res = check()
    assert res.returncode == 1 and "orphan" in res.stdout
    res = check()
    assert res.returncode == 1  # a report alone repairs nothing
    res = check("--fix")
    assert res.returncode == 0 and "removed orphan" in res.stdout
    res = check()
    assert res.returncode == 0 and "1 entries" in res.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "shardcache", "check", "--cache-dir", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "--cache-dir" in bad.stderr


def test_stats_io_roundtrip(origin, proxies):
    origin.files["m.tar"] = b"y" * 5000
    p = proxies("--upstream", origin.url, "--admin-token", "tok")
    curl(f"{p.url}/m.tar", "-f")
    curl(f"{p.url}/m.tar", "-f")
    rc, body, _ = curl(f"{p.url}/metrics", "-f")
    assert rc == 0 and b'shardcache_requests_total{cache="HIT",code="200"} 1.0' in body
    rc, body, head = curl(f"{p.url}/-/cache", "-X", "DELETE")
    assert "401" in head.split("\r\n")[0]
    rc, body, head = curl(f"{p.url}/-/cache", "-X", "DELETE", "-H", "Authorization: Bearer tok")
    assert rc == 0 and b'"removed": 1' in body
