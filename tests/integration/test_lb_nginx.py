"""A rolling restart behind a real nginx (open source: no active health checks).

nginx never asks /readyz, so numaserve skips lb_grace (nothing watches) and
relies on the rest of the stop path: queued connections are taken before the
workers stop, and the listeners go away as the workers stop accepting, so
nginx's new connections to the stopping host are refused and retried on the
next one (deploy/nginx/numaserve.conf: proxy_next_upstream error).  Keep-alive,
new-connection, POST and SSE load: 0 failed requests at the client.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.lbfleet import NGINX, FleetLoad, Instance, Nginx, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NGINX is None, reason="nginx not installed (scripts/install)")]


def test_rolling_restart_behind_nginx_loses_no_request() -> None:
    names = ["numa-a", "numa-b", "numa-c"]
    instances = {n: Instance(n, lb_grace=5.0) for n in names}
    lb = None
    exit_codes = {}
    grace_events = {}
    try:
        for inst in instances.values():
            inst.start()
        lb = Nginx([i.port for i in instances.values()])
        with FleetLoad(lb.port, keepalive=2, fresh=2, posts=1, streams=1, pace=0.02) as load:
            time.sleep(2.0)
            for n, inst in instances.items():
                inst.sigterm()
                exit_codes[n] = inst.wait_exit(60)
                assert inst.run is not None
                grace_events[n] = [e for e in inst.run.events() if e.get("event") == "lb_grace"]
                inst.close()
                inst.start()
                # the rolling procedure: the next host goes only once this one is back in
                # nginx's rotation (nginx retries a refusing host after fail_timeout, 5 s)
                wait_until(lambda: load.report.answered_by[f"{n}.2"] > 0, 30, f"{n} back in nginx's rotation")
                time.sleep(1.0)
            # traffic on the fully restarted fleet too: nginx tries a host that
            # refused a connection again only after fail_timeout (5 s)
            wait_until(lambda: all(load.report.answered_by[f"{n}.2"] for n in names), 30,
                       "every restarted instance to serve")
            time.sleep(1.0)
        report = load.report
        nginx_log = lb.error_log()
    finally:
        if lb is not None:
            lb.close()
        for inst in instances.values():
            inst.close()
    assert exit_codes == {n: 0 for n in names}
    for n in names:   # nobody watched /readyz: no time spent waiting for a balancer that cannot see it
        assert len(grace_events[n]) == 1 and grace_events[n][0]["seconds"] == 0, grace_events[n]
    assert report.failed == 0, report.summary() + "\nnginx error log:\n" + nginx_log[-2500:]
    for n in names:
        assert report.answered_by[f"{n}.1"] > 0 and report.answered_by[f"{n}.2"] > 0, report.summary()
    assert report.ok["stream"] > 0 and report.ok["post"] > 0, report.summary()
