"""Read plans through the real proxy (a subprocess) and a real origin: the HTTP API, the
lookahead, eviction that follows the plans, the stall metric, expiry."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.proxy import call, wait_idle
from support.proxy_helpers import Fault, Origin, ProxyProcess
from support.wait import wait_until

SHARD = 256 << 10


def _files(n: int, size: int = SHARD) -> dict[str, bytes]:
    return {f"s{i:02d}.tar": bytes([i]) * size for i in range(n)}


def _get(proxy: ProxyProcess, name: str, headers: dict[str, str] | None = None):
    status, body, hdrs = call(proxy, "GET", "/" + name, headers=headers)
    return status, hdrs.get("X-Cache"), body


def _metric(proxy: ProxyProcess, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + (labels if labels else "")) and (
            labels or line[len(name)] in " {"
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def rig(tmp_path: Path):
    started: list = []

    def make(files: dict[str, bytes], *args: str, faults: dict[str, Fault] | None = None):
        origin = Origin(files=dict(files), faults=dict(faults or {})).start()
        proxy = ProxyProcess(tmp_path / "cache", "--upstream", origin.url, *args).start()
        started.append((origin, proxy))
        return origin, proxy

    yield make
    for origin, proxy in started:
        proxy.stop()
        origin.stop()


def test_api_register_list_get_delete(rig) -> None:
    origin, proxy = rig(_files(4))
    status, body, _ = call(
        proxy, "POST", "/-/plans", {"pattern": "/s{00..03}.tar", "name": "job/w0", "lookahead": 2}
    )
    assert status == 201, body
    pid = body["id"]
    assert body["shards"] == 4 and body["name"] == "job/w0"
    assert body["lookahead"] == {"shards": 2, "bytes": None}
    # every URL form names the same shards: proxy path, proxy URL, upstream URL
    forms = [
        "/s00.tar",
        f"{proxy.url}/s01.tar",
        f"{origin.url}/s02.tar",
        f"http://localhost:{proxy.port}/s03.tar",
    ]
    status, other, _ = call(proxy, "POST", "/-/plans", {"urls": forms, "lookahead": "1MiB"})
    assert status == 201, other
    assert other["lookahead"]["bytes"] == 1 << 20
    status, listing, _ = call(proxy, "GET", "/-/plans")
    assert status == 200
    assert {p["id"] for p in listing["plans"]} == {pid, other["id"]}
    status, one, _ = call(proxy, "GET", f"/-/plans/{pid}")
    assert status == 200 and one["shards"] == 4 and one["position"] == 0
    for key in ("ready_ahead_bytes", "behind_bytes", "wait_seconds", "idle_seconds", "done"):
        assert key in one
    status, gone, _ = call(proxy, "DELETE", f"/-/plans/{pid}")
    assert status == 200 and gone == {"removed": True}
    assert call(proxy, "GET", f"/-/plans/{pid}")[0] == 404
    assert call(proxy, "DELETE", f"/-/plans/{pid}")[0] == 404


def test_a_lookahead_size_without_a_unit_is_refused() -> None:
    """``"lookahead": "10"`` is a forgotten unit (or a count sent as text), not 10 bytes."""
    from proxy.plans import parse_lookahead
    from shardcache.errors import BadRequest

    with pytest.raises(BadRequest, match="10 = 10 bytes; did you mean 10G"):
        parse_lookahead("10")
    assert parse_lookahead("10MiB") == (None, 10 << 20)
    assert parse_lookahead(10) == (10, None)


def test_api_rejects_bad_plans(rig) -> None:
    _, proxy = rig(_files(2), "--max-plans", "1", "--max-plan-shards", "3")
    status, text, _ = call(proxy, "POST", "/-/plans", b"{nope")
    assert status == 400 and "JSON" in text
    status, text, _ = call(proxy, "POST", "/-/plans", {"name": "x"})
    assert status == 400 and "urls" in text
    status, text, _ = call(proxy, "POST", "/-/plans", {"urls": ["http://elsewhere.example/x"]})
    assert status == 400 and "--allow-host" in text
    status, text, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"], "lookahead": 0})
    assert status == 400 and "lookahead" in text
    status, text, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..09}.tar"})
    assert status == 413 and "--max-plan-shards" in text
    assert call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"]})[0] == 201
    status, text, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s01.tar"]})
    assert status == 400 and "--max-plans" in text


@pytest.mark.parametrize("workers", ["1", "2"])
def test_api_replace_ends_the_plans_of_the_same_name(rig, workers) -> None:
    _, proxy = rig(_files(4), "--max-plans", "2", "--workers", workers)
    status, text, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"], "replace": True})
    assert status == 400 and "name" in text
    body = {"urls": ["/s00.tar"], "name": "job/worker-0", "replace": "yes"}
    status, text, _ = call(proxy, "POST", "/-/plans", body)
    assert status == 400 and "replace" in text
    ids = {}
    for name in ("job/worker-0", "other"):
        status, body, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"], "name": name})
        assert status == 201, body
        ids[name] = body["id"]
    # at --max-plans a plain plan is refused; one that replaces takes its room
    status, text, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s01.tar"], "name": "x"})
    assert status == 400 and "--max-plans" in text
    new = {"pattern": "/s{01..03}.tar", "name": "job/worker-0", "replace": True}
    status, body, _ = call(proxy, "POST", "/-/plans", new)
    assert status == 201, body
    # each call is a new connection: with two workers both answer, and agree
    for _ in range(4):
        listing = call(proxy, "GET", "/-/plans")[1]["plans"]
        got = sorted((p["name"], p["id"], p["shards"]) for p in listing)
        assert got == [("job/worker-0", body["id"], 3), ("other", ids["other"], 1)], got
    assert call(proxy, "GET", f"/-/plans/{ids['job/worker-0']}")[0] == 404


def test_api_needs_the_admin_token_when_set(rig) -> None:
    _, proxy = rig(_files(1), "--admin-token", "sekret")
    assert call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"]})[0] == 401
    auth = {"Authorization": "Bearer sekret"}
    status, body, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"]}, auth)
    assert status == 201
    assert call(proxy, "GET", "/-/plans")[0] == 200  # reading needs no token
    assert call(proxy, "DELETE", f"/-/plans/{body['id']}")[0] == 401
    assert call(proxy, "DELETE", f"/-/plans/{body['id']}", headers=auth)[0] == 200


def test_lookahead_downloads_the_next_shards_before_the_reader_asks(rig) -> None:
    files = _files(8)
    origin, proxy = rig(files, "--prefetch-concurrency", "2")
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..07}.tar", "lookahead": 3})
    assert status == 201
    pid = body["id"]
    # the first three are downloaded without any read
    wait_until(
        lambda: all(origin.gets[f"s{i:02d}.tar"] == 1 for i in range(3)),
        what="lookahead",
        timeout=15,
    )
    wait_until(
        lambda: call(proxy, "GET", f"/-/plans/{pid}")[1]["ready_ahead_shards"] == 3,
        what="three shards ready",
        timeout=15,
    )
    assert origin.gets["s05.tar"] == 0  # beyond the lookahead
    for i in range(8):
        status, cache, data = _get(proxy, f"s{i:02d}.tar")
        assert status == 200
        assert isinstance(data, str) and len(data) == SHARD
    # a request's accounting ends just after its last byte went out
    wait_until(
        lambda: call(proxy, "GET", f"/-/plans/{pid}")[1]["behind_bytes"] == 8 * SHARD, timeout=15
    )
    st = call(proxy, "GET", f"/-/plans/{pid}")[1]
    assert st["position"] == 8 and st["done"]
    assert st["planned_hits"] >= 3
    assert sum(origin.gets.values()) == 8  # every shard once
    assert _metric(proxy, "shardcache_prefetch_bytes_total", '{reason="plan"}') >= 3 * SHARD
    assert _metric(proxy, "shardcache_plan_requests_total", '{ready="hit"}') >= 3


def test_eviction_keeps_the_shard_a_plan_reads_next(rig) -> None:
    files = _files(4)
    # room for three shards: LRU would evict s00 (the oldest) to admit s03
    origin, proxy = rig(files, "--cache-size", f"{3 * SHARD}B", "--min-free", "0")
    for i in range(3):
        assert _get(proxy, f"s{i:02d}.tar")[0] == 200
    status, body, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s03.tar", "/s00.tar"]})
    assert status == 201
    assert _get(proxy, "s03.tar")[0] == 200
    wait_until(lambda: origin.gets["s03.tar"] == 1, timeout=15)
    status, cache, _ = _get(proxy, "s00.tar")
    assert (status, cache) == (200, "HIT")
    assert origin.gets["s00.tar"] == 1
    # an unplanned entry (s01, the least recently used of those) made the room
    assert _get(proxy, "s01.tar")[1] != "HIT"


def test_a_shard_needed_later_than_the_cache_holds_is_streamed_uncached(rig) -> None:
    files = _files(3)
    origin, proxy = rig(files, "--cache-size", f"{2 * SHARD}B", "--min-free", "0")
    assert _get(proxy, "s00.tar")[0] == 200
    assert _get(proxy, "s01.tar")[0] == 200
    # s02 is read now and never again; s00 and s01 are read right after it
    status, body, _ = call(
        proxy, "POST", "/-/plans", {"urls": ["/s02.tar", "/s00.tar", "/s01.tar"], "lookahead": 1}
    )
    assert status == 201
    status, cache, data = _get(proxy, "s02.tar")
    assert status == 200 and len(data) == SHARD
    assert cache in ("BYPASS", "MISS", "COALESCED")
    assert _get(proxy, "s00.tar")[1] == "HIT"
    assert _get(proxy, "s01.tar")[1] == "HIT"
    assert origin.gets["s00.tar"] == 1 and origin.gets["s01.tar"] == 1


def test_cyclic_epochs_over_twice_the_cache_keep_part_of_it_with_plans(rig) -> None:
    n = 12
    files = _files(n)
    origin, proxy = rig(files, "--cache-size", f"{n // 2 * SHARD}B", "--min-free", "0")
    order = [f"/s{i:02d}.tar" for i in range(n)]
    fetched = []
    for _epoch in range(3):
        before = sum(origin.gets.values())
        status, body, _ = call(proxy, "POST", "/-/plans", {"urls": order})
        assert status == 201
        for path in order:
            status, _, data = _get(proxy, path[1:], {"X-Shardcache-Plan": body["id"]})
            assert status == 200 and len(data) == SHARD
        wait_idle(proxy.port)  # downloads started ahead have ended
        assert call(proxy, "DELETE", f"/-/plans/{body['id']}")[0] == 200
        fetched.append(sum(origin.gets.values()) - before)
    # LRU fetches all 12 every epoch. The optimum keeps the 6 the cache holds: each
    # epoch streams its first half uncached and reads the second half from the cache;
    # the plans fetch 6 or 7 (one shard fetched ahead may push out a kept one)
    assert fetched[0] == n
    assert max(fetched[1:]) <= n - 4, fetched


def test_wait_seconds_measure_the_stall(rig) -> None:
    files = _files(2)
    faults = {"s00.tar": Fault(delay=0.05, chunk=32 << 10)}  # 8 chunks: ~0.4 s
    _, proxy = rig(files, faults=faults)
    status, body, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s01.tar", "/s00.tar"]})
    pid = body["id"]
    call(proxy, "DELETE", f"/-/plans/{pid}")
    before = _metric(proxy, "shardcache_client_wait_seconds_total")
    assert _get(proxy, "s00.tar")[0] == 200
    slow = _metric(proxy, "shardcache_client_wait_seconds_total") - before
    assert slow >= 0.2, slow
    assert _get(proxy, "s00.tar")[1] == "HIT"
    hit = _metric(proxy, "shardcache_client_wait_seconds_total") - before - slow
    assert hit < 0.05, hit


def test_a_plan_reports_its_readers_wait_and_the_bytes_ready_ahead(rig) -> None:
    files = _files(3)
    faults = {"s00.tar": Fault(delay=0.05, chunk=32 << 10)}  # 8 chunks: ~0.4 s
    _, proxy = rig(files, faults=faults)
    body = {"urls": ["/s00.tar", "/s01.tar", "/s02.tar"], "lookahead": 2}
    status, answer, _ = call(proxy, "POST", "/-/plans", body)
    assert status == 201, answer
    pid = answer["id"]
    # the reader asks at once: its first shard is still downloading, it waits for it
    assert _get(proxy, "s00.tar", {"X-Shardcache-Plan": pid})[0] == 200
    st = call(proxy, "GET", f"/-/plans/{pid}")[1]
    assert st["wait_seconds"] >= 0.2 and st["position"] == 1, st

    def ready() -> dict:
        return call(proxy, "GET", f"/-/plans/{pid}")[1]

    wait_until(
        lambda: ready()["ready_ahead_shards"] == 2, what="two shards ready ahead", timeout=15
    )
    assert ready()["ready_ahead_bytes"] == 2 * SHARD
    gauge = _metric(proxy, "shardcache_plan_ready_ahead_bytes", f'{{plan="{pid}"}}')
    assert gauge == 2 * SHARD, gauge
    # hits from complete entries add no wait
    waited = ready()["wait_seconds"]
    for name in ("s01.tar", "s02.tar"):
        assert _get(proxy, name, {"X-Shardcache-Plan": pid})[1] == "HIT"
    assert ready()["wait_seconds"] - waited < 0.05


def test_idle_plans_expire(rig) -> None:
    _, proxy = rig(_files(1), "--plan-ttl", "1")
    status, body, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"]})
    assert status == 201
    wait_until(
        lambda: call(proxy, "GET", f"/-/plans/{body['id']}")[0] == 404, what="expiry", timeout=15
    )
    assert "expired" in proxy.log_text()


def test_plans_are_shared_by_the_workers_of_one_port(rig) -> None:
    files = _files(8)
    origin, proxy = rig(files, "--workers", "2", "--plan-ttl", "30")
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..07}.tar", "lookahead": 2})
    assert status == 201, body
    pid = body["id"]
    # each call is a new connection: the kernel spreads them over both workers
    for _ in range(6):
        assert call(proxy, "GET", f"/-/plans/{pid}")[0] == 200
    # named by its header (as ShardDataset sends it), a plan registered through one
    # worker counts at the other at once: that worker merges before matching
    for i in range(8):
        status, _, data = _get(proxy, f"s{i:02d}.tar", {"X-Shardcache-Plan": pid})
        assert status == 200 and len(data) == SHARD
    wait_until(
        lambda: call(proxy, "GET", f"/-/plans/{pid}")[1]["requests"] == 8,
        what="every worker's requests counted",
        timeout=15,
    )
    st = call(proxy, "GET", f"/-/plans/{pid}")[1]
    assert st["position"] == 8 and st["done"]
    assert all(origin.gets[f"s{i:02d}.tar"] == 1 for i in range(8)), origin.gets
    assert call(proxy, "DELETE", f"/-/plans/{pid}")[0] == 200
    for _ in range(4):
        assert call(proxy, "GET", f"/-/plans/{pid}")[0] == 404
    assert call(proxy, "GET", "/-/plans")[1] == {"plans": []}


def test_store_merges_plan_progress_of_several_processes(tmp_path: Path) -> None:
    from proxy.daemonstore import DaemonStore

    a = DaemonStore(tmp_path / "c", 1 << 30)
    b = DaemonStore(tmp_path / "c", 1 << 30)  # another process's handle of the same index
    a.plan_put("p-1", '{"urls": []}', now=100.0)
    rows, docs = b.plans_sync({}, expire_before=0.0, known=set())
    assert docs == {"p-1": '{"urls": []}'} and rows["p-1"][0] == 0
    # positions and last-seen times take the largest, counters add up
    a.plans_sync({"p-1": (5, 110.0, 1.5, 2, 5, 500)}, 0.0, {"p-1"})
    rows, docs = b.plans_sync({"p-1": (3, 105.0, 0.5, 1, 3, 300)}, 0.0, {"p-1"})
    assert docs == {}
    assert rows["p-1"] == (5, 110.0, 2.0, 3, 8, 800)
    # a plan nobody read since the TTL began is dropped for everyone
    rows, _ = a.plans_sync({}, expire_before=111.0, known={"p-1"})
    assert rows == {}
    assert not b.plan_delete("p-1")
    a.close()
    b.close()


def test_store_replaces_and_counts_plans_in_one_transaction(tmp_path: Path) -> None:
    """Several processes register at once: the count and the replacement are decided by
    the index, never by a process's possibly stale view."""
    from proxy.daemonstore import DaemonStore

    a = DaemonStore(tmp_path / "c", 1 << 30)
    b = DaemonStore(tmp_path / "c", 1 << 30)  # another process's handle of the same index

    def doc(name: str) -> str:
        return json.dumps({"name": name, "urls": []})

    assert a.plan_put("p-1", doc("job/worker-0"), max_plans=2) == []
    assert b.plan_put("p-2", doc("job/worker-1"), max_plans=2) == []
    # full: a plain registration is refused and changes nothing
    assert a.plan_put("p-3", doc("other"), max_plans=2) is None
    # a replacement takes the room of the plans it replaces, in the same transaction
    assert b.plan_put("p-4", doc("job/worker-0"), replace_name="job/worker-0", max_plans=2) == [
        "p-1"
    ]
    assert a.plan_put("p-5", doc("job/worker-0"), replace_name="job/worker-0", max_plans=2) == [
        "p-4"
    ]
    # a replacement whose name matches nothing needs a room of its own
    assert a.plan_put("p-6", doc("new"), replace_name="new", max_plans=2) is None
    rows, docs = b.plans_sync({}, expire_before=0.0, known=set())
    assert sorted(rows) == ["p-2", "p-5"]
    a.close()
    b.close()


