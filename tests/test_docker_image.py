"""The container image, built from docker/Dockerfile as written and run by a Docker
engine: it serves, turns healthy by its own HEALTHCHECK, stops with exit code 0 on
SIGTERM, keeps its cache on a volume across a restart, and carries the package data
(the status page) byte for byte.

The base image is the registry's ``python:<version>-slim-bookworm`` when the engine has
it or can pull it; where the registry is out of reach, a stand-in built from Debian
packages (mmdebstrap: python3, python3-venv, python-is-python3, ca-certificates; the
host's CA bundle, for machines whose HTTPS goes through a proxy with its own CA) is
imported under that name, and the same Dockerfile builds on it.

Skips, with the reason, where no Docker engine answers (``docker info``), or where the
base can be neither pulled nor built. .ci/run tries to start an engine first.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from opshelpers import Origin, free_port, http_get, make_shard

from proxy import statuspage
from shardcache._version import __version__

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKER = shutil.which("docker")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
STANDIN_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    assert DOCKER
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done


def base_image() -> str:
    """The FROM of docker/Dockerfile with its ARG default: python:3.11-slim-bookworm."""
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    (base,) = set(re.findall(r"^FROM (python:\S+)", text, re.M))
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


def engine_or_skip() -> None:
    if DOCKER is None:
        pytest.skip("no docker client on PATH (Debian: apt-get install docker.io)")
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("docker info: no answer from the engine in 30 s")
    if info.returncode != 0 or not info.stdout.strip():
        pytest.skip(f"no Docker engine answers: {info.stderr.strip()[:400]}")


def ensure_base(tmp: Path) -> str:
    """The base image present in the engine: there already, pulled, or the stand-in."""
    base = base_image()
    if docker("image", "inspect", base, check=False).returncode == 0:
        return "present"
    try:
        pulled = docker("pull", base, timeout=180, check=False)
    except subprocess.TimeoutExpired:
        pulled = None
    if pulled is not None and pulled.returncode == 0:
        return "pulled"
    why = "timed out" if pulled is None else pulled.stderr.strip()[:300]
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        pytest.skip(f"{base}: pull failed ({why}) and no mmdebstrap to build a stand-in")
    tar = tmp / "base.tar"
    argv = [
        mmdebstrap,
        "--variant=minbase",
        f"--include={STANDIN_PACKAGES}",
        '--aptopt=Acquire::Check-Valid-Until "false"',
    ]
    if HOST_CA.is_file():
        argv.append(f"--customize-hook=upload {HOST_CA} {HOST_CA}")
    argv += ["bookworm", str(tar)]
    made = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if made.returncode != 0:
        pytest.skip(f"{base}: pull failed ({why}); mmdebstrap failed: {made.stderr[-400:]}")
    # pip trusts its own bundle unless told: point it at the system's (with the host's CA)
    docker(
        "import",
        "--change",
        f"ENV PIP_CERT={HOST_CA}",
        str(tar),
        base,
        timeout=300,
    )
    return "stand-in"


# what pip and apt say when the network, not the Dockerfile, is what fails
_NETWORK_FAILURES = (
    "Temporary failure in name resolution",
    "Name or service not known",
    "CERTIFICATE_VERIFY_FAILED",
    "ProxyError",
    "Connection refused",
    "Network is unreachable",
    "Read timed out",
    "Failed to establish a new connection",
)


def _unreachable(stderr: str) -> bool:
    """Whether a failed build failed for want of the package index (skip), not because
    of the Dockerfile (fail)."""
    return any(s in stderr for s in _NETWORK_FAILURES)


def health(container: str) -> str:
    return docker("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip()


def wait_for(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_image_builds_serves_turns_healthy_stops_cleanly_and_keeps_its_volume(tmp_path):
    engine_or_skip()
    how = ensure_base(tmp_path)
    tag = f"shardcache-test:{__version__}-{uuid.uuid4().hex[:8]}"
    volume = f"shardcache-test-{uuid.uuid4().hex[:8]}"
    containers: list[str] = []
    shards = {f"/train-{i}.tar": make_shard(i, 400_000) for i in range(2)}
    try:
        # host networking: the build reaches the package index as this machine does
        built = docker(
            "build", "--network", "host", "-f", str(DOCKERFILE), "-t", tag, str(REPO),
            timeout=1200, check=False,
        )  # fmt: skip
        if built.returncode != 0 and _unreachable(built.stderr):
            pytest.skip(f"the build cannot reach the package index: {built.stderr[-600:]}")
        assert built.returncode == 0, f"build on the {how} base failed:\n{built.stderr[-3000:]}"

        # the page's files are in the image, exactly as in the sources
        code = (
            "import hashlib, sys\nfrom importlib import resources\n"
            "for n in sys.argv[1:]:\n"
            "    b = resources.files('proxy').joinpath('static', n).read_bytes()\n"
            "    print(n, hashlib.sha256(b).hexdigest())\n"
        )
        listed = docker(
            "run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c", code,
            *statuspage.STATIC_FILES,
        ).stdout.split()  # fmt: skip
        expected = []
        for name in statuspage.STATIC_FILES:
            data = (REPO / "proxy" / "static" / name).read_bytes()
            expected += [name, hashlib.sha256(data).hexdigest()]
        assert listed == expected

        with Origin(shards) as origin:

            def run() -> tuple[str, str]:
                port = free_port()
                cid = docker(
                    "run", "-d", "--network", "host", "-v", f"{volume}:/var/cache/shardcache",
                    # the image's own HEALTHCHECK command, checked more often than in service
                    "--health-interval", "1s", "--health-start-period", "30s",
                    "-e", f"SHARDCACHE_UPSTREAM={origin.url}",
                    "-e", f"SHARDCACHE_PORT={port}", "-e", "SHARDCACHE_HOST=127.0.0.1",
                    tag,
                ).stdout.strip()  # fmt: skip
                containers.append(cid)
                wait_for(lambda: health(cid) == "healthy", "healthy", 90)
                return cid, f"http://127.0.0.1:{port}"

            cid, url = run()
            status, body, headers = http_get(f"{url}/train-0.tar")
            assert status == 200 and body == shards["/train-0.tar"]
            assert headers["X-Cache"] == "MISS"
            status, body, headers = http_get(f"{url}/train-0.tar")
            assert status == 200 and headers["X-Cache"] == "HIT"
            # the status page from the image: / leads to it, its files as in the sources
            status, page, headers = http_get(f"{url}/")
            assert status == 200 and page == statuspage.static_file("index.html")
            assert "default-src 'self'" in headers["Content-Security-Policy"]
            for name in ("status.js", "status.css"):
                assert http_get(f"{url}/-/static/{name}")[1] == statuspage.static_file(name)

            docker("stop", "--time", "30", cid, timeout=60)  # SIGTERM (STOPSIGNAL)
            state = docker("inspect", "-f", "{{.State.ExitCode}} {{.State.OOMKilled}}", cid)
            assert state.stdout.split() == ["0", "false"], state.stdout
            logs = docker("logs", cid).stdout + docker("logs", cid).stderr
            assert "Traceback" not in logs, logs[-3000:]

            # a new container on the same volume: the entry is still there
            cid2, url2 = run()
            status, body, headers = http_get(f"{url2}/train-0.tar")
            assert status == 200 and body == shards["/train-0.tar"]
            assert headers["X-Cache"] == "HIT"
            assert origin.gets["/train-0.tar"] == 1
            docker("stop", "--time", "30", cid2, timeout=60)
            assert docker("inspect", "-f", "{{.State.ExitCode}}", cid2).stdout.strip() == "0"
    finally:
        for cid in containers:
            docker("rm", "-f", cid, check=False, timeout=60)
        docker("volume", "rm", "-f", volume, check=False, timeout=60)
        docker("image", "rm", "-f", tag, check=False, timeout=120)


def test_base_image_name_is_read_from_the_dockerfile():
    assert base_image() == "python:3.11-slim-bookworm"
