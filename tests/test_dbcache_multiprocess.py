"""Several processes fill and read one DBCache file at once."""

import multiprocessing as mp
import sqlite3

import pytest

from dbcache import DBCache

NPROC = 4
PER_PROC = 1000
OVERLAP = 200  # each process also sees 200 samples of its neighbour's shard
SIZE = 2500


def source(index):
    def samples(shard, keys):
        for k in keys:
            sample = {"__key__": f"{k:05d}", "__url__": f"http://h/shard-{shard}.tar"}
            # three layouts, met first in a different order by each process
            sample.update({("x", "y", "z")[(k + shard) % 3]: b"v" * 64})
            yield sample

    yield from samples(index, range(PER_PROC - OVERLAP))
    yield from samples((index + 1) % NPROC, range(OVERLAP))  # the neighbour's first ones


def fill(path, index, barrier, results):
    barrier.wait(120)  # all open (and create) the new file at once
    cache = DBCache(path, SIZE, source(index), verbose=False, batch_size=50)
    yielded = [(s["__url__"], s["__key__"]) for s in cache]
    barrier.wait(120)
    # second pass, all at once, from the file
    again = [(s["__url__"], s["__key__"]) for s in DBCache(path, SIZE, verbose=False)]
    results.put((index, yielded, again))


@pytest.mark.slow
def test_concurrent_fill_holds_exactly_size_distinct_samples(tmp_path):
    path = str(tmp_path / "v.db")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(NPROC)
    results = ctx.Queue()
    procs = [ctx.Process(target=fill, args=(path, i, barrier, results)) for i in range(NPROC)]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=240) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT url, key FROM samples").fetchall()
        layouts = conn.execute("SELECT fields FROM layouts").fetchall()
    conn.close()
    assert len(layouts) == 3  # the processes agreed on one id per layout
    stored = set(rows)
    assert len(rows) == SIZE == len(stored)  # exactly size, no duplicates
    yielded = [pair for _, first, _ in got for pair in first]
    # every process yields only stored samples; together they yield each stored one
    assert set(yielded) == stored
    for _, first, _ in got:
        assert len(first) == len(set(first))
    for _, _, again in got:
        assert len(again) == SIZE and set(again) == stored
