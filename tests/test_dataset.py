"""DataSource implementations, node/worker splitting, ShardDataset, and the demo command."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support.httporigin import Origin

from shardcache.errors import ConfigError, HTTPStatusError, IncompleteDownloadError
from shardcache.sources import CachedSource, DataSource, URLSource
from shardcache.store import Store
from shardcache.workers import WorkerEnvironment, split_by_node, split_by_worker

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def tar_bytes(shard: int, n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            for ext, data in (("cls", b"%d" % i), ("txt", b"shard %d sample %d" % (shard, i))):
                info = tarfile.TarInfo(f"s{shard:03d}/k{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def shards_dir(tmp_path) -> Path:
    d = tmp_path / "shards"
    d.mkdir()
    for s in range(6):
        (d / f"train-{s:06d}.tar").write_bytes(tar_bytes(s, 5 + s))
    return d


@pytest.fixture
def origin():
    with Origin({f"train-{s:06d}.tar": tar_bytes(s, 5 + s) for s in range(6)}) as o:
        yield o


def all_keys() -> set[str]:
    return {f"s{s:03d}/k{i:04d}" for s in range(6) for i in range(5 + s)}


# -- sources -----------------------------------------------------------------------------


def test_url_source_brace_pattern(shards_dir):
    src = URLSource(str(shards_dir / "train-{000000..000005}.tar"))
    assert isinstance(src, DataSource)
    ids = src.list_shards()
    assert len(ids) == 6 and ids[0].endswith("train-000000.tar")
    with src.open_shard(ids[2]) as f:
        assert f.read() == (shards_dir / "train-000002.tar").read_bytes()
    pairs = list(src.shards)
    assert [i for i, _ in pairs] == ids
    for _, stream in pairs:
        stream.close()
    with pytest.raises(KeyError):
        src.open_shard(str(shards_dir / "train-000099.tar"))


def test_cached_source_over_http(origin, tmp_path):
    pattern = origin.url("train-{000000..000005}.tar")
    for _ in range(2):
        src = CachedSource(pattern, tmp_path / "cache")
        assert isinstance(src, DataSource)
        for sid, stream in src.shards:
            assert stream.read() == origin.files[sid.rsplit("/", 1)[1]]
            stream.close()
    assert set(origin.requests.values()) == {1}
    with pytest.raises(KeyError):
        src.open_shard(origin.url("nope.tar"))
    assert Store(tmp_path / "cache").stats()["entries"] == 6


def test_cached_source_over_a_custom_source(tmp_path):
    class Mem:
        """A DataSource whose shard ids are not URLs."""

        def __init__(self):
            self.data = {"mem://a": b"A" * 100, "mem://b": b"B" * 50}
            self.opened = 0

        @property
        def shards(self):
            return ((k, self.open_shard(k)) for k in self.data)

        def list_shards(self):
            return list(self.data)

        def open_shard(self, shard_id):
            self.opened += 1
            return io.BytesIO(self.data[shard_id])

    mem = Mem()
    src = CachedSource(mem, tmp_path, cache_size=1000)
    for _ in range(3):
        assert {k: s.read() for k, s in src.shards} == mem.data
    assert mem.opened == 2


def test_cached_source_never_caches_a_short_shard(origin, tmp_path):
    origin.drop_after["train-000003.tar"] = 1000
    src = CachedSource(origin.url("train-{000000..000005}.tar"), tmp_path)
    with pytest.raises((IncompleteDownloadError, HTTPStatusError, OSError)):
        src.open_shard(origin.url("train-000003.tar")).read()
    assert Store(tmp_path).get(origin.url("train-000003.tar")) is None


# -- workers -----------------------------------------------------------------------------


def test_split_by_node_and_worker_partition_the_shards():
    urls = [f"u{i}" for i in range(23)]
    seen = []
    for rank in range(2):
        for worker in range(3):
            env = WorkerEnvironment(rank=rank, world_size=2, worker=worker, num_workers=3)
            seen.extend(split_by_worker(split_by_node(urls, env), env))
    assert sorted(seen) == sorted(urls)


def test_environment_from_variables():
    env = WorkerEnvironment.detect(
        {"RANK": "1", "WORLD_SIZE": "4", "WORKER": "2", "NUM_WORKERS": "3"}
    )
    if "torch" not in sys.modules:
        assert env == WorkerEnvironment(1, 4, 2, 3)
    assert WorkerEnvironment.detect({}).world_size >= 1
    with pytest.raises(ConfigError, match="RANK"):
        WorkerEnvironment.detect({"RANK": "one"})
    with pytest.raises(ConfigError, match="rank 5 of world size 2"):
        WorkerEnvironment.detect({"RANK": "5", "WORLD_SIZE": "2"})


def test_detect_does_not_import_torch():
    code = (
        "import sys; from shardcache.workers import WorkerEnvironment; "
        "import shardcache; WorkerEnvironment.detect(); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- ShardDataset --------------------------------------------------------------------------


def keys_of(ds) -> list[str]:
    return [s["__key__"] for s in ds]


def test_dataset_reads_every_sample_once(shards_dir):
    from shardcache.dataset import ShardDataset

    ds = ShardDataset(str(shards_dir / "train-{000000..000005}.tar"), env=WorkerEnvironment())
    keys = keys_of(ds)
    assert len(keys) == len(set(keys)) and set(keys) == all_keys()
    sample = next(iter(ds))
    assert set(sample) == {"__key__", "__url__", "cls", "txt"}


def test_dataset_shuffle_is_reproducible_and_splits_are_disjoint(shards_dir):
    from shardcache.dataset import ShardDataset

    pattern = str(shards_dir / "train-{000000..000005}.tar")
    base = ShardDataset(pattern, shuffle=True, seed=7, env=WorkerEnvironment())
    assert base.shard_urls() == ShardDataset(pattern, shuffle=True, seed=7).shard_urls(
        WorkerEnvironment()
    )
    assert base.shard_urls() != sorted(base.shard_urls())  # seed 7 reorders 6 shards
    base.set_epoch(1)
    epoch1 = base.shard_urls()
    assert sorted(epoch1) == sorted(base.urls) and epoch1 != ShardDataset(
        pattern, shuffle=True, seed=7
    ).shard_urls(WorkerEnvironment())
    keys = []
    for rank in range(2):
        for worker in range(2):
            env = WorkerEnvironment(rank, 2, worker, 2)
            keys += keys_of(ShardDataset(pattern, shuffle=True, seed=3, env=env))
    assert sorted(keys) == sorted(all_keys())


def test_dataset_with_cache(origin, tmp_path):
    from shardcache.dataset import ShardDataset

    ds = ShardDataset(
        origin.url("train-{000000..000005}.tar"), cache_dir=tmp_path, env=WorkerEnvironment()
    )
    first, second = keys_of(ds), keys_of(ds)
    assert first == second and set(first) == all_keys()
    assert set(origin.requests.values()) == {1}


def test_dataset_handler_skips_a_broken_shard(origin, tmp_path):
    from shardcache.dataset import ShardDataset
    from shardcache.handlers import ignore_and_continue

    origin.drop_after["train-000002.tar"] = 700
    urls = origin.url("train-{000000..000005}.tar")
    with pytest.raises(OSError, match="train-000002.tar"):
        keys_of(ShardDataset(urls, cache_dir=tmp_path, env=WorkerEnvironment()))
    keys = keys_of(
        ShardDataset(urls, cache_dir=tmp_path, handler=ignore_and_continue, env=WorkerEnvironment())
    )
    assert set(keys) == {k for k in all_keys() if not k.startswith("s002/")}
    assert Store(tmp_path).get(origin.url("train-000002.tar")) is None


def test_dataset_dbcache_fills_then_reads_without_the_shards(shards_dir, tmp_path):
    from dbcache import DBCache
    from shardcache.dataset import ShardDataset

    paths = [str(shards_dir / f"train-{s:06d}.tar") for s in range(2)]  # 5 + 6 samples
    db = tmp_path / "v.sqlite"
    cache = ShardDataset(paths).dbcache(db, 8, verbose=False)
    assert isinstance(cache, DBCache)
    first = list(cache)  # the filling pass reads the shards and stops at the size
    assert len(first) == 8 and len(cache) == 8
    assert [s["__key__"] for s in first[:5]] == [f"s000/k{i:04d}" for i in range(5)]
    assert first[5]["txt"] == b"shard 1 sample 0"
    for path in paths:
        Path(path).unlink()
    second = list(ShardDataset(paths).dbcache(db, 8, verbose=False))
    assert second == first  # read from the file, the shards are gone
    assert list(DBCache(db, None)) == first


def test_dataset_is_plain_iterable_without_torch(shards_dir):
    code = (
        "import sys, builtins\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'torch' else real(n, *a)\n"
        "from shardcache.dataset import ShardDataset\n"
        "assert ShardDataset.__mro__[1] is object\n"
        f"ds = ShardDataset({str(shards_dir / 'train-000001.tar')!r})\n"
        "print(len(list(ds)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "6"


@pytest.mark.torch
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install '.[torch]')")
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_torch_dataloader_with_workers_reads_each_sample_once(origin, tmp_path):
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from shardcache.dataset import ShardDataset

    ds = ShardDataset(
        origin.url("train-{000000..000005}.tar"), shuffle=True, seed=1, cache_dir=tmp_path / "cache"
    )
    assert isinstance(ds, IterableDataset)
    for _ in range(2):  # a cold and a warm epoch
        loader = DataLoader(ds, batch_size=None, num_workers=3)
        keys = [s["__key__"] for s in loader]
        assert sorted(keys) == sorted(all_keys())
    assert set(origin.requests.values()) == {1}
    assert torch.utils.data.get_worker_info() is None


# -- demo --------------------------------------------------------------------------------


def test_demo_command(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcache",
            "demo",
            "--library",
            "--shards",
            "3",
            "--samples",
            "20",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pass1 = next(line for line in lines if line.startswith("pass 1"))
    pass2 = next(line for line in lines if line.startswith("pass 2"))
    assert "60 samples" in pass1 and "origin requests: 3" in pass1 and "cache hits: 0" in pass1
    assert "origin requests: 0" in pass2 and "cache hits: 3" in pass2