def test_api_replace_of_no_plan_at_max_plans_is_refused(rig) -> None:
    _, proxy = rig(_files(2), "--max-plans", "1")
    assert call(proxy, "POST", "/-/plans", {"urls": ["/s00.tar"], "name": "a"})[0] == 201
    body = {"urls": ["/s01.tar"], "name": "b", "replace": True}
    status, text, _ = call(proxy, "POST", "/-/plans", body)
    assert status == 400 and "--max-plans" in text


def test_a_failing_planned_shard_is_retried_with_backoff_not_hammered(rig) -> None:
    files = _files(3)
    origin, proxy = rig(files, faults={"s01.tar": Fault(status=500)})
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..02}.tar"})
    assert status == 201
    wait_until(lambda: origin.gets["s02.tar"] == 1, what="the lookahead", timeout=15)
    time.sleep(2.0)
    # 1 s, then 2 s between tries: at most three in about two seconds
    assert 1 <= origin.gets["s01.tar"] <= 3, origin.gets
    assert _get(proxy, "s01.tar")[0] == 500  # the upstream's answer, passed on
    assert "next try" in proxy.log_text()


def test_a_lookahead_download_cut_by_the_origin_is_never_committed(rig) -> None:
    files = _files(2)
    # every GET of s01 is cut half-way: no resume can complete it
    faults = {"s01.tar": Fault(truncate_at=SHARD // 2)}
    origin, proxy = rig(files, "--retries", "1", faults=faults)
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..01}.tar"})
    assert status == 201
    wait_until(lambda: origin.gets["s01.tar"] >= 2, what="the lookahead and its resume", timeout=15)
    wait_idle(proxy.port)  # the lookahead's download has given up
    st = call(proxy, "GET", f"/-/plans/{body['id']}")[1]
    assert st["ready_ahead_shards"] <= 1  # s00 at most: s01 never became an entry
    # the reader's own request fails visibly: the connection breaks, never a short body
    req = urllib.request.Request(proxy.url + "/s01.tar")
    with pytest.raises(Exception) as info:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            assert len(data) == SHARD, "a short body must not end cleanly"
    assert not isinstance(info.value, AssertionError), info.value
    assert list((proxy.cache_dir).glob("*.part")) == []


def test_plan_downloads_go_before_plain_prefetch(rig) -> None:
    files = _files(6)
    slow = {f"s{i:02d}.tar": Fault(delay=0.02, chunk=32 << 10) for i in range(6)}  # ~0.16 s
    origin, proxy = rig(files, "--prefetch-concurrency", "1", faults=slow)
    status, _, _ = call(proxy, "POST", "/-/prefetch", {"pattern": "/s{00..03}.tar"})
    assert status == 202
    wait_until(lambda: sum(origin.gets.values()) >= 1, what="the first prefetch", timeout=15)
    status, _, _ = call(proxy, "POST", "/-/plans", {"urls": ["/s05.tar", "/s04.tar"]})
    assert status == 201
    wait_until(lambda: sum(origin.gets.values()) == 6, timeout=30, what="all downloads")
    order = [name for name, _, _ in origin.ranges]
    # one background download at a time: the plan's two come right after the prefetch
    # download that was running when the plan arrived
    assert order.index("s05.tar") <= 2 and order.index("s04.tar") <= 3, order
    assert order[-1] in ("s02.tar", "s03.tar"), order


def test_plans_over_the_same_shards_share_their_downloads(rig) -> None:
    files = _files(6)
    slow = {name: Fault(delay=0.02, chunk=32 << 10) for name in files}  # ~0.16 s a shard
    origin, proxy = rig(files, "--prefetch-concurrency", "4", faults=slow)
    ids = []
    for w in range(2):  # two DataLoader workers, or two jobs, reading the same shards
        body = {"pattern": "/s{00..05}.tar", "lookahead": 4, "name": f"w{w}"}
        status, answer, _ = call(proxy, "POST", "/-/plans", body)
        assert status == 201, answer
        ids.append(answer["id"])

    def ready(pid: str) -> int:
        return call(proxy, "GET", f"/-/plans/{pid}")[1]["ready_ahead_shards"]

    wait_until(lambda: all(ready(pid) >= 4 for pid in ids), timeout=30, what="both lookaheads")
    for i in range(6):
        for pid in ids:
            status, _, data = _get(proxy, f"s{i:02d}.tar", {"X-Shardcache-Plan": pid})
            assert status == 200 and len(data) == SHARD
    assert all(origin.gets[name] == 1 for name in files), dict(origin.gets)


def test_a_demand_miss_never_waits_for_plan_downloads(rig) -> None:
    import threading

    files = _files(6)
    gate = threading.Event()  # the planned shards send their headers, then wait
    faults = {f"s{i:02d}.tar": Fault(gate=gate) for i in range(4)}
    origin, proxy = rig(files, "--prefetch-concurrency", "1", faults=faults)
    try:
        assert call(proxy, "POST", "/-/plans", {"pattern": "/s{00..03}.tar"})[0] == 201
        wait_until(
            lambda: origin.gets["s00.tar"] == 1, what="the plan's first download", timeout=15
        )
        began = time.monotonic()
        status, cache, data = _get(proxy, "s05.tar")  # a reader's miss, not in the plan
        took = time.monotonic() - began
        assert status == 200 and cache == "MISS" and len(data) == SHARD
        assert took < 3, f"the demand miss waited {took:.1f} s behind the plan's download"
        # the one background slot is still held by the plan's stalled download
        assert sum(origin.gets[f"s{i:02d}.tar"] for i in range(4)) == 1, dict(origin.gets)
    finally:
        gate.set()


def test_a_lookahead_in_bytes_bounds_the_shards_downloaded_ahead(rig) -> None:
    files = _files(8)
    origin, proxy = rig(files, "--prefetch-concurrency", "1")
    look = f"{int(2.5 * SHARD)}"  # bytes, as a size string: two and a half shards
    body = {"pattern": "/s{00..07}.tar", "lookahead": look + "B"}
    status, answer, _ = call(proxy, "POST", "/-/plans", body)
    assert status == 201, answer
    assert answer["lookahead"] == {"shards": None, "bytes": int(2.5 * SHARD)}
    wait_until(lambda: sum(origin.gets.values()) >= 2, what="the lookahead", timeout=15)
    time.sleep(1.0)  # several scheduler passes: nothing more is fetched
    assert sum(origin.gets.values()) == 2, dict(origin.gets)
    st = call(proxy, "GET", f"/-/plans/{answer['id']}")[1]
    assert st["ready_ahead_shards"] == 2 and st["ready_ahead_bytes"] == 2 * SHARD, st


def test_background_downloads_stay_within_prefetch_concurrency(rig) -> None:
    files = _files(6)
    slow = {f"s{i:02d}.tar": Fault(delay=0.05, chunk=32 << 10) for i in range(6)}  # ~0.4 s
    origin, proxy = rig(files, "--prefetch-concurrency", "2", faults=slow)
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..05}.tar", "lookahead": 6})
    assert status == 201
    most = 0
    deadline = time.monotonic() + 30
    while sum(origin.gets.values()) < 6 and time.monotonic() < deadline:
        most = max(most, _metric(proxy, "shardcache_downloads_in_progress"))
        time.sleep(0.02)
    assert sum(origin.gets.values()) == 6
    assert 1 <= most <= 2, most


