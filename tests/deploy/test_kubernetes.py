"""deploy/kubernetes: core objects pass kubernetes-validate --strict (offline
schemas); what its schemas cannot say (Guaranteed QoS, probes on the right
port, a grace period longer than numaserve's stop, the CRD objects matching
the DaemonSet) is checked here against the manifests and numaserve's config."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from numaserve.config import load_config, parse_bind
from numaserve.supervisor.arbiter import ACCEPT_SETTLE_MAX_S

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
CORE = ["namespace.yaml", "configmap.yaml", "daemonset.yaml", "service.yaml"]
CRD = ["podmonitor.yaml", "prometheusrule.yaml"]
VERSIONS = ["1.28.0", "1.37.0"]   # topology manager GA since 1.27; the newest schemas shipped

KV = shutil.which("kubernetes-validate")
if KV is None and Path(sys.executable).with_name("kubernetes-validate").exists():
    KV = str(Path(sys.executable).with_name("kubernetes-validate"))
needs_kv = pytest.mark.skipif(KV is None, reason="kubernetes-validate not installed (pip install -e '.[test]')")


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    assert len(docs) == 1, name
    return docs[0]


def pod_spec() -> dict[str, Any]:
    return load("daemonset.yaml")["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (c,) = pod_spec()["containers"]
    return c


def numaserve_toml() -> str:
    return load("configmap.yaml")["data"]["numaserve.toml"]


def effective_config(tmp_path: Path) -> Any:
    f = tmp_path / "numaserve.toml"
    f.write_text(numaserve_toml())
    return load_config(str(f), {}, environ={})


@needs_kv
@pytest.mark.parametrize("version", VERSIONS)
def test_core_objects_pass_kubernetes_validate_strict(version: str) -> None:
    r = subprocess.run([KV, "--strict", "-k", version, *[str(K8S / n) for n in CORE]],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # every object was really checked against a schema (unknown kinds only warn)
    assert r.stdout.count(" passed for resource ") == len(CORE), r.stdout + r.stderr
    assert "Couldn't find schema" not in r.stdout + r.stderr


@needs_kv
def test_strict_validation_would_catch_a_typo(tmp_path: Path) -> None:
    ds = load("daemonset.yaml")
    ds["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    bad = tmp_path / "ds.yaml"
    bad.write_text(yaml.safe_dump(ds))
    r = subprocess.run([KV, "--strict", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "readinesProbe" in r.stdout + r.stderr


def test_kustomization_lists_every_manifest() -> None:
    k = load("kustomization.yaml")
    assert k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(CORE + CRD)
    for r in k["resources"]:
        assert (K8S / r).is_file(), r
    namespaces = {load(n)["metadata"].get("namespace") for n in CORE[1:] + CRD}
    assert namespaces == {load("namespace.yaml")["metadata"]["name"]}


def test_configmap_is_a_valid_numaserve_config(tmp_path: Path) -> None:
    cfg = effective_config(tmp_path)
    assert cfg.placement.nodes == "all" and cfg.placement.workers_per_node == "auto"
    # reachable from the kubelet and Prometheus: not loopback
    assert parse_bind(cfg.admin.bind)[0] in ("0.0.0.0", "::")
    assert all(parse_bind(b)[0] in ("0.0.0.0", "::") for b in cfg.server.bind)
    assert cfg.server.lb_grace > 0


def test_one_pod_per_node_rolled_one_at_a_time() -> None:
    ds = load("daemonset.yaml")
    assert ds["kind"] == "DaemonSet"
    ru = ds["spec"]["updateStrategy"]["rollingUpdate"]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate" and ru["maxUnavailable"] == 1
    assert ru.get("maxSurge", 0) == 0   # exclusive cores cannot be held twice on a node
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in ds["spec"]["selector"]["matchLabels"].items())


def _cpu_is_integer(q: str) -> bool:
    return bool(re.fullmatch(r"[1-9][0-9]*", str(q)))


def test_guaranteed_qos_with_integer_cpus() -> None:
    spec = pod_spec()
    for c in spec.get("initContainers", []) + spec["containers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"], f"{c['name']}: requests must equal limits (Guaranteed QoS)"
        assert {"cpu", "memory"} <= set(res["limits"]), c["name"]
        assert _cpu_is_integer(res["limits"]["cpu"]), f"{c['name']}: integer CPUs for the static CPU manager"
        for k in res["limits"]:
            if k.startswith("hugepages-"):
                assert res["requests"][k] == res["limits"][k]


def test_probes_on_the_admin_port(tmp_path: Path) -> None:
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    cfg = effective_config(tmp_path)
    assert ports["admin"] == parse_bind(cfg.admin.bind)[1]
    assert ports["http"] == parse_bind(cfg.server.bind[0])[1]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # probed often enough that numaserve counts readiness as watched and spends lb_grace
    from numaserve.supervisor.lbgrace import watch_window

    assert c["readinessProbe"]["periodSeconds"] < watch_window(cfg.server.lb_grace)
    assert "startupProbe" not in c or c["startupProbe"]["httpGet"]["port"] == "admin"


def test_termination_grace_covers_numaserves_stop(tmp_path: Path) -> None:
    cfg = effective_config(tmp_path)
    need = (cfg.server.lb_grace + ACCEPT_SETTLE_MAX_S + cfg.server.graceful_timeout
            + cfg.supervisor.stop_timeout)
    assert pod_spec()["terminationGracePeriodSeconds"] > need


def test_security_context_matches_the_image() -> None:
    spec, c = pod_spec(), container()
    psc, csc = spec["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True
    user = re.search(r"^USER\s+(\d+):(\d+)\s*$", (REPO / "Dockerfile").read_text(), re.M)
    assert user, "Dockerfile needs a numeric USER uid:gid"
    assert (psc["runAsUser"], psc["runAsGroup"]) == (int(user.group(1)), int(user.group(2)))
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    # RuntimeDefault lets set_mempolicy/mbind through only with CAP_SYS_NICE: without it
    # every worker's memory binding fails
    assert csc["capabilities"]["add"] == ["SYS_NICE"]
    assert c["image"].rsplit(":", 1)[0].endswith("/numaserve")
    # the runtime directory lives in a writable volume (read-only root file system)
    env = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(RUNTIME_DIRECTORY)=(\S+)", (REPO / "Dockerfile").read_text(), re.M)}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert any(env["RUNTIME_DIRECTORY"].startswith(m + "/") for m in mounts), (env, mounts)
    assert "/etc/numaserve" in mounts and "/tmp" in mounts


def test_service_and_podmonitor_select_the_daemonset_pods() -> None:
    pod_labels = load("daemonset.yaml")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container()["ports"]}
    svc = load("service.yaml")
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    pm = load("podmonitor.yaml")   # a CRD object: structure checked here, not by a schema
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(pm) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pm["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    assert all(pod_labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "admin" and ep["path"] == "/metrics"
    assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings", "metricRelabelings"}


def test_prometheusrule_carries_the_same_rules_as_alerts_yml() -> None:
    pr = load("prometheusrule.yaml")
    assert (pr["apiVersion"], pr["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert set(pr) == {"apiVersion", "kind", "metadata", "spec"} and set(pr["spec"]) == {"groups"}
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert pr["spec"]["groups"] == alerts["groups"]


def test_kubelet_example_has_the_settings_the_readme_names() -> None:
    k = yaml.safe_load((K8S / "kubelet-config.example.yaml").read_text())
    assert k["kind"] == "KubeletConfiguration"
    assert k["cpuManagerPolicy"] == "static"
    assert k["topologyManagerPolicy"] in ("single-numa-node", "restricted")
    readme = (K8S / "README.md").read_text()
    for word in ("cpuManagerPolicy: static", "single-numa-node", "restricted", "SYS_NICE", "lb_grace",
                 "terminationGracePeriodSeconds"):
        assert word in readme, word


def test_readme_example_toml_blocks_parse() -> None:
    for block in re.findall(r"```toml\n(.*?)```", (K8S / "README.md").read_text(), re.S):
        tomllib.loads(block)
