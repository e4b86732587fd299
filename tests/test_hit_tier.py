"""What a hit does not derive again: the header block of the whole-object answer kept
with the entry (rebuilt whenever what it is made from changes, the same headers the
per-request path builds), and the time of a log line made once a second."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy import logs
from proxy.answer import HIT_FIELDS, _with_fields, whole_headers
from proxy.decide import XCache
from proxy.hits import ITEM_OVERHEAD, HitTier
from proxy.policy import confine
from shardcache.store import Entry, Store


def entry(tmp_path: Path, **changes: object) -> Entry:
    values: dict = dict(
        key="k1",
        url="http://origin/a.tar",
        path=tmp_path / "k1",
        size=4,
        etag='"v1"',
        last_modified="Tue, 03 Nov 2026 10:00:00 GMT",
        content_type="application/x-tar",
        created=1.0,
        last_access=1.0,
        hits=0,
        validated=1.0,
        fields=(("Cache-Control", "max-age=60"), ("X-Meta", "one")),
    )
    values.update(changes)
    return Entry(**values)


def test_kept_until_what_it_was_made_from_changes(tmp_path: Path) -> None:
    tier = HitTier(store=None)  # type: ignore[arg-type]
    e = entry(tmp_path)
    assert tier.kept(e) is None
    tier.keep(e, "block")
    # the same entry read again (a new object, other access times): still kept
    assert tier.kept(entry(tmp_path, last_access=9.0, hits=3, validated=5.0)) == "block"
    # a 304 that brought new fields, a new version, a new type: made afresh
    assert tier.kept(entry(tmp_path, fields=(("X-Meta", "two"),))) is None
    assert tier.kept(entry(tmp_path, etag='"v2"')) is None
    assert tier.kept(entry(tmp_path, size=5)) is None
    assert tier.kept(entry(tmp_path, content_type="text/plain")) is None
    assert tier.kept(entry(tmp_path, last_modified=None)) is None


def test_kept_is_bounded_oldest_first(tmp_path: Path) -> None:
    tier = HitTier(store=None)  # type: ignore[arg-type]
    tier.max_kept = 3
    entries = [entry(tmp_path, key=f"k{i}") for i in range(5)]
    for i, e in enumerate(entries):
        tier.keep(e, i)
    assert [tier.kept(e) for e in entries] == [None, None, 2, 3, 4]


@pytest.mark.parametrize(
    "fields",
    [
        (),
        (("Cache-Control", "max-age=60"), ("X-Meta", "one"), ("X-Meta", "two")),
        # stored fields the proxy's own replace: never sent twice
        (("Age", "100"), ("X-Cache", "MISS"), ("Accept-Ranges", "none"), ("ETag", '"old"')),
        (("Content-Type", "text/plain"), ("Content-Encoding", "gzip"), ("Content-MD5", "x")),
    ],
)
@pytest.mark.parametrize("etag", ['"v1"', None])
def test_the_kept_block_is_what_each_answer_built(
    tmp_path: Path, fields: tuple, etag: str | None
) -> None:
    meta = entry(tmp_path, fields=fields, etag=etag).meta
    own = {"X-Cache": XCache.HIT, "Accept-Ranges": "bytes"}
    if meta.etag:
        own["ETag"] = meta.etag
    own["Last-Modified"] = meta.last_modified
    own["Age"] = "7"
    own["Content-Type"] = meta.content_type
    built = _with_fields(meta, own, None)  # what a hit's 200 answer was made of
    confine(built)  # with the fields of every answer of an upstream's bytes
    block = whole_headers(meta, XCache.HIT, HIT_FIELDS).copy()
    block.update({"Age": "7"})
    assert sorted((k.lower(), str(v)) for k, v in block.items()) == sorted(
        (k.lower(), str(v)) for k, v in built.items()
    )


def test_the_log_formatter_writes_what_logging_writes() -> None:
    """The daemon's formatter makes a line's time once a second; its lines are the
    standard formatter's, across second boundaries and out-of-order records alike."""
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    ours, standard = logs.Formatter(fmt), logging.Formatter(fmt)
    base = 1_790_000_000.0
    for created in [base, base + 0.001, base + 0.999, base + 1.0, base + 0.5, base + 3600.25]:
        record = logging.LogRecord(
            "shardcache.access", logging.INFO, __file__, 1, "m %d", (1,), None
        )
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == standard.format(record)
    dated = logs.Formatter(fmt, datefmt="%H:%M")
    assert dated.format(record) == logging.Formatter(fmt, datefmt="%H:%M").format(record)


def test_a_full_tier_takes_an_entry_in_on_its_second_read(tmp_path: Path) -> None:
    """Small entries read once each (a pass over more of them than the RAM tier holds)
    do not push out the ones it holds; an entry read again while it is full goes in,
    the least recently used out. Every read answers the file's bytes."""
    store = Store(tmp_path / "cache", 1 << 30)
    try:
        entries = []
        for i in range(6):
            url = f"http://origin/s{i}.tar"
            part = store.begin(url, 1000)
            Path(part.path).write_bytes(bytes([i]) * 1000)
            entries.append(store.commit(part, 1000))
        tier = HitTier(store, max_bytes=3 * (1000 + ITEM_OVERHEAD))
        for e in entries[:3]:
            assert tier.load(e) == bytes([entries.index(e)]) * 1000
        assert len(tier) == 3  # room for three
        for e in entries[3:]:  # read once each: not taken in
            assert tier.load(e) == bytes([entries.index(e)]) * 1000
        assert len(tier) == 3
        assert all(tier.small(e) is not None for e in entries[:3])
        assert all(tier.small(e) is None for e in entries[3:])
        assert tier.load(entries[4]) == bytes([4]) * 1000  # its second read: taken in
        assert tier.small(entries[4]) == bytes([4]) * 1000
        assert tier.small(entries[0]) is None  # the least recently used went out
        assert len(tier) == 3 and tier.bytes <= tier.max_bytes
    finally:
        store.close()
