"""Lint what cannot run here (no Docker, no cluster): the Dockerfile with hadolint, the
Kubernetes manifests with kubernetes-validate (offline schemas), the compose files against
the compose specification, the Grafana dashboard's queries against the metrics we export,
and the lock file against pyproject's dependencies. Each linter is also shown a broken
file, so a linter that silently passes everything fails here."""

from __future__ import annotations

import json

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import yaml
from packaging.requirements import Requirement
from support.deploy import (
    DOCKER,
    MANIFESTS,
    REPO,
    SIDECAR_RECIPES,
    dashboard_exprs,
    dockerfile_final_stage,
    metric_names,
    run,
    tool,
)


# The metric names DESIGN.md lists; a histogram also exports _bucket, _sum and _count.
def _exported() -> set[str]:
    """Every metric family the proxy exports, as its series are named (counters with
    ``_total``), from a live registry: a new metric must reach the dashboard."""
    from proxy.metrics import ProxyMetrics

    names = set()
    for family in ProxyMetrics().registry.collect():
        if family.type == "histogram":
            continue
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


EXPORTED_METRICS = _exported()
HISTOGRAMS = {"shardcache_time_to_first_byte_seconds"}


# ------------------------------------------------------------------------------ Dockerfile


def test_hadolint_passes_dockerfile():
    res = run(tool("hadolint"), str(DOCKER / "Dockerfile"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install aiohttp\nCMD shardcache serve\n")
    res = run(tool("hadolint"), str(bad))
    assert res.returncode != 0
    assert "DL3007" in res.stdout  # latest tag
    assert "DL3013" in res.stdout  # unpinned pip install


def test_dockerfile_runtime_stage_shape():
    stage = dockerfile_final_stage()
    instrs = {i for i, _ in stage}
    args = {i: a for i, a in stage}
    assert "slim" in args["FROM"]
    assert args["ENTRYPOINT"] == '["shardcache"]'  # exec form: shardcache is PID 1
    assert args["CMD"] == '["serve"]'
    assert args["USER"].split(":")[0] not in ("0", "root")
    assert "VOLUME" in instrs and "HEALTHCHECK" in instrs
    assert "/-/healthz" in args["HEALTHCHECK"]
    assert "curl" not in args["HEALTHCHECK"] and "wget" not in args["HEALTHCHECK"]
    assert "SHARDCACHE_CACHE_DIR=" in " ".join(a for i, a in stage if i == "ENV")


def test_lock_pins_every_runtime_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (DOCKER / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"not pinned: {line}"
            pins[req.name.lower().replace("_", "-")] = spec[0].version
    for dep in project["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{dep} (pyproject.toml) is missing from docker/requirements.lock"
        assert req.specifier.contains(pins[name]), f"lock pins {name}=={pins[name]}, needs {dep}"


def test_dockerignore_keeps_what_the_image_copies():
    copied = []
    for _instr, arg in (
        tuple(line.split(" ", 1))
        for line in (DOCKER / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
    ):
        copied += arg.split()[:-1]
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for src in copied:
        assert src.rstrip("/") in allowed, f"{src} is COPYed but excluded by .dockerignore"
        assert (REPO / src).exists(), f"{src} is COPYed but does not exist"


# ------------------------------------------------------------------------------ Kubernetes


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(manifest):
    res = run(tool("kubernetes-validate"), "--strict", str(manifest))
    assert res.returncode == 0, res.stdout + res.stderr
    # every resource of the file passed, none was skipped for want of a schema
    ndocs = len([d for d in yaml.safe_load_all(manifest.read_text()) if d])
    assert res.stdout.count(" passed ") == ndocs, res.stdout + res.stderr
    assert "WARN" not in res.stdout + res.stderr


def test_kubernetes_validate_rejects_a_bad_manifest(tmp_path):
    doc = yaml.safe_load((DOCKER / "k8s" / "job.yaml").read_text())
    sidecar = doc["spec"]["template"]["spec"]["initContainers"][0]
    sidecar["readinessProbe"]["httpGet"]["prot"] = 8080  # typo'd field
    sidecar["resources"]["requests"]["memory"] = ["256Mi"]  # wrong type
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    res = run(tool("kubernetes-validate"), "--strict", str(bad))
    assert res.returncode != 0, res.stdout


def pod_specs() -> list[dict]:
    specs = []
    for path in SIDECAR_RECIPES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "Pod":
                specs.append((doc["metadata"], doc["spec"]))
            elif "template" in doc.get("spec", {}):
                specs.append((doc["spec"]["template"]["metadata"], doc["spec"]["template"]["spec"]))
    return specs


def test_pods_have_the_sidecar_probes_resources_and_scrape_annotations():
    specs = pod_specs()
    assert len(specs) >= 2
    for meta, spec in specs:
        sidecars = [c for c in spec.get("initContainers", []) if c["name"] == "shardcache"]
        assert len(sidecars) == 1 and sidecars[0]["restartPolicy"] == "Always"
        sc = sidecars[0]
        assert sc["readinessProbe"]["httpGet"]["path"] == "/-/readyz"
        assert sc["livenessProbe"]["httpGet"]["path"] == "/-/healthz"
        assert sc["resources"]["requests"] and sc["resources"]["limits"]
        assert {m["mountPath"] for m in sc["volumeMounts"]} == {"/var/cache/shardcache", "/tmp"}
        ann = meta["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert all("resources" in c for c in spec["containers"])
        trainer_env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        assert trainer_env["TRAINER_URLS"].startswith("http://localhost:8080/")
    cache_volumes = [v for _, s in specs for v in s["volumes"] if v["name"] == "cache"]
    assert any(v.get("emptyDir", {}).get("sizeLimit") for v in cache_volumes)
    assert any("hostPath" in v for v in cache_volumes)


def test_configmap_cache_size_fits_the_emptydir_limit():
    from proxy.policy import parse_size

    cm = yaml.safe_load((DOCKER / "k8s" / "configmap.yaml").read_text())
    job = yaml.safe_load((DOCKER / "k8s" / "job.yaml").read_text())
    (vol,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    limit = vol["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi")
    limit_bytes = int(limit[:-2]) * 1024**3
    assert parse_size(cm["data"]["SHARDCACHE_CACHE_SIZE"]) <= 0.95 * limit_bytes


# ------------------------------------------------------------------------------ compose

COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "tier" / "compose.yaml"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(DOCKER)))
def test_compose_file_matches_the_compose_spec(path):
    res = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_spec_check_rejects_a_bad_file(tmp_path):
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    doc["services"]["trainer"]["depends_on"]["seed"]["condition"] = "service_done"
    doc["services"]["shardcache"]["restart"] = 3
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(doc))
    res = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad))
    assert res.returncode != 0


def test_compose_example_wiring():
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = doc["services"]
    assert {"seaweedfs", "seed", "shardcache", "trainer"} <= set(services)
    sc = services["shardcache"]
    assert sc["environment"]["SHARDCACHE_UPSTREAM"].split("=", 1)[1].startswith("s3://")
    assert any(v.startswith("shardcache-cache:") for v in sc["volumes"])
    assert "shardcache-cache" in doc["volumes"]
    trainer = services["trainer"]
    assert trainer["network_mode"] == "service:shardcache"
    assert trainer["depends_on"]["shardcache"]["condition"] == "service_healthy"
    # every relative file the compose file mounts exists
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), src


# ------------------------------------------------------------------------------ Grafana


def allowed_series() -> set[str]:
    return EXPORTED_METRICS | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}


