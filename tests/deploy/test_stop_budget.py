"""Every place that bounds a stop from outside leaves numaserve's own stop
enough time: lb_grace + the accept-queue hand-over + graceful_timeout + the
kill escalation (systemd's TimeoutStopSec; Kubernetes' grace period is
checked in test_kubernetes.py)."""

from __future__ import annotations

import re
from pathlib import Path

from numaserve.config import Config
from numaserve.supervisor.arbiter import ACCEPT_SETTLE_MAX_S

REPO = Path(__file__).resolve().parents[2]


def stop_budget(cfg: Config) -> float:
    return cfg.server.lb_grace + ACCEPT_SETTLE_MAX_S + cfg.server.graceful_timeout + cfg.supervisor.stop_timeout


def test_systemd_timeout_stop_covers_the_lb_safe_stop() -> None:
    unit = (REPO / "systemd" / "numaserve.service").read_text()
    (value,) = re.findall(r"^TimeoutStopSec=(\d+)\s*$", unit, re.M)
    assert int(value) > stop_budget(Config())
    assert "lb_grace" in unit


def test_documented_rule_matches_the_budget() -> None:
    """The docs say "above lb_grace + graceful_timeout + 10 s": the 10 s must cover the rest."""
    assert ACCEPT_SETTLE_MAX_S + Config().supervisor.stop_timeout <= 10
    for doc in ("README.md", "systemd/numaserve.service.d/10-example.conf", "config/numaserve.toml"):
        text = " ".join((REPO / doc).read_text().split())
        assert "lb_grace" in text and ("+ 10 s" in text or "supervisor.stop_timeout" in text), doc
