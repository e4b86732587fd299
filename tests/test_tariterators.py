"""The tar pipeline agrees with webdataset 1.0.2 on good tars and fails loudly on bad ones."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import time
import warnings

import pytest
import webdataset as wds
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.pipeline_helpers import wds_samples, write_tar

from shardcache import ShardFormatError
from shardcache.errors import GopenError
from shardcache.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from shardcache.tariterators import (
    BAD_SHARD,
    base_plus_ext,
    group_by_keys,
    tar_file_expander,
    tar_file_iterator,
    tarfile_samples,
    url_opener,
    valid_sample,
)
from shardcache.tarreader import _byte_sum
from shardcache.urls import shardlist

pytestmark = pytest.mark.fast

HYPOTHESIS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def ours(urls, **kw):
    return list(tarfile_samples(shardlist(urls), **kw))


# ---------------------------------------------------------------------------
# strategies: sample sets as webdataset writers produce them, plus awkward names

_key_chars = st.sampled_from("abcXYZ019_-ü é")
_dir_chars = st.sampled_from("abcXYZ01._-ü")
_ext_chars = st.sampled_from("abcjpgPNGJSON019_-.")

dirs = st.lists(st.text(_dir_chars, min_size=1, max_size=12), max_size=3).map(
    lambda parts: "".join(p + "/" for p in parts if p not in (".", ".."))
)
basenames = st.text(_key_chars, min_size=1, max_size=20).filter(lambda s: not s.startswith("__"))
long_dirs = st.just("d" * 60 + ".x/" + "e" * 70 + "/")  # names longer than 100 bytes
keys = st.tuples(st.one_of(dirs, dirs, long_dirs), basenames).map(lambda t: t[0] + t[1])
exts = st.text(_ext_chars, min_size=1, max_size=10).filter(lambda e: not e.startswith("."))
payloads = st.one_of(st.just(b""), st.binary(max_size=700))


@st.composite
def sample_sets(draw):
    """A list of shards, each a list of (key, [(ext, payload), ...]) samples."""
    n_shards = draw(st.integers(1, 3))
    shards = []
    for _ in range(n_shards):
        shard_keys = draw(st.lists(keys, min_size=0, max_size=6, unique=True))
        shard = []
        for key in shard_keys:
            sample_exts = draw(
                st.lists(exts, min_size=1, max_size=3, unique_by=lambda e: e.lower())
            )
            shard.append((key, [(e, draw(payloads)) for e in sample_exts]))
        shards.append(shard)
    return shards


def _members(shard, meta_positions):
    members = []
    for i, (key, files) in enumerate(shard):
        if i in meta_positions:
            members += [
                ("__meta__", b"m"),
                ("__info__/x.json", b"{}"),
                (key.split("/")[0] + "-dir.d", None),
            ]
        members += [(f"{key}.{ext}", data) for ext, data in files]
    return members


def _expected(shards, paths):
    result = []
    for shard, path in zip(shards, paths, strict=True):
        for key, files in shard:
            sample = {"__key__": key, "__url__": path}
            for ext, data in files:
                sample[ext.lower()] = data
            sample["__local_path__"] = path
            result.append(sample)
    return result


@HYPOTHESIS
@given(
    shards=sample_sets(),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    meta=st.sets(st.integers(0, 5), max_size=3),
)
def test_random_sample_sets_match_webdataset(tmp_path_factory, shards, fmt, meta):
    directory = tmp_path_factory.mktemp("shards")
    paths = []
    for i, shard in enumerate(shards):
        path = str(directory / f"shard-{i:03d}.tar")
        write_tar(path, _members(shard, meta), fmt)
        paths.append(path)
    urls = str(directory / f"shard-{{000..{len(shards) - 1:03d}}}.tar")

    got = ours(urls)
    assert got == wds_samples(urls)
    assert [list(s) for s in got] == [list(s) for s in wds_samples(urls)]  # same key order
    assert got == _expected(shards, paths)


@HYPOTHESIS
@given(shards=sample_sets())
def test_ustar_prefix_names_match_webdataset(tmp_path_factory, shards):
    directory = tmp_path_factory.mktemp("ustar")
    path = str(directory / "s.tar")
    try:
        write_tar(path, _members(shards[0], set()), tarfile.USTAR_FORMAT)
    except ValueError:  # a name ustar cannot hold (too long, or not ASCII)
        assume(False)
    assert ours(path) == wds_samples(path) == _expected(shards[:1], [path])


def test_same_key_in_two_shards_is_two_samples(tmp_path):
    write_tar(tmp_path / "a.tar", [("k.txt", b"1")])
    write_tar(tmp_path / "b.tar", [("k.cls", b"2")])
    urls = str(tmp_path / "{a,b}.tar")
    got = ours(urls)
    assert [(s["__key__"], s["__url__"].rsplit("/", 1)[1]) for s in got] == [
        ("k", "a.tar"),
        ("k", "b.tar"),
    ]
    assert got == wds_samples(urls)


def test_awkward_names(tmp_path):
    members = [
        ("a.b/c.d/key.seg.png", b"seg"),
        ("a.b/c.d/key.JPG", b"jpg"),
        ("a.b/c.d/key.Json", b""),
        ("nodot", b"skipped: no extension"),
        ("__meta__", b"skipped"),
        ("sub/__x__", b"kept: not top-level"),
        ("key2.", b"empty extension"),
        ("dir.only/", None),
        ("x" * 120 + ".txt", b"long"),
        ("y" * 90 + "/" + "z" * 90 + ".txt", b"long dir"),
    ]
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = str(tmp_path / f"awkward-{fmt}.tar")
        write_tar(path, members, fmt)
        got = ours(path)
        assert got == wds_samples(path)
        assert got[0]["seg.png"] == b"seg" and got[0]["jpg"] == b"jpg"
        assert any(s["__key__"] == "x" * 120 for s in got)


def test_symlinks_and_hardlinks_are_skipped_like_webdataset(tmp_path):
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w") as tf:
        for name, typ in [
            ("a.txt", tarfile.REGTYPE),
            ("a.lnk", tarfile.SYMTYPE),
            ("a.hard", tarfile.LNKTYPE),
        ]:
            info = tarfile.TarInfo(name)
            info.type = typ
            info.linkname = "a.txt" if typ != tarfile.REGTYPE else ""
            data = b"data" if typ == tarfile.REGTYPE else b""
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert ours(str(path)) == wds_samples(str(path))
    assert set(ours(str(path))[0]) == {"__key__", "__url__", "__local_path__", "txt"}


def test_gnu_tar_written_shard_matches_webdataset(tmp_path):
    src = tmp_path / "src"
    (src / "d.x").mkdir(parents=True)
    (src / "d.x" / ("k" * 110 + ".TXT")).write_bytes(b"hello")
    (src / "d.x" / "k2.seg.png").write_bytes(b"")
    for fmt in ("gnu", "posix"):
        path = tmp_path / f"gnu-{fmt}.tar"
        os.system(f"tar --format={fmt} -C {src} -cf {path} d.x")
        assert path.stat().st_size > 0
        got = ours(str(path))
        assert got == wds_samples(str(path))
        assert len(got) == 2


def test_compressed_shards(tmp_path):
    write_tar(tmp_path / "a.tar", [("k.txt", b"1" * 1000), ("k.cls", b"2")])
    raw = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(raw))
    path = str(tmp_path / "a.tar.gz")
    assert ours(path) == wds_samples(path)
    assert ours(path)[0]["txt"] == b"1" * 1000

    truncated = gzip.compress(raw)[:-30]
    (tmp_path / "cut.tar.gz").write_bytes(truncated)
    with pytest.raises(ShardFormatError, match="cut.tar.gz"):
        ours(str(tmp_path / "cut.tar.gz"))


def test_pipe_urls_match_webdataset(tmp_path):
    write_tar(tmp_path / "a.tar", [("k.txt", b"1"), ("k2.txt", b"2")])
    url = f"pipe:cat {tmp_path / 'a.tar'}"
    assert ours(url) == wds_samples(url)


def test_pipe_failing_after_a_complete_tar_is_an_error(tmp_path):
    write_tar(tmp_path / "a.tar", [("k.txt", b"1")])
    url = f"pipe:cat {tmp_path / 'a.tar'}; exit 3"
    with pytest.raises(GopenError, match="status 3"):
        ours(url)


# ---------------------------------------------------------------------------
# truncated and corrupt shards


@pytest.fixture
def shard(tmp_path):
    members = [("k1.txt", b"a" * 700), ("k1.cls", b"1"), ("k2.txt", b"b" * 100), ("k2.cls", b"2")]
    path = tmp_path / "good.tar"
    end = write_tar(path, members, tarfile.GNU_FORMAT)
    return path, end, members


def _cut(path, n, name="cut.tar"):
    dest = path.parent / name
    dest.write_bytes(path.read_bytes()[:n])
    return str(dest)


@pytest.mark.parametrize(
    "cut",
    [
        1,  # inside the first header
        300,  # inside the first header
        512,  # after the first header, before its data
        800,  # inside the first member's data
        1300,  # inside the first member's padding
        1536,  # at a member boundary (k1.cls header next)
        2560 + 100,  # inside the third header (k2.txt)
        3072 + 50,  # inside the third member's data (k2.txt)
        4608,  # after the last member, before the end-of-archive block
        4608 + 200,  # inside the end-of-archive block
    ],
)
def test_truncated_tar_raises_naming_the_url(shard, cut):
    path, end, _ = shard
    assert end == 4608
    url = _cut(path, cut)
    with pytest.raises(ShardFormatError, match="cut.tar") as info:
        ours(url)
    assert "truncated" in str(info.value)


@HYPOTHESIS
@given(data=st.data())
def test_any_cut_before_the_end_block_raises(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("cuts")
    members = [("k1.txt", b"a" * 700), ("k" * 120 + ".txt", b"x"), ("k2.cls", b"")]
    path = directory / "good.tar"
    end = write_tar(
        path, members, data.draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    )
    cut = data.draw(st.integers(0, end + 511))
    url = _cut(path, cut)
    with pytest.raises(ShardFormatError, match="cut.tar"):
        ours(url)


def test_cut_after_end_block_is_complete(shard):
    path, end, _ = shard
    url = _cut(path, end + 512)
    assert ours(url) == wds_samples(str(path))[:0] + [
        {k: (url if k in ("__url__", "__local_path__") else v) for k, v in s.items()}
        for s in wds_samples(str(path))
    ]


def test_webdataset_hides_a_cut_at_a_member_boundary(shard):
    """The failure we guard against: tarfile's stream mode ends quietly, a sample shrinks."""
    path, _, _ = shard
    url = _cut(path, 1536)  # k1.txt complete, k1.cls missing
    theirs = wds_samples(url)
    assert theirs and "cls" not in theirs[-1]  # a silently shortened sample
    with pytest.raises(ShardFormatError):
        ours(url)


