"""Commits that are ready at the same time are made together: one index transaction and
one fsync of the directory for the group, each committer returning only once both are
done; a commit that fails in a group fails alone. And the reservations read at each
download's start cost a look-up per process, not per row."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from shardcache.errors import CacheError, NoRoomError
from shardcache.store import HOST, Store
from shardcache.store import names as store_names

pytestmark = pytest.mark.fast

KiB = 1 << 10


class SlowDirectoryFsync:
    """A disk whose directory fsyncs take a while, the first one until ``release`` is set
    (the fault injected); counts the directory fsyncs the store asks for."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.calls = 0
        self.files = 0  # fsyncs of files, done
        self.first_started = threading.Event()
        self.release = threading.Event()
        self._real = os.fsync

    def __call__(self, fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self.calls += 1
            if self.calls == 1:
                self.first_started.set()
                assert self.release.wait(30), "the test never released the first fsync"
            self._real(fd)
            return
        self._real(fd)
        self.files += 1

    def wait_files(self, n: int) -> None:
        """Until ``n`` files were fsynced (their commits are next), and a moment more."""
        deadline = time.monotonic() + 30
        while self.files < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)


def begin_written(store: Store, url: str, data: bytes, *, size_known: bool = True):
    partial = store.begin(url, len(data) if size_known else None)
    assert partial is not None, f"{url} not admitted"
    partial.path.write_bytes(data)
    return partial


def commit_in_threads(store: Store, partials: list, sizes: list[int]) -> list:
    """Commit each partial from a thread of its own; the entries, or the exceptions."""
    results: list = [None] * len(partials)

    def one(i: int) -> None:
        try:
            results[i] = store.commit(partials[i], sizes[i])
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(partials))]
    for t in threads:
        t.start()
    return threads, results


def test_commits_ready_together_share_one_transaction_and_one_directory_fsync(tmp_path):
    store = Store(tmp_path, cache_size=1 << 30)
    data = {f"http://h/o{i}": os.urandom(KiB + i) for i in range(9)}
    partials = {u: begin_written(store, u, b) for u, b in data.items()}
    urls = list(data)
    disk = SlowDirectoryFsync(tmp_path)
    with mock.patch("os.fsync", disk):
        # the first commit leads its group and waits in its directory fsync...
        first, first_result = commit_in_threads(store, [partials[urls[0]]], [len(data[urls[0]])])
        assert disk.first_started.wait(30)
        # ...while eight more become ready: they wait for it, then go in as one group
        rest, results = commit_in_threads(
            store, [partials[u] for u in urls[1:]], [len(data[u]) for u in urls[1:]]
        )
        disk.wait_files(1 + 8)
        # none of the waiting commits returned before its group was durable
        assert all(r is None for r in results)
        assert store.lookup(urls[1]) is None
        disk.release.set()
        for t in first + rest:
            t.join(30)
    assert not any(isinstance(r, Exception) for r in first_result + results), results
    assert disk.calls == 2, f"{disk.calls} directory fsyncs for 2 groups"
    store.close()
    again = Store(tmp_path, cache_size=1 << 30)
    for u, b in data.items():
        hit = again.open_hit(u)
        assert hit is not None, u
        entry, f = hit
        with f:
            assert f.read() == b
    assert again.stats()["reserved"] == 0
    again.close()


def test_a_commit_that_fails_in_a_group_fails_alone(tmp_path):
    """One rename refused (EIO), one with no room left (a download of unknown size that
    outgrew a full cache under ``keep``): those two raise and leave neither file nor
    reservation; the rest of their group is committed."""
    store = Store(tmp_path, cache_size=10 * KiB, policy="keep")
    good = {f"http://h/g{i}": os.urandom(KiB) for i in range(4)}
    partials = [begin_written(store, u, b) for u, b in good.items()]
    sizes = [KiB] * 4
    refused = begin_written(store, "http://h/refused", os.urandom(KiB))
    too_big = begin_written(store, "http://h/big", os.urandom(7 * KiB), size_known=False)
    partials += [refused, too_big]
    sizes += [KiB, 7 * KiB]
    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        if Path(dst).name == refused.key:
            raise OSError(errno.EIO, "injected")
        return real_replace(src, dst, *a, **kw)

    disk = SlowDirectoryFsync(tmp_path)
    # a first commit holds the lead so that all six are made as one group
    lead = begin_written(store, "http://h/lead", os.urandom(KiB))
    with mock.patch("os.fsync", disk), mock.patch("os.replace", replace):
        first, _ = commit_in_threads(store, [lead], [KiB])
        assert disk.first_started.wait(30)
        rest, results = commit_in_threads(store, partials, sizes)
        disk.wait_files(1 + len(partials))
        disk.release.set()
        for t in first + rest:
            t.join(30)
    assert disk.calls == 2
    assert all(not isinstance(r, Exception) for r in results[:4]), results
    assert isinstance(results[4], CacheError) and "injected" in str(results[4])
    assert isinstance(results[5], NoRoomError)
    for p in (refused, too_big):
        assert not p.path.exists()
        assert store.lookup(p.url) is None
    assert store.stats()["reserved"] == 0
    store.close()
    again = Store(tmp_path, cache_size=10 * KiB, policy="keep")
    for u, b in good.items():
        hit = again.open_hit(u)
        assert hit is not None, u
        with hit[1] as f:
            assert f.read() == b
    assert again.stats()["entries"] == 5  # the four and the one that led
    again.close()


