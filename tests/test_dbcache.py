"""DBCache against real SQLite files: filling, reading, ordering, resuming, bad files."""

import logging
import os
import pickle
import re
import sqlite3

import numpy as np
import pytest
from support.data import shard_samples, write_shard

from dbcache import DBCache, DBCacheError, get_uuid
from shardcache.errors import ShardcacheError


def make_samples(n, url="http://h/a.tar", start=0):
    return [
        {"__key__": f"s{i:05d}", "__url__": url, "jpg": os.urandom(32), "cls": i}
        for i in range(start, start + n)
    ]


class Counting:
    """A re-iterable source that counts how many samples were taken from it."""

    def __init__(self, samples):
        self.samples = samples
        self.taken = 0

    def __iter__(self):
        for sample in self.samples:
            self.taken += 1
            yield sample


def keys(samples):
    return [s["__key__"] for s in samples]


def test_get_uuid_is_uuid3_of_url_namespace():
    import uuid

    assert get_uuid("a/b") == str(uuid.uuid3(uuid.NAMESPACE_URL, "a/b"))
    assert get_uuid(b"a/b") == get_uuid("a/b")


def test_first_pass_stores_and_yields_then_reads_from_the_file(tmp_path):
    data = make_samples(50)
    source = Counting(data)
    cache = DBCache(tmp_path / "v.db", 20, source, batch_size=8)
    first = list(cache)
    assert keys(first) == keys(data[:20])
    assert len(cache) == 20
    taken = source.taken
    assert taken <= 20 + 8  # stops reading the source once full
    second = list(cache)
    assert source.taken == taken  # no source used
    assert second == data[:20]  # decoded samples equal the originals
    # a fresh object needs no source at all
    assert list(DBCache(tmp_path / "v.db", 20)) == data[:20]


def test_pass_through_without_a_file(tmp_path):
    data = make_samples(5)
    cache = DBCache(None, 3, data)
    assert list(cache) == data
    assert len(cache) == 5
    assert list(tmp_path.iterdir()) == []


def test_source_smaller_than_size_refills_next_pass(tmp_path, caplog):
    data = make_samples(5)
    cache = DBCache(tmp_path / "v.db", 10, data)
    with caplog.at_level(logging.WARNING):
        assert list(cache) == data
    assert "5 of 10" in caplog.text
    cache.source_(data + make_samples(10, start=5))
    assert keys(cache) == keys(make_samples(10))
    assert len(cache) == 10


def test_duplicates_are_stored_once(tmp_path):
    data = make_samples(10)
    dup = dict(data[3], jpg=b"other")
    other_url = dict(data[3], __url__="http://h/b.tar")  # same key, other shard: distinct
    source = data[:5] + [dup] + data[5:] + [other_url]
    cache = DBCache(tmp_path / "v.db", 20, source, batch_size=4)
    out = list(cache)
    assert len(out) == 11 and len(cache) == 11
    assert cache.key_exists("s00003", "http://h/a.tar")
    assert cache.key_exists(other_url)
    assert not cache.key_exists("s00003", "http://h/c.tar")
    stored = [s for s in cache.dbiter() if s["__key__"] == "s00003"]
    assert {s["__url__"] for s in stored} == {"http://h/a.tar", "http://h/b.tar"}
    assert data[3] in stored  # the first one seen wins


def test_key_exists_by_key_alone_whatever_the_url(tmp_path):
    """The seed API: key_exists(key) is true for any stored sample with that __key__."""
    cache = DBCache(tmp_path / "v.db", 10, make_samples(3, url="http://h/a.tar"))
    list(cache)
    assert cache.key_exists("s00001")  # no url given: the key alone decides
    assert not cache.key_exists("s00009")
    # the optional url still narrows it to one shard's sample
    assert cache.key_exists("s00001", "http://h/a.tar")
    assert not cache.key_exists("s00001", "http://h/b.tar")
    assert not cache.key_exists("s00001", "")
    # samples without __url__ are stored under url ""
    bare = DBCache(tmp_path / "bare.db", 1, [{"__key__": "k", "x": b"1"}])
    list(bare)
    assert bare.key_exists("k") and bare.key_exists("k", "")


