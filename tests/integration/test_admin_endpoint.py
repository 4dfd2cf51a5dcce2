"""The supervisor's admin HTTP endpoint, scraped over real HTTP from the real `numaserve start`.

The harness config sets ``[admin] bind = "127.0.0.1:0"``; the chosen address is
``supervisor.admin`` in ``numaserve status --json``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from numaserve.config import SECTIONS
from tests.integration.harness import FAST_CONFIG, Running, http_get

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("admin" not in SECTIONS, reason="[admin] is not wired into Config yet"),
]

TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]
CONFIG = FAST_CONFIG if "[admin]" in FAST_CONFIG else FAST_CONFIG + '[admin]\nbind = "127.0.0.1:0"\n'


def get(address: str, path: str, *, method: str = "GET", timeout: float = 5.0) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = get(address, "/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def pick(samples: dict[Any, float], name: str, **labels: str) -> float:
    found = [v for (n, lab), v in samples.items() if n == name and all((k, v2) in lab for k, v2 in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and all((k, v2) in lab for k, v2 in labels.items()))


def test_metrics_health_and_readiness_over_http() -> None:
    # exec'd workers: a worker forked from the warm template replaces a killed one in ~30 ms, too
    # short a window for this test to see /readyz name the slot (tests/integration/test_template.py
    # covers the forked replacement); an exec'd one takes a fresh interpreter's start-up
    with Running(TWO + ["--worker-start", "exec"], config=CONFIG) as sup:
        st = sup.status()
        address = st["supervisor"]["admin"]
        assert address and address.startswith("127.0.0.1:") and not address.endswith(":0"), st["supervisor"]

        assert get(address, "/healthz")[0] == 200
        status, body = get(address, "/readyz")
        assert status == 200 and json.loads(body)["status"] == "ready"
        assert get(address, "/nope")[0] == 404

        assert sup.port is not None
        for _ in range(20):
            assert http_get(sup.port, "/")[0] == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # workers report stats about once a second
            m = scrape(address)
            if total(m, "numaserve_requests_total", status_class="2xx") >= 20:
                break
            time.sleep(0.2)
        assert total(m, "numaserve_requests_total", status_class="2xx") >= 20
        for slot in ("0", "1"):
            assert pick(m, "numaserve_slot_state", slot=slot, state="ready") == 1
            assert pick(m, "numaserve_binding_verified", slot=slot) == 1
            assert pick(m, "numaserve_worker_rss_bytes", slot=slot) > 0
            assert ("numaserve_accept_queue_depth", (("address", f"127.0.0.1:{sup.port}"), ("node", "0"),
                                                     ("slot", slot))) in m
        assert pick(m, "numaserve_supervisor_ready") == 1
        assert pick(m, "numaserve_request_duration_seconds_count", slot="0") + \
            pick(m, "numaserve_request_duration_seconds_count", slot="1") >= 20
        assert pick(m, "numaserve_supervisor_loop_heartbeat_age_seconds") < 1.0
        before = {k: v for k, v in m.items() if k[0] in ("numaserve_requests_total",
                                                         "numaserve_request_duration_seconds_count")}

        # a worker dies: /readyz names the slot until the replacement is ready; counters never go back
        victim = st["slots"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        seen_unready: list[Any] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status, body = get(address, "/readyz")
            if status == 503:
                seen_unready = json.loads(body)["unready"]
            elif seen_unready:
                break
            time.sleep(0.02)
        assert seen_unready and seen_unready[0]["slot"] == 0, seen_unready
        assert get(address, "/healthz")[0] == 200          # the supervisor itself is fine
        sup.wait_ready()
        m = scrape(address)
        for key, v in before.items():
            assert m.get(key, -1) >= v, (key, v, m.get(key))
        assert pick(m, "numaserve_worker_restarts_total", slot="0", reason="sigkill") == 1

        # stopping: health and readiness go 503 (or the endpoint is already gone)
        sup.signal(signal.SIGTERM)
        codes = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sup.proc.poll() is None:
            try:
                codes.add(get(address, "/healthz", timeout=1)[0])
            except OSError:
                codes.add("closed")
            if codes - {200}:
                break
            time.sleep(0.02)
        assert codes - {200}, codes
        assert sup.wait_exit(30) == 0
        with pytest.raises(OSError):
            get(address, "/healthz", timeout=1)


def test_admin_disabled() -> None:
    cfg = CONFIG.replace('bind = "127.0.0.1:0"', 'bind = ""') if '[admin]' in CONFIG else CONFIG
    assert 'bind = ""' in cfg
    with Running(TWO, config=cfg) as sup:
        assert sup.status()["supervisor"]["admin"] is None