def test_shutdown_does_not_wait_for_downloads_nobody_reads(rig) -> None:
    import threading

    files = _files(4)
    gate = threading.Event()  # never opened: the origin sends headers, then nothing
    faults = {f"s{i:02d}.tar": Fault(gate=gate) for i in range(4)}
    origin, proxy = rig(files, faults=faults)
    assert call(proxy, "POST", "/-/plans", {"pattern": "/s{00..03}.tar"})[0] == 201
    wait_until(lambda: sum(origin.gets.values()) >= 2, what="the lookahead", timeout=15)
    began = time.monotonic()
    assert proxy.stop() == 0
    assert time.monotonic() - began < 8, "shutdown waited for downloads nobody reads"
    assert list(proxy.cache_dir.glob("*.part")) == []


def test_plan_position_with_readers_out_of_order_and_several_epochs() -> None:
    from proxy.plans import Plan

    urls = tuple(f"u{i}" for i in range(20)) * 5  # five epochs in one plan
    plan = Plan(id="p", name="", urls=urls, keys=urls, lookahead_shards=4)
    plan.window = 3
    # two workers sharing the plan, each a shard behind the other in turn
    for u in ("u1", "u0", "u3", "u2", "u5", "u4"):
        idx = plan.match(u, reach=64)
        assert idx is not None
        plan.advance(idx, 0.0)
    assert plan.position == 6  # not the next epoch's copies
    # a small dataset: the next epoch starts where this one ends
    small = tuple(f"v{i}" for i in range(4)) * 3
    plan = Plan(id="q", name="", urls=small, keys=small, lookahead_shards=2)
    plan.window = 2
    for i, u in enumerate(small):
        idx = plan.match(u, reach=64)
        assert idx == i, (u, idx, i)
        plan.advance(idx, 0.0)
    assert plan.done


