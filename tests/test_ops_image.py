"""Run the container image's exact ENTRYPOINT + CMD + ENV (parsed from docker/Dockerfile)
in this virtualenv, and the example trainer through it: a healthy proxy, the image's own
HEALTHCHECK command passing, the dashboard's metrics really exported, a clean SIGTERM. And
the pinned dependencies the image installs cover what the recipes in docker/ ask of it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.deploy import dashboard_exprs, dockerfile_final_stage, metric_names
from support.opshelpers import Origin, free_port, http_get, make_shard, wait_healthy

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)
LOCK = REPO / "docker" / "requirements.lock"


def parse_env(arg: str) -> dict[str, str]:
    """ENV KEY=VALUE [KEY=VALUE ...] (values without spaces, as in our Dockerfile)."""
    out = {}
    for pair in arg.split():
        key, eq, value = pair.partition("=")
        assert eq, f"ENV without '=': {pair}"
        out[key] = value.strip('"')
    return out


def image_spec() -> tuple[dict[str, str], list[str], list[str]]:
    env: dict[str, str] = {}
    entrypoint = cmd = healthcheck = None
    for instr, arg in dockerfile_final_stage():
        if instr == "ENV":
            env.update(parse_env(arg))
        elif instr == "ENTRYPOINT":
            entrypoint = json.loads(arg)
        elif instr == "CMD":
            cmd = json.loads(arg)
        elif instr == "HEALTHCHECK":
            healthcheck = json.loads(arg.split(" CMD ", 1)[1])
    assert entrypoint and cmd and healthcheck, "ENTRYPOINT, CMD and HEALTHCHECK expected"
    return env, entrypoint + cmd, healthcheck


def test_image_spec_parses_as_exec_form():
    env, argv, health = image_spec()
    assert argv == ["shardcache", "serve"]
    assert env["SHARDCACHE_CACHE_DIR"] == "/var/cache/shardcache"
    assert health[0] == "python"


@pytest.fixture
def image_run(tmp_path):
    """The image's process started as Docker would, with machine-specific overrides only."""
    image_env, argv, health = image_spec()
    shards = {f"/train-{i}.tar": make_shard(i, 300_000) for i in range(3)}
    with Origin(shards) as origin:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
        for key, value in image_env.items():
            # $PATH expands as Docker does; the image's venv is ours here.
            value = value.replace("$PATH", os.environ.get("PATH", ""))
            env[key] = value.replace("/opt/shardcache/bin", VENV_BIN)
        port = free_port()
        overrides = {
            # Paths and addresses of this machine; everything else is the image's.
            "SHARDCACHE_CACHE_DIR": str(tmp_path / "cache"),
            "SHARDCACHE_HOST": "127.0.0.1",
            "SHARDCACHE_PORT": str(port),
            # The image leaves the upstream to the deployment (compose, k8s ConfigMap).
            "SHARDCACHE_UPSTREAM": origin.url,
        }
        env.update(overrides)
        log = open(tmp_path / "proxy.log", "wb")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout=30)
            yield proc, url, env, health, origin, shards, tmp_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()