def test_corrupt_header_raises(shard):
    path, _, _ = shard
    data = bytearray(path.read_bytes())
    data[1536 + 3] ^= 0xFF  # second header's name: checksum no longer matches
    bad = path.parent / "bad.tar"
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="bad.tar.*checksum"):
        ours(str(bad))


@HYPOTHESIS
@given(block=st.binary(min_size=512, max_size=512) | st.binary(max_size=1100))
def test_the_header_checksum_sum_is_sum(block):
    assert _byte_sum(block) == sum(block)
    assert _byte_sum(b"\xff" * 512) == 255 * 512 and _byte_sum(bytes(512)) == 0


@pytest.mark.parametrize("flip", [0, 100, 148, 152, 156, 300, 511])
def test_a_changed_header_byte_is_a_bad_checksum(shard, flip):
    path, _, _ = shard
    data = bytearray(path.read_bytes())
    data[512 * 3 + flip] ^= 0x01  # in the header of k1.cls
    bad = path.parent / "flip.tar"
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="flip.tar"):
        ours(str(bad))


def test_not_a_tar_and_empty_file(tmp_path):
    (tmp_path / "junk.tar").write_bytes(os.urandom(2000))
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ShardFormatError, match="junk.tar"):
        ours(str(tmp_path / "junk.tar"))
    with pytest.raises(ShardFormatError, match="empty.tar.*empty"):
        ours(str(tmp_path / "empty.tar"))


