"""The settings table is the one source of each setting's flag, variable, parser, default
and help; flags, environment, config file, Settings and the upstream clients follow it."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys

import pytest

from proxy.config import (
    BY_NAME,
    CONFIG_FILE,
    DEFAULTS,
    ENV_PREFIX,
    SETTINGS,
    Settings,
    parse_settings,
)
from proxy.policy import parse_size
from proxy.upstream.cloud import CloudUpstream
from proxy.upstream.fetcher import Fetcher
from proxy.upstream.options import DEFAULT_OPTIONS, RetryPolicy, UpstreamOptions
from proxy.upstream.s3 import S3Upstream
from shardcache.errors import ConfigError

pytestmark = pytest.mark.fast

CODE_ONLY = {"retry_backoff", "chunk_size"}  # no flag: tests and benchmarks set them


@pytest.fixture
def base(tmp_path):
    return ["--cache-dir", str(tmp_path), "--upstream", "http://origin.example.com"]


# --- the table --------------------------------------------------------------------------


def test_every_setting_has_flag_env_help_and_default():
    assert {s.name for s in SETTINGS if s.flag is None} == CODE_ONLY
    for s in SETTINGS:
        assert s.help and s.help == s.help.strip(), s.name
        assert "(default" not in s.help, f"{s.name}: the default is appended, not written"
        assert s.required or s.name in DEFAULTS, s.name
        if s.flag is None:
            continue
        assert re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", s.flag), s.flag
        assert re.fullmatch(ENV_PREFIX + r"[A-Z0-9]+(_[A-Z0-9]+)*", s.env), s.env
        assert s.env in (
            ENV_PREFIX + s.name.upper(),
            ENV_PREFIX + s.flag[2:].upper().replace("-", "_"),
        )
        assert s.required or s.default_text() or s.default in (None, ()), s.name
    flags = [s.flag for s in SETTINGS if s.flag]
    envs = [s.env for s in SETTINGS if s.flag]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert CONFIG_FILE.flag == "--config" and CONFIG_FILE.env == "SHARDCACHE_CONFIG"


def test_the_table_is_the_only_source_of_settings_defaults():
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert set(fields) == set(BY_NAME)
    assert fields["cache_dir"].default is dataclasses.MISSING and BY_NAME["cache_dir"].required
    for name, value in DEFAULTS.items():
        assert fields[name].default is value, name
    settings = Settings(cache_dir=BY_NAME["cache_dir"].convert("/tmp"))
    assert {n: getattr(settings, n) for n in DEFAULTS} == dict(DEFAULTS)


def test_the_upstream_clients_take_their_defaults_from_the_table():
    fetcher = inspect.signature(Fetcher).parameters
    for name in (
        "connect_timeout",
        "read_timeout",
        "retries",
        "retry_backoff",
        "chunk_size",
        "part_size",
        "parallel",
        "http_parts",
    ):
        assert fetcher[name].default is DEFAULTS[name], name
    assert fetcher["threaded"].default is (DEFAULTS["http_transport"] == "threads")
    from proxy.upstream import parts

    assert parts.DEFAULT_PART_SIZE is DEFAULTS["part_size"]
    assert parts.DEFAULT_PARALLEL is DEFAULTS["parallel"]
    for client in (S3Upstream, CloudUpstream):
        assert inspect.signature(client).parameters["options"].default is DEFAULT_OPTIONS
    for f in dataclasses.fields(UpstreamOptions):
        assert getattr(DEFAULT_OPTIONS, f.name) is DEFAULTS[f.name], f.name


def test_the_s3_and_cloud_clients_get_the_daemons_upstream_settings(tmp_path):
    """One set of timeouts, retries and pool size for every backend: gs:// and az:// read
    ``--retries`` as s3:// does (they kept the built-in 3 before)."""
    from proxy.app import make_app
    from proxy.context import CLOUD_CLIENT, S3_CLIENT

    s = parse_settings(
        [
            "--cache-dir", str(tmp_path), "--upstream", "a=s3://bkt/p",
            "--upstream", "g=gs://bkt/p", "--retries", "7", "--read-timeout", "12",
            "--connect-timeout", "4", "--parallel", "40",
        ],
        {},
    )  # fmt: skip
    wanted = UpstreamOptions(
        connect_timeout=4, read_timeout=12, retries=7, parallel=40, part_size=s.part_size
    )
    assert s.upstream_options == wanted
    app = make_app(dataclasses.replace(s, retry_backoff=0.25))
    for client in (app[S3_CLIENT], app[CLOUD_CLIENT]):
        assert client.options == dataclasses.replace(wanted, retry_backoff=0.25)
        assert client.retry == RetryPolicy(7, 0.25)
        assert client.options.connections == 80


