"""Control messages on the worker side: dispatcher (fake channel) and the real DEALER."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

import pytest
import zmq

from numaserve.control.messages import (
    Ack,
    Command,
    Drain,
    Goodbye,
    Heartbeat,
    Stop,
    decode_from_worker,
    encode,
)
from numaserve.worker.control import CommandDispatcher, ControlChannel, worker_identity


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, str]] = []

    def request_stop(self, deadline: float, reason: str) -> None:
        self.calls.append(("stop", deadline, reason))

    def request_drain(self, deadline: float) -> None:
        self.calls.append(("drain", deadline, ""))


@pytest.fixture
def setup() -> tuple[CommandDispatcher, FakeWorker, list[Any]]:
    worker = FakeWorker()
    posted: list[Any] = []
    return CommandDispatcher(2, 5, worker, posted.append), worker, posted


def test_identity() -> None:
    assert worker_identity(3, 7, 1234) == b"3:7:1234"


def test_stop_acks_and_stops(setup: Any) -> None:
    d, worker, posted = setup
    d.handle_frame(encode(Stop(id="s1", deadline=4.5)))
    assert posted == [Ack(slot=2, generation=5, ref="s1")]
    assert worker.calls == [("stop", 4.5, "stopped")]


def test_drain_acks_and_drains(setup: Any) -> None:
    d, worker, posted = setup
    d.handle_frame(encode(Drain(id="d1", deadline=-3)))
    assert worker.calls == [("drain", 0.0, "")]  # negative deadline clamped
    assert posted == [Ack(slot=2, generation=5, ref="d1")]


def test_ping_and_unknown_commands(setup: Any) -> None:
    d, worker, posted = setup
    d.handle_frame(encode(Command(id="c1", name="ping")))
    d.handle_frame(encode(Command(id="c2", name="reticulate", args={"x": 1})))
    assert posted == [
        Ack(slot=2, generation=5, ref="c1"),
        Ack(slot=2, generation=5, ref="c2", ok=False, detail="unknown command reticulate"),
    ]
    assert worker.calls == []


def test_trim_command(setup: Any) -> None:
    d, _, posted = setup
    d.handle_frame(encode(Command(id="t", name="trim")))
    assert posted[0].ok and posted[0].ref == "t" and "gc collected" in posted[0].detail


@pytest.mark.parametrize("frame", [
    b"",
    b"\x00garbage",
    b"\xc1",
    encode(Heartbeat(slot=0, generation=0, loop_lag=0.0, mono=0.0)),  # wrong direction
    encode(Goodbye(slot=0, generation=0, reason="x")),
    b"\x81\xa4type\xa4Stop",  # right tag, missing fields
    b"\x00" * (2 << 20),      # over MAX_MESSAGE_BYTES
])
def test_malformed_frames_are_counted_and_dropped(setup: Any, frame: bytes) -> None:
    d, worker, posted = setup
    logged: list[Any] = []
    d._debug = lambda *a, **k: logged.append((a, k))
    d.handle_frame(frame)
    assert d.bad_frames == 1 and posted == [] and worker.calls == [] and logged


def test_channel_round_trip_over_ipc() -> None:
    async def main() -> None:
        d = tempfile.mkdtemp(prefix="nswc-")
        endpoint = f"ipc://{d}/ctl.sock"
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        chan = ControlChannel(endpoint, b"1:2:3", linger_ms=100)
        try:
            assert chan.post(Ack(slot=1, generation=2, ref="hello"))
            loop = asyncio.get_running_loop()
            frames = await loop.run_in_executor(None, router.recv_multipart)
            assert frames[0] == b"1:2:3" and decode_from_worker(frames[1]).ref == "hello"
            router.send_multipart([b"1:2:3", encode(Command(id="x", name="ping"))])
            assert await asyncio.wait_for(chan.recv(), 5) == encode(Command(id="x", name="ping"))
            router.send_multipart([b"1:2:3", b"", b"payload"])  # a REQ-style delimiter is tolerated
            assert await asyncio.wait_for(chan.recv(), 5) == b"payload"
        finally:
            chan.close()
            assert not chan.post(Ack(slot=1, generation=2, ref="late"))  # closed: dropped, no raise
            assert chan.dropped == 1
            router.close(0)
            ctx.term()
            os.unlink(f"{d}/ctl.sock")
            os.rmdir(d)

    asyncio.run(main())


def test_a_command_that_comes_while_the_worker_sends_is_still_received() -> None:
    """libzmq's fd is edge-triggered and every send processes its pending commands: a send between a
    Command's arrival and the loop's next look takes the fd's edge, and the waiting recv must still see it."""
    async def main() -> None:
        d = tempfile.mkdtemp(prefix="nswc-")
        endpoint = f"ipc://{d}/ctl.sock"
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        chan = ControlChannel(endpoint, b"1:2:3", linger_ms=0)
        try:
            assert chan.post(Ack(slot=1, generation=2, ref="hello"))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, router.recv_multipart)
            for i in range(20):
                got = asyncio.create_task(chan.recv())
                await asyncio.sleep(0.01)                     # recv waits on the fd
                router.send_multipart([b"1:2:3", encode(Command(id=f"c{i}", name="ping"))])
                time.sleep(0.02)                              # the loop busy: the Command is in, unseen
                assert chan.post(Ack(slot=1, generation=2, ref=f"beat{i}"))   # ... and this send takes the edge
                assert await asyncio.wait_for(got, 2) == encode(Command(id=f"c{i}", name="ping"))
        finally:
            chan.close()
            router.close(0)
            ctx.term()
            os.unlink(f"{d}/ctl.sock")
            os.rmdir(d)

    asyncio.run(main())