# ---------------------------------------------------------------------------
# handlers


@pytest.fixture
def three_shards(tmp_path, shard):
    path, _, _ = shard
    write_tar(tmp_path / "a.tar", [("a1.txt", b"1"), ("a1.cls", b"1")])
    write_tar(tmp_path / "c.tar", [("c1.txt", b"3"), ("c1.cls", b"3")])
    cut = _cut(path, 3072 + 50, "b.tar")  # k1 complete, k2.txt cut mid-data
    return str(tmp_path / "a.tar"), cut, str(tmp_path / "c.tar")


def _keys(samples):
    return [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples]


def test_ignore_and_continue_skips_the_broken_shard_tail(three_shards):
    got = ours(list(three_shards), handler=ignore_and_continue)
    # k1 of b.tar is complete but still pending when b.tar breaks: it is dropped with the
    # rest of the shard's unfinished sample, never yielded short
    assert _keys(got) == [("a1", ["cls", "txt"]), ("c1", ["cls", "txt"])]


def test_ignore_and_stop_stops_without_a_partial_sample(three_shards):
    got = ours(list(three_shards), handler=ignore_and_stop)
    assert _keys(got) == [("a1", ["cls", "txt"])]


def test_reraise_raises(three_shards):
    with pytest.raises(ShardFormatError, match="b.tar"):
        ours(list(three_shards), handler=reraise_exception)


def test_warn_handlers_warn_without_sleeping(three_shards):
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="b.tar"):
        got = ours(list(three_shards), handler=warn_and_continue)
    assert len(got) == 2
    with pytest.warns(RuntimeWarning, match="ShardFormatError"):
        got = ours(list(three_shards), handler=warn_and_stop)
    assert len(got) == 1
    assert time.monotonic() - start < 1.0