@pytest.mark.parametrize(
    "setting",
    [
        s
        for s in SETTINGS
        if s.flag and not s.required and s.default is not None and s.default_text()
    ],
    ids=lambda s: s.name,
)
def test_the_default_the_help_shows_parses_back_to_the_default(setting):
    assert setting.convert(setting.default_text()) == setting.default


@pytest.mark.slow  # a subprocess: left to `make test`
def test_serve_help_is_plain_text_with_defaults_and_variables():
    res = subprocess.run(
        [sys.executable, "-m", "shardcache", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for markup in ("``", ":class:", ":func:", "**", "`"):
        assert markup not in out, markup
    flat = " ".join(out.split())
    assert "(default 100G)" in flat and "(default 8MiB)" in flat
    assert "one of lru, fifo, keep; default lru" in flat
    assert "G = 10^9 bytes" in flat and "GiB = 2^30 bytes" in flat
    for s in SETTINGS:
        if s.flag:
            assert s.flag in out and s.env in flat, s.name


# --- the environment --------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, field, expected",
    [
        ({"SHARDCACHE_PORT": "9000"}, "port", 9000),  # int
        ({"SHARDCACHE_READ_TIMEOUT": "2.5"}, "read_timeout", 2.5),  # float
        ({"SHARDCACHE_CACHE_SIZE": "2GiB"}, "cache_size", 2 * 2**30),  # size, binary
        ({"SHARDCACHE_CACHE_SIZE": "2G"}, "cache_size", 2 * 10**9),  # size, decimal
        ({"SHARDCACHE_PART_SIZE": "0"}, "part_size", 0),
        ({"SHARDCACHE_EVICTION": "FIFO"}, "eviction", "fifo"),  # choice, any case
        ({"SHARDCACHE_HTTP_PARTS": "on"}, "http_parts", True),  # on/off
        ({"SHARDCACHE_HTTP_PARTS": "false"}, "http_parts", False),
        ({"SHARDCACHE_MIN_FREE": "10%"}, "min_free", 0.1),
        ({"SHARDCACHE_MIN_FREE": "2G"}, "min_free", 2 * 10**9),
        ({"SHARDCACHE_REVALIDATE": "10m"}, "revalidate", 600.0),
        ({"SHARDCACHE_REVALIDATE": "always"}, "revalidate", 0.0),
        (
            {"SHARDCACHE_S3_DOMAINS": "a.example, b.example"},
            "s3_domains",
            ("a.example", "b.example"),
        ),
        (
            {"SHARDCACHE_ALLOW_HOST": "A.example b.example:8080"},
            "allow_hosts",
            ("a.example", "b.example:8080"),
        ),
        ({"SHARDCACHE_ADMIN_TOKEN": "secret"}, "admin_token", "secret"),  # text
        (
            {"SHARDCACHE_S3_ENDPOINT_URL": "http://minio:9000"},
            "s3_endpoint_url",
            "http://minio:9000",
        ),
        ({"SHARDCACHE_PORT": "  "}, "port", 8080),  # blank: unset
    ],
)
def test_environment_values_of_each_kind(base, env, field, expected):
    assert getattr(parse_settings(base, env), field) == expected


def test_upstream_list_from_the_environment(tmp_path):
    env = {"SHARDCACHE_CACHE_DIR": str(tmp_path), "SHARDCACHE_UPSTREAM": "http://a, b=http://b"}
    s = parse_settings([], env)
    assert [str(u) for u in s.upstreams] == ["http://a", "b=http://b"]
    assert s.cache_dir == tmp_path


def test_a_flag_wins_over_its_variable(base):
    s = parse_settings(
        [*base, "--port", "1234", "--eviction", "keep"],
        {"SHARDCACHE_PORT": "9000", "SHARDCACHE_EVICTION": "fifo"},
    )
    assert (s.port, s.eviction) == (1234, "keep")


@pytest.mark.parametrize(
    "env, flag",
    [
        ({"SHARDCACHE_PORT": "http"}, "--port"),
        ({"SHARDCACHE_WORKERS": "65"}, "--workers"),
        ({"SHARDCACHE_HTTP_PARTS": "maybe"}, "--http-parts"),
        ({"SHARDCACHE_LOG_LEVEL": "loud"}, "--log-level"),
        ({"SHARDCACHE_READ_TIMEOUT": "inf"}, "--read-timeout"),
    ],
)
def test_a_bad_variable_names_the_flag_and_the_variable(base, env, flag):
    with pytest.raises(ConfigError) as ei:
        parse_settings(base, env)
    assert ei.value.flag == flag
    assert next(iter(env)) in str(ei.value)


# --- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--cache-size", "-5G"], {}),
        (["--cache-size=-5G"], {}),
        (["--cache-size", "-1"], {}),
        ([], {"SHARDCACHE_CACHE_SIZE": "-5G"}),
    ],
)
def test_a_negative_cache_size_is_rejected_naming_the_flag(base, argv, env):
    with pytest.raises(ConfigError) as ei:
        parse_settings([*base, *argv], env)
    assert ei.value.flag == "--cache-size"
    assert "negative" in str(ei.value)


