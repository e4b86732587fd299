import os
import re
import signal
import subprocess
import sys

import pytest

import shardcache


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args], capture_output=True, text=True, timeout=60
    )


def test_version():
    res = run_cli("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"shardcache {shardcache.__version__}"


def test_help_lists_usage():
    res = run_cli("--help")
    assert res.returncode == 0
    assert "usage: shardcache" in res.stdout


def test_no_command_prints_help_and_fails():
    res = run_cli()
    assert res.returncode == 2
    assert "usage: shardcache" in res.stdout


def test_every_subcommand_help_renders_as_plain_text():
    """argparse formats help lazily: a stray % in one flag's text breaks only --help; and
    a docstring passed as a description brings its reStructuredText markup along."""
    commands = [
        ["serve"],
        ["check"],
        ["demo"],
        ["dbcache"],
        ["dbcache", "build"],
        ["dbcache", "info"],
        ["dbcache", "export"],
        ["prefetch"],
        ["plan"],
        ["stats"],
        ["ls"],
    ]
    for command in [[], *commands]:
        res = run_cli(*command, "--help")
        assert res.returncode == 0, (command, res.stderr)
        assert f"usage: {' '.join(['shardcache', *command])} " in res.stdout, res.stdout
        markup = re.findall(r"``|:(?:func|class|meth|mod|attr):`|\*\*\w", res.stdout)
        assert not markup, (command, markup, res.stdout)
    assert "(10%)" in run_cli("serve", "--help").stdout


def test_a_mistyped_command_names_the_closest_one():
    res = run_cli("prefech", "/d/a-{0..1}.tar")
    assert res.returncode == 2
    assert res.stderr.startswith("usage: shardcache [-h] [--version] COMMAND ...")
    assert "unknown command 'prefech'; did you mean 'prefetch'?" in res.stderr
    res = run_cli("dbcache", "biuld", "x.db", "u", "--size", "1")
    assert res.returncode == 2 and "did you mean 'build'?" in res.stderr
    res = run_cli("frobnicate")
    assert res.returncode == 2
    assert "unknown command 'frobnicate' (choose from serve, check," in res.stderr


def test_a_mistyped_flag_shows_one_usage_line_and_the_closest_flag_first():
    res = run_cli("serve", "--cache-dir", "x", "--upstream", "http://a", "--cache-sise", "5G")
    assert res.returncode == 2
    # the exact shape: one short usage line, then the error with the hint first
    assert res.stderr == (
        "usage: shardcache serve --cache-dir PATH --upstream [NAME=]URL [OPTION ...]\n"
        "shardcache serve: error: did you mean --cache-size? "
        "(unrecognized arguments: --cache-sise 5G)\n"
    )
    # a flag without its value: the same two lines
    res = run_cli("serve", "--port")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "usage: shardcache serve --cache-dir PATH --upstream [NAME=]URL [OPTION ...]",
        "shardcache serve: error: argument --port: expected one argument",
    ]
    # a nested subcommand, the --flag=value form
    res = run_cli("dbcache", "build", "x.db", "u", "--size", "1", "--codex=safe")
    assert res.returncode == 2
    assert res.stderr.startswith("usage: shardcache dbcache build ")
    assert len(res.stderr.splitlines()) == 2, res.stderr
    assert "error: did you mean --codec? (unrecognized arguments: --codex=safe)" in res.stderr
    # nothing close: the arguments alone
    res = run_cli("stats", "--frobnicate")
    assert res.stderr.startswith("usage: shardcache stats ")
    assert res.stderr.rstrip().endswith("error: unrecognized arguments: --frobnicate")


def test_a_long_usage_is_shortened_on_errors():
    """A usage longer than a line becomes the program, [OPTION ...] and the positionals."""
    import argparse

    from shardcache.cli import short_usage

    p = argparse.ArgumentParser(prog="shardcache tool")
    for i in range(12):
        p.add_argument(f"--option-number-{i}", metavar="VALUE")
    p.add_argument("pattern", metavar="PATTERN")
    assert short_usage(p) == (
        "usage: shardcache tool [OPTION ...] PATTERN  (shardcache tool --help lists the options)"
    )
    q = argparse.ArgumentParser(prog="shardcache small")
    q.add_argument("--json", action="store_true")
    assert short_usage(q) == "usage: shardcache small [-h] [--json]"