def test_handler_values():
    exc = ValueError("x")
    with pytest.raises(ValueError):
        reraise_exception(exc)
    assert ignore_and_continue(exc) is True
    assert ignore_and_stop(exc) is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert warn_and_continue(exc) is True
        assert warn_and_stop(exc) is False


def test_missing_shard_goes_to_the_handler(tmp_path, three_shards):
    a, _, c = three_shards
    urls = [a, str(tmp_path / "missing.tar"), c]
    assert len(ours(urls, handler=ignore_and_continue)) == 2
    with pytest.raises(GopenError, match="missing.tar"):
        ours(urls)


def test_duplicate_names_like_webdataset(tmp_path):
    path = str(tmp_path / "dup.tar")
    write_tar(path, [("k.txt", b"1"), ("k.TXT", b"2"), ("k.cls", b"3"), ("j.txt", b"4")])
    with pytest.raises(ShardFormatError, match="dup.tar.*duplicate"):
        ours(path)
    with pytest.raises(ValueError):
        wds_samples(path)
    got = ours(path, handler=ignore_and_continue)
    assert got == wds_samples(path, handler=wds.ignore_and_continue)
    assert got[0]["txt"] == b"1" and got[0]["cls"] == b"3"


# ---------------------------------------------------------------------------
# the stages on their own


def test_stages_compose_like_webdataset(tmp_path):
    path = str(tmp_path / "s.tar")
    write_tar(path, [("a.x", b"1"), ("a.y", b"2"), ("b.x", b"3")])
    with open(path, "rb") as f:
        files = list(tar_file_iterator(f))
    with open(path, "rb") as f:
        theirs = list(wds.tariterators.tar_file_iterator(f))
    assert (
        files
        == theirs
        == [
            {"fname": "a.x", "data": b"1"},
            {"fname": "a.y", "data": b"2"},
            {"fname": "b.x", "data": b"3"},
        ]
    )
    expanded = list(tar_file_expander(url_opener([{"url": path}])))
    assert expanded[-1] == {}
    assert expanded[0] == {"fname": "a.x", "data": b"1", "__url__": path, "__local_path__": path}
    assert list(group_by_keys(expanded, suffixes={"x"})) == [
        {"__key__": "a", "__url__": path, "x": b"1", "__local_path__": path},
        {"__key__": "b", "__url__": path, "x": b"3", "__local_path__": path},
    ]


def test_tar_file_iterator_names_the_stream_and_honours_the_handler(shard):
    path, _, _ = shard
    url = _cut(path, 800)
    with open(url, "rb") as f, pytest.raises(ShardFormatError, match="cut.tar"):
        list(tar_file_iterator(f))
    with open(url, "rb") as f:
        assert list(tar_file_iterator(f, handler=ignore_and_continue)) == []


def test_select_and_rename_files(tmp_path):
    path = str(tmp_path / "s.tar")
    write_tar(path, [("a.x", b"1"), ("a.y", b"2")])
    kw = dict(select_files=lambda n: n.endswith(".X"), rename_files=str.upper)
    got = ours(path, **kw)
    assert got == wds_samples(path, **kw)
    assert got[0]["__key__"] == "A" and got[0]["x"] == b"1"


def test_bad_marker_drops_the_pending_sample():
    files = [
        {"fname": "a.x", "data": b"1", "__url__": "u"},
        {BAD_SHARD: True, "__url__": "u"},
        {"fname": "b.x", "data": b"2", "__url__": "v"},
        {},
    ]
    assert [s["__key__"] for s in group_by_keys(files)] == ["b"]


@pytest.mark.parametrize(
    "path,expected",
    [
        ("a/b.c/key.seg.png", ("a/b.c/key", "seg.png")),
        ("key.JPG", ("key", "JPG")),
        ("nodot", (None, None)),
        (".hidden", (None, None)),
        ("dir/key.", ("dir/key", "")),
    ],
)
def test_base_plus_ext(path, expected):
    assert base_plus_ext(path) == expected == wds.tariterators.base_plus_ext(path)


def test_valid_sample():
    assert valid_sample({"__key__": "a"})
    assert not valid_sample({})
    assert not valid_sample(None)
    assert not valid_sample({"__key__": "a", "__bad__": True})


def test_global_pax_header_and_v7_directory(tmp_path):
    path = tmp_path / "g.tar"
    with tarfile.open(
        path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "made by a test"}
    ) as tf:
        v7dir = tarfile.TarInfo("olddir.d/")
        v7dir.type = tarfile.AREGTYPE  # old V7 tar: a directory is a regular file ending in "/"
        tf.addfile(v7dir)
        for name, data in [("k.txt", b"1"), ("ü" * 60 + ".txt", b"unicode, long")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert path.read_bytes()[156:157] == tarfile.XGLTYPE
    got = ours(str(path))
    assert got == wds_samples(str(path))
    assert [s["__key__"] for s in got] == ["k", "ü" * 60]