def test_parse_size_rejects_negatives_and_reads_both_unit_families():
    for text in ("-5G", "-0.5", " -1KiB"):
        with pytest.raises(ValueError, match="negative"):
            parse_size(text)
    assert parse_size("1G") == 10**9 and parse_size("1GiB") == 2**30


@pytest.mark.parametrize(
    "argv, env, toml, flag",
    [
        (["--cache-size", "10"], {}, "", "--cache-size"),
        ([], {"SHARDCACHE_CACHE_SIZE": "500"}, "", "--cache-size"),
        ([], {}, "cache_size = 10\n", "--cache-size"),
        ([], {}, 'cache_size = "1048575"\n', "--cache-size"),
        (["--min-free", "2"], {}, "", "--min-free"),
    ],
)
def test_a_size_without_a_unit_below_1mib_is_refused_with_a_hint(
    base, tmp_path, argv, env, toml, flag
):
    """``--cache-size 10`` is a forgotten unit, not a 10-byte cache that admits nothing."""
    extra = ["--config", write(tmp_path / "c.toml", toml)] if toml else []
    with pytest.raises(ConfigError) as ei:
        parse_settings([*base, *argv, *extra], env)
    number = re.search(r"\d+", " ".join([*argv, *env.values(), toml])).group()
    assert ei.value.flag == flag
    assert f"{number} = {number} bytes; did you mean {number}G?" in str(ei.value)


def test_sizes_with_a_unit_or_of_1mib_and_more_are_taken_as_written(base):
    for text, value in (("10B", 10), ("10G", 10 * 10**9), ("1048576", 2**20), ("1k", 1000)):
        assert parse_settings([*base, "--cache-size", text], {}).cache_size == value
    assert parse_settings([*base, "--min-free", "0"], {}).min_free == 0
    assert parse_settings([*base, "--min-free", "64KiB"], {}).min_free == 64 * 1024
    assert parse_size("10") == 10  # the parser itself: bytes, as before


