"""Operator tools (prefetch, stats, ls) against a real proxy subprocess and a real origin,
plus their pure helpers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.opshelpers import Origin, ProxyProcess, make_shard, running

from shardcache.cli import common as tools
from shardcache.cli import prefetch

SHARDS = {f"/data/train-{i:03d}.tar": make_shard(i, 200_000 + 1000 * i) for i in range(6)}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An origin with SHARDS and one proxy in front of it."""
    tmp = tmp_path_factory.mktemp("tools")
    with Origin(SHARDS) as origin:
        proxy = ProxyProcess(origin.url, tmp / "cache")
        with running(proxy):
            yield origin, proxy


# ---------------------------------------------------------------------------- prefetch


def test_prefetch_warms_every_shard_once(served):
    origin, proxy = served
    res = cli("prefetch", "/data/train-{000..003}.tar", "--proxy", proxy.url, "-j", "3")
    assert res.returncode == 0, res.stderr
    assert "4 shards" in res.stdout and "MISS" in res.stdout and "total" in res.stdout
    for i in range(4):
        assert origin.gets[f"/data/train-{i:03d}.tar"] == 1
    # a second run is all hits and costs the origin nothing; the proxy comes from the env
    res = cli("prefetch", "/data/train-{000..003}.tar", env={"SHARDCACHE_PROXY": proxy.url})
    assert res.returncode == 0, res.stderr
    assert "HIT" in res.stdout and "MISS" not in res.stdout
    assert sum(origin.gets[f"/data/train-{i:03d}.tar"] for i in range(4)) == 4


def test_prefetch_names_failed_shards_and_exits_nonzero(served):
    origin, proxy = served
    res = cli("prefetch", "/data/train-{004..007}.tar", "--proxy", proxy.url, "--quiet")
    assert res.returncode == 1
    assert "2 of 4 shards failed" in res.stderr
    for i in (6, 7):
        assert f"{proxy.url}/data/train-{i:03d}.tar: HTTP 404" in res.stderr
    for i in (4, 5):
        assert f"train-{i:03d}.tar:" not in res.stderr
    assert "FAILED" in res.stdout


@pytest.mark.parametrize("command", [("prefetch", "/a-{0..1}.tar", "--quiet"), ("stats",)])
def test_a_proxy_that_is_not_running_is_one_clear_error(command):
    """prefetch and stats say the same thing when nothing listens at the proxy address."""
    from support.opshelpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    res = cli(*command, "--proxy", url)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"shardcache {command[0]}: error: no proxy answers at {url}: connection refused; "
        "start one with `shardcache serve --upstream URL ...`, or give its address with "
        "--proxy or SHARDCACHE_PROXY"
    ]
    assert res.stdout == ""


def test_prefetch_rejects_a_bad_proxy_url():
    res = cli("prefetch", "/a.tar", "--proxy", "localhost:8080")
    assert res.returncode == 1
    assert "--proxy" in res.stderr and "localhost:8080" in res.stderr


def test_prefetch_plain_text_progress_without_rich(served, tmp_path):
    """Without rich (or without a terminal) progress and table are plain text."""
    origin, proxy = served
    blocker = tmp_path / "rich.py"
    blocker.write_text("raise ImportError('rich hidden for this test')\n")
    res = cli(
        "prefetch",
        "/data/train-{000..001}.tar",
        "--proxy",
        proxy.url,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    assert "2/2 shards" in res.stderr and "/s, ETA" in res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].split() == ["outcome", "shards", "bytes", "rate"]
    assert lines[2].startswith("-------")


def test_prefetch_progress_and_summary_give_one_rate(served, tmp_path):
    """The last progress line and the summary's total measure the same transfer time
    (not the start-up), and the summary says what that time is."""
    origin, proxy = served
    blocker = tmp_path / "rich.py"
    blocker.write_text("raise ImportError('rich hidden for this test')\n")
    res = cli(
        "prefetch",
        "/data/train-{000..005}.tar",
        "--proxy",
        proxy.url,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("6/6 shards, ")
    progress_rate = re.search(r", ([0-9.]+ [KMGT]?i?B/s), ETA", last).group(1)
    title, _, _, *rows = res.stdout.splitlines()
    total = rows[-1].split()
    assert total[0] == "total"
    assert " ".join(total[-2:]) == progress_rate
    assert "from the first request to the last byte" in title
    seconds = re.search(r"in ([0-9.]+) s from the first request", title).group(1)
    assert float(seconds) <= float(re.search(r"\(([0-9.]+) s with start-up\)", title).group(1))


def test_prefetch_rich_display_on_a_terminal(served):
    """With rich and a terminal (forced here) the progress shows bytes/s and an ETA."""
    origin, proxy = served
    env = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "200"}
    res = cli("prefetch", "/data/train-{000..001}.tar", "--proxy", proxy.url, env=env)
    assert res.returncode == 0, res.stderr
    assert "2/2 shards" in res.stderr and "/s" in res.stderr and "ETA" in res.stderr
    assert "┏━" in res.stdout and "outcome" in res.stdout  # a rich table


