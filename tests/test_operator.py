"""What an operator reads: bounds named in readable units and with their reason, the
evictions behind a hit ratio, one URL form for every tool, the version everywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.proxy import call, wait_idle
from support.proxy_helpers import Fault, Origin, ProxyProcess
from support.wait import wait_until

from shardcache.store import Store

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def rig(tmp_path: Path):
    started: list = []

    def make(files: dict[str, bytes], *args: str):
        origin = Origin(files=dict(files)).start()
        proxy = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *args).start()
        started.append((origin, proxy))
        return origin, proxy

    yield make
    for origin, proxy in started:
        proxy.stop()
        origin.stop()


def get(proxy: ProxyProcess, path: str) -> tuple[int, str | None, bytes]:
    with urllib.request.urlopen(proxy.url + path, timeout=30) as r:
        return r.status, r.headers.get("X-Cache"), r.read()


def settle(proxy: ProxyProcess, timeout: float = 15) -> dict:
    return wait_idle(proxy.port, timeout)


def wait_log(proxy: ProxyProcess, pattern: str, timeout: float = 10) -> str:
    m = wait_until(
        lambda: re.search(pattern, proxy.log_text()),
        timeout,
        what=lambda: f"{pattern!r} in:\n{proxy.log_text()}",
    )
    return m.group(0)


# --- sizes in logs, and the bound named --------------------------------------------------


def test_a_shard_larger_than_the_cache_names_the_bound_in_readable_units(rig):
    _, proxy = rig({"big.tar": b"x" * (2 * MiB)}, "--cache-size", "1MiB", "--min-free", "0")
    assert re.search(r"limit 1\.0 MiB, 0 B kept free", proxy.log_text()), proxy.log_text()
    assert get(proxy, "/big.tar")[1] == "BYPASS"
    line = wait_log(proxy, r"not cached \(.*\)")
    assert "size 2.0 MiB exceeds the bound in force, the cache size, 1.0 MiB" in line, line


def test_a_full_keep_cache_says_why_it_admits_nothing(rig):
    files = {"a.tar": b"a" * (600 * KiB), "b.tar": b"b" * (600 * KiB)}
    _, proxy = rig(files, "--cache-size", "1MiB", "--min-free", "0", "--eviction", "keep")
    assert get(proxy, "/a.tar")[1] == "MISS"
    settle(proxy)
    assert get(proxy, "/b.tar")[1] == "BYPASS"
    line = wait_log(proxy, r"b\.tar not cached \(.*\)")
    assert "no room for size 600.0 KiB" in line, line
    assert "--eviction keep" in line and "600.0 KiB cached" in line, line
    assert "the cache size, 1.0 MiB" in line, line


def test_a_body_of_unknown_length_that_outgrows_the_cache_names_the_bound(tmp_path):
    origin = Origin(files={"big.tar": b"x" * (3 * MiB)}, faults={"big.tar": Fault(chunked=True)})
    origin.start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--cache-size", "1MiB", "--min-free", "0"
    ).start()
    try:
        status, _, body = get(proxy, "/big.tar")
        assert (status, len(body)) == (200, 3 * MiB)
        line = wait_log(proxy, r"big\.tar outgrew the cache at .*")
        assert "the cache size, 1.0 MiB" in line, line
        # what was received when it no longer fitted, not a reservation step
        m = re.search(r"outgrew the cache at (\S+ \S+) \(size (\S+ \S+) exceeds", line)
        assert m and m.group(1) == m.group(2) and m.group(1).endswith("MiB"), line
    finally:
        proxy.stop()
        origin.stop()


def test_a_body_of_unknown_length_is_cached_in_a_cache_smaller_than_the_growth_step(tmp_path):
    """A chunked body reserves room in steps of 64 MiB; in a smaller cache the step is
    the cache size, so a body that fits is cached instead of turned away unread."""
    data = b"c" * (300 * KiB)
    origin = Origin(files={"c.tar": data}, faults={"c.tar": Fault(chunked=True)}).start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", origin.url, "--cache-size", "1MiB", "--min-free", "0"
    ).start()
    try:
        assert get(proxy, "/c.tar")[1:] == ("MISS", data)
        settle(proxy)
        assert get(proxy, "/c.tar")[1:] == ("HIT", data), proxy.log_text()
    finally:
        proxy.stop()
        origin.stop()


@pytest.mark.parametrize("daemon", [False, True], ids=["library", "daemon"])
def test_a_bound_lowered_by_min_free_says_so(tmp_path, daemon):
    """A cache size beyond the filesystem is lowered to keep min_free free: the warning
    and the reason a download is not admitted both say so, in readable units, naming the
    setting as the library's parameter or, in the daemon, as its flag."""
    from proxy.daemonstore import DaemonStore

    opener = DaemonStore if daemon else Store
    setting = "--min-free" if daemon else "min_free"
    store = opener(tmp_path / "c", cache_size=1 << 60, min_free=0)
    try:
        warning = store.size_warning or ""
        assert re.search(rf"^cache size 1024\.0 PiB exceeds .* kept free by {setting}\)", warning)
        assert not re.search(r"\d{7,}", warning), warning  # no raw byte counts
        why = store.why_no_room(1 << 59)
        assert "exceeds the bound in force" in why and "lowered to keep" in why, why
        assert f"({setting})" in why, why
        if not daemon:
            assert "--" not in warning + why, (warning, why)  # no daemon flag in the library
    finally:
        store.close()