def test_a_group_survives_sigkill_as_soon_as_its_commits_return(tmp_path):
    """Sixteen threads of a process commit at once; the process kills itself (SIGKILL)
    the moment the last commit returns: every entry is there when the store is opened
    again."""
    code = (
        "import os, signal, sys, threading\n"
        "from shardcache.store import Store\n"
        "store = Store(sys.argv[1], cache_size=1 << 30)\n"
        "parts = []\n"
        "for i in range(64):\n"
        "    p = store.begin(f'http://h/k{i}', 1024)\n"
        "    p.path.write_bytes(bytes([i]) * 1024)\n"
        "    parts.append(p)\n"
        "def run(mine):\n"
        "    for p in mine:\n"
        "        store.commit(p, 1024)\n"
        "ts = [threading.Thread(target=run, args=(parts[i::16],)) for i in range(16)]\n"
        "for t in ts: t.start()\n"
        "for t in ts: t.join()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120)
    assert done.returncode == -9
    again = Store(tmp_path, cache_size=1 << 30)
    try:
        for i in range(64):
            hit = again.open_hit(f"http://h/k{i}")
            assert hit is not None, i
            with hit[1] as f:
                assert f.read() == bytes([i]) * 1024
    finally:
        again.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_reservations_are_checked_once_per_process_not_once_per_row(tmp_path):
    """A download's start drops the reservations of processes that are gone (a dead pid,
    or this pid before this process started) and keeps those of live ones, looking each
    process up once: this process's own rows without a system call."""
    store = Store(tmp_path, cache_size=1 << 20)
    mine = [store.begin(f"http://h/m{i}", KiB) for i in range(5)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    try:
        started = store_names.process_started(os.getpid())
        assert started is not None
        now = time.time()
        rows = [("live", sleeper.pid, now)] * 3 + [("dead", dead.pid, now)] * 3
        rows += [("predecessor", os.getpid(), started - 60)]
        with store.transaction() as conn:
            for i, (what, pid, created) in enumerate(rows):
                conn.execute(
                    "INSERT INTO reservations (name, key, url, pid, host, created, expected, "
                    "bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f"{what}{i}.part",
                        f"k{i}",
                        f"http://h/{what}{i}",
                        pid,
                        HOST,
                        created,
                        KiB,
                        KiB,
                    ),
                )
        looked_up: list[int] = []
        real = store_names.process_started

        def counted(pid: int) -> float | None:
            looked_up.append(pid)
            return real(pid)

        with mock.patch.object(store_names, "process_started", counted):
            extra = store.begin("http://h/next", KiB)
        assert extra is not None
        with store.transaction() as conn:
            left = sorted(r[0] for r in conn.execute("SELECT name FROM reservations"))
        assert [n for n in left if n.startswith(("live", "dead", "predecessor"))] == [
            "live0.part",
            "live1.part",
            "live2.part",
        ], left
        assert store.stats()["reserved"] == (5 + 1 + 3) * KiB
        assert looked_up.count(sleeper.pid) == 1
        assert os.getpid() not in looked_up  # this process's start is read once, earlier
        for p in [*mine, extra]:
            store.abort(p)
    finally:
        sleeper.kill()
        sleeper.wait(10)
        store.close()


def test_a_fanout_group_makes_each_entrys_subdirectory_durable(tmp_path):
    """In the fan-out layout a group's renames go into several subdirectories: each of
    them is fsynced (once) before the group's commits return."""
    store = Store(tmp_path, cache_size=1 << 30, layout="fanout")
    data = {f"http://h/f{i}": os.urandom(KiB + i) for i in range(12)}
    partials = [begin_written(store, u, b) for u, b in data.items()]
    real_fsync = os.fsync
    synced: list[str] = []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced.append(path)
        real_fsync(fd)

    with mock.patch("os.fsync", fsync):
        threads, results = commit_in_threads(store, partials, [len(b) for b in data.values()])
        for t in threads:
            t.join(30)
    assert not any(isinstance(r, Exception) for r in results), results
    dirs = {str(r.path.parent) for r in results}
    assert len(dirs) > 1  # the test means something: the entries are spread
    assert all(str(tmp_path) != d for d in dirs)
    assert dirs <= set(synced), (dirs, synced)
    store.close()
    again = Store(tmp_path, cache_size=1 << 30)
    for u, b in data.items():
        hit = again.open_hit(u)
        assert hit is not None, u
        with hit[1] as f:
            assert f.read() == b
    again.close()
