"""``serve --workers N``: one listening port, N worker processes under a supervising parent.

Real processes only: the proxy as a subprocess, an aiohttp origin in a thread, clients on
loopback. Which worker answers is learnt from ``/-/stats`` (``"pid"``); a keep-alive
connection stays with the worker that accepted it, so a test can talk to a chosen worker.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter

import pytest
from support.data import sha
from support.proxy import Pinned, pin_connections
from support.proxy_helpers import Fault, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KiB, MiB = 1024, 1024 * 1024


# ---------------------------------------------------------------------------------------
# processes


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, Z...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]


def running(pid: int) -> bool:
    """A live process (a zombie has finished; only its exit status is left)."""
    return proc_state(pid) not in (None, "Z", "X")


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (read from /proc)."""
    parent_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent_of[int(name)] = int(stat.rpartition(")")[2].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found


class Proxy(ProxyProcess):
    """The proxy; remembers every process it ran so that teardown leaves none behind."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def note_processes(self) -> set[int]:
        if self.proc is not None and self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
        return self.seen

    def shutdown(self) -> None:
        self.note_processes()
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGTERM, timeout=15)  # SIGKILLs the parent if it hangs
        elif self.proc is not None:
            self._log.close()
        for pid in self.seen:  # only processes this proxy started
            if running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def proxy(tmp_path, origin):
    started: list[Proxy] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Proxy:
        p = Proxy(tmp_path / "cache", "--upstream", origin.url, *args, env=env).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.shutdown()


# ---------------------------------------------------------------------------------------
# clients


def fetch(port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 20):
    """GET on a fresh connection: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def fresh_stats(port: int) -> dict:
    status, _, body = fetch(port, "/-/stats")
    assert status == 200, body
    return json.loads(body)


def pin_workers(port: int, per_worker: int, workers: int = 2, tries: int = 400):
    """``per_worker`` open connections to each of ``workers`` workers: {pid: [Pinned]}."""
    return pin_connections(
        lambda: http.client.HTTPConnection("127.0.0.1", port, timeout=20),
        per_worker,
        workers,
        tries,
    )


def close_all(pinned: dict[int, list[Pinned]]) -> None:
    for conns in pinned.values():
        for c in conns:
            c.close()


def part_files(cache_dir) -> list[str]:
    return [n for _, _, names in os.walk(cache_dir) for n in names if n.endswith(".part")]


def wait_for(predicate, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


# ---------------------------------------------------------------------------------------
# 1. one port, two workers


@pytest.mark.parametrize("how", ["flag", "env"])
def test_two_workers_share_one_port(origin, proxy, how):
    p = proxy("--workers", "2") if how == "flag" else proxy(env={"SHARDCACHE_WORKERS": "2"})
    log = p.log_text()
    serving = [line for line in log.splitlines() if "serving on http://" in line]
    # per-worker lines, if any, say "worker" before "serving on" (not "workers", as in the
    # logger name proxy.workers)
    main = [
        line for line in serving if not re.search(r"\bworker\b", line.partition("serving on")[0])
    ]
    assert len(main) == 1, log
    assert f"serving on http://127.0.0.1:{p.port}" in main[0], log
    ports = {int(m) for m in re.findall(r"serving on http://[^:\s]+:(\d+)", log)}
    assert ports == {p.port}, log  # worker lines, if any, name the shared port

    pids: Counter = Counter()
    for i in range(400):
        st = fresh_stats(p.port)
        assert st["workers"] == 2, st
        assert isinstance(st["pid"], int) and st["pid"] != p.proc.pid, st
        pids[st["pid"]] += 1
        if len(pids) >= 2 and i >= 49:
            break
    assert len(pids) == 2, f"only {dict(pids)} answered {sum(pids.values())} connections"
    assert all(running(pid) for pid in pids)
    assert set(pids) <= descendants(p.proc.pid)  # workers of this parent


def test_one_worker_by_default(origin, proxy):
    p = proxy()
    st = fresh_stats(p.port)
    assert st["workers"] == 1 and isinstance(st["pid"], int), st


# ---------------------------------------------------------------------------------------
# 2. hits and misses from either worker


def test_hits_and_misses_from_either_worker(origin, proxy):
    sizes = [4 * KiB, 64 * KiB, 300 * KiB, 1 * MiB, 3 * MiB, 5 * MiB]  # RAM tier and sendfile
    data = {f"o{i}.tar": os.urandom(n) for i, n in enumerate(sizes)}
    origin.files.update(data)
    p = proxy("--workers", "2")
    pinned = pin_workers(p.port, per_worker=1)
    a, b = (conns[0] for conns in pinned.values())
    try:
        for i, (name, body) in enumerate(data.items()):  # misses on both workers
            status, headers, got = (a, b)[i % 2].get(f"/{name}")
            assert (status, headers["X-Cache"], sha(got)) == (200, "MISS", sha(body)), name
        for name, body in data.items():  # hits on both workers, then on fresh connections
            for c in (a, b):
                status, headers, got = c.get(f"/{name}")
                assert (status, headers["X-Cache"], sha(got)) == (200, "HIT", sha(body)), name
            for _ in range(4):
                status, headers, got = fetch(p.port, f"/{name}")
                assert (status, headers["X-Cache"], sha(got)) == (200, "HIT", sha(body)), name
            status, headers, got = fetch(p.port, f"/{name}", {"Range": "bytes=100-2099"})
            assert (status, headers["X-Cache"], got) == (206, "HIT", body[100:2100]), name
        assert dict(origin.gets) == {name: 1 for name in data}
    finally:
        close_all(pinned)


# ---------------------------------------------------------------------------------------
# 3. concurrent misses across workers: one upstream GET


@pytest.mark.parametrize("ranges", [False, True], ids=["full", "with-ranges"])
def test_concurrent_misses_across_workers_cost_one_upstream_get(origin, proxy, ranges):
    data = os.urandom(16 * MiB)
    origin.files["hot.tar"] = data
    origin.faults["hot.tar"] = Fault(delay=0.005)  # 256 chunks: more than a second
    p = proxy("--workers", "2")
    pinned = pin_workers(p.port, per_worker=8)  # 16 connections, 8 on each worker
    conns = [c for cs in zip(*pinned.values(), strict=True) for c in cs]  # alternate workers
    go = threading.Barrier(len(conns))

    def client(i: int):
        c = conns[i]
        headers = {"Range": "bytes=1000-2000000"} if ranges and i % 2 else {}
        go.wait(10)
        status, h, body = c.get("/hot.tar", headers)
        return c.pid, headers, status, h.get("X-Cache"), h.get("Content-Range"), body

    try:
        with concurrent.futures.ThreadPoolExecutor(len(conns)) as ex:
            results = list(ex.map(client, range(len(conns)), timeout=60))
    finally:
        close_all(pinned)
    caches = Counter(r[3] for r in results)
    for pid, headers, status, cache, content_range, body in results:
        if headers:
            assert status == 206, (pid, status, cache)
            assert content_range == f"bytes 1000-2000000/{len(data)}", content_range
            assert sha(body) == sha(data[1000:2000001]), (pid, cache, len(body))
        else:
            assert status == 200, (pid, status, cache)
            assert sha(body) == sha(data), (pid, cache, len(body))
    assert set(caches) <= {"MISS", "COALESCED"}, caches
    assert caches["COALESCED"] >= 1 and caches["MISS"] >= 1, caches
    assert origin.gets["hot.tar"] == 1, (origin.gets, origin.ranges, caches)
    by_worker = {pid: Counter(r[3] for r in results if r[0] == pid) for pid in pinned}
    # the worker that did not download followed the other one's download
    assert any(c["MISS"] == 0 and c["COALESCED"] == 8 for c in by_worker.values()), by_worker


# ---------------------------------------------------------------------------------------
# 4. metrics add up across workers


def requests_total(text: str, cache: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"shardcache_requests_total\{([^}]*)\}\s+(\S+)", line)
        if m and re.search(rf'(^|,)cache="{cache}"', m.group(1)):
            total += float(m.group(2))
    return total


def converged_hits(port: int, want: int, timeout: float = 2) -> list:
    """Scrape /-/stats and /metrics until both report ``want`` hits (a response may reach
    its client a moment before its worker counts it); what was seen, for messages."""
    seen: list = []

    def check() -> bool:
        st = fresh_stats(port)["hits"]
        m = requests_total(fetch(port, "/metrics")[2].decode(), "HIT")
        seen.append((st, m))
        return st == m == want

    wait_for(check, timeout, step=0.02)
    return seen[-5:]


def test_metrics_and_stats_add_up_across_workers(origin, proxy):
    data = os.urandom(200 * KiB)
    origin.files["m.tar"] = data
    p = proxy("--workers", "2")
    status, headers, _ = fetch(p.port, "/m.tar")
    assert (status, headers["X-Cache"]) == (200, "MISS")
    hits = 0
    for _ in range(40):
        status, headers, body = fetch(p.port, "/m.tar")
        assert status == 200 and body == data
        hits += headers["X-Cache"] == "HIT"
    assert hits == 40
    converged_hits(p.port, hits)
    pinned = pin_workers(p.port, per_worker=1)
    try:
        seen = []
        for _ in range(3):  # every worker, several times, and fresh connections too
            for pid, (c,) in pinned.items():
                status, _, body = c.get("/metrics")
                assert status == 200
                text = body.decode()
                seen.append(("metrics", pid, requests_total(text, "HIT")))
                seen.append(("metrics-miss", pid, requests_total(text, "MISS")))
                st = c.stats()
                seen.append(("stats", pid, st["hits"]))
                seen.append(("stats-miss", pid, st["misses"]))
            status, _, body = fetch(p.port, "/metrics")
            seen.append(("metrics", "fresh", requests_total(body.decode(), "HIT")))
        wrong = [s for s in seen if s[2] != (1 if s[0].endswith("miss") else hits)]
        assert not wrong, f"expected {hits} hits and 1 miss; got {wrong}"
    finally:
        close_all(pinned)


# ---------------------------------------------------------------------------------------
# 5. lifecycle


def test_sigterm_stops_the_parent_and_every_worker(origin, proxy):
    origin.files["t.tar"] = b"t" * (100 * KiB)
    p = proxy("--workers", "2")
    pinned = pin_workers(p.port, per_worker=1)
    close_all(pinned)
    assert fetch(p.port, "/t.tar")[0] == 200
    workers = set(pinned)
    everyone = p.note_processes() | workers
    assert workers <= everyone
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    try:
        rc = p.proc.wait(15)
    except Exception:
        pytest.fail(f"the parent did not exit within 15 s of SIGTERM:\n{p.log_text()}")
    took = time.monotonic() - t0
    assert rc == 0, (rc, p.log_text())
    left = wait_for(lambda: not [pid for pid in everyone if running(pid)], 2)
    assert left, {pid: proc_state(pid) for pid in everyone if running(pid)}
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", p.port), timeout=2).close()
    assert took < 15


def test_a_killed_worker_is_replaced_and_the_service_keeps_answering(origin, proxy):
    data = os.urandom(500 * KiB)
    origin.files["k.tar"] = data
    p = proxy("--workers", "2")
    assert fetch(p.port, "/k.tar")[0] == 200
    pinned = pin_workers(p.port, per_worker=1)
    victim, survivor = list(pinned)
    hits = 0
    for _ in range(10):  # counted by the victim, whose counts must outlive it
        status, headers, body = pinned[victim][0].get("/k.tar")
        assert (status, headers["X-Cache"], body) == (200, "HIT", data)
        hits += 1
    close_all(pinned)
    assert converged_hits(p.port, hits)[-1] == (hits, hits)
    os.kill(victim, signal.SIGKILL)
    # A connection the kernel queued on the victim's own SO_REUSEPORT socket before that
    # socket closed is lost with it; from the moment the victim is gone (reaped: a zombie
    # thread-group leader may still have threads holding its sockets), nothing may fail.
    assert wait_for(lambda: proc_state(victim) is None, 5), proc_state(victim)
    t0 = time.monotonic()
    failures: list = []
    answered_by: Counter = Counter()
    rounds = 0

    def failed(*what) -> None:
        failures.append((round(time.monotonic() - t0, 2), *what))

    def scrape(path: str) -> bytes | None:
        try:
            status, _, body = fetch(p.port, path, timeout=5)
        except (OSError, http.client.HTTPException) as exc:
            failed(path, repr(exc))
            return None
        if status != 200:
            failed(path, status, body[:60])
            return None
        return body

    def admin_load() -> None:  # /-/stats and /metrics all the while a worker starts
        while time.monotonic() - t0 < 4:
            body = scrape("/-/stats")
            if body is not None:
                answered_by[json.loads(body)["pid"]] += 1
            scrape("/metrics")

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        loads = [ex.submit(admin_load) for _ in range(3)]
        while time.monotonic() - t0 < 4:  # every request after the kill succeeds
            rounds += 1
            try:
                status, headers, body = fetch(p.port, "/k.tar", timeout=5)
            except (OSError, http.client.HTTPException) as exc:
                failed("/k.tar", repr(exc))
                continue
            if (status, body) != (200, data):
                failed("/k.tar", status, len(body))
            hits += headers.get("X-Cache") == "HIT"
        for f in loads:
            f.result(10)
    assert not failures, f"{len(failures)} failures after the kill ({rounds} GETs): {failures[:4]}"
    assert victim not in answered_by, answered_by

    def replacement() -> set[int]:
        st = fresh_stats(p.port)
        answered_by[st["pid"]] += 1
        assert st["workers"] == 2
        return set(answered_by) - {victim, survivor}

    new = wait_for(replacement, 10)
    assert new, f"no new worker within 10 s; answered by {dict(answered_by)}:\n{p.log_text()}"
    assert p.proc.poll() is None
    (new_pid,) = new
    assert new_pid in descendants(p.proc.pid)
    status, headers, body = fetch(p.port, "/k.tar")
    assert (status, headers["X-Cache"], body) == (200, "HIT", data)
    hits += 1
    assert origin.gets["k.tar"] == 1
    # the dead worker's counts stay in the totals, counted once
    assert converged_hits(p.port, hits)[-1] == (hits, hits), (hits, converged_hits(p.port, hits))
    for _ in range(4):
        assert fresh_stats(p.port)["hits"] == hits
        assert requests_total(fetch(p.port, "/metrics")[2].decode(), "HIT") == hits


# ---------------------------------------------------------------------------------------
# 6. a worker killed while it downloads


def test_worker_killed_mid_download(origin, proxy):
    data = os.urandom(8 * MiB)
    origin.files["slow.tar"] = data
    origin.faults["slow.tar"] = Fault(delay=0.02, chunk=64 * KiB)  # about 3 s
    p = proxy("--workers", "2")
    cache = p.cache_dir
    pinned = pin_workers(p.port, per_worker=2)
    (owner, other) = list(pinned)
    results: dict[str, tuple] = {}
    done: dict[str, float] = {}

    def client(name: str, c: Pinned, headers: dict[str, str]) -> None:
        try:
            status, h, body = c.get("/slow.tar", headers)
            results[name] = ("clean", c.pid, status, h.get("X-Cache"), headers, body)
        except TimeoutError as exc:
            results[name] = ("hang", c.pid, repr(exc))
        except (OSError, http.client.HTTPException) as exc:
            results[name] = ("aborted", c.pid, repr(exc))
        done[name] = time.monotonic()

    for conns in pinned.values():
        for c in conns:
            c.conn.timeout = 12
            c.conn.sock.settimeout(12)
    threads = [threading.Thread(target=client, args=("first", pinned[owner][0], {}), daemon=True)]
    threads[0].start()
    first_part = wait_for(lambda: part_files(cache), 10)
    assert first_part, "the download did not start"
    followers = [
        ("owner-follower", pinned[owner][1], {}),
        ("other-follower", pinned[other][0], {}),
        ("other-range", pinned[other][1], {"Range": "bytes=6000000-"}),
    ]
    for name, c, headers in followers:
        t = threading.Thread(target=client, args=(name, c, headers), daemon=True)
        t.start()
        threads.append(t)

    def grown() -> bool:
        ps = part_files(cache)
        return bool(ps) and os.path.getsize(os.path.join(cache, ps[0])) > 2 * MiB

    assert wait_for(grown, 15), part_files(cache)
    (part,) = part_files(cache)
    part_pid = int(part[: -len(".part")].split(".")[-2])
    assert part_pid == owner, (part, owner, other)  # the MISS client's worker downloads
    killed_at = time.monotonic()
    os.kill(owner, signal.SIGKILL)
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), results

    summary = {
        k: v[:4] + (len(v[5]),) if v[0] == "clean" else v for k, v in sorted(results.items())
    }
    for name, r in results.items():
        if r[0] == "clean":  # only a complete, correct answer may end cleanly
            _, pid, status, cache_status, headers, body = r
            want = data[6000000:] if headers else data
            assert status in (200, 206) and sha(body) == sha(want), (name, summary)
        else:
            assert r[0] == "aborted", (name, summary)
    assert results["first"][0] == "aborted" and results["owner-follower"][0] == "aborted"
    slow = {k: round(t - killed_at, 1) for k, t in done.items() if t - killed_at > 10}
    assert not slow, f"clients of the dead download ended late: {slow} {summary}"

    origin.faults.pop("slow.tar")
    for _ in range(3):  # the next requests, whichever worker answers
        status, headers, body = fetch(p.port, "/slow.tar", timeout=15)
        assert status == 200 and sha(body) == sha(data), (status, headers.get("X-Cache"))
    close_all(pinned)
    assert wait_for(lambda: not part_files(cache), 10), part_files(cache)
    status, headers, body = fetch(p.port, "/slow.tar")
    assert (status, headers["X-Cache"], sha(body)) == (200, "HIT", sha(data))
