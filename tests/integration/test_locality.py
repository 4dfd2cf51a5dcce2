"""Locality as data on this machine: every worker's local memory share and threads off node
in /metrics and `numaserve status` (one node here: everything is local)."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import FAST_CONFIG, Running

pytestmark = pytest.mark.slow

CONFIG = FAST_CONFIG + "\n[placement]\nlocality_interval = 1.0\n"
TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode()
        assert r.status == 200, text
    finally:
        conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def by_slot(samples: dict, name: str) -> dict[str, float]:
    return {dict(lab)["slot"]: v for (n, lab), v in samples.items() if n == name}


def test_metrics_and_status_show_locality_for_every_worker() -> None:
    with Running(TWO, config=CONFIG) as sup:
        sup.wait_ready()
        addr = sup.status()["supervisor"]["admin"]
        deadline = time.monotonic() + 60
        while True:
            got = scrape(addr)
            ratios = by_slot(got, "numaserve_worker_memory_local_ratio")
            threads = by_slot(got, "numaserve_worker_threads_off_node")
            if (len(ratios) == 2 and len(threads) == 2) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(ratios) == set(threads) == {"0", "1"}, sorted(k[0] for k in got)
        assert all(r >= 0.99 for r in ratios.values()), ratios      # one node: every page is on it
        assert all(t == 0 for t in threads.values()), threads
        node = {dict(lab)["node"]: v for (n, lab), v in got.items() if n == "numaserve_node_memory_remote_ratio"}
        assert node == {"0": pytest.approx(0.0, abs=0.01)}, node
        repairs = {(dict(lab)["slot"], dict(lab)["action"]): v for (n, lab), v in got.items()
                   if n == "numaserve_locality_repairs_total"}
        assert repairs == {(s, a): 0.0 for s in ("0", "1") for a in ("migrate", "recycle")}
        assert got[("numaserve_locality_samples_total", ())] >= 2
        assert got[("numaserve_locality_sample_cpu_seconds_total", ())] > 0
        r = sup.ops("status", "--json")
        assert r.returncode == 0, r.stderr
        for s in json.loads(r.stdout)["slots"]:
            loc = s["locality"]
            assert loc["local_ratio"] >= 0.99 and loc["threads_off_node"] == 0 and loc["threads"] >= 1, loc
            assert loc["anon_bytes"] > 0 and loc["repair"] == "off" and loc["repairs"] == {}, loc
        text = sup.ops("status", "--no-json").stdout
        assert "local" in text and "100%" in text, text