# ---------------------------------------------------------------------------- stats


def test_stats_json_and_table(served):
    origin, proxy = served
    cli("prefetch", "/data/train-000.tar", "--proxy", proxy.url, "--quiet")
    res = cli("stats", "--proxy", proxy.url, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["entries"] >= 1 and data["bytes"] >= len(SHARDS["/data/train-000.tar"])
    res = cli("stats", "--proxy", proxy.url)
    assert res.returncode == 0, res.stderr
    assert "entries" in res.stdout and "hit_ratio" in res.stdout
    rows = dict(line.split(None, 1) for line in res.stdout.splitlines()[3:])
    assert rows["pid"] == str(data["pid"])
    assert rows["reserved"].endswith(" B") or rows["reserved"].endswith(f"({data['reserved']})")
    # (the free space behind it moves between the two calls)
    assert re.fullmatch(r"\d+\.\d [KMGTP]iB \(\d+\)", rows["store.effective_limit"])
    assert f"{data['hit_ratio'] * 100:.1f}%" in res.stdout or "hit_ratio" in res.stdout


@pytest.mark.parametrize("command", [("stats",), ("plan", "--list", "--json")])
def test_a_reader_that_goes_away_ends_the_output_quietly(served, command):
    """`shardcache stats | head -4`: the closed pipe ends the command without a
    traceback (the reader here closes before anything is written)."""
    origin, proxy = served
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    try:
        res = subprocess.run(
            [sys.executable, "-m", "shardcache", *command, "--proxy", proxy.url],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=env,
        )
    finally:
        os.close(write_end)
    assert res.stderr == ""
    assert res.returncode == 1


# ---------------------------------------------------------------------------- plan


def test_plan_without_the_admin_token_names_the_variable_to_set(tmp_path):
    with Origin(SHARDS) as origin:
        proxy = ProxyProcess(origin.url, tmp_path / "cache", ["--admin-token", "sekrit"])
        with running(proxy):
            res = cli("plan", "/data/train-{000..001}.tar", "--proxy", proxy.url)
            assert res.returncode == 1
            assert "HTTP 401" in res.stderr
            assert "set SHARDCACHE_ADMIN_TOKEN to the proxy's --admin-token" in res.stderr
            res = cli(
                "plan",
                "--delete",
                "nope",
                "--proxy",
                proxy.url,
                env={"SHARDCACHE_ADMIN_TOKEN": "wrong"},
            )
            assert res.returncode == 1
            assert "SHARDCACHE_ADMIN_TOKEN does not match" in res.stderr
            res = cli(
                "plan",
                "/data/train-{000..001}.tar",
                "--no-watch",
                "--proxy",
                proxy.url,
                env={"SHARDCACHE_ADMIN_TOKEN": "sekrit"},
            )
            assert res.returncode == 0, res.stderr
    assert "SHARDCACHE_ADMIN_TOKEN" in cli("plan", "--help").stdout


# ---------------------------------------------------------------------------- ls


def test_ls_lists_entries_with_size_access_and_url(served):
    origin, proxy = served
    cli("prefetch", "/data/train-{000..002}.tar", "--proxy", proxy.url, "--quiet")
    res = cli("ls", "--cache-dir", str(proxy.cache_dir), "--json")
    assert res.returncode == 0, res.stderr
    entries = {e["url"]: e for e in json.loads(res.stdout)}
    for i in range(3):
        url = f"{origin.url}/data/train-{i:03d}.tar"
        assert entries[url]["size"] == len(SHARDS[f"/data/train-{i:03d}.tar"])
        assert entries[url]["last_access"] > 0
    res = cli("ls", "--cache-dir", str(proxy.cache_dir), "--sort", "size")
    assert res.returncode == 0, res.stderr
    assert f"{origin.url}/data/train-002.tar" in res.stdout
    assert "last access" in res.stdout


def test_ls_refuses_a_directory_that_is_not_a_cache(tmp_path):
    stray = tmp_path / "0a7d5a0e-7a8e-3f4e-9c5b-8d8f1c2b3a4d"
    stray.write_bytes(b"not ours")
    res = cli("ls", "--cache-dir", str(tmp_path))
    assert res.returncode == 1
    assert "not a shardcache cache" in res.stderr
    assert stray.exists() and not (tmp_path / ".shardcache.sqlite").exists()


def test_ls_missing_directory():
    res = cli("ls", "--cache-dir", "/nonexistent/shardcache-cache")
    assert res.returncode == 1 and "--cache-dir" in res.stderr


# ---------------------------------------------------------------------------- pure helpers


def test_proxy_url_mapping():
    p = "http://127.0.0.1:8080"
    assert tools.proxy_url(p, "/a/b.tar") == f"{p}/a/b.tar"
    assert tools.proxy_url(p + "/", "a/b.tar") == f"{p}/a/b.tar"
    assert tools.proxy_url(p, f"{p}/x.tar") == f"{p}/x.tar"
    assert tools.proxy_url(p, "https://h.example/x.tar") == f"{p}/https://h.example/x.tar"
    assert tools.proxy_url(p, "/a b.tar") == f"{p}/a%20b.tar"
    with pytest.raises(tools.ToolError, match="scheme"):
        tools.proxy_url(p, "ftp://h/x.tar")


def test_human_units():
    assert tools.human_bytes(0) == "0 B"
    assert tools.human_bytes(1536) == "1.5 KiB"
    assert tools.human_bytes(3 * 1024**3) == "3.0 GiB"
    assert tools.human_duration(75) == "1:15"
    assert tools.human_duration(3725) == "1:02:05"
    assert tools.human_duration(None) == "-:--"


@given(
    st.lists(st.integers(1, 10**9), max_size=50),
    st.integers(0, 100),
)
def test_estimate_total_properties(lengths, extra):
    n_total = len(lengths) + extra
    est = tools.estimate_total(lengths, n_total)
    if not lengths:
        assert est is None
        return
    assert est >= sum(lengths)
    assert min(lengths) * n_total - 1 <= est <= max(lengths) * n_total + 1


@given(st.integers(0, 10**12), st.integers(0, 10**12), st.floats(0.001, 1e5))
def test_eta_properties(done, total, elapsed):
    eta = tools.eta_seconds(done, total, elapsed)
    if done == 0:
        assert eta is None
    else:
        assert eta >= 0
        if done >= total:
            assert eta == 0


def test_render_table_alignment():
    out = tools.render_table(["a", "n"], [("x", 1), ("long", 100)], right=[1])
    assert out.splitlines() == ["a       n", "----  ---", "x       1", "long  100"]


def test_format_stat():
    assert tools.format_stat("hit_ratio", 0.25) == "25.0%"
    assert tools.format_stat("bytes", 2048) == "2.0 KiB (2048)"
    assert tools.format_stat("entries", 12345) == "12,345"
    # every byte figure like `limit`, ids plain
    assert tools.format_stat("limit", 5_000_000) == "4.8 MiB (5000000)"
    assert tools.format_stat("store.effective_limit", 5_000_000) == "4.8 MiB (5000000)"
    assert tools.format_stat("reserved", 0) == "0 B"
    assert tools.format_stat("reserved", 4096) == "4.0 KiB (4096)"
    assert tools.format_stat("pid", 9792) == "9792"
    assert tools.format_stat("store.errno", 28) == "28"
    assert tools.flatten({"a": {"b": 1}, "c": 2}) == [("a.b", 1), ("c", 2)]


def test_summary_rows_group_by_outcome():
    rs = [
        prefetch.ShardResult("u1", True, 10, 0.1, "HIT"),
        prefetch.ShardResult("u2", True, 20, 0.1, "MISS"),
        prefetch.ShardResult("u3", False, 0, 0.1, "", "HTTP 404"),
    ]
    rows = prefetch.summarize(rs, 1.0)
    assert [r[0] for r in rows] == ["HIT", "MISS", "FAILED", "total"]
    assert rows[-1][1] == 3 and rows[-1][2] == "30 B"
