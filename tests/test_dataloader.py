"""ShardDataset and DBCache read by a torch DataLoader with worker processes.

torch is an optional extra (``pip install '.[torch]'``): `make test` does not install it
(PyPI's torch brings some 4 GiB of CUDA libraries), so these tests skip there; `make
test-clients` runs them in the clients' venv, which has torch already, and `make test-torch`
(or `make test TORCH=1`) installs the extra into .venv.
"""

from __future__ import annotations

import importlib.util

import pytest
from support.data import shard_samples, write_shard

from dbcache import DBCache

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed: `make test-torch` or `make test-clients` run the "
        "DataLoader tests (pip install '.[torch]')",
    ),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]


@pytest.fixture
def shards(tmp_path):
    """Four local tar shards of 25 samples each; returns (brace pattern, all keys)."""
    root = tmp_path / "shards"
    root.mkdir()
    keys = []
    for k, part in enumerate(shard_samples(4, 25)):
        write_shard(root / f"val-{k}.tar", part)
        keys += [s["__key__"] for s in part]
    return str(root / "val-{0..3}.tar"), keys


def test_shard_dataset_in_workers_reads_each_sample_once(shards):
    from torch.utils.data import DataLoader, IterableDataset

    from shardcache import ShardDataset

    pattern, keys = shards
    ds = ShardDataset(pattern, shuffle=True, seed=3)
    assert isinstance(ds, IterableDataset)
    got = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(keys)


def test_dbcache_in_workers_reads_each_stored_sample_once(shards, tmp_path):
    """A full DBCache as the first stage of a webdataset pipeline read by DataLoader
    workers: each worker reads its own share."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from shardcache import ShardDataset

    pattern, keys = shards
    db = tmp_path / "val.db"
    filled = [s["__key__"] for s in DBCache(db, 60, ShardDataset(pattern), verbose=False)]
    assert filled == keys[:60]
    for workers in (2, 3):
        pipeline = wds.DataPipeline(DBCache(db, 60, verbose=False))
        loader = DataLoader(pipeline, batch_size=None, num_workers=workers)
        got = [s["__key__"] for s in loader]
        assert sorted(got) == sorted(keys[:60]), workers