async def test_a_worker_learns_a_plan_named_by_a_request_at_once(tmp_path: Path) -> None:
    from proxy.daemonstore import DaemonStore
    from proxy.metrics import ProxyMetrics
    from proxy.plans import Plans

    def worker() -> tuple[DaemonStore, Plans]:
        store = DaemonStore(tmp_path / "c", 1 << 30)  # each worker's own handle of one index
        kw = {"ttl": 600.0, "default_lookahead": 2, "max_plans": 8, "max_shards": 100}
        return store, Plans(store, ProxyMetrics(), shared=True, **kw)

    (sa, a), (sb, b) = worker(), worker()
    assert not sb.plans_exist()
    await b.sync()  # idle: nothing registered anywhere
    plan = await a.register(["http://o/s00.tar", "http://o/s01.tar"], "job")
    assert sb.plans_exist() and plan.id not in b  # b merges a few times a second
    await b.learn(plan.id)  # a request names it: merged at once
    assert plan.id in b
    assert [p.id for p in b.on_request("http://o/s00.tar", plan.id)] == [plan.id]
    await b.learn("p-unknown")
    await b.learn("p-unknown")  # asked again within a second: no second merge
    assert "p-unknown" not in b
    sa.close()
    sb.close()


async def test_workers_replacing_plans_at_once_stay_within_max_plans(tmp_path: Path) -> None:
    """Every DataLoader worker registers its next plan at the start of an epoch, through
    whichever proxy worker takes the request: the replacements interleave."""
    import asyncio

    from proxy.daemonstore import DaemonStore
    from proxy.metrics import ProxyMetrics
    from proxy.plans import Plans
    from shardcache.errors import BadRequest

    stores: list[DaemonStore] = []

    def worker() -> Plans:
        store = DaemonStore(tmp_path / "c", 1 << 30)  # each worker's own handle of one index
        stores.append(store)
        kw = {"ttl": 600.0, "default_lookahead": 2, "max_plans": 2, "max_shards": 100}
        return Plans(store, ProxyMetrics(), shared=True, **kw)

    a, b = worker(), worker()
    urls = ["http://o/s00.tar", "http://o/s01.tar"]
    first = [await a.register(urls, f"job/worker-{k}") for k in range(2)]
    for _ in range(3):  # epochs: both readers' next plans, registered at once
        new = await asyncio.gather(
            a.register(urls, "job/worker-0", replace=True),
            b.register(urls, "job/worker-1", replace=True),
        )
        await a.sync(force=True)
        await b.sync(force=True)
        for p in (a, b):
            assert sorted(x.id for x in p) == sorted(x.id for x in new)
    assert not {p.id for p in first} & {x.id for x in a}
    # the same name replaced through both at once: one plan of that name is left
    await asyncio.gather(
        a.register(urls, "job/worker-0", replace=True),
        b.register(urls, "job/worker-0", replace=True),
    )
    await a.sync(force=True)
    assert sorted(x.name for x in a) == ["job/worker-0", "job/worker-1"]
    # a third name has no room
    try:
        await b.register(urls, "other")
    except BadRequest as exc:
        assert "--max-plans" in str(exc)
    else:
        raise AssertionError("a third plan was registered beyond --max-plans 2")
    for s in stores:
        s.close()


