"""The name pass owed after a crash, made once the store is open (``defer_names_above``,
:meth:`Store.reconcile_names`; the daemon does so above 10,000 entries): the open is
as quick as after a clean end, and once the pass ends the directory and the index are
exactly as the open-time pass leaves them, downloads begun or committed meanwhile left
alone."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.origins import Fault
from support.proxy import stats
from support.wait import wait_until

from shardcache.store import INDEX_NAME, Store, reconcile, shard_uuid
from shardcache.store.entry import ENTRY_INSERT

LOST = "http://origin/lost.tar"  # renamed into place by a process that died before its row


@pytest.fixture
def large(monkeypatch):
    """Stores of more than 10 entries count as large: compared only after an unclean end."""
    monkeypatch.setattr(reconcile, "SCAN_ALWAYS", 10)


def seed(store: Store, n: int) -> list[str]:
    keys, rows = [], []
    for i in range(n):
        url = f"http://origin/s/{i}.tar"
        key = shard_uuid(url)
        keys.append(key)
        (store.cache_dir / key).write_bytes(b"xy")
        rows.append((key, url, 2, None, None, None, 1000.0 + i, 2000.0 + i, 0, 1000.0, None, None))
    with store._tx() as conn:
        conn.executemany(ENTRY_INSERT, rows)
    return keys


def crashed(path: Path, n: int = 40) -> list[str]:
    """A store of ``n`` entries a process died with open, leaving what a crash leaves: a
    download under way (its ``.part`` and reservation), an entry file whose row never
    committed; and, by hand, a row whose file is gone and an evicted file not yet
    deleted."""
    store = Store(path)
    keys = seed(store, n)
    store.close()
    code = (
        "import os; from shardcache.store import Store; "
        f"s = Store({str(path)!r}); "
        "p = s.begin('http://origin/partial.tar', 10); "
        "open(p.path, 'wb').write(b'12345'); "
        f"open(os.path.join({str(path)!r}, {shard_uuid(LOST)!r}), 'wb').write(b'lost'); "
        "os._exit(0)"  # dies without close()
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    os.unlink(path / keys[0])
    (path / f"{keys[1]}.0123456789ab.del").write_bytes(b"zz")
    return keys


def state(path: Path) -> tuple[list[str], list[tuple], list[tuple]]:
    """The directory's names, the index's rows and reservations."""
    names = sorted(n for n in os.listdir(path) if not n.startswith(INDEX_NAME))
    conn = sqlite3.connect(path / INDEX_NAME)
    try:
        rows = conn.execute("SELECT key, url, size FROM entries ORDER BY key").fetchall()
        held = conn.execute("SELECT name, bytes FROM reservations ORDER BY name").fetchall()
    finally:
        conn.close()
    return names, rows, held


def owed(path: Path) -> list[int]:
    conn = sqlite3.connect(path / INDEX_NAME)
    try:
        return [r[0] for r in conn.execute("SELECT pid FROM sessions WHERE pid <= 0")]
    finally:
        conn.close()


def test_the_deferred_pass_leaves_what_the_open_time_pass_leaves(tmp_path, large):
    keys = crashed(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    before = state(tmp_path / "a")

    now = Store(tmp_path / "b")  # the pass at open, as always
    expected = state(tmp_path / "b")
    now.close()
    assert keys[0] not in {r[0] for r in expected[1]}  # the pass did its work
    assert not any(n.endswith((".part", ".del")) for n in expected[0])
    assert shard_uuid(LOST) not in expected[0]

    store = Store(tmp_path / "a", defer_names_above=10)
    assert store.names_pass == "pending" and store.names_owed
    # the open compared nothing: every leftover is still there (only the dead
    # process's reservation went, as at every open)
    names, rows, held = state(tmp_path / "a")
    assert (names, rows) == before[:2] and held == []
    assert store.open_hit(LOST) is None  # a file without a row: never served

    report = store.reconcile_names()
    assert store.names_pass == "done" and not store.names_owed
    assert (report.orphans, report.missing, report.stale_partials) == (1, 1, 1)
    assert state(tmp_path / "a") == expected
    assert owed(tmp_path / "a") == []
    store.close()
    reopened = Store(tmp_path / "a", defer_names_above=10)  # a clean end: nothing owed
    assert reopened.names_pass is None
    reopened.close()


def test_downloads_committed_or_begun_during_the_pass_are_kept(tmp_path, large):
    keys = crashed(tmp_path)
    store = Store(tmp_path, defer_names_above=10)
    listing = store._listing
    made: dict = {}

    def listing_then_downloads():
        # the directory is listed and compared with the index's snapshot; before the
        # repairs, downloads commit the two names the snapshot found wrong and begin one
        yield from listing()
        for url, body in ((LOST, b"found"), ("http://origin/s/0.tar", b"again")):
            p = store.begin(url, len(body))
            p.path.write_bytes(body)
            store.commit(p, len(body))
        made["partial"] = p = store.begin("http://origin/new.tar", 3)
        p.path.write_bytes(b"1")

    store._listing = listing_then_downloads  # type: ignore[method-assign]
    report = store.reconcile_names()
    assert (report.orphans, report.missing, report.stale_partials) == (0, 0, 1)
    for url, body in ((LOST, b"found"), ("http://origin/s/0.tar", b"again")):
        got = store.open_hit(url)
        assert got is not None, url
        entry, f = got
        with f:
            assert f.read() == body
    assert made["partial"].path.exists()  # a live download: untouched
    names, rows, held = state(tmp_path)
    assert held == [(made["partial"].path.name, 3)]
    assert [n for n in names if n.endswith(".part")] == [made["partial"].path.name]
    assert not any(n.endswith(".del") for n in names)
    assert {r[0] for r in rows} == set(keys) | {shard_uuid(LOST)}
    store.close()


def test_a_pass_not_finished_stays_owed(tmp_path, large):
    crashed(tmp_path)
    store = Store(tmp_path, defer_names_above=10)
    assert owed(tmp_path) == [-os.getpid()]  # under way here: another open leaves it
    other = Store(tmp_path, defer_names_above=10)
    assert other.names_pass is None
    other.close()
    store.close()  # closed before its pass: owed to the next open
    assert owed(tmp_path) == [0]
    store = Store(tmp_path, defer_names_above=10)
    assert store.names_pass == "pending"
    store.stop_names()
    assert store.reconcile_names().orphans == 0 and store.names_pass == "stopped"
    store._names_stop.clear()
    # the process with it under way dies: owed again
    code = (
        f"from shardcache.store import Store; import os; s = Store({str(tmp_path)!r}, "
        "defer_names_above=10); assert s.names_pass == 'pending'; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    store.close()
    again = Store(tmp_path, defer_names_above=10)
    assert again.names_pass == "pending"
    assert again.reconcile_names().orphans == 1
    again.close()
    assert owed(tmp_path) == []


# over 100,000 (compared only after an unclean end) and the daemon's threshold (10,000)
ENTRIES = 100_100


def seed_many(cache: Path, base: str, n: int) -> list[str]:
    """``n`` two-byte entries of URLs ``base/s<i>.tar``: hard links of a few files (a
    link per name is what keeps this test to seconds), rows in one transaction."""
    with Store(cache, reconcile=False) as store:
        store.used()  # the index, as this shardcache makes it
    keys, rows, src = [], [], None
    for i in range(n):
        url = f"{base}/s{i}.tar"
        key = shard_uuid(url)
        keys.append(key)
        if i % 50_000 == 0:
            src = cache / key
            src.write_bytes(b"xy")
        else:
            os.link(src, cache / key)
        rows.append((key, url, 2, None, None, None, 1000.0 + i, 2000.0 + i, 0, 1000.0, None, None))
    conn = sqlite3.connect(cache / INDEX_NAME, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(ENTRY_INSERT, rows)
    conn.execute("COMMIT")
    conn.close()
    return keys


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_daemon_is_ready_before_the_pass_a_crash_left(origin, proxies, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    keys = seed_many(cache, origin.url, ENTRIES)
    origin.files["slow.tar"] = os.urandom(1 << 20)
    origin.faults["slow.tar"] = Fault(delay=0.05, chunk=16 << 10)
    origin.files["lost.tar"] = b"served by the origin"
    origin.files["other.tar"] = b"never asked for"
    p = proxies("--upstream", origin.url, cache_dir=cache)
    assert stats(p.port)["store"]["names_pass"] is None  # a clean start: nothing owed
    killer = subprocess.Popen(["curl", "-sS", "-o", "/dev/null", f"{p.url}/slow.tar"])
    wait_until(lambda: any(n.endswith(".part") for n in os.listdir(cache)), 20, 0.02, ".part")
    p.stop(signal.SIGKILL)
    killer.wait(30)
    # entry files whose rows never committed
    lost = cache / shard_uuid(f"{origin.url}/lost.tar")
    lost.write_bytes(b"no row")
    other = cache / shard_uuid(f"{origin.url}/other.tar")
    other.write_bytes(b"no row either")
    os.unlink(cache / keys[7])  # a row whose file went

    t0 = time.monotonic()
    p2 = proxies("--upstream", origin.url, cache_dir=cache)
    first = stats(p2.port)["store"]["names_pass"]
    assert first in ("pending", "running", "done"), first
    assert time.monotonic() - t0 < 60
    # served whether the pass is under way or not: a file without a row is a miss,
    # fetched from the origin and committed over it
    out = subprocess.run(
        ["curl", "-sS", "-D", "-", f"{p2.url}/lost.tar"], capture_output=True, timeout=60
    ).stdout
    assert out.endswith(b"served by the origin") and b"X-Cache: MISS" in out
    wait_until(lambda: stats(p2.port)["store"]["names_pass"] == "done", 120, 0.1, "the pass")
    names = set(os.listdir(cache))
    assert not [n for n in names if n.endswith((".part", ".del"))]
    assert other.name not in names and keys[7] not in names
    assert lost.read_bytes() == b"served by the origin"
    assert stats(p2.port)["entries"] == ENTRIES - 1 + 1  # keys[7] dropped, lost.tar added
    assert owed(cache) == []
    assert "names compared in" in p2.log_text()