def test_post_never_blocks_when_nobody_listens() -> None:
    async def main() -> None:
        d = tempfile.mkdtemp(prefix="nswc-")
        chan = ControlChannel(f"ipc://{d}/nobody.sock", b"x", linger_ms=0, sndhwm=5)
        try:
            results = [chan.post(Ack(slot=0, generation=0, ref=str(i))) for i in range(50)]
        finally:
            chan.close()
            os.rmdir(d)
        assert results.count(False) >= 40 and chan.dropped == results.count(False)

    asyncio.run(main())


# ------------------------------------------------------------ heartbeat grid


def test_beats_fall_on_the_shared_grid_after_now() -> None:
    from numaserve.worker.control import beat_phase, next_beat_due

    assert next_beat_due(10.2, 1.0) == pytest.approx(11.0)
    assert next_beat_due(11.0, 1.0) == pytest.approx(12.0)     # on the grid: one interval on
    assert next_beat_due(10.002, 1.0) == pytest.approx(11.0)   # a timer that fired a little late
    assert next_beat_due(10.1, 1.0, 0.003) == pytest.approx(11.003)
    # a beat late by any part of an interval (blocked loop): no second beat at once, and back on
    # the grid within two beats
    for late in (0.05, 0.3, 0.5, 0.51, 0.95):
        t, gaps = 13.0 + late, []
        for _ in range(2):
            nxt = next_beat_due(t, 1.0)
            gaps.append(nxt - t)
            t = nxt
        assert all(0.5 - 1e-9 <= g <= 1.0 + 1e-9 for g in gaps), gaps
        assert t % 1.0 == pytest.approx(0.0, abs=1e-6) or t % 1.0 == pytest.approx(1.0, abs=1e-6), (late, gaps)
    for now in (0.0, 0.37, 5.99, 1234.5678):
        for interval in (0.25, 1.0, 2.5):
            due = next_beat_due(now, interval, beat_phase(7))
            assert now + 0.5 * interval - 1e-9 <= due <= now + interval + 1e-9   # never more than one interval
    # workers of different slots beat within a few ms of each other, so one read takes them all
    phases = [beat_phase(s) for s in range(64)]
    assert len(set(phases)) == 64 and max(phases) < 0.01
    with pytest.raises(ValueError):
        next_beat_due(1.0, 0.0)


def test_unchanged_stats_stay_off_the_beat_but_are_refreshed() -> None:
    from numaserve.worker.stats import StatsDedup

    d = StatsDedup(refresh=3)
    assert d.due(b"a")                    # first: sent
    assert not d.due(b"a")                # the same: skipped
    assert not d.due(b"a")
    assert d.due(b"a")                    # every 3rd call anyway (a dropped message is caught up)
    assert d.due(b"b")                    # changed: at once
    assert not d.due(b"b")
    assert d.skipped_total == 3