def test_a_fill_reads_no_further_than_the_sample_that_fills_the_file(tmp_path):
    source = Counting(make_samples(1000))
    assert len(list(DBCache(tmp_path / "v.db", 30, source))) == 30
    assert source.taken == 30  # not a whole 256-sample batch
    # resuming past samples already held: the fill still completes, one flush or a few
    source = Counting(make_samples(1000))
    path = tmp_path / "w.db"
    list(DBCache(path, 50, make_samples(49)))
    assert len(list(DBCache(path, 50, source))) == 50  # the 49 held, then one more
    assert source.taken <= 64 and len(DBCache(path, 50)) == 50


def test_interrupted_fill_resumes_without_duplicates(tmp_path):
    path = tmp_path / "v.db"
    data = make_samples(100)
    cache = DBCache(path, 60, data, batch_size=10)
    it = iter(cache)
    got = [next(it) for _ in range(25)]
    it.close()  # the training loop stopped mid-pass
    del cache
    held = DBCache(path, 60)
    assert 25 <= len(held) <= 30  # everything yielded is stored
    assert all(held.key_exists(s) for s in got)
    resumed = list(DBCache(path, 60, data, batch_size=10))
    assert keys(resumed) == keys(data[:60])
    final = DBCache(path, 60)
    assert len(final) == 60
    assert list(final) == data[:60]


