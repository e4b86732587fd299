import subprocess
import sys

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


def test_every_subcommand_help_renders():
    """argparse formats help lazily: a stray % in one flag's text breaks only --help."""
    for command in ("serve", "check", "prefetch", "stats", "ls"):
        res = run_cli(command, "--help")
        assert res.returncode == 0, (command, res.stderr)
        assert f"usage: shardcache {command}" in res.stdout
    assert "(10%)" in run_cli("serve", "--help").stdout