# --- a cache that explains its hit ratio ---------------------------------------------------


def test_a_thrashing_cache_counts_its_evictions_and_warns_once(rig):
    """Two epochs over 12 shards through a cache that holds 3: every entry is evicted
    before its re-use. /-/stats and ``shardcache stats`` count it; the log says so once,
    with the remedies."""
    files = {f"s{i:02d}.tar": bytes([i]) * (300 * KiB) for i in range(12)}
    _, proxy = rig(files, "--cache-size", "1MiB", "--min-free", "0")
    for _epoch in range(2):
        for name in files:
            status, cache, body = get(proxy, f"/{name}")
            assert (status, cache, body) == (200, "MISS", files[name])
            settle(proxy)
    st = call(proxy, "GET", "/-/stats")[1]
    assert st["hit_ratio"] == 0.0
    assert st["evictions"] >= 20, st
    assert st["evicted_bytes"] == st["evictions"] * 300 * KiB, st
    assert st["evicted_before_reuse"] == st["evictions"], st
    warnings = re.findall(r"WARNING .*cache thrashing.*", proxy.log_text())
    assert len(warnings) == 1, proxy.log_text()
    for remedy in ("--cache-size", "--eviction keep", "read plan", "the cache size, 1.0 MiB"):
        assert remedy in warnings[0], warnings[0]

    out = subprocess.run(
        [sys.executable, "-m", "shardcache", "stats", "--proxy", proxy.url],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert re.search(rf"evictions\s+{st['evictions']}\b", out), out
    assert re.search(r"evicted_bytes\s+\d+\.\d MiB", out), out
    assert re.search(r"evicted_before_reuse\s+\d+", out), out


def test_thrash_watch_needs_a_sustained_rate_of_unread_evictions_and_is_rate_limited():
    from proxy.thrash import ThrashWatch

    now = [0.0]
    w = ThrashWatch(lambda: "the cache size, 1.0 MiB", clock=lambda: now[0])
    for _ in range(50):  # entries that were re-used before eviction: a working cache
        w.evicted(MiB, hits=3)
    assert w.warnings == 0
    for _ in range(7):  # a few unread evictions, spread out: not sustained
        now[0] += 61
        w.evicted(MiB, hits=0)
    assert w.warnings == 0
    for _ in range(20):  # a burst: one warning, then quiet
        now[0] += 1
        w.evicted(MiB, hits=0)
    assert w.warnings == 1
    now[0] += 601
    for _ in range(8):
        w.evicted(MiB, hits=0)
    assert w.warnings == 2


# --- cache directories this uid cannot use --------------------------------------------------

NO_DAC = "-dac_override,-dac_read_search,-fowner"


def as_plain_user(tmp_path: Path) -> list[str]:
    """A command prefix that runs a program as this uid without the powers of root over
    file permissions (tests run as root, whom a mode of 000 does not stop). Skips when
    that cannot be arranged here."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to drop the permission override")
    closed = tmp_path / "probe"
    closed.mkdir(mode=0o000)
    prefix = ["setpriv", f"--bounding-set={NO_DAC}", "--"]
    works = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    res = subprocess.run([*prefix, "ls", str(closed)], capture_output=True, timeout=30)
    if works.returncode != 0 or res.returncode == 0:
        pytest.skip("setpriv could not drop the permission override here")
    return prefix


def shardcache_cmd(
    prefix: list[str], *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "shardcache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **(env or {})),
        cwd=cwd,
    )


def test_a_cache_dir_under_a_parent_this_uid_cannot_search_is_a_usage_error(tmp_path):
    prefix = as_plain_user(tmp_path)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o000)
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    for cache in (closed / "cache", readonly / "cache"):
        res = shardcache_cmd(
            prefix,
            "serve",
            "--port",
            "0",
            "--upstream",
            "http://127.0.0.1:9",
            "--cache-dir",
            str(cache),
        )
        out = res.stdout + res.stderr
        assert res.returncode == 2, out
        assert "Traceback" not in out, out
        assert str(cache) in out and "Permission denied" in out and "uid 0" in out, out
        assert "--cache-dir" in out, out


def test_ls_and_check_on_an_unreadable_dir_say_why(tmp_path):
    prefix = as_plain_user(tmp_path)
    cache = tmp_path / "cache"
    Store(cache).close()
    cache.chmod(0o000)
    try:
        for tool in ("ls", "check"):
            res = shardcache_cmd(prefix, tool, "--cache-dir", str(cache))
            assert res.returncode != 0
            assert f"cannot read {cache} (Permission denied)" in res.stderr, res.stderr
            assert "no .shardcache.sqlite" not in res.stderr, res.stderr
    finally:
        cache.chmod(0o755)


def test_check_reads_the_cache_dir_variable_and_names_a_relative_dir_in_full(tmp_path):
    with Store(tmp_path / "cache") as store:
        partial = store.begin("http://h/a.tar", 3)
        partial.path.write_bytes(b"abc")
        store.commit(partial, 3)
    # run from tmp_path: the variable holds a relative path
    res = shardcache_cmd([], "check", env={"SHARDCACHE_CACHE_DIR": "cache"}, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0] == f"cache directory {tmp_path / 'cache'}: 1 entries, 3 bytes"


# --- one URL form everywhere ----------------------------------------------------------------


def prefetch_cli(proxy: ProxyProcess, pattern: str) -> subprocess.CompletedProcess:
    return shardcache_cmd([], "prefetch", "--quiet", "--proxy", proxy.url, pattern)


def test_prefetch_takes_upstream_urls_proxy_urls_and_paths(tmp_path):
    files = {f"data/s{i}.tar": bytes([i]) * 1000 for i in range(6)}
    origin = Origin(files=dict(files)).start()
    proxy = ProxyProcess(
        tmp_path / "cache", "--upstream", f"{origin.url}/data", "--upstream", f"named={origin.url}"
    ).start()
    try:
        forms = [
            f"{origin.url}/data/s{{0..1}}.tar",  # under the unnamed upstream
            f"{proxy.url}/s2.tar",  # a URL of the proxy
            f"http://localhost:{proxy.port}/s3.tar",  # ... under another loopback name
            "/s4.tar",  # a path on the proxy
        ]
        for pattern in forms:
            res = prefetch_cli(proxy, pattern)
            assert res.returncode == 0, res.stdout + res.stderr
        for i in range(5):
            assert get(proxy, f"/s{i}.tar")[1] == "HIT", i
        assert sum(origin.gets.values()) == 5, origin.gets
        # under the named upstream, the longest base matching wins: /data/s5.tar there
        res = prefetch_cli(proxy, f"{origin.url}/data/s5.tar")
        assert res.returncode == 0, res.stderr
        assert get(proxy, "/s5.tar")[1] == "HIT"
        # a URL under no upstream: the upstreams named, once, not 403 advice per shard
        res = prefetch_cli(proxy, "http://elsewhere.example/data/s{0..3}.tar")
        assert res.returncode == 1
        assert "under none of the proxy's upstreams" in res.stderr, res.stderr
        assert f"{origin.url}/data" in res.stderr and "HTTP 403" not in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1, res.stderr
    finally:
        proxy.stop()
        origin.stop()


def test_the_prefetch_route_maps_urls_as_read_plans_do(rig):
    files = {f"s{i}.tar": bytes([i]) * 1000 for i in range(3)}
    origin, proxy = rig(files)
    body = {"urls": [f"{proxy.url}/s0.tar", f"{origin.url}/s1.tar", "/s2.tar"]}
    status, answer, _ = call(proxy, "POST", "/-/prefetch", body)
    assert status == 202, answer
    settle(proxy)
    wait_until(lambda: sum(origin.gets.values()) >= 3, 10, what="three prefetched GETs")
    settle(proxy)
    for name in files:
        assert get(proxy, f"/{name}")[1] == "HIT", name
    status, text, _ = call(proxy, "POST", "/-/prefetch", {"urls": ["http://elsewhere.example/x"]})
    assert status == 400, text
    assert "under none of this proxy's upstreams" in text and origin.url in text, text


# --- the version, where people look -------------------------------------------------------


def test_the_version_is_in_stats_metrics_and_the_command_line(rig):
    import shardcache

    _, proxy = rig({"a.tar": b"a"})
    assert call(proxy, "GET", "/-/stats")[1]["version"] == shardcache.__version__
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    line = f'shardcache_build_info{{version="{shardcache.__version__}"}} 1.0'
    assert line in text.splitlines(), [ln for ln in text.splitlines() if "build_info" in ln]
    res = shardcache_cmd([], "--version")
    assert res.stdout.strip() == f"shardcache {shardcache.__version__}"
    out = shardcache_cmd([], "stats", "--proxy", proxy.url).stdout
    assert re.search(rf"version\s+{re.escape(shardcache.__version__)}", out), out


def test_make_test_says_why_tests_were_skipped():
    """``pytest -q`` hides skip reasons; with ``-rs`` the summary lists them (a missing
    tool or privilege is then seen, not mistaken for a pass)."""
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    lines = [ln for ln in makefile.splitlines() if "-m pytest" in ln]
    assert lines and all(" -rs " in ln for ln in lines), lines


def test_stats_against_an_origin_says_it_is_not_a_shardcache_proxy():
    origin = Origin(files={"a.tar": b"a"}).start()
    try:
        res = shardcache_cmd([], "stats", "--proxy", origin.url)
    finally:
        origin.stop()
    assert res.returncode == 1
    assert "HTTP 404" in res.stderr, res.stderr
    assert f"the server at {origin.url} answers HTTP but is not a shardcache proxy" in res.stderr
    assert "--proxy" in res.stderr, res.stderr


def test_stats_lists_the_upstreams_without_credentials():
    from proxy.admin import _without_userinfo

    assert _without_userinfo("data=https://user:secret@h.example:8443/x") == (
        "data=https://h.example:8443/x"
    )
    assert _without_userinfo("s3://bucket/prefix") == "s3://bucket/prefix"
    assert _without_userinfo("file:///srv/shards") == "file:///srv/shards"
