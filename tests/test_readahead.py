"""Read-ahead of local shards: the same samples, errors and order as webdataset and as
the reader without it, at most the limit ahead, and nothing left running."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.pipeline_helpers import wds_samples, write_tar

from shardcache import ShardDataset, ShardFormatError
from shardcache.handlers import ignore_and_continue, ignore_and_stop, warn_and_continue
from shardcache.readahead import members_ahead, regular_file
from shardcache.tariterators import group_by_keys, tar_file_expander, url_opener
from shardcache.workers import WorkerEnvironment

pytestmark = pytest.mark.fast

HYPOTHESIS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SOLO = WorkerEnvironment(rank=0, world_size=1, worker=0, num_workers=1)


def _ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardcache-read-ahead"]


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def _samples(urls, read_ahead: int, **kw) -> list[dict]:
    files = tar_file_expander(url_opener([{"url": u} for u in urls]), read_ahead=read_ahead, **kw)
    return list(group_by_keys(files, handler=kw.get("handler")))


def _without_local_path(samples: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in samples]


# ---------------------------------------------------------------------------
# samples as webdataset reads them: long names (GNU and PAX headers), ustar prefixes,
# empty members, directories, meta members, sizes at the 512-byte block boundaries

_SIZES = [0, 1, 511, 512, 513, 1023, 1024, 1025, 4096, 5000, 70_000]
names = st.sampled_from(
    ["k", "dir/k", "d" * 60 + ".x/" + "e" * 70 + "/k", "ü é", "k" * 120, "a.b/c"]
)


@st.composite
def shard_sets(draw):
    shards = []
    for s in range(draw(st.integers(1, 3))):
        members = []
        for i in range(draw(st.integers(0, 6))):
            key = f"{draw(names)}{s}-{i}"
            if draw(st.booleans()):
                members.append((f"{key}-dir", None))
            if draw(st.integers(0, 5)) == 0:
                members.append(("__meta__", b"m"))
            for ext in draw(
                st.lists(
                    st.sampled_from(["jpg", "cls", "JSON", "seg.png"]),
                    min_size=1,
                    max_size=3,
                    unique_by=str.lower,
                )
            ):
                size = draw(st.sampled_from(_SIZES))
                members.append((f"{key}.{ext}", bytes([i % 251]) * size))
        shards.append(members)
    return shards


@HYPOTHESIS
@given(
    shards=shard_sets(),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    limit=st.sampled_from([1, 600, 5000, 1 << 20]),
)
def test_read_ahead_samples_match_webdataset(tmp_path_factory, shards, fmt, limit):
    directory = tmp_path_factory.mktemp("ahead")
    paths = []
    for i, members in enumerate(shards):
        path = str(directory / f"shard-{i:03d}.tar")
        write_tar(path, members, fmt)
        paths.append(path)
    theirs = wds_samples(paths)
    assert _samples(paths, limit) == theirs
    ds = ShardDataset(paths, read_ahead=limit, env=SOLO, plan=False)
    got = list(ds)
    assert got == _without_local_path(theirs)
    assert [list(s) for s in got] == [list(s) for s in _without_local_path(theirs)]
    assert _wait_for(lambda: not _ahead_threads())


def test_ustar_prefix_names_and_block_boundaries_match_webdataset(tmp_path):
    members = [
        ("p" * 90 + "/" + "q" * 90 + f".{ext}", b"z" * size)
        for ext, size in (("a", 511), ("b", 512), ("c", 513), ("d", 0))
    ]
    path = str(tmp_path / "u.tar")
    write_tar(path, members, tarfile.USTAR_FORMAT)
    assert _samples([path], 100) == wds_samples(path)


# ---------------------------------------------------------------------------
# errors: the same samples before them, the same error, the handlers decide the same


def _cut(src: str, n: int, dest: str) -> str:
    with open(src, "rb") as f:
        data = f.read()[:n]
    with open(dest, "wb") as f:
        f.write(data)
    return dest


@HYPOTHESIS
@given(data=st.data())
def test_a_cut_shard_fails_at_the_same_place(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("cut")
    members = [
        ("k1.jpg", b"a" * 700),
        ("k1.cls", b"1"),
        ("k" * 120 + ".txt", b"x" * 512),
        ("k3.jpg", b""),
        ("k3.cls", b"3" * 1500),
    ]
    good = str(directory / "good.tar")
    end = write_tar(
        good, members, data.draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    )
    cut = _cut(good, data.draw(st.integers(0, end + 511)), str(directory / "cut.tar"))
    other = str(directory / "other.tar")
    write_tar(other, [("o.txt", b"o")])
    urls = [other, cut, other]
    limit = data.draw(st.sampled_from([1, 1000, 1 << 20]))

    def run(read_ahead, **kw):
        got = []
        try:
            files = tar_file_expander(
                url_opener([{"url": u} for u in urls]), read_ahead=read_ahead, **kw
            )
            for item in files:
                got.append(item)
        except ShardFormatError as exc:
            return got, str(exc)
        return got, None

    plain, error = run(0)
    assert error is not None and "cut.tar" in error
    assert run(limit) == (plain, error)
    for handler in (ignore_and_continue, ignore_and_stop):
        assert run(limit, handler=handler) == run(0, handler=handler)


def test_a_broken_shard_goes_to_the_handler_as_without_read_ahead(tmp_path):
    write_tar(tmp_path / "a.tar", [("a1.txt", b"1"), ("a1.cls", b"1")])
    end = write_tar(tmp_path / "b.tar", [("b1.txt", b"2" * 3000), ("b2.txt", b"2")])
    _cut(str(tmp_path / "b.tar"), end - 700, str(tmp_path / "b.tar"))
    write_tar(tmp_path / "c.tar", [("c1.txt", b"3")])
    urls = [str(tmp_path / n) for n in ("a.tar", "b.tar", "c.tar")]
    with pytest.warns(RuntimeWarning, match="b.tar"):
        got = _samples(urls, 10, handler=warn_and_continue)
    assert [s["__key__"] for s in got] == ["a1", "c1"]
    with pytest.raises(ShardFormatError, match="b.tar"):
        list(ShardDataset(urls, read_ahead=10, env=SOLO, plan=False))


# ---------------------------------------------------------------------------
# the thread: ahead, bounded, stopped


def test_a_local_shard_is_read_ahead_of_the_consumer(tmp_path):
    path = str(tmp_path / "s.tar")
    end = write_tar(path, [(f"k{i}.bin", bytes(1000)) for i in range(8)])
    with open(path, "rb") as stream:
        files = tar_file_expander([{"url": path, "stream": stream}], read_ahead=1 << 20)
        first = next(files)
        assert first["fname"] == "k0.bin"
        # the rest of the shard is read while the consumer holds the first member
        assert _wait_for(lambda: stream.closed or stream.tell() >= end)
        assert [f["fname"] for f in files if f] == [f"k{i}.bin" for i in range(1, 8)]
    with open(path, "rb") as stream:
        files = tar_file_expander([{"url": path, "stream": stream}], read_ahead=0)
        next(files)
        time.sleep(0.05)
        assert stream.tell() < end  # without read-ahead nothing is read beyond it
        files.close()


def _sources(paths, opened, then=None, streams=None):
    for path in paths:
        opened.append(path)
        stream = open(path, "rb")  # noqa: SIM115 - closed by the expander
        if streams is not None:
            streams.append(stream)
        yield {"url": path, "stream": stream}
    if then is not None:
        raise then


def _read_to_the_end(stream) -> None:
    size = os.fstat(stream.fileno()).st_size
    assert _wait_for(lambda: stream.closed or stream.tell() >= size)
    time.sleep(0.05)


def test_the_next_shard_is_opened_once_the_previous_is_read(tmp_path):
    paths = []
    for s in range(3):
        paths.append(str(tmp_path / f"s{s}.tar"))
        write_tar(paths[-1], [(f"s{s}k{i}.bin", bytes([s]) * 700) for i in range(5)])
    opened: list[str] = []
    streams: list = []
    files = tar_file_expander(_sources(paths, opened, streams=streams), read_ahead=1 << 20)
    got = [next(files)]
    _read_to_the_end(streams[0])  # by the thread, while the consumer holds one file
    got.append(next(files))
    assert opened == paths[:2]  # s1 taken while s0's files are still being yielded
    got += list(files)
    opened2: list[str] = []
    assert got == list(tar_file_expander(_sources(paths, opened2), read_ahead=0))
    assert opened == opened2 == paths
    assert not _ahead_threads()


def test_an_error_of_the_next_source_taken_early_comes_where_it_would(tmp_path):
    paths = [str(tmp_path / "a.tar")]
    write_tar(paths[0], [(f"k{i}.x", bytes(300)) for i in range(4)])

    def run(read_ahead):
        got = []
        files = tar_file_expander(
            _sources(paths, [], then=RuntimeError("listing failed")), read_ahead=read_ahead
        )
        with pytest.raises(RuntimeError, match="listing failed"):
            for f in files:
                got.append(f)
                time.sleep(0.02)
        return got

    assert run(1 << 20) == run(0)
    assert run(1 << 20)[-1] == {}  # the shard's end marker before the error


def test_a_consumer_that_stops_after_the_next_shard_was_taken_closes_it(tmp_path):
    paths = []
    for s in range(2):
        paths.append(str(tmp_path / f"s{s}.tar"))
        write_tar(paths[-1], [(f"k{i}.bin", bytes(3000)) for i in range(6)])
    streams = []

    def sources():
        for path in paths:
            streams.append(open(path, "rb"))  # noqa: SIM115 - closed by the expander
            yield {"url": path, "stream": streams[-1]}

    files = tar_file_expander(sources(), read_ahead=1 << 20)
    next(files)
    _read_to_the_end(streams[0])
    next(files)
    assert len(streams) == 2
    files.close()
    assert all(s.closed for s in streams)
    assert not _ahead_threads()


def test_the_limit_bounds_what_is_read_ahead():
    pulled = []

    def members():
        for i in range(50):
            pulled.append(i)
            yield {"fname": f"k{i}", "data": bytes(100)}

    got = members_ahead(members(), 350)
    taken = [next(got)]
    assert _wait_for(lambda: len(pulled) >= 4)
    time.sleep(0.05)
    # 1 taken, at most 3 queued (300 bytes <= 350), 1 read and waiting for room
    assert 4 <= len(pulled) <= 5
    taken += list(got)
    assert [m["fname"] for m in taken] == [f"k{i}" for i in range(50)]


def test_a_member_larger_than_the_limit_still_passes():
    items = [{"data": bytes(n)} for n in (10, 5000, 1, 7000)]
    assert [len(m["data"]) for m in members_ahead(iter(items), 100)] == [10, 5000, 1, 7000]


def test_an_error_comes_after_the_members_before_it():
    boom = ValueError("boom")

    def members():
        yield {"data": b"1"}
        yield {"data": b"2"}
        raise boom

    got = members_ahead(members(), 1 << 20)
    assert [m["data"] for m in (next(got), next(got))] == [b"1", b"2"]
    with pytest.raises(ValueError) as info:
        next(got)
    assert info.value is boom
    assert _wait_for(lambda: not _ahead_threads())


def test_a_consumer_that_stops_early_stops_the_thread_before_the_stream_closes(tmp_path):
    path = str(tmp_path / "big.tar")
    write_tar(path, [(f"k{i}.bin", bytes(4096)) for i in range(200)])
    stream = open(path, "rb")  # noqa: SIM115 - closed by the expander
    files = tar_file_expander([{"url": path, "stream": stream}], read_ahead=8192)
    assert next(files)["fname"] == "k0.bin"
    files.close()
    assert stream.closed
    assert not _ahead_threads()  # joined before the stream was closed

    ds = ShardDataset([path, path], read_ahead=8192, env=SOLO, plan=False)
    it = iter(ds)
    assert next(it)["__key__"] == "k0"
    it.close()
    assert not _ahead_threads()


def test_only_regular_files_are_read_ahead(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    with open(path, "rb") as f, open(path, "rb", buffering=0) as raw:
        assert regular_file(f) and regular_file(raw)
    closed = open(path, "rb")  # noqa: SIM115
    closed.close()
    assert not regular_file(closed)
    assert not regular_file(io.BytesIO(b"x"))
    r, w = os.pipe()
    with open(r, "rb") as pipe_r, open(w, "wb"):
        assert not regular_file(pipe_r)


def test_a_pipe_is_read_without_a_thread(tmp_path):
    path = str(tmp_path / "s.tar")
    write_tar(path, [("a.x", b"1"), ("b.x", b"2")])
    seen = []

    def watch(files):
        for f in files:
            seen.append(bool(_ahead_threads()))
            yield f

    got = list(
        group_by_keys(
            watch(tar_file_expander(url_opener([{"url": f"pipe:cat {path}"}]), read_ahead=1 << 20))
        )
    )
    assert [s["__key__"] for s in got] == ["a", "b"] and not any(seen)


def test_select_and_rename_files_are_called_in_the_consumer(tmp_path):
    path = str(tmp_path / "s.tar")
    write_tar(path, [("a.x", b"1"), ("a.y", b"2")])
    callers = set()

    def select(name):
        callers.add(threading.current_thread().name)
        return name.endswith(".x")

    got = _samples([path], 1 << 20, select_files=select)
    assert got == wds_samples(path, select_files=select)
    assert callers == {threading.current_thread().name}


def test_read_ahead_must_be_a_count_of_bytes(tmp_path):
    for bad in (-1, 1.5, True, "8M"):
        with pytest.raises(ValueError, match="read_ahead"):
            ShardDataset(str(tmp_path / "s.tar"), read_ahead=bad)
    assert ShardDataset(str(tmp_path / "s.tar")).read_ahead == 8 << 20


@pytest.mark.slow  # starts an interpreter
def test_an_iteration_left_open_at_exit_does_not_abort_the_interpreter(tmp_path):
    paths = []
    for s in range(2):
        paths.append(str(tmp_path / f"s{s}.tar"))
        write_tar(paths[-1], [(f"k{i}.bin", bytes(50_000)) for i in range(40)])
    script = (
        "import sys\n"
        "from shardcache import ShardDataset\n"
        "from shardcache.workers import WorkerEnvironment\n"
        f"ds = ShardDataset({paths!r}, read_ahead=100_000, plan=False,\n"
        "                  env=WorkerEnvironment(0, 1, 0, 1))\n"
        "IT = iter(ds)\n"
        "next(IT)\n"
    )
    for end in ("", "sys.exit(0)\n"):
        done = subprocess.run(
            [sys.executable, "-c", script + end], capture_output=True, text=True, timeout=60
        )
        # a daemon thread frozen mid-read at shutdown made closing its stream abort
        assert done.returncode == 0, done.stderr
        assert "Fatal Python error" not in done.stderr


def test_without_a_thread_to_be_had_the_shard_is_read_in_place(tmp_path, monkeypatch):
    paths = []
    for s in range(2):
        paths.append(str(tmp_path / f"s{s}.tar"))
        write_tar(paths[-1], [(f"s{s}k{i}.x", bytes([i]) * 600) for i in range(3)])

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)  # fault injection
    assert _samples(paths, 1 << 20) == wds_samples(paths)
