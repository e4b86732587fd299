"""The Kubernetes recipes in docker/k8s/ as an operator applies them (no cluster here):
the images they name are the ones the documented build commands tag, the DaemonSet and its
Service give each node one proxy reached from that node only, the Secrets they read are
in the example, and the Prometheus Operator resources (no schema in kubernetes-validate)
have the structure the operator needs and query only metrics that proxy/metrics.py
exports. The core kinds are validated with kubernetes-validate in tests/test_ops_lint.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from support.deploy import ALL_MANIFESTS, K8S, MANIFESTS, SIDECAR_RECIPES, is_crd, run, tool

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
DEPLOYMENT_MD = REPO / "docs" / "deployment.md"
METRICS_PY = REPO / "proxy" / "metrics.py"
CACHE_DIR = "/var/cache/shardcache"


# ------------------------------------------------------------------------------ YAML


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (PyYAML keeps the last one silently;
    kubectl rejects the manifest)."""


def _no_duplicates(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dups = {k for k in keys if keys.count(k) > 1}
    if dups:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {sorted(dups)}", node.start_mark
        )
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=StrictLoader) if d]


def docs_of(name: str) -> list[dict]:
    return load_docs(K8S / name)


def only(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("path", ALL_MANIFESTS, ids=lambda p: p.name)
def test_manifest_parses_strictly_and_names_its_resources(path):
    text = path.read_text()
    assert "\t" not in text, "tab in YAML"
    docs = load_docs(path)
    assert docs
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"]
    # a file is either all core kinds (kubernetes-validate) or all CRDs (checked here)
    assert len({is_crd(d) for d in docs}) == 1, f"{path.name} mixes core kinds and CRDs"


def test_every_manifest_is_validated_one_way_or_the_other():
    crd_files = {p for p in ALL_MANIFESTS if all(is_crd(d) for d in load_docs(p))}
    assert set(MANIFESTS) | crd_files == set(ALL_MANIFESTS)
    assert {p.name for p in crd_files} == {"monitoring.yaml"}
    expected = {"configmap.yaml", "daemonset.yaml", "job.yaml", "pod-hostpath.yaml"}
    assert expected | {"secret.example.yaml"} <= {p.name for p in MANIFESTS}


def test_strict_loader_rejects_a_duplicate_key():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate"):
        yaml.load("a: 1\nb: 2\na: 3\n", Loader=StrictLoader)


# ------------------------------------------------------------------------------ image tags


def documented_tags(text: str) -> dict[str, str]:
    """{target: tag} of every `docker build -f docker/Dockerfile ...` command in ``text``
    (a Dockerfile header or a Markdown page); the default target is "runtime". A tag
    made of a shell variable (an upgrade example, `-t "shardcache:$VERSION"`) is skipped."""
    tags: dict[str, str] = {}
    for line in text.splitlines():
        line = line.lstrip("# ").strip()
        if not line.startswith("docker build") or "docker/Dockerfile" not in line:
            continue
        target = re.search(r"--target[ =](\S+)", line)
        tag = re.search(r"(?:-t|--tag)[ =](\S+)", line)
        assert tag, f"build command without a tag: {line}"
        if "$" in tag.group(1):
            continue
        name = target.group(1) if target else "runtime"
        assert tags.setdefault(name, tag.group(1)) == tag.group(1), f"two tags for {name}"
    return tags


def manifest_images() -> dict[str, set[str]]:
    """{manifest: images of every container and init container} over the core recipes."""
    out: dict[str, set[str]] = {}
    for path in MANIFESTS:
        for doc in load_docs(path):
            spec = doc.get("spec", {})
            spec = spec.get("template", {}).get("spec", spec)
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                out.setdefault(path.name, set()).add(c["image"])
    return out


def test_manifests_use_exactly_the_tags_the_documented_build_produces():
    from shardcache import __version__

    header = documented_tags(DOCKERFILE.read_text())
    assert header == {
        "runtime": f"shardcache:{__version__}",
        "trainer": f"shardcache-trainer:{__version__}",
    }, "docker/Dockerfile's build commands should tag the image with the package version"
    # docs/deployment.md builds with the same commands
    assert documented_tags(DEPLOYMENT_MD.read_text()) == header
    images = manifest_images()
    assert {"job.yaml", "pod-hostpath.yaml", "daemonset.yaml"} <= set(images)
    for name, used in images.items():
        assert used <= set(header.values()), f"{name} uses {used - set(header.values())}"
    for recipe in ("job.yaml", "pod-hostpath.yaml", "daemonset.yaml"):
        assert header["runtime"] in images[recipe]


def test_tag_check_catches_a_mismatch():
    text = "#   docker build -f docker/Dockerfile -t shardcache .\n"
    assert documented_tags(text) == {"runtime": "shardcache"}  # implicitly :latest
    assert "shardcache:0.1.0" not in documented_tags(text).values()
    with pytest.raises(AssertionError, match="two tags"):
        documented_tags(text + "docker build -f docker/Dockerfile -t shardcache:1 .\n")


def test_docs_apply_only_manifests_that_exist():
    text = DEPLOYMENT_MD.read_text()
    applied = re.findall(r"-f (docker/k8s/\S+\.yaml)", text)
    for name in ("daemonset.yaml", "monitoring.yaml", "job.yaml"):
        assert f"docker/k8s/{name}" in applied, f"docs/deployment.md never applies {name}"
    assert "docker/k8s/secret.example.yaml" in text
    for rel in applied:
        assert (REPO / rel).exists(), rel


# ------------------------------------------------------------------------------ DaemonSet


def test_daemonset_runs_one_proxy_per_node_on_a_hostpath_cache():
    docs = docs_of("daemonset.yaml")
    ds = only(docs, "DaemonSet")
    tpl = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    spec = tpl["spec"]
    (proxy,) = [c for c in spec["containers"] if c["name"] == "shardcache"]
    assert proxy["args"] == ["serve"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    assert "hostPath" in volumes[mounts[CACHE_DIR]]
    # the init step that makes a kubelet-created (root-owned) directory the proxy's
    (owner,) = spec["initContainers"]
    assert {m["mountPath"] for m in owner["volumeMounts"]} == {CACHE_DIR}
    assert "chown" in owner["command"] and "10001:10001" in owner["command"]
    assert proxy["securityContext"]["runAsUser"] == 10001
    assert proxy["securityContext"]["runAsNonRoot"] is True
    # probes, resources
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/-/readyz"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/-/healthz"
    assert proxy["startupProbe"]["httpGet"]["path"] == "/-/readyz"
    for c in spec["containers"] + spec["initContainers"]:
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
    # rolling one node at a time, never two versions on one cache directory
    rolling = ds["spec"]["updateStrategy"]
    assert rolling["type"] == "RollingUpdate"
    assert rolling["rollingUpdate"]["maxUnavailable"] and rolling["rollingUpdate"]["maxSurge"] == 0
    assert spec["terminationGracePeriodSeconds"] > 30  # SHARDCACHE_GRACE_PERIOD's default


def test_daemonset_settings_and_secrets():
    from proxy.policy import parse_size

    spec = only(docs_of("daemonset.yaml"), "DaemonSet")["spec"]["template"]["spec"]
    (proxy,) = spec["containers"]
    env = {e["name"]: e for e in proxy["env"]}
    token = env["SHARDCACHE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] == "shardcache-admin" and token["key"] == "token"
    assert not token.get("optional"), "the node proxy is reachable from every Pod: require it"
    refs = {r.get("configMapRef", r.get("secretRef"))["name"] for r in proxy["envFrom"]}
    assert refs == {"shardcache", "shardcache-s3"}
    assert parse_size(env["SHARDCACHE_CACHE_SIZE"]["value"]) > 0
    cm = only(docs_of("configmap.yaml"), "ConfigMap")
    assert cm["data"]["SHARDCACHE_HOST"] == "0.0.0.0"  # reachable through the Service
    assert cm["data"]["SHARDCACHE_CACHE_DIR"] == CACHE_DIR
    port = [p for p in proxy["ports"] if p["name"] == "http"][0]["containerPort"]
    assert str(port) == cm["data"]["SHARDCACHE_PORT"]


def test_service_reaches_the_proxy_of_the_callers_node_only():
    docs = docs_of("daemonset.yaml")
    svc = only(docs, "Service")
    tpl = only(docs, "DaemonSet")["spec"]["template"]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"].items() <= tpl["metadata"]["labels"].items()
    # no other workload in the recipes carries the selected labels
    for path in SIDECAR_RECIPES:
        for doc in load_docs(path):
            meta = doc["spec"].get("template", {}).get("metadata", doc["metadata"])
            assert not svc["spec"]["selector"].items() <= meta.get("labels", {}).items()
    names = {p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in names


# ------------------------------------------------------------------------------ proxies


def proxy_containers(path: Path) -> list[tuple[dict, dict]]:
    """(container, pod spec) of every proxy (a container named shardcache) in a recipe."""
    out = []
    for doc in load_docs(path):
        spec = doc.get("spec", {})
        spec = spec.get("template", {}).get("spec", spec)
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            if c["name"] == "shardcache":
                out.append((c, spec))
    return out


PROXY_RECIPES = ("job.yaml", "pod-hostpath.yaml", "daemonset.yaml")


@pytest.mark.parametrize("recipe", ["daemonset.yaml", "job.yaml", "pod-hostpath.yaml"])
def test_node_proxy_has_a_writable_tmp(recipe):
    """With --workers above 1 the proxy keeps its metrics files in a temporary directory;
    on a read-only root filesystem without a /tmp volume that would be refused."""
    ((proxy, spec),) = proxy_containers(K8S / recipe)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    assert "/tmp" in mounts, f"{recipe}: the proxy has no /tmp volume"
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert mounts["/tmp"] != mounts[CACHE_DIR]


DURATION_PART = re.compile(r"([0-9.]+)(h|m|s|ms|us)")


def compose_seconds(text: str) -> float:
    """A Compose duration (``40s``, ``1m30s``) in seconds."""
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = DURATION_PART.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * scale[u] for n, u in parts)


def test_stop_timeouts_are_longer_than_the_proxys_grace_period():
    """Docker and the kubelet send SIGKILL after their stop timeout; the proxy needs its
    grace period (SHARDCACHE_GRACE_PERIOD) to let responses finish, and a little more."""
    from proxy.config import DEFAULTS

    default = float(DEFAULTS["grace_period"])
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    service = compose["services"]["shardcache"]
    grace = float(service["environment"].get("SHARDCACHE_GRACE_PERIOD", default))
    assert compose_seconds(service["stop_grace_period"]) >= grace + 5
    for recipe in PROXY_RECIPES:
        for proxy, spec in proxy_containers(K8S / recipe):
            env = {e["name"]: e.get("value") for e in proxy.get("env", [])}
            grace = float(env.get("SHARDCACHE_GRACE_PERIOD") or default)
            assert spec["terminationGracePeriodSeconds"] >= grace + 5, recipe


def test_compose_duration_parser():
    assert compose_seconds("40s") == 40 and compose_seconds("1m30s") == 90
    with pytest.raises(AssertionError):
        compose_seconds("forty")


# ------------------------------------------------------------------------------ Secrets


def secret_refs(path: Path) -> list[tuple[str, str | None, bool]]:
    """(secret, key or None for a whole-Secret envFrom, optional) a manifest reads."""
    refs = []
    for doc in load_docs(path):
        spec = doc.get("spec", {})
        spec = spec.get("template", {}).get("spec", spec)
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append((ref["name"], ref["key"], bool(ref.get("optional"))))
            for e in c.get("envFrom", []):
                if "secretRef" in e:
                    refs.append(
                        (e["secretRef"]["name"], None, bool(e["secretRef"].get("optional")))
                    )
    return refs


def test_secret_example_holds_what_every_recipe_reads_and_only_placeholders():
    secrets = {d["metadata"]["name"]: d for d in docs_of("secret.example.yaml")}
    assert set(secrets) == {"shardcache-admin", "shardcache-s3"}
    for s in secrets.values():
        assert s["kind"] == "Secret" and s["type"] == "Opaque"
        for key, value in s["stringData"].items():
            assert value.startswith("CHANGE-ME"), f"{key}: not a marked placeholder"
    assert set(secrets["shardcache-s3"]["stringData"]) == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    }
    for recipe in PROXY_RECIPES:
        refs = secret_refs(K8S / recipe)
        assert {name for name, _, _ in refs} == set(secrets), recipe
        for name, key, _optional in refs:
            assert key is None or key in secrets[name]["stringData"], (recipe, name, key)


# ------------------------------------------------------------------------------ monitoring


def exported_series() -> set[str]:
    """Every series name proxy/metrics.py registers (a histogram's _bucket/_sum/_count)."""
    from prometheus_client import CollectorRegistry

    from proxy.metrics import ProxyMetrics

    source = set(re.findall(r'"(shardcache_[a-z0-9_]+)"', METRICS_PY.read_text()))
    registry = CollectorRegistry()
    ProxyMetrics(registry)
    series = set()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in source, name
        series.add(name)
        if family.type == "histogram":
            series |= {family.name + s for s in ("_bucket", "_sum", "_count")}
    assert source <= series
    return series


def promql_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bshardcache_[a-z0-9_]+", expr))


DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def check_prometheus_rule(doc: dict, series: set[str]) -> list[str]:
    """What the operator (and Prometheus) would reject or never fire; [] when fine."""
    problems = []
    if doc.get("apiVersion") != "monitoring.coreos.com/v1" or doc.get("kind") != "PrometheusRule":
        problems.append("not a monitoring.coreos.com/v1 PrometheusRule")
    groups = doc.get("spec", {}).get("groups") or []
    if not groups:
        problems.append("spec.groups is empty")
    alerts = []
    for group in groups:
        if not group.get("name") or not group.get("rules"):
            problems.append(f"group without name or rules: {group}")
        for rule in group.get("rules") or []:
            name = rule.get("alert") or rule.get("record")
            expr = rule.get("expr")
            if not name or not isinstance(expr, str) or not expr.strip():
                problems.append(f"rule without alert/record name or expr: {rule}")
                continue
            extra = set(rule) - {"alert", "record", "expr", "for", "labels", "annotations"}
            if extra:
                problems.append(f"{name}: unknown fields {sorted(extra)}")
            if "for" in rule and not DURATION.match(rule["for"]):
                problems.append(f"{name}: bad duration {rule['for']!r}")
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                problems.append(f"{name}: unbalanced brackets")
            used = promql_metrics(expr)
            if not used:
                problems.append(f"{name}: names no shardcache metric")
            if used - series:
                problems.append(f"{name}: metrics not in proxy/metrics.py: {used - series}")
            for rng in re.findall(r"\[([^\]]+)\]", expr):
                if not DURATION.match(rng):
                    problems.append(f"{name}: bad range [{rng}]")
            if "alert" in rule:
                alerts.append(name)
                if rule.get("labels", {}).get("severity") not in ("info", "warning", "critical"):
                    problems.append(f"{name}: no severity label")
                if not rule.get("annotations", {}).get("summary"):
                    problems.append(f"{name}: no summary annotation")
    if len(alerts) != len(set(alerts)):
        problems.append("duplicate alert names")
    return problems


def monitoring() -> tuple[dict, dict]:
    docs = docs_of("monitoring.yaml")
    return only(docs, "ServiceMonitor"), only(docs, "PrometheusRule")


def rule_exprs() -> dict[str, str]:
    _, rule = monitoring()
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def test_prometheus_rule_structure_and_metric_names():
    _, rule = monitoring()
    assert check_prometheus_rule(rule, exported_series()) == []


def test_rule_check_catches_unknown_metrics_and_missing_fields():
    series = exported_series()
    _, rule = monitoring()
    bad = yaml.safe_load(yaml.safe_dump(rule))
    first = bad["spec"]["groups"][0]["rules"]
    first[0]["expr"] = "rate(shardcache_cache_hits_total[5m]) > 0"
    first[1]["for"] = "five minutes"
    del first[2]["labels"]
    first.append({"alert": "NoExpr"})
    problems = "\n".join(check_prometheus_rule(bad, series))
    assert "shardcache_cache_hits_total" in problems
    assert "bad duration" in problems and "no severity" in problems and "NoExpr" in problems


def test_alerts_cover_what_an_operator_needs():
    exprs = rule_exprs()
    joined = "\n".join(exprs.values())
    # hit ratio on shard reads (not the proxy's own routes)
    assert re.search(r'shardcache_requests_total\{cache="HIT"\}', joined)
    assert "shardcache_service_requests_total" not in joined
    # store not writable, cache at its limit
    assert any(re.fullmatch(r"shardcache_store_writable == 0", e.strip()) for e in exprs.values())
    assert any(
        "shardcache_cache_size_bytes" in e and "shardcache_cache_limit_bytes" in e
        for e in exprs.values()
    )
    # upstream errors, failed downloads
    upstream = [e for e in exprs.values() if "shardcache_upstream_requests_total" in e]
    assert upstream and 'outcome=~"error|timeout|aborted"' in upstream[0]
    assert "shardcache_failed_downloads_total" in joined
    # disk near full: the bound in force against the configured one
    assert any(
        "shardcache_cache_effective_limit_bytes" in e and "shardcache_cache_limit_bytes" in e
        for e in exprs.values()
    )
    # the readers' stall
    assert re.search(r"rate\(shardcache_client_wait_seconds_total\[\w+\]\)", joined)


def test_rule_label_values_are_ones_the_proxy_sets():
    text = METRICS_PY.read_text()
    outcomes = set(
        re.search(r"upstream_requests_total\{outcome\}\s+(.+)", text).group(1).split(" | ")
    )
    assert {"ok", "error", "timeout", "aborted", "not_found", "resumed"} <= outcomes
    for expr in rule_exprs().values():
        for values in re.findall(r'outcome=~?"([^"]+)"', expr):
            assert set(values.split("|")) <= outcomes, values
        for values in re.findall(r'cache=~?"([^"]+)"', expr):
            assert set(values.split("|")) <= {"HIT", "MISS", "COALESCED", "BYPASS", "NONE"}


def test_service_monitor_selects_the_node_proxies_service():
    sm, rule = monitoring()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = only(docs_of("daemonset.yaml"), "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"]
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in port_names and ep["path"] == "/metrics"
        assert DURATION.match(ep["interval"])
    # the operator's selectors: the same label on both
    assert sm["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"]


def test_core_kinds_still_fail_kubernetes_validate_when_broken(tmp_path):
    docs = docs_of("daemonset.yaml")
    svc = only(docs, "Service")
    svc["spec"]["internalTrafficPolicy"] = ["Local"]  # wrong type
    only(docs, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavalable"] = 1
    bad = tmp_path / "daemonset.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    res = run(tool("kubernetes-validate"), "--strict", str(bad))
    assert res.returncode != 0, res.stdout


def test_secret_example_names_every_token_protected_route():
    """Each mutating route of proxy/app.py (all need the admin token, checked in its handler) is listed where the
    example explains the token, with the variable the plan client reads."""
    app = (REPO / "proxy" / "app.py").read_text()
    routes = re.findall(r'r\.add_(post|delete|put|patch)\("([^"]+)"', app)
    handlers = "".join((REPO / "proxy" / f).read_text() for f in ("admin.py", "plans_api.py"))
    assert len(routes) == handlers.count("    _require_admin(request)")
    comment = " ".join(
        line.lstrip("# ").strip()
        for line in (K8S / "secret.example.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    for method, path in routes:
        shown = f"{method.upper()} {re.sub(r'{[a-z_]+}', 'ID', path)}"
        assert shown in comment, f"secret.example.yaml does not list {shown}"
    assert "SHARDCACHE_ADMIN_TOKEN" in comment and "shardcache plan" in comment