def test_resume_after_a_killed_process(tmp_path):
    import multiprocessing as mp

    path = str(tmp_path / "v.db")
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_fill_then_die, args=(path,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 17
    held = len(DBCache(path, 100))
    assert held == 40  # four committed batches of ten; the fifth was never committed
    assert keys(DBCache(path, 100, make_samples(200), batch_size=10)) == keys(make_samples(100))
    assert len(DBCache(path, 100)) == 100


def _dying_source():
    for i, sample in enumerate(make_samples(200)):
        if i == 45:
            os._exit(17)  # killed while the fifth batch is being gathered
        yield sample


def _fill_then_die(path):
    for _ in DBCache(path, 100, _dying_source(), batch_size=10):
        pass


def test_insertion_order_and_shuffle_contract(tmp_path):
    path = tmp_path / "v.db"
    data = make_samples(200)
    list(DBCache(path, 200, data))
    ordered = DBCache(path, 200)
    assert keys(ordered) == keys(data) == keys(ordered)
    shuffled = DBCache(path, 200, shuffle=True, seed=7)
    p1, p2 = keys(shuffled), keys(shuffled)
    assert p1 != p2  # a new order each pass
    assert sorted(p1) == sorted(p2) == keys(data)  # the same samples
    again = DBCache(path, 200, shuffle=True, seed=7)
    assert [keys(again), keys(again)] == [p1, p2]  # seedable
    assert keys(DBCache(path, 200, shuffle=True, seed=8)) != p1


def test_worker_shares_are_disjoint_and_complete(tmp_path):
    path = tmp_path / "v.db"
    list(DBCache(path, 30, make_samples(30)))
    for shuffle in (False, True):
        parts = [
            keys(DBCache(path, 30, shuffle=shuffle, seed=1).dbiter(worker=(i, 4))) for i in range(4)
        ]
        flat = [k for part in parts for k in part]
        assert sorted(flat) == keys(make_samples(30))


def test_mixed_layouts_round_trip_in_order_shuffled_and_in_shares(tmp_path):
    shapes = [
        lambda i: {"__key__": f"k{i:04d}", "jpg": os.urandom(40), "cls": i},
        lambda i: {"__url__": "u", "__key__": f"k{i:04d}"},
        lambda i: {"txt": f"t{i}", "__key__": f"k{i:04d}", "a": b"1", "b": b"", "meta": [i]},
        lambda i: {"__key__": f"k{i:04d}", "__url__": "u", "jpg": os.urandom(9), "x": None},
    ]
    data = [shapes[i % len(shapes)](i) for i in range(60)]
    path = tmp_path / "v.db"
    assert list(DBCache(path, 60, data, batch_size=7)) == data
    with sqlite3.connect(path) as conn:
        layouts = conn.execute("SELECT id, fields FROM layouts ORDER BY id").fetchall()
        used = conn.execute("SELECT layout FROM samples ORDER BY id LIMIT 4").fetchall()
    conn.close()
    assert len(layouts) == len(shapes) == len({f for _, f in layouts})  # each stored once
    assert [u for (u,) in used] == [i for i, _ in layouts]
    assert list(DBCache(path, 60)) == data
    shuffled = list(DBCache(path, 60, shuffle=True, seed=3))
    assert shuffled != data and sorted(shuffled, key=lambda s: s["__key__"]) == data
    shares = [list(DBCache(path, 60).dbiter(worker=(w, 3))) for w in range(3)]
    assert sorted((s for share in shares for s in share), key=lambda s: s["__key__"]) == data


@pytest.mark.parametrize("nfields", [1, 255, 256, 257, 600])
def test_samples_with_many_fields_round_trip(tmp_path, nfields):
    data = [
        {"__key__": f"s{i}", **{f"f{j}": bytes([j % 256]) * (j % 3) for j in range(nfields)}}
        for i in range(3)
    ]
    data[1]["__url__"] = "u"  # a second layout
    path = tmp_path / "v.db"
    list(DBCache(path, 3, data))
    back = list(DBCache(path, 3))
    assert back == data and [list(s) for s in back] == [list(s) for s in data]


def test_field_names_are_data_never_code(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda cmd: calls.append(cmd) or 0)
    names = [
        "__import__('os').system('x')",
        "k0",  # the builder's own identifiers, as names
        "a1",
        "a[0]",
        "}, **{'y': 1}, 'z': {",
        "\n    return None\n",
        "__builtins__",
    ]
    data = [
        {"__key__": f"s{i}", **{name: f"{name}{i}".encode() for name in names}, "cls": i}
        for i in range(3)
    ]
    path = tmp_path / "v.db"
    list(DBCache(path, 3, data))
    back = list(DBCache(path, 3))
    assert back == data and [list(s) for s in back] == [list(s) for s in data]
    assert calls == []
    # the same names in a layout written straight into the file: plain keys, nothing runs
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE samples SET data = X'' WHERE id = 1")  # a one-field layout:
        conn.execute(
            "INSERT INTO layouts (id, fields) VALUES (9, ?)",
            (
                b"SC\x02"
                + b"".join(
                    len(n.encode()).to_bytes(4, "little") + bytes([k]) + n.encode()
                    for n, k in [("__key__", 4), (names[0], 3)]
                ),
            ),
        )
        conn.execute("UPDATE samples SET layout = 9 WHERE id = 1")
        (payload,) = conn.execute("SELECT payload FROM samples WHERE id = 1").fetchone()
    conn.close()
    first = next(iter(DBCache(path, 3)))
    assert first == {"__key__": "s0", names[0]: payload} and list(first)[1] == names[0]
    assert calls == []


def test_numpy_and_nested_fields_round_trip_through_the_file(tmp_path):
    sample = {
        "__key__": "a",
        "__url__": "u",
        "img": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "json": {"label": 3, "tags": ["x", None, 1.5, True]},
    }
    list(DBCache(tmp_path / "v.db", 1, [sample]))
    (back,) = DBCache(tmp_path / "v.db", 1)
    np.testing.assert_array_equal(back["img"], sample["img"])
    assert back["json"] == sample["json"]


def test_unsupported_value_raises_type_error_naming_file_sample_and_field(tmp_path):
    bad = {"__key__": "k1", "__url__": "u", "x": {1, 2}}
    cache = DBCache(tmp_path / "v.db", 2, [bad])
    with pytest.raises(TypeError) as info:
        list(cache)
    text = str(info.value)
    assert "v.db" in text and "'k1'" in text and "'x'" in text and "set" in text
    assert len(cache) == 0


def test_samples_must_be_identifiable(tmp_path):
    with pytest.raises(ValueError, match="__key__"):
        list(DBCache(tmp_path / "v.db", 2, [{"x": b""}]))
    with pytest.raises(TypeError, match="dicts"):
        list(DBCache(tmp_path / "w.db", 2, [(b"a", 1)]))


def test_pickle_codec_is_explicit(tmp_path):
    path = tmp_path / "p.db"
    data = [{"__key__": "a", "__url__": "", "s": {1, 2}}]
    assert list(DBCache(path, 1, data, codec="pickle")) == data
    assert list(DBCache(path, 1, codec="pickle")) == data
    with pytest.raises(DBCacheError) as info:
        DBCache(path, 1)
    assert str(path) in str(info.value)
    assert "codec 'pickle'" in str(info.value) and "trust" in str(info.value)


class Payload:
    """Unpickling this creates the file ``target``."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_tampered_row_does_not_execute(tmp_path):
    path = tmp_path / "v.db"
    marker = tmp_path / "pwned"
    list(DBCache(path, 3, make_samples(3)))

    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Payload(str(proof))))
    assert proof.exists()  # the payload does run when unpickled
    payload = pickle.dumps({"__key__": "s00001", "x": Payload(str(marker))})
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO layouts (id, fields) VALUES (7, ?)", (payload,))
        conn.execute("UPDATE samples SET layout = 7 WHERE key = 's00001'")
    cache = DBCache(path, 3)
    with pytest.raises(DBCacheError) as info:
        list(cache)
    text = str(info.value)
    assert str(path) in text and "row 2" in text and "not a safe-codec row" in text
    assert "'s00001'" in text and "pickle" in text
    assert not marker.exists()
    # a pickle in a bytes column is only ever handed back as bytes
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE samples SET layout = (SELECT layout FROM samples WHERE id = 1)")
        conn.execute("UPDATE samples SET payload = ?, data = ? WHERE id = 2", (payload, payload))
    with pytest.raises(DBCacheError, match=r"row 2 .*field 'cls'"):
        list(DBCache(path, 3))  # cls is an int: its tagged form is checked, never unpickled
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE samples SET data = (SELECT data FROM samples WHERE id = 1)")
    assert [s["jpg"] for s in DBCache(path, 3)][1] == payload
    assert not marker.exists()
    # the meta row can be tampered too: switching the codec to pickle is refused
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = 'pickle' WHERE key = 'codec'")
    with pytest.raises(DBCacheError, match="codec 'pickle'"):
        list(DBCache(path, 3))
    assert not marker.exists()


def test_truncated_row_names_file_and_row(tmp_path):
    path = tmp_path / "v.db"
    list(DBCache(path, 3, make_samples(3)))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE samples SET data = substr(data, 1, 5) WHERE id = 3")
    with pytest.raises(DBCacheError, match=r"v\.db: row 3 \(__key__ 's00002'.*record truncated"):
        list(DBCache(path, 3))


def test_damaged_columns_name_the_problem(tmp_path):
    path = tmp_path / "v.db"
    samples = [dict(s, txt="hello", extra=b"xyz") for s in make_samples(3)]
    list(DBCache(path, 3, samples))
    assert list(DBCache(path, 3)) == samples
    cases = [
        ("payload = NULL", "payload column holds NoneType, expected bytes"),
        ("data = substr(data, 1, 12)", "record truncated"),
        ("data = CAST('x' AS TEXT)", "data column holds a str"),
        ("key = CAST('s00002' AS BLOB)", "url/key columns hold str/bytes"),
        ("layout = 99", "layout 99 is not in the layouts table"),
        ("layout = 2", "empty field table", "INSERT INTO layouts VALUES (2, X'534302')"),
        ("layout = 2", "unknown kind 9", "INSERT INTO layouts VALUES (2, X'53430201000000096b')"),
        ("layout = 2", "fields column holds a str", "INSERT INTO layouts VALUES (2, 'text')"),
    ]
    for change, message, *before in cases:
        damaged = tmp_path / "d.db"
        damaged.write_bytes(path.read_bytes())
        _sqlite_with(damaged, *before, f"UPDATE samples SET {change} WHERE id = 3")
        with pytest.raises(DBCacheError, match=r"d\.db: .*" + re.escape(message)):
            list(DBCache(damaged, 3))


def _sqlite_with(path, *statements):
    with sqlite3.connect(path) as conn:
        for stmt in statements:
            conn.execute(stmt)
    conn.close()


@pytest.mark.parametrize(
    "setup, size, message",
    [
        (lambda p: p.write_bytes(b"this is not a database" * 100), 5, "not an SQLite database"),
        (lambda p: p.write_bytes(os.urandom(4096)), 5, "not an SQLite database"),
        (
            lambda p: _sqlite_with(p, "CREATE TABLE users (name TEXT)"),
            5,
            "not a DBCache file",
        ),
        (
            lambda p: _sqlite_with(
                p,
                "CREATE TABLE samples (id INTEGER PRIMARY KEY)",
                "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
                "INSERT INTO meta VALUES ('format', 'something.else')",
            ),
            5,
            "not a DBCache file",
        ),
        (lambda p: p.mkdir(), 5, "cannot open"),
        (lambda p: None, None, "no such file"),
    ],
)
def test_bad_files(tmp_path, setup, size, message):
    path = tmp_path / "bad.db"
    setup(path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(DBCacheError) as info:
        DBCache(path, size)
    assert str(path) in str(info.value)
    assert message in str(info.value)
    assert isinstance(info.value, ShardcacheError)
    if before is not None:
        assert path.read_bytes() == before  # never written to


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("format_version", "1", "format version 1 was written by an older dbcache"),
        ("format_version", "2", "format version 2 was written by an older dbcache"),
        ("format_version", "4", "unsupported format version '4'"),
        ("size", "many", "bad size in metadata"),
        ("codec", "msgpack", "written with codec 'msgpack'"),
    ],
)
def test_incompatible_metadata(tmp_path, key, value, message):
    path = tmp_path / "v.db"
    list(DBCache(path, 2, make_samples(2)))
    _sqlite_with(path, f"UPDATE meta SET value = '{value}' WHERE key = '{key}'")
    with pytest.raises(DBCacheError) as info:
        DBCache(path, None)
    assert str(path) in str(info.value) and message in str(info.value)


def test_a_format_2_file_is_refused_untouched(tmp_path):
    path = tmp_path / "old.db"
    _sqlite_with(
        path,
        "CREATE TABLE samples (id INTEGER PRIMARY KEY, url TEXT NOT NULL, key TEXT NOT NULL,"
        " fields BLOB NOT NULL, data BLOB NOT NULL, payload BLOB)",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
        "INSERT INTO meta VALUES ('format', 'shardcache.dbcache'), ('format_version', '2'),"
        " ('codec', 'safe'), ('size', '1')",
        "INSERT INTO samples VALUES (1, '', 'a', X'5343020300000000636c73', X'31', NULL)",
    )
    before = path.read_bytes()
    for size in (None, 1):
        with pytest.raises(DBCacheError) as info:
            DBCache(path, size)
        assert str(path) in str(info.value)
        assert "format version 2 was written by an older dbcache" in str(info.value)
    assert path.read_bytes() == before


def test_size_mismatch_and_missing_source(tmp_path):
    path = tmp_path / "v.db"
    list(DBCache(path, 5, make_samples(3)))
    with pytest.raises(DBCacheError, match="holds a cache of size 5, opened with size 6"):
        DBCache(path, 6)
    assert DBCache(path, None).size == 5
    with pytest.raises(DBCacheError, match="holds 3 of 5 samples and has no source"):
        list(DBCache(path, 5))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="size"):
        DBCache(tmp_path / "v.db", 0)
    with pytest.raises(ValueError, match="unknown codec"):
        DBCache(tmp_path / "v.db", 1, codec="json")
    assert not (tmp_path / "v.db").exists()


def test_metadata(tmp_path):
    path = tmp_path / "v.db"
    cache = DBCache(path, 4)
    assert cache.getmeta("size") == "4"
    assert cache.getmeta("codec") == "safe"
    assert cache.getmeta("format_version") == "3"
    assert cache.getmeta("missing") is None
    assert cache.getmeta("missing", "d") == "d"
    cache.setmeta("origin", "http://h/val-{0..9}.tar")
    cache.setmeta("origin", "http://h/val-{0..3}.tar")
    assert DBCache(path, 4).getmeta("origin") == "http://h/val-{0..3}.tar"
    with pytest.raises(ValueError, match="fixed"):
        cache.setmeta("size", "10")
    with pytest.raises(TypeError, match="str"):
        cache.setmeta("n", 3)


def test_wal_mode_and_batched_commits(tmp_path):
    path = tmp_path / "v.db"
    cache = DBCache(path, 100, make_samples(100), batch_size=25)
    commits = []
    cache.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    list(cache)
    assert len(commits) == 4
    assert cache.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_pickled_object_reopens_its_connection(tmp_path):
    path = tmp_path / "v.db"
    cache = DBCache(path, 3, make_samples(3))
    list(cache)
    clone = pickle.loads(pickle.dumps(cache))
    assert list(clone) == list(cache)


def test_verbose_logs_progress(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dbcache"):
        list(DBCache(tmp_path / "v.db", 3, make_samples(3)))
    assert "full with 3 samples" in caplog.text


# -- with real webdataset pipelines over real tar files ------------------------------------


def test_after_a_webdataset_pipeline(tmp_path):
    wds = pytest.importorskip("webdataset")
    shards = shard_samples(3, 20)
    for k, samples in enumerate(shards):
        write_shard(tmp_path / f"val-{k}.tar", samples)
    urls = str(tmp_path / "val-{0..2}.tar")
    dataset = wds.WebDataset(urls, shardshuffle=False)
    cache = DBCache(tmp_path / "v.db", 45, source=dataset)
    first = list(cache)
    assert len(first) == 45
    for k in range(3):
        os.unlink(tmp_path / f"val-{k}.tar")  # later passes need no shards
    second = list(cache)
    assert keys(second) == keys(first)
    flat = [s for shard in shards for s in shard][:45]
    for got, want in zip(second, flat, strict=True):
        assert got["jpg"] == want["jpg"] and got["cls"] == want["cls"]
        assert got["__url__"].endswith(".tar")


def test_as_a_stage_of_a_webdataset_pipeline(tmp_path):
    wds = pytest.importorskip("webdataset")
    write_shard(tmp_path / "val-0.tar", shard_samples(1, 10)[0])
    url = str(tmp_path / "val-0.tar")
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(url),
        wds.tarfile_to_samples(),
        DBCache(tmp_path / "v.db", 10),
        wds.map(lambda s: int(s["cls"])),
    )
    assert list(pipeline) == list(range(10))
    os.unlink(url)
    reread = wds.DataPipeline(DBCache(tmp_path / "v.db", 10), wds.map(lambda s: int(s["cls"])))
    assert list(reread) == list(range(10))


def test_an_existing_file_opens_by_its_name_alone(tmp_path):
    """``DBCache(path)``: the size the file records, without ``size=None``; a file that
    does not exist yet needs a size, and the error says so."""
    path = str(tmp_path / "v.sqlite")
    with pytest.raises(DBCacheError, match="give a size"):
        DBCache(path)
    first = list(DBCache(path, size=3, source=({"__key__": str(i), "x": b"a"} for i in range(5))))
    again = DBCache(path)
    assert again.size == 3
    assert [s["__key__"] for s in again] == [s["__key__"] for s in first]