def _covered(origin: Origin, name: str) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` the GETs of ``name`` asked for, sorted."""
    size = len(origin.files[name])
    spans = []
    for path, rng, _ in origin.ranges:
        if path != name:
            continue
        if rng is None:
            spans.append((0, size))
            continue
        first, _, last = rng.removeprefix("bytes=").partition("-")
        spans.append((int(first), min(int(last) + 1, size) if last else size))
    return sorted(spans)


def _read_slow_shards_through_a_plan(rig, *flags: str) -> tuple[Origin, dict[str, bytes], int]:
    """Six shards of eight 64 KiB parts from an origin that sends ~1.6 MB/s a connection,
    read in turn at once through a plan with lookahead 4 (--prefetch-concurrency 4,
    --parallel 4, 64 KiB parts, and ``flags``), each checked whole; returns the origin,
    the files and the part size once the proxy is idle."""
    part = 64 << 10
    files = {f"s{i:02d}.tar": bytes([i]) * (8 * part) for i in range(6)}
    slow = {name: Fault(delay=0.01, chunk=16 << 10) for name in files}  # ~1.6 MB/s a connection
    origin, proxy = rig(
        files,
        *flags,
        "--prefetch-concurrency",
        "4",
        "--part-size",
        f"{part}B",
        "--parallel",
        "4",
        faults=slow,
    )
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..05}.tar", "lookahead": 4})
    assert status == 201, body
    pid = body["id"]
    for i in range(6):  # the reader, at once
        status, _, data = _get(proxy, f"s{i:02d}.tar", {"X-Shardcache-Plan": pid})
        assert status == 200 and data == files[f"s{i:02d}.tar"].decode()
    wait_idle(proxy.port)
    return origin, files, part


def test_a_plans_next_shard_comes_first_and_in_parts(rig) -> None:
    """The shard a plan's reader waits for gets the origin first: fetched in ranged parts
    although --http-parts is off (the origin limits each connection), and no other shard
    of the plan is asked for before all its parts are; every byte crosses once."""
    origin, files, part = _read_slow_shards_through_a_plan(rig)
    first = _covered(origin, "s00.tar")
    assert first == [(k * part, (k + 1) * part) for k in range(8)], first  # 8 parts, once each
    starts = [name for kind, name, _ in origin.events if kind == "start"]
    last_part = max(i for i, name in enumerate(starts) if name == "s00.tar")
    assert set(starts[: last_part + 1]) == {"s00.tar"}, starts  # nothing else meanwhile
    for name in files:  # every byte of every shard asked for once
        spans = _covered(origin, name)
        assert sum(e - s for s, e in spans) == len(files[name]), (name, spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (name, spans)


@pytest.mark.parametrize(
    "fault", [Fault(ignore_range=True), Fault(range_status=400)], ids=["range-ignored", "range-400"]
)
def test_an_origin_without_ranges_serves_a_plans_next_shard_in_one_stream(rig, fault) -> None:
    """Parts the operator did not ask for are tried once per origin: an origin that
    answers a ranged GET with the whole object, or with an error, is asked with plain
    GETs from then on, and the reader gets its shard."""
    part = 64 << 10
    files = {f"s{i:02d}.tar": bytes([i]) * (4 * part) for i in range(3)}
    faults = {name: fault for name in files}
    origin, proxy = rig(files, "--part-size", f"{part}B", "--parallel", "4", faults=faults)
    status, body, _ = call(proxy, "POST", "/-/plans", {"pattern": "/s{00..02}.tar"})
    assert status == 201, body
    for name in sorted(files):
        status, _, data = _get(proxy, name, {"X-Shardcache-Plan": body["id"]})
        assert status == 200 and data == files[name].decode()
    wait_idle(proxy.port)
    retried = 1 if fault.range_status else 0  # the first shard again, in one stream
    assert sum(origin.gets.values()) == len(files) + retried, dict(origin.gets)
    asked = [rng for _, rng, _ in origin.ranges]
    assert asked[0] is not None and asked[1:] == [None] * (len(files) - 1 + retried), asked


def test_with_http_parts_on_the_lookahead_beside_a_waited_shard_comes_in_one_stream(rig) -> None:
    """--http-parts on: the shards a plan fetches ahead while its reader's next shard
    downloads come in one stream each, leaving the part requests to the shard the
    reader needs first; every byte still crosses once."""
    origin, files, part = _read_slow_shards_through_a_plan(rig, "--http-parts", "on")
    assert len(_covered(origin, "s00.tar")) == 8  # the first shard in parts
    whole = [name for name in files if _covered(origin, name) == [(0, 8 * part)]]
    assert whole, origin.ranges  # at least one shard fetched ahead in one stream
    for name in files:
        spans = _covered(origin, name)
        assert sum(e - s for s, e in spans) == len(files[name]), (name, spans)