def test_image_entrypoint_serves_healthy_and_stops_cleanly_on_sigterm(image_run):
    proc, url, env, health, origin, shards, tmp_path = image_run
    status, body, _ = http_get(f"{url}/-/healthz")
    assert status == 200
    # the image's HEALTHCHECK command, run as Docker runs it
    res = subprocess.run(health, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    # a shard through the proxy: miss, then hit
    status, body, headers = http_get(f"{url}/train-1.tar")
    assert status == 200 and body == shards["/train-1.tar"]
    status, body, headers = http_get(f"{url}/train-1.tar")
    # (COALESCED when the first download is still being committed)
    assert body == shards["/train-1.tar"] and headers.get("X-Cache") in ("HIT", "COALESCED")
    assert origin.gets["/train-1.tar"] == 1
    # every series the dashboard queries is exported
    status, text, _ = http_get(f"{url}/metrics")
    exported = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text.decode(), re.M):
        exported.add(name)
        if kind == "counter":
            exported.add(name if name.endswith("_total") else name + "_total")
        if kind == "histogram":
            exported |= {name + s for s in ("_bucket", "_sum", "_count")}
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert used <= exported, f"dashboard queries metrics not exported: {used - exported}"
    # SIGTERM (what `docker stop` sends to PID 1): a clean, prompt exit
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(35) == 0
    assert time.monotonic() - t0 < 30
    assert not list((tmp_path / "cache").glob("*.part"))
    res = subprocess.run(health, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode != 0  # the healthcheck notices a dead proxy


def test_trainer_reads_through_the_proxy_and_prints_throughput(image_run, tmp_path):
    proc, url, env, health, origin, shards, _ = image_run
    trainer = str(REPO / "docker" / "trainer.py")
    data = tmp_path / "data"
    res = subprocess.run(
        [
            sys.executable,
            trainer,
            "make",
            "--out",
            str(data),
            "--shards",
            "3",
            "--samples",
            "10",
            "--sample-size",
            "2000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    for name in sorted(os.listdir(data)):
        origin.files[f"/ds/{name}"] = (data / name).read_bytes()
    res = subprocess.run(
        [
            sys.executable,
            trainer,
            "read",
            "--urls",
            f"{url}/ds/train-{{000000..000002}}.tar",
            "--epochs",
            "2",
            "--sidecar",
            url,
            "--json",
            "--opener",
            "urllib",  # as in the slim image, which has no curl
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in env.items() if not k.startswith("SHARDCACHE_")},
    )
    assert res.returncode == 0, res.stderr
    assert re.search(r"epoch 0: 30 samples, .* samples/s, .* MB/s", res.stdout)
    epochs = json.loads(res.stdout.strip().splitlines()[-1])
    assert [e["samples"] for e in epochs] == [30, 30]
    assert "sidecar /-/stats" in res.stdout
    # the second epoch came from the cache: one origin GET per shard in all
    assert [origin.gets[f"/ds/train-{i:06d}.tar"] for i in range(3)] == [1, 1, 1]


# ------------------------------------------------------------------------------ the lock


def yaml_strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in yaml_strings(k) + yaml_strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in yaml_strings(v)]
    return [node] if isinstance(node, str) else []


def s3_upstream_users() -> set[str]:
    """The recipes under docker/ (compose files, Kubernetes manifests) with an s3://
    value, comments left out."""
    users = set()
    for path in sorted((REPO / "docker").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if any("s3://" in s for s in yaml_strings(doc)):
                users.add(str(path.relative_to(REPO)))
    return users


def lock_misses(lock_text: str, extra: str) -> list[str]:
    """The requirements of the package's ``extra`` that ``lock_text`` does not pin to a
    version they allow."""
    pins = {}
    for line in lock_text.splitlines():
        name, eq, version = line.partition("==")
        if eq and not line.startswith("#"):
            pins[canonicalize_name(name)] = version.strip()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    misses = []
    for spec in project["optional-dependencies"][extra]:
        req = Requirement(spec)
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None or not req.specifier.contains(pinned, prereleases=True):
            misses.append(f"{spec} (lock: {pinned})")
    return misses


def test_image_lock_holds_the_s3_extra_the_recipes_need():
    users = s3_upstream_users()
    assert {"docker/compose.yaml", "docker/k8s/configmap.yaml"} <= users
    assert lock_misses(LOCK.read_text(), "s3") == [], (
        f"{sorted(users)} use s3:// upstreams but docker/requirements.lock lacks the s3 "
        "extra: regenerate it with docker/update-lock.sh"
    )
    # the lock's own recipe installs the extra
    assert '".[s3]"' in (REPO / "docker" / "update-lock.sh").read_text()


def test_lock_check_catches_a_missing_extra():
    text = LOCK.read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("aiobotocore"))
    assert [m for m in lock_misses(without, "s3") if m.startswith("aiobotocore")]
    too_old = re.sub(r"^aiobotocore==.*$", "aiobotocore==2.0.0", text, flags=re.M)
    assert lock_misses(too_old, "s3")