@pytest.mark.slow  # a subprocess: left to `make test`
def test_the_size_hint_on_the_command_line(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(tmp_path)]
        + ["--upstream", "http://a", "--cache-size", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "--cache-size: 10 = 10 bytes; did you mean 10G?" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_negative_part_size_names_its_flag(base):
    with pytest.raises(ConfigError, match="^--part-size: .*negative"):
        parse_settings([*base, "--part-size", "-8MiB"], {})


def test_a_missing_flag_value_is_a_config_error_naming_the_flag(base):
    with pytest.raises(ConfigError) as ei:
        parse_settings([*base, "--port"], {})
    assert ei.value.flag == "--port"


# --- the config file --------------------------------------------------------------------


def write(path, text):
    path.write_text(text)
    return str(path)


def test_a_toml_file_gives_settings(tmp_path):
    cache = tmp_path / "cache"
    conf = write(
        tmp_path / "shardcache.toml",
        f'cache_dir = "{cache}"\n'
        'cache_size = "500G"\n'
        'upstreams = ["http://a.example", "b=http://b.example"]\n'
        "port = 9001\n"
        "read_timeout = 2.5\n"
        "http_parts = true\n"
        's3_domains = ["s3.example", "localhost"]\n',
    )
    s = parse_settings(["--config", conf], {})
    assert s.cache_dir == cache and s.cache_size == 500 * 10**9 and s.port == 9001
    assert [str(u) for u in s.upstreams] == ["http://a.example", "b=http://b.example"]
    assert s.read_timeout == 2.5 and s.http_parts is True
    assert s.s3_domains == ("s3.example", "localhost")
    assert s.eviction == DEFAULTS["eviction"]  # not in the file: the default
    assert parse_settings([], {"SHARDCACHE_CONFIG": conf}) == s  # the file named by variable


def test_flag_beats_variable_beats_file_beats_default(tmp_path):
    conf = write(
        tmp_path / "c.toml",
        f'cache_dir = "{tmp_path}"\nupstreams = ["http://a.example"]\n'
        "port = 1001\nretries = 7\nmax_plans = 9\n",
    )
    env = {"SHARDCACHE_PORT": "1002", "SHARDCACHE_RETRIES": "5"}
    s = parse_settings(["--config", conf, "--port", "1003"], env)
    assert s.port == 1003  # flag
    assert s.retries == 5  # variable over file
    assert s.max_plans == 9  # file over default
    assert s.plan_lookahead == DEFAULTS["plan_lookahead"]


def test_an_unknown_key_is_an_error_naming_it(tmp_path):
    conf = write(tmp_path / "c.toml", f'cache_dir = "{tmp_path}"\ncache_sise = "1G"\n')
    with pytest.raises(ConfigError) as ei:
        parse_settings(["--config", conf, "--upstream", "http://a"], {})
    assert ei.value.flag == "cache_sise"
    assert "did you mean cache_size" in str(ei.value)


def test_a_code_only_setting_is_not_a_file_key(tmp_path):
    conf = write(tmp_path / "c.toml", "chunk_size = 4096\n")
    with pytest.raises(ConfigError, match="^chunk_size: not a setting"):
        parse_settings(
            ["--config", conf, "--cache-dir", str(tmp_path), "--upstream", "http://a"], {}
        )


def test_a_bad_file_value_names_the_flag_and_the_file(base, tmp_path):
    conf = write(tmp_path / "c.toml", 'cache_size = "-5G"\n')
    with pytest.raises(ConfigError) as ei:
        parse_settings([*base, "--config", conf], {})
    assert ei.value.flag == "--cache-size" and conf in str(ei.value)
    conf = write(tmp_path / "d.toml", "port = {a = 1}\n")
    with pytest.raises(ConfigError, match="^--port: expected a string"):
        parse_settings([*base, "--config", conf], {})


@pytest.mark.parametrize("text", [None, "port = = 1\n"])
def test_a_missing_or_broken_file_names_config(base, tmp_path, text):
    path = tmp_path / "c.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        parse_settings([*base, "--config", str(path)], {})
    assert ei.value.flag == "--config"


def test_the_library_writes_its_cache_defaults_once():
    from shardcache.cachestream import cache_shards
    from shardcache.dataset import ShardDataset
    from shardcache.sources import CachedSource
    from shardcache.store import DEFAULT_CACHE_SIZE, DEFAULT_POLICY, Store

    for fn in (Store, cache_shards, ShardDataset, CachedSource):
        params = inspect.signature(fn).parameters
        assert params["cache_size"].default is DEFAULT_CACHE_SIZE, fn
        if "policy" in params:
            assert params["policy"].default is DEFAULT_POLICY, fn
