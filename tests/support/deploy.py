"""The deployment files as the tests read them (Dockerfile, Kubernetes manifests, the
Grafana dashboard), and the linters that check them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (it is part of the test extra)")
    return found


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """(instruction, argument) of the last stage, continuation lines joined."""
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, arg = line.partition(" ")
        if instr.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instr.upper(), arg.strip()))
    return stages[-1]


K8S = DOCKER / "k8s"
ALL_MANIFESTS = sorted(K8S.glob("*.yaml"))
# kubernetes-validate has schemas for the core kinds only: the Prometheus Operator's
# resources (monitoring.yaml) are checked by structure in tests/test_k8s.py.
CRD_API_GROUPS = ("monitoring.coreos.com/",)


def is_crd(doc: dict) -> bool:
    return doc["apiVersion"].startswith(CRD_API_GROUPS)


MANIFESTS = [
    p for p in ALL_MANIFESTS if not all(is_crd(d) for d in yaml.safe_load_all(p.read_text()))
]
# the per-Pod sidecar recipes (daemonset.yaml is one proxy per node: tests/test_k8s.py)
SIDECAR_RECIPES = [K8S / "job.yaml", K8S / "pod-hostpath.yaml"]


def dashboard_exprs() -> list[str]:
    dash = json.loads((DOCKER / "grafana" / "shardcache.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bshardcache_[a-z0-9_]+", expr))
