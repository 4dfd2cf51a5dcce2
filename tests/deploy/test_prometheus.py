"""deploy/prometheus/alerts.yml: promtool check rules, promtool test rules
(every alert has a firing case), and every metric an alert uses is one a
real numaserve supervisor exports on /metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian prometheus; scripts/install)")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """numaserve_* names in a PromQL expression (selectors, not label values or strings)."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(re.findall(r"\bnumaserve_[a-z0-9_]+\b", no_strings))


@needs_promtool
def test_promtool_check_rules() -> None:
    r = subprocess.run([PROMTOOL, "check", "rules", str(PROM / "alerts.yml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], capture_output=True, text=True, timeout=120,
                       cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_test_would_catch_a_changed_threshold(tmp_path: Path) -> None:
    """The unit tests pin behaviour: the same tests against a rule with another threshold fail."""
    text = (PROM / "alerts.yml").read_text().replace("numaserve_worker_remote_memory_ratio > 0.2",
                                                      "numaserve_worker_remote_memory_ratio > 0.5")
    (tmp_path / "alerts.yml").write_text(text)
    shutil.copy(PROM / "alerts.test.yml", tmp_path / "alerts.test.yml")
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode != 0 and "NumaserveRemoteMemoryHigh" in r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = yaml.safe_load((PROM / "alerts.test.yml").read_text())["tests"]
    firing, quiet = set(), set()
    for t in tests:
        for a in t["alert_rule_test"]:
            (firing if a["exp_alerts"] else quiet).add(a["alertname"])
    names = {r["alert"] for r in rules()}
    assert names == firing, names ^ firing
    assert names == quiet, names ^ quiet
    for r in rules():
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_the_alerts_named_in_the_issue_exist() -> None:
    names = {r["alert"] for r in rules()}
    for need in ("NumaserveSlotFailed", "NumaserveCrashLoop", "NumaserveLeakRecycling", "NumaserveShedding",
                 "NumaserveBindingNotVerified", "NumaserveRemoteMemoryHigh", "NumaserveWatchdogMissed"):
        assert need in names


@pytest.mark.slow
def test_every_metric_an_alert_uses_is_exported() -> None:
    from tests.integration.harness import Running, http_get

    used = set().union(*(metric_names(r["expr"]) for r in rules()))
    assert used, "no numaserve_* metric found in the alerts"
    with Running(["--nodes", "0", "--bind", "127.0.0.1:0"]) as sup:
        for _ in range(5):
            http_get(sup.port)
        deadline = time.monotonic() + 30
        while True:   # per-worker data (binding, memory) appears once the worker reported
            addr = sup.status()["supervisor"]["admin"]
            text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
            exported = {ln.split("{")[0].split()[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
            if used <= exported or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert used <= exported, f"used by alerts but not exported: {sorted(used - exported)}"
    # and the label values the alerts match on are the ones numaserve uses
    from numaserve.supervisor.metrics import (
        RESTART_REASONS,
        SLOT_STATES,
        SUPERVISOR_STATES,
    )

    exprs = " ".join(r["expr"] for r in rules())
    for reason in re.findall(r'reason=~?"([^"]+)"', exprs) + re.findall(r'reason!~"([^"]+)"', exprs):
        assert set(reason.split("|")) <= set(RESTART_REASONS), reason
    for state in re.findall(r'state="([^"]+)"', exprs):
        assert state in SLOT_STATES or state in SUPERVISOR_STATES, state


@needs_promtool
def test_promtool_test_would_catch_a_changed_locality_threshold(tmp_path: Path) -> None:
    """The locality alert's unit test pins its threshold: at 0.6 the 62 % worker would not alert."""
    text = (PROM / "alerts.yml").read_text().replace("numaserve_worker_memory_local_ratio < 0.9",
                                                      "numaserve_worker_memory_local_ratio < 0.6")
    (tmp_path / "alerts.yml").write_text(text)
    shutil.copy(PROM / "alerts.test.yml", tmp_path / "alerts.test.yml")
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode != 0 and "NumaserveMemoryLocalityLow" in r.stdout + r.stderr
