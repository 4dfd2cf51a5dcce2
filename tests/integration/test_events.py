"""Lifecycle events on the ZeroMQ PUB stream (the same records as the JSON log)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import zmq

from tests.integration.harness import Running

pytestmark = pytest.mark.slow


def test_lifecycle_events_are_published() -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]) as sup:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"event")
        sub.setsockopt(zmq.SUBSCRIBE, b"stats")
        sub.connect(f"ipc://{sup.rt / 'events.sock'}")
        # the subscriptions reached the publisher once a stats message (sent every second) arrives
        until = time.monotonic() + 10
        while not (sub.poll(500) and sub.recv_multipart()[0] == b"stats"):
            assert time.monotonic() < until, "no stats on events.sock within 10 s"
        victim = sup.slots()[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not {"worker_crash", "backoff", "spawn", "worker_ready"} <= set(seen):
            if sub.poll(500):
                topic, payload = sub.recv_multipart()
                if topic != b"event":   # (subscribed to stats too, above: they carry no level)
                    continue
                ev = json.loads(payload)
                seen.setdefault(ev["event"], ev)
        sub.close(0)
        assert {"worker_crash", "backoff", "spawn", "worker_ready"} <= set(seen), sorted(seen)
        crash = seen["worker_crash"]
        assert crash["slot"] == 1 and crash["pid"] == victim and "SIGKILL" in crash["exit"]
        assert seen["backoff"]["delay_s"] >= 0 and seen["spawn"]["slot"] == 1
        assert all("timestamp" in e and e["level"] for e in seen.values())