def test_serve_help_lists_the_flags_by_group_with_metavars():
    out = run_cli("serve", "--help").stdout
    titles = [line.rstrip(":") for line in out.splitlines() if re.fullmatch(r"[a-z]+:", line)]
    assert titles == ["options", "cache", "upstreams", "fronts", "admin", "performance", "logging"]
    flat = " ".join(out.split())
    for shown in (
        "--cache-size SIZE",
        "--cache-dir PATH",
        "--read-timeout SECONDS",
        "--prefetch-concurrency N",
        "--s3-endpoint-url URL",
        "--log-level debug|info|warning|error|critical",
        "--http-parts on|off",
    ):
        assert shown in flat, shown
    assert not re.search(r"--[a-z-]+ [A-Z]+_[A-Z_]+", flat), "a metavar made from the dest"
    # every flag of the table sits under its group's title
    cache = out[out.index("\ncache:") : out.index("\nupstreams:")]
    assert "--cache-size" in cache and "--eviction" in cache and "--upstream " not in cache


def test_check_reports_stray_files_and_leaves_them(tmp_path):
    from shardcache.store import Store

    cache = tmp_path / "cache"
    with Store(cache, cache_size=10**9) as store:
        partial = store.begin("http://h/a.tar", 3)
        with open(partial.path, "wb") as f:
            f.write(b"abc")
        store.commit(partial, 3)
    (cache / "notes.txt").write_text("mine\n")
    (cache / "backup").mkdir()
    (cache / "shard-000.tar").write_bytes(b"x" * 10)
    (cache / "0123.tmp.part").write_bytes(b"")  # work files are the store's business
    (cache / "0123.del").write_bytes(b"")
    res = run_cli("check", "--cache-dir", str(cache))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"cache directory {cache}: 1 entries, 3 bytes"
    strays = [line for line in lines if line.startswith("stray: ")]
    assert strays == [
        "stray: backup (a directory): not a cache file; left alone, outside --cache-size",
        "stray: notes.txt (5 bytes): not a cache file; left alone, outside --cache-size",
        "stray: shard-000.tar (10 bytes): not a cache file; left alone, outside --cache-size",
    ]
    assert lines[-1] == f"3 stray name(s) in {cache}"
    # --fix repairs the store, never removes what is not the cache's
    res = run_cli("check", "--cache-dir", str(cache), "--fix")
    assert (cache / "notes.txt").exists() and (cache / "shard-000.tar").exists()
    assert "stray: notes.txt" in res.stdout


def test_stray_names_are_what_the_store_never_makes():
    from shardcache.cli.check import stray_names
    from shardcache.urls import shard_uuid

    key = shard_uuid("http://h/a.tar")
    ours = [
        key,
        f"{key}.123.abcdef.part",
        f"{key}.abcdef.del",
        ".shardcache.sqlite",
        ".shardcache.sqlite-wal",
        ".shardcache.sqlite-shm",
        ".probe.12.ab",
    ]
    assert stray_names(ours) == []
    others = ["a.tar", key.upper(), key + ".tar", ".shardcache.sqlite.bak", "lost+found"]
    assert stray_names(others + ours) == sorted(others)


def test_part_size_is_off_or_at_least_64kib(tmp_path):
    from proxy.config import ConfigError, parse_settings

    base = ["--cache-dir", str(tmp_path), "--upstream", "http://origin.example.com"]
    for text, value in (("0", 0), ("64KiB", 65536), ("8MiB", 8 << 20)):
        assert parse_settings([*base, "--part-size", text], {}).part_size == value
    with pytest.raises(ConfigError, match="^--part-size: must be 0 .* at least 64KiB"):
        parse_settings(base, {"SHARDCACHE_PART_SIZE": "64000"})
    res = run_cli("serve", *base, "--part-size", "1")
    assert res.returncode == 2
    assert "--part-size: must be 0 (off) or at least 64KiB (got '1')" in res.stderr


def test_workers_refuse_to_put_their_metrics_in_the_working_directory(tmp_path):
    """With no writable $TMPDIR, /tmp, /var/tmp or /usr/tmp (a read-only root filesystem)
    tempfile falls back to the working directory, which may be the cache: `serve
    --workers 2` stops with an error naming TMPDIR instead. The fallback is simulated
    by setting tempfile's cached answer to the working directory."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os, tempfile\ntempfile.tempdir = os.getcwd()\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    env.update(PYTHONPATH=str(hook))
    env.pop("TMPDIR", None)
    argv = [sys.executable, "-m", "shardcache", "serve", "--cache-dir", str(cache)]
    argv += ["--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--workers", "2"],
        cwd=cache,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the workers too, should they start
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == 2, err
    assert "no writable temporary directory" in err and "set TMPDIR" in err
    assert not list(cache.glob("shardcache-metrics-*"))
