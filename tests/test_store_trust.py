"""The proxy and a store it cannot fully trust: a full disk, a filesystem smaller than
``--cache-size``, and cache directories or indexes it cannot use at startup.

The disk-space tests put the cache directory on a small tmpfs (they need root and
``mount``; they skip otherwise). The proxy's log stays outside the tmpfs so that a full
cache filesystem cannot swallow it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import http.client
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support.data import sha
from support.proxy import part_files, stats, wait_idle
from support.proxy_helpers import Fault
from support.store_faults import fill, run_serve
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB = 1 << 10
MiB = 1 << 20
INDEX = ".shardcache.sqlite"


# --- fixtures and helpers --------------------------------------------------------------


def get(port: int, path: str, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """One GET with http.client: (status, headers, body). A body cut short raises."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, dict(resp.getheaders()), body
    finally:
        conn.close()


def stream_digest(port: int, path: str, timeout: float = 60) -> tuple[int, str, int, str]:
    """GET ``path`` reading in 64 KiB pieces: (status, X-Cache, length, sha256).

    ``read(amt)`` does not raise on a body cut short: the caller compares the length (an
    aborted chunked body raises IncompleteRead)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        h = hashlib.sha256()
        n = 0
        while True:
            piece = resp.read(64 * KiB)
            if not piece:
                break
            h.update(piece)
            n += len(piece)
        return resp.status, resp.getheader("X-Cache", ""), n, h.hexdigest()
    finally:
        conn.close()


def metrics(port: int) -> str:
    st, _, body = get(port, "/metrics", timeout=10)
    assert st == 200, body
    return body.decode()


def part_sizes(cache_dir: Path) -> list[int]:
    out = []
    for n in part_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.path.getsize(cache_dir / n))
    return out


def free_bytes(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def sample_value(text: str, name: str, **labels: str) -> list[float]:
    """Values of the samples of ``name`` whose labels include ``labels`` (any order)."""
    out = []
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


# --- A: a full disk turns caching into pass-through -------------------------------------


def test_disk_full_mid_download_streams_on_and_recovers(rig, origin):
    fs = rig.mount_tmpfs("fs", "size=64m")
    cache = fs / "cache"
    filler = fs / "filler"
    warm, fresh, after = os.urandom(MiB), os.urandom(MiB), os.urandom(MiB)
    origin.files.update({"warm.tar": warm, "fresh.tar": fresh, "after.tar": after})
    big = {f"big-{i}.tar": os.urandom(20 * MiB) for i in range(3)}
    origin.files.update(big)
    for name in big:
        origin.faults[name] = Fault(delay=0.01)  # 320 chunks of 64 KiB: several seconds
    p = rig.proxy(cache, "--upstream", origin.url, "--min-free", "0", "--store-probe-interval", "1")

    st, h, body = get(p.port, "/warm.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "MISS", sha(warm))
    wait_idle(p.port)
    st, h, body = get(p.port, "/warm.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "HIT", sha(warm))

    stop_filling = threading.Event()
    held = fs / "held"
    held.mkdir()

    def keep_full() -> None:
        """Keep the filesystem full until told to stop. A .part file the proxy gives up
        is hard-linked first, so deleting it frees nothing (a store probe could otherwise
        see the freed space in the moment before the filler takes it back)."""
        while not stop_filling.is_set():
            for name in part_files(cache):
                if not (held / name).exists():
                    with contextlib.suppress(FileNotFoundError):
                        os.link(cache / name, held / name)
            if fill(filler) == 0:
                time.sleep(0.001)

    jobs = [name for name in big for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as ex:
        futures = [ex.submit(stream_digest, p.port, f"/{name}") for name in jobs]

        def writing() -> bool:  # the downloads are writing their .part files
            sizes = part_sizes(cache)
            return len(sizes) >= 2 and min(sizes) >= 2 * MiB

        wait_until(writing, 20, 0.01, what=lambda: f"downloads writing: {part_files(cache)}")
        filler_job = ex.submit(keep_full)
        results = []
        for name, fut in zip(jobs, futures, strict=True):
            try:
                results.append((name, fut.result(timeout=90)))
            except Exception as exc:  # an aborted client: the upstream was healthy
                results.append((name, repr(exc)))
        deadline = time.monotonic() + 10
        while part_files(cache) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_filling.set()
        filler_job.result(timeout=30)
    fill(filler)

    log_tail = p.log_text()[-4000:]
    for name, res in results:
        assert isinstance(res, tuple), f"{name}: client failed: {res}\n{log_tail}"
        status, _, length, digest = res
        want = (name, 200, len(big[name]), sha(big[name]))
        assert (name, status, length, digest) == want, f"{res}\n{log_tail}"
    assert part_files(cache) == []
    # at most the shared download plus one own upstream request per client
    assert all(1 <= origin.gets[name] <= 4 for name in big), (dict(origin.gets), origin.ranges)

    s = stats(p.port)
    assert s["reserved"] == 0
    store = s["store"]
    assert set(store) >= {"writable", "error", "errors", "free_bytes", "min_free_bytes"}
    assert store["writable"] is False, store
    assert isinstance(store["errors"], int) and store["errors"] >= 1, store
    assert isinstance(store["free_bytes"], int) and store["min_free_bytes"] == 0, store
    assert store["error"] is None or isinstance(store["error"], str)
    text = metrics(p.port)
    assert sample_value(text, "shardcache_store_writable") == [0.0]
    enospc = sample_value(text, "shardcache_store_errors_total", errno="ENOSPC")
    assert enospc and sum(enospc) >= 1, [ln for ln in text.splitlines() if "store_errors" in ln]
    assert all(
        'op="' in ln for ln in text.splitlines() if ln.startswith("shardcache_store_errors_total{")
    )
    warnings = [
        ln
        for ln in p.log_text().splitlines()
        if "WARNING" in ln and str(cache) in ln and "ENOSPC" in ln
    ]
    assert warnings, p.log_text()[-3000:]

    # still unwritable: new objects pass through, old entries are still hits
    st, h, body = get(p.port, "/fresh.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "BYPASS", sha(fresh))
    st, h, body = get(p.port, "/warm.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "HIT", sha(warm))
    assert origin.gets["warm.tar"] == 1
    st, _, body = get(p.port, "/-/readyz")
    assert st == 200, body
    st, _, body = get(p.port, "/-/healthz")
    assert st == 200 and re.search(r"not writable|unwritable", body.decode().lower()), body
    assert stats(p.port)["store"]["writable"] is False

    # space comes back: the store is writable again within the probe interval
    filler.unlink()
    shutil.rmtree(held)
    wait_until(lambda: stats(p.port)["store"]["writable"], 10, 0.1, "a writable store again")
    assert sample_value(metrics(p.port), "shardcache_store_writable") == [1.0]
    st, h, body = get(p.port, "/after.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "MISS", sha(after))
    wait_idle(p.port)
    st, h, body = get(p.port, "/after.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "HIT", sha(after))
    assert origin.gets["after.tar"] == 1


# --- B: the free-space guard -------------------------------------------------------------

_CACHE_SIZE_RE = re.compile(r"100\s*G\b|100000000000|93\.1\s*GiB|100(\.0)?\s*GB")
_UNITS = {"": 1, "b": 1, "bytes": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 1000**2}
_UNITS.update({"mb": 1000**2, "mib": MiB, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30})


def sizes_named(line: str) -> list[int]:
    """Byte counts written in ``line`` (``67108864``, ``64 MiB``, ``48.0MiB``...)."""
    out = []
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(bytes|[kmg]i?b|[kmg]|b)?\b", line, re.I):
        out.append(int(float(number) * _UNITS[unit.lower()]))
    return out


def test_cache_size_larger_than_the_filesystem_keeps_min_free(rig, origin):
    fs = rig.mount_tmpfs("fs", "size=64m")
    cache = fs / "cache"
    objs = {f"o-{i}.tar": os.urandom(10 * MiB) for i in range(8)}
    origin.files.update(objs)
    p = rig.proxy(cache, "--upstream", origin.url, "--min-free", "16M")

    lines = [
        ln
        for ln in p.log_text().splitlines()
        if _CACHE_SIZE_RE.search(ln) and any(16 * MiB < n <= 64 * MiB for n in sizes_named(ln))
    ]
    assert lines, p.log_text()
    assert any(re.search(r"cache.size", ln, re.I) for ln in lines), lines
    s = stats(p.port)
    assert 0 < s["limit"] <= 64 * MiB, s

    floor = 16 * MiB - MiB
    for name, data in objs.items():
        st, h, body = get(p.port, f"/{name}")
        assert (name, st, h.get("X-Cache"), sha(body)) == (name, 200, "MISS", sha(data))
        assert free_bytes(fs) >= floor, (name, free_bytes(fs))
        wait_idle(p.port)
        assert free_bytes(fs) >= floor, (name, free_bytes(fs))
        st, h, body = get(p.port, f"/{name}")
        assert (name, st, h.get("X-Cache"), sha(body)) == (name, 200, "HIT", sha(data))
    assert all(origin.gets[name] == 1 for name in objs), dict(origin.gets)
    s = stats(p.port)
    assert s["store"]["writable"] is True and s["store"]["errors"] == 0, s
    assert s["bytes"] <= s["limit"] and 1 <= s["entries"] < len(objs), s
    # the oldest object was evicted to make room: it is fetched again
    st, h, body = get(p.port, "/o-0.tar")
    assert (st, h.get("X-Cache"), sha(body)) == (200, "MISS", sha(objs["o-0.tar"]))
    assert origin.gets["o-0.tar"] == 2
    wait_idle(p.port)
    assert free_bytes(fs) >= floor


def test_other_data_filling_the_disk_lowers_the_bound_in_force(rig, origin):
    """shardcache_cache_effective_limit_bytes (the ShardcacheDiskNearFull alert) follows
    the free space; the configured bound stays."""
    fs = rig.mount_tmpfs("fs", "size=64m")
    p = rig.proxy(fs / "cache", "--upstream", origin.url, "--cache-size", "40M", "--min-free", "8M")
    text = metrics(p.port)
    assert sample_value(text, "shardcache_cache_limit_bytes") == [40e6], text
    assert sample_value(text, "shardcache_cache_effective_limit_bytes") == [40e6], text
    (fs / "other").write_bytes(b"\0" * (40 * MiB))
    text = metrics(p.port)
    effective = sample_value(text, "shardcache_cache_effective_limit_bytes")
    assert effective == [float(free_bytes(fs) - 8_000_000)], (effective, free_bytes(fs))
    assert effective[0] < 0.9 * 40e6
    assert sample_value(text, "shardcache_cache_limit_bytes") == [40e6]
    assert stats(p.port)["store"]["effective_limit"] == effective[0]


def test_min_free_percent_is_accepted(rig, origin, tmp_path):
    origin.files["a.tar"] = b"a" * 5000
    p = rig.proxy(tmp_path / "cache", "--upstream", origin.url, "--min-free", "10%")
    st, h, body = get(p.port, "/a.tar")
    assert (st, body) == (200, b"a" * 5000)
    assert stats(p.port)["store"]["min_free_bytes"] > 0


def test_min_free_bogus_is_a_usage_error(tmp_path):
    rc, out, served = run_serve(
        "--cache-dir",
        str(tmp_path / "cache"),
        "--upstream",
        "http://127.0.0.1:9",
        "--min-free",
        "bogus",
    )
    assert not served, out
    assert rc == 2, out
    assert "--min-free" in out and "unrecognized arguments" not in out, out


# --- C: startup errors name the path, the uid and what to do ------------------------------


def assert_startup_error(rc, out, served, path) -> None:
    assert not served, f"the proxy started listening:\n{out}"
    assert rc == 2, out
    assert str(path) in out, out
    assert re.search(rf"\buid {os.getuid()}\b", out), out
    assert "Traceback" not in out, out


def test_cache_dir_under_a_regular_file(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file.txt").write_text("not a directory\n")
    bad = tmp_path / "x" / "file.txt" / "sub"
    rc, out, served = run_serve("--cache-dir", str(bad), "--upstream", "http://127.0.0.1:9")
    assert_startup_error(rc, out, served, bad)
    assert "--port" not in out, out


def test_cache_dir_on_a_read_only_filesystem(rig):
    ro = rig.mount_tmpfs("ro", "size=8m,ro")
    rc, out, served = run_serve("--cache-dir", str(ro), "--upstream", "http://127.0.0.1:9")
    assert_startup_error(rc, out, served, ro)
    assert "--port" not in out, out


def make_index(rig, cache: Path) -> None:
    """Create the store's index with a real proxy start and a clean stop."""
    p = rig.proxy(cache, "--upstream", "http://127.0.0.1:9")
    assert p.stop() == 0, p.log_text()
    assert (cache / INDEX).exists()


def test_index_shm_not_writable(rig, tmp_path):
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("making a file unwritable for root needs chattr and root")
    cache = tmp_path / "cache"
    make_index(rig, cache)
    shm = cache / (INDEX + "-shm")
    if not shm.exists():
        shm.write_bytes(b"")
    res = subprocess.run(["chattr", "+i", str(shm)], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"chattr +i not supported here: {res.stderr.strip()}")
    rig.immutable.append(shm)
    try:
        with open(shm, "r+b"):
            pytest.skip("an immutable file is still writable here")
    except PermissionError:
        pass
    rc, out, served = run_serve("--cache-dir", str(cache), "--upstream", "http://127.0.0.1:9")
    assert_startup_error(rc, out, served, cache)


def test_index_from_a_newer_version(rig, tmp_path):
    cache = tmp_path / "cache"
    make_index(rig, cache)
    conn = sqlite3.connect(cache / INDEX)
    try:
        conn.execute("PRAGMA user_version = 999")
        conn.commit()
    finally:
        conn.close()
    rc, out, served = run_serve("--cache-dir", str(cache), "--upstream", "http://127.0.0.1:9")
    assert_startup_error(rc, out, served, cache / INDEX)
    assert "newer" in out.lower(), out
