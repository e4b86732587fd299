"""``shardcache completion bash|zsh``: the scripts, sourced in real shells, complete
subcommands, flags, choices and file names from the parser tree."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from proxy.config import SETTINGS


def _script(shell: str, tmp_path) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "shardcache", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    path = tmp_path / f"shardcache.{shell}"
    path.write_text(res.stdout)
    return str(path)


BASH_DRIVER = r"""
source "$1"
shift
complete -p shardcache >/dev/null || exit 3
while (($#)); do
    IFS=' ' read -r -a COMP_WORDS <<< "$1"
    [[ "$1" == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    COMPREPLY=()
    _shardcache
    echo "${COMPREPLY[*]}"
    shift
done
"""


def bash_complete(script: str, *lines: str, cwd=None) -> list[list[str]]:
    """What bash offers for each ``line`` (the cursor at its end), as COMPREPLY."""
    res = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_DRIVER, "bash", script, *lines],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert res.returncode == 0, res.stderr
    assert not res.stderr, res.stderr
    return [line.split() for line in res.stdout.splitlines()]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_flags_choices_and_files(tmp_path):
    script = _script("bash", tmp_path)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "shards.toml").write_text("")
    got = bash_complete(
        script,
        "shardcache se",
        "shardcache serve --cache-",
        "shardcache serve --log-level w",
        "shardcache serve --http-parts ",
        "shardcache serve --config sh",
        "shardcache serve --cache-dir s",
        "shardcache dbcache b",
        "shardcache completion ",
        "shardcache serve --port 8080 --eviction ",
        "shardcache wh",
        "shardcache where --",
        "shardcache ",
        "shardcache serve --port ",
        cwd=data,
    )
    assert got[0] == ["serve"]
    assert got[1] == ["--cache-dir", "--cache-size", "--cache-layout"]
    assert got[2] == ["warning"]
    assert got[3] == ["on", "off"]
    assert got[4] == ["shards.toml"]  # a PATH-like metavar: file names
    assert sorted(got[5]) == ["shards.toml", "sub"]
    assert got[6] == ["build"]
    assert got[7] == ["bash", "zsh"]
    assert got[8] == ["lru", "fifo", "keep"]  # after a flag's value, the command is still serve
    assert got[9] == ["where"]
    assert {"--proxy", "--json", "--no-probe", "--timeout"} <= set(got[10])
    assert {"serve", "prefetch", "plan", "stats", "where", "completion"} <= set(got[11])
    assert got[12] == []  # a number: nothing to offer


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_offers_every_flag_of_the_settings_table(tmp_path):
    (flags,) = bash_complete(_script("bash", tmp_path), "shardcache serve --")
    assert {s.flag for s in SETTINGS if s.flag} <= set(flags)
    assert "--config" in flags and "--help" in flags


ZSH_DRIVER = r"""
source "$1"
shift
typeset -ga got
# the completion system's builtins, recording what the function offers
compadd() {
    local -a a; a=("$@")
    while [[ ${a[1]} == -* && ${a[1]} != -- ]]; do a=("${a[@]:1}"); done
    [[ ${a[1]} == -- ]] && a=("${a[@]:1}")
    got+=("${a[@]}")
}
_describe() { local -a arr; arr=("${(@P)2}"); got+=("${arr[@]%%:*}"); }
_files() { got+=("<files>"); }
_message() { got+=("<$1>"); }
for line in "$@"; do
    got=()
    words=(${(s: :)line})
    [[ "$line" == *" " ]] && words+=("")
    CURRENT=${#words}
    _shardcache
    print -r -- "${got[*]}"
done
"""


@pytest.mark.skipif(
    shutil.which("zsh") is None, reason="zsh is not installed (apt-get install zsh)"
)
def test_zsh_script_parses_and_completes(tmp_path):
    script = _script("zsh", tmp_path)
    check = subprocess.run(["zsh", "-n", script], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert open(script).readline() == "#compdef shardcache\n"
    lines = [
        "shardcache s",
        "shardcache serve --cache-",
        "shardcache serve --log-level ",
        "shardcache serve --cache-dir ",
        "shardcache completion ",
        "shardcache serve --port ",
    ]
    # compdef is only defined after compinit: stand in for it
    res = subprocess.run(
        ["zsh", "-f", "-c", "compdef() { :; }; " + ZSH_DRIVER, "zsh", script, *lines],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert not res.stderr, res.stderr
    got = [line.split() for line in res.stdout.splitlines()]
    assert {"serve", "stats", "where", "completion"} <= set(got[0])
    assert {"--cache-dir", "--cache-size", "--upstream"} <= set(got[1])
    assert got[2] == ["debug", "info", "warning", "error", "critical"]
    assert got[3] == ["<files>"]
    assert got[4] == ["bash", "zsh"]
    assert got[5] == ["<value>"]


def test_the_completion_command_refuses_other_shells():
    res = subprocess.run(
        [sys.executable, "-m", "shardcache", "completion", "fish"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "invalid choice: 'fish'" in res.stderr