def test_dashboard_is_json_with_unique_panel_ids():
    dash = json.loads((DOCKER / "grafana" / "shardcache.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "shardcache"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("hit ratio", "saved", "upstream", "first byte", "evictions", "in progress"):
        assert topic in titles, topic


def test_dashboard_queries_name_only_exported_metrics():
    used: set[str] = set()
    for expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, f"query names no shardcache metric: {expr}"
        unknown = names - allowed_series()
        assert not unknown, f"{expr} uses metrics we do not export: {unknown}"
        used |= names
        assert expr.count("(") == expr.count(")"), expr
    # every exported metric is on the dashboard
    assert EXPORTED_METRICS <= used
    assert "shardcache_time_to_first_byte_seconds_bucket" in used


def test_dashboard_metric_check_catches_an_unknown_name():
    assert metric_names("rate(shardcache_cache_hits_total[5m])") - allowed_series()


# ------------------------------------------------------------------------------ yamllint


def test_yamllint_passes_every_deployment_file():
    res = run(tool("yamllint"), "-f", "parsable", "-c", str(REPO / ".yamllint"), str(DOCKER))
    assert res.returncode == 0, res.stdout + res.stderr


def test_yamllint_catches_a_duplicate_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: 2\na: 3\n")
    res = run(tool("yamllint"), "-f", "parsable", "-c", str(REPO / ".yamllint"), str(bad))
    assert res.returncode != 0 and "key-duplicates" in res.stdout, res.stdout
