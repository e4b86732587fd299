"""The bare-metal recipes of docs/deployment.md, tried as written: the systemd unit
(checked by systemd itself, and its command run with its environment) and the SLURM
wrapper and job script (run with a stand-in for srun on one node)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.proxy_helpers import Origin

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "docker" / "systemd" / "shardcache.service"
WRAPPER = ROOT / "docker" / "slurm" / "with-shardcache.sh"
SBATCH = ROOT / "docker" / "slurm" / "train.sbatch"
BIN = Path(sys.executable).parent
SHARD = os.urandom(300_000)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def origin():
    o = Origin(files={"data/a.tar": SHARD}).start()
    yield o
    o.stop()


def unit_values(key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", UNIT.read_text(), re.MULTILINE)


def test_the_docs_show_the_files_as_they_are():
    doc = (ROOT / "docs" / "deployment.md").read_text()
    for path in (UNIT, WRAPPER, SBATCH):
        body = path.read_text()
        assert body in doc, f"docs/deployment.md does not show {path.relative_to(ROOT)} as it is"


def test_systemd_accepts_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    shardcache = BIN / "shardcache"
    assert shardcache.exists()
    unit = tmp_path / "shardcache.service"
    unit.write_text(UNIT.read_text().replace("/opt/shardcache/bin/shardcache", str(shardcache)))
    res = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert not re.search(r"unknown|ignoring|invalid", res.stderr, re.IGNORECASE), res.stderr


def test_the_units_command_serves_and_stops_on_sigterm_within_its_timeout(tmp_path, origin):
    """ExecStart with the unit's Environment=, its paths moved under tmp_path."""
    (exec_start,) = unit_values("ExecStart")
    argv = exec_start.split()
    assert argv[0] == "/opt/shardcache/bin/shardcache"
    env = dict(os.environ)
    places = {
        "/var/cache/shardcache": str(tmp_path / "cache"),
        "/etc/shardcache/shardcache.toml": str(tmp_path / "shardcache.toml"),
    }
    for assignment in unit_values("Environment"):
        key, _, value = assignment.partition("=")
        env[key] = places.get(value, value)
    assert set(places.values()) <= set(env.values())
    (tmp_path / "shardcache.toml").write_text(
        f'upstreams = ["{origin.url}/data"]\nport = 0\ncache_size = "1G"\n'
    )
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "shardcache"), *argv[1:]], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"serving on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with urllib.request.urlopen(m.group(1).rstrip("/") + "/a.tar", timeout=30) as r:
            assert r.read() == SHARD
        (timeout,) = unit_values("TimeoutStopSec")
        (kill,) = unit_values("KillSignal")
        proc.send_signal(getattr(signal, kill))
        assert proc.wait(float(timeout)) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "cache" / ".shardcache.sqlite").exists()
    (status,) = unit_values("RestartPreventExitStatus")
    assert status == "2"  # what a configuration error exits with (tests/test_store_trust.py)


def free_port() -> int:
    for port in range(20000 + os.getpid() % 19000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port")


READER = f"""
import os, sys, urllib.request
url = os.environ["SHARDCACHE_PROXY"] + "/a.tar"
for want in ("MISS", "HIT"):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.headers["X-Cache"] == want, r.headers["X-Cache"]
        assert len(r.read()) == {len(SHARD)}
print("read through", os.environ["SHARDCACHE_PROXY"])
sys.exit(3)
"""


def slurm_env(tmp_path: Path, origin: Origin, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    env.update(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{BIN}{os.pathsep}{env.get('PATH', '')}",
        SHARDCACHE_UPSTREAM=f"{origin.url}/data",
        SHARDCACHE_CACHE_SIZE="1G",
        SLURM_TMPDIR=str(tmp_path / "node"),
        SLURM_JOB_ID=str(port - 20000 + 20000 * 7),  # the port is derived from the job id
    )
    (tmp_path / "node").mkdir(exist_ok=True)
    return env


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_slurm_wrapper_runs_a_command_beside_a_proxy_and_stops_it(tmp_path, origin):
    port = free_port()
    env = slurm_env(tmp_path, origin, port)
    (tmp_path / "reader.py").write_text(READER)
    res = subprocess.run(
        [str(WRAPPER), sys.executable, str(tmp_path / "reader.py")],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert res.returncode == 3, res.stdout + res.stderr  # the command's status
    assert f"read through http://127.0.0.1:{port}" in res.stdout, res.stdout + res.stderr
    assert port_closed(port)
    uid = os.getuid()
    assert (tmp_path / "node" / f"shardcache-{uid}" / ".shardcache.sqlite").exists()
    log = (tmp_path / "node" / f"shardcache-{uid}.log").read_text()
    assert "serving on" in log and "Traceback" not in log, log


def test_the_slurm_wrapper_says_why_the_proxy_did_not_start(tmp_path, origin):
    env = slurm_env(tmp_path, origin, free_port())
    env["SHARDCACHE_CACHE_SIZE"] = "10"
    res = subprocess.run(
        [str(WRAPPER), "true"], capture_output=True, text=True, timeout=90, env=env
    )
    assert res.returncode == 1
    assert "the proxy did not start" in res.stderr, res.stderr
    assert "10 = 10 bytes; did you mean 10G?" in res.stderr, res.stderr


def test_the_job_script_runs_with_srun_standing_in_for_one_node(tmp_path, origin):
    port = free_port()
    env = slurm_env(tmp_path, origin, port)
    env["SHARDCACHE_WRAPPER"] = str(WRAPPER)
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    # one node: drop srun's options, run the task
    srun.write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "train.py").write_text(READER.replace("sys.exit(3)", "sys.exit(0)"))
    res = subprocess.run(
        ["bash", str(SBATCH)], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"read through http://127.0.0.1:{port}" in res.stdout
    assert port_closed(port)
