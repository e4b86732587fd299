"""The public API changes only on purpose: this test pins ``shardcache.__all__``."""

import subprocess
import sys

import pytest

import shardcache

pytestmark = pytest.mark.fast

EXPECTED = {
    "__version__",
    # errors
    "ShardcacheError", "GopenError", "GopenException", "HTTPStatusError", "ShardFormatError",
    "ProxyURLError", "CacheError", "IncompleteDownloadError", "NoRoomError", "DBCacheError",
    "ConfigError", "ProxyError", "BadRequest", "Forbidden", "NotFound", "MethodNotAllowed",
    "RangeNotSatisfiable", "UpstreamError", "UpstreamTimeout",
    # urls
    "shard_uuid", "guess_shard", "expand_urls", "shardlist", "proxied",
    # gopen and handlers
    "gopen", "reraise_exception", "ignore_and_continue", "ignore_and_stop",
    "warn_and_continue", "warn_and_stop",
    # tar pipeline
    "base_plus_ext", "valid_sample", "tar_file_iterator", "tar_file_expander",
    "group_by_keys", "url_opener", "tarfile_samples",
    # store and cache streams
    "Store", "Entry", "Partial", "CheckReport", "CacheStream", "cache_shards", "open_cached",
    # sources, workers, dataset
    "DataSource", "URLSource", "CachedSource", "split_by_node", "split_by_worker",
    "WorkerEnvironment", "ShardDataset",
    # read plans
    "plan", "Plan", "PlanError",
    # DBCache
    "DBCache", "get_uuid",
}  # fmt: skip


def test_all_is_pinned():
    assert set(shardcache.__all__) == EXPECTED
    assert len(shardcache.__all__) == len(set(shardcache.__all__))


def test_every_public_name_resolves():
    for name in shardcache.__all__:
        assert getattr(shardcache, name) is not None, name
    assert shardcache.GopenException is shardcache.GopenError


def test_errors_share_one_base():
    for name in shardcache.__all__:
        obj = getattr(shardcache, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, shardcache.ShardcacheError), name


def test_unknown_name_raises_attribute_error():
    try:
        shardcache.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light():
    """``import shardcache`` must not pull aiohttp, torch or sqlite-utils."""
    code = (
        "import sys, shardcache; "
        "print(sorted(m for m in ('aiohttp', 'torch', 'sqlite_utils', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
