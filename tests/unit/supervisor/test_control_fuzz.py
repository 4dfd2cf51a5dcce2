"""Property-based fuzzing of every control and ops decoder and handler.

Random frames, wrong types, huge sizes, NaN and infinities go through the
same entry points the sockets feed (``on_control_frames``, ``on_ops_frames``)
on a real ``Supervisor`` object (not started: no processes).  Properties:
nothing raises, no handler falls into its "internal error" safety net, every
control message that is not from a verified worker is counted in
``bad_messages``, and every ops request gets a well-formed reply.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaserve.bind.placement import Plan, SlotPlan
from numaserve.config import Config
from numaserve.control import messages as m
from numaserve.runtime import RuntimeDir
from numaserve.supervisor import channel as ch
from numaserve.supervisor import controlplane as cp
from numaserve.supervisor import slots as S
from numaserve.supervisor.arbiter import Supervisor
from numaserve.supervisor.ops import MUTATING, READ_ONLY
from numaserve.supervisor.ratelimit import PeerRateLimiter

NO_SUCH_PID = 4_194_303 + 1   # above pid_max: os.kill finds nobody


class _FakePopen:
    pid = NO_SUCH_PID
    returncode = None

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        return 0


class _Exceptions:
    """Stands in for the module logger: records what fell into a catch-all."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.caught: list[str] = []

    def exception(self, event: str, **kw: Any) -> None:
        import traceback

        self.caught.append(f"{event}: {traceback.format_exc()}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def make_supervisor(tmp: Path) -> Supervisor:
    cfg = Config()
    plan = Plan(slots=[SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="bind", memory_nodes=(0,))])
    sup = Supervisor(cfg, plan, RuntimeDir(tmp), config_path=None)
    sup.plane.ops_limiter = PeerRateLimiter(1e9, 1e9)
    slot = sup.table.slots[0]
    slot.generation = 1
    slot.worker = S.WorkerProc(generation=1, popen=_FakePopen(), started=0.0, token="t" * 32)  # type: ignore[arg-type]
    slot.state = S.STARTING
    return sup


def close(sup: Supervisor) -> None:
    sup.plane.end_event_stream()


@pytest.fixture
def caught(monkeypatch: pytest.MonkeyPatch) -> _Exceptions:
    rec = _Exceptions(cp.log)
    monkeypatch.setattr(cp, "log", rec)
    control = _Exceptions(ch.control_log)
    control.caught = rec.caught   # one list: a catch-all in either receive path fails the test
    monkeypatch.setattr(ch, "control_log", control)
    import numaserve.supervisor.ops as ops_mod

    monkeypatch.setattr(ops_mod, "log", _Exceptions(ops_mod.log))
    rec.ops = ops_mod.log  # type: ignore[attr-defined]
    return rec


# ------------------------------------------------------------------ strategies

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=20)

W2S = ["Hello", "Ready", "Heartbeat", "Stats", "Ack", "Goodbye", "Stop", "Drain", "Command", "Nope"]
FIELDS = ["slot", "generation", "pid", "protocol", "token", "placement", "loop_lag", "mono", "requests",
          "inflight", "queued", "shed", "connections", "status_classes", "latency_ms", "rss_bytes",
          "draining", "limits_epoch", "extra", "ref", "ok", "detail", "reason"]


def _field_value(name: str) -> st.SearchStrategy[Any]:
    if name in ("slot", "generation"):   # mostly aim at the real slot/generation, so handlers run
        return st.one_of(st.just(0), st.just(1), values)
    if name == "extra":
        return st.one_of(values, st.fixed_dictionaries({}, optional={
            "latency_buckets": st.lists(st.one_of(st.integers(-5, 2**64 - 1), st.floats()), max_size=600),
            "latency_sum_ms": st.floats(), "latency_count": values, "fd_limited": values,
            "admission": st.one_of(values, st.fixed_dictionaries({}, optional={
                "shed": values, "admitted": values, "limit": values, "epoch": values})),
        }))
    return values


messages = st.builds(
    lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}),
    st.sampled_from(W2S),
    st.fixed_dictionaries({}, optional={f: _field_value(f) for f in FIELDS}),
)
control_frames = st.one_of(
    st.lists(st.binary(max_size=64), max_size=4),
    st.tuples(st.binary(min_size=1, max_size=16), messages).map(list),
    st.tuples(st.binary(max_size=8), st.sampled_from([b"\x91" * 10_000, b"\xdd\xff\xff\xff\xff", b"\xc1",
                                                       b"\x00" * (m.MAX_MESSAGE_BYTES + 1)])).map(list),
)

ARG_NAMES = ["slot", "node", "all", "timeout", "fast", "id", "prefix", "rate", "concurrency", "trigger", "x"]
requests = st.builds(
    lambda verb, args, who: msgspec.msgpack.encode({"verb": verb, "args": args, "id": "f", "who": who}),
    st.one_of(st.sampled_from(sorted(READ_ONLY | MUTATING)), st.text(max_size=12)),
    st.dictionaries(st.sampled_from(ARG_NAMES), st.one_of(values, st.sampled_from(
        [math.nan, math.inf, -math.inf, 0, 1, -1, 2**64 - 1, -(2**63), "0", True])), max_size=4),
    values,
)
ops_frames = st.one_of(
    st.lists(st.binary(max_size=64), max_size=4),
    st.tuples(st.binary(min_size=1, max_size=8), st.just(b""), requests).map(list),
    st.tuples(st.binary(min_size=1, max_size=8), requests).map(list),
    st.tuples(st.binary(min_size=1, max_size=8), st.just(b""), st.binary(min_size=cp.MAX_OPS_BYTES + 1,
                                                                          max_size=cp.MAX_OPS_BYTES + 2)).map(list),
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


# ---------------------------------------------------------------------- tests


@pytest.mark.slow   # 200 examples, each on a fresh Supervisor object: ~10-20 s of CPU
@FUZZ
@given(frames=control_frames)
def test_control_frames_never_raise_and_are_counted(tmp_path: Path, caught: _Exceptions, frames: list[bytes]) -> None:
    sup = make_supervisor(tmp_path)
    try:
        w = sup.table.slots[0].worker
        before = sup.messages.bad_messages
        ch.on_control_frames(sup.messages, frames)
        assert caught.caught == []
        # nothing a stranger sends is accepted: without the spawn token no Hello is,
        # and without a Hello nothing else is
        assert sup.messages.bad_messages == before + 1
        assert w is sup.table.slots[0].worker and w.identity is None and w.stats is None and w.kill_reason is None
    finally:
        close(sup)


@pytest.mark.slow   # 200 examples, each on a fresh Supervisor object: ~10-20 s of CPU
@FUZZ
@given(frames=ops_frames, channel=st.sampled_from(["ipc", "ipc-readonly", "tcp-curve"]))
def test_ops_frames_always_get_a_well_formed_reply(tmp_path: Path, caught: _Exceptions, frames: list[bytes],
                                                   channel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sup = make_supervisor(tmp_path)
    # reload re-reads config and topology: keep it off this machine's /etc and sysfs
    monkeypatch.setattr(sup.reloader, "config_path", str(tmp_path / "missing.toml"))
    monkeypatch.setattr(subprocess, "Popen", None)   # nothing may start a process
    try:
        async def go() -> list[bytes] | None:
            out = await cp.on_ops_frames(sup, sup.plane, frames, channel, readonly=channel == "ipc-readonly")
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()
            return out

        out = asyncio.run(go())
        assert caught.caught == [] and caught.ops.caught == []  # type: ignore[attr-defined]
        if not frames:
            assert out is None
            return
        assert out is not None and out[0] == frames[0]
        reply = m.decode_ops_reply(out[-1])
        assert not reply.error.startswith("internal error"), reply.error
        assert reply.ok or reply.error
    finally:
        close(sup)


@pytest.mark.slow   # 300 large generated messages: ~15 s of CPU
@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=200), messages, requests))
def test_decoders_raise_only_bad_message(data: bytes) -> None:
    for decode in (m.decode_from_worker, m.decode_from_supervisor, m.decode_ops_request, m.decode_ops_reply):
        try:
            decode(data)
        except m.BadMessage:
            pass


def test_a_verified_hello_then_nan_stats_are_refused(tmp_path: Path, caught: _Exceptions) -> None:
    """The handlers' value checks, reached through a Hello that passes (right token, no peer cred)."""
    sup = make_supervisor(tmp_path)
    try:
        async def go() -> None:
            hello = m.Hello(slot=0, generation=1, pid=NO_SUCH_PID, token="t" * 32)
            ch.on_control_frames(sup.messages, [b"me", m.encode(hello)])
            w = sup.table.slots[0].worker
            assert w is not None and w.identity == b"me"
            bad = sup.messages.bad_messages
            for msg in (m.Stats(slot=0, generation=1, requests=1, inflight=0, latency_ms={"p50": math.nan}),
                        m.Stats(slot=0, generation=1, requests=1, inflight=0, extra={"latency_buckets": [-1]}),
                        m.Heartbeat(slot=0, generation=1, loop_lag=math.inf, mono=0.0)):
                ch.on_control_frames(sup.messages, [b"me", m.encode(msg)])
            assert sup.messages.bad_messages == bad + 3 and w.stats is None
            ch.on_control_frames(sup.messages, [b"me", m.encode(m.Stats(slot=0, generation=1, requests=5, inflight=1))])
            assert w.stats is not None and w.stats.requests == 5
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()

        asyncio.run(go())
        assert caught.caught == []
    finally:
        close(sup)


def test_stats_riding_on_a_beat_are_checked_and_the_beat_stands(tmp_path: Path, caught: _Exceptions) -> None:
    """One message per interval: a Heartbeat carries the Stats; bad or foreign stats are refused, the beat kept."""
    sup = make_supervisor(tmp_path)
    try:
        async def go() -> None:
            hello = m.Hello(slot=0, generation=1, pid=NO_SUCH_PID, token="t" * 32)
            ch.on_control_frames(sup.messages, [b"me", m.encode(hello)])
            w = sup.table.slots[0].worker
            assert w is not None and w.identity == b"me"
            bad = sup.messages.bad_messages
            nan_stats = m.Stats(slot=0, generation=1, requests=1, inflight=0, latency_ms={"p50": math.nan})
            foreign = m.Stats(slot=1, generation=1, requests=9, inflight=0)
            for stats in (nan_stats, foreign):
                w.last_beat = 0.0
                ch.on_control_frames(sup.messages, [b"me", m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.25,
                                                                      mono=1.0, stats=stats))])
                assert w.last_beat > 0.0 and w.loop_lag == 0.25 and w.stats is None
            assert sup.messages.bad_messages == bad + 2
            good = m.Stats(slot=0, generation=1, requests=7, inflight=2, rss_bytes=4096)
            ch.on_control_frames(sup.messages, [b"me", m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=2.0,
                                                                  stats=good))])
            assert w.stats == good and w.rss_bytes == 4096 and w.loop_lag == 0.0
            assert sup.messages.bad_messages == bad + 2
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()

        asyncio.run(go())
        assert caught.caught == []
    finally:
        close(sup)


def test_protocol_mismatch_signals_only_a_verified_worker(tmp_path: Path) -> None:
    from numaserve.control.peercred import PeerCred

    sup = make_supervisor(tmp_path)
    try:
        signalled: list[tuple[int, int]] = []
        sup.table.send_signal = lambda pid, sig: signalled.append((pid, sig))
        w = sup.table.slots[0].worker
        assert w is not None
        hello99 = m.Hello(protocol=99, slot=0, generation=1, pid=NO_SUCH_PID)
        # a stranger (wrong pid by SO_PEERCRED, no token) naming the worker: refused, nobody signalled
        sup.messages.handle_worker_msg(b"x", hello99, PeerCred(0, 0, 12345))
        sup.messages.handle_worker_msg(b"x", hello99, None)
        assert signalled == [] and w.kill_reason is None and sup.messages.rejected[0] == 2
        # the worker itself (token and kernel pid match) speaking another protocol: told to go, with the reason
        good = m.Hello(protocol=99, slot=0, generation=1, pid=NO_SUCH_PID, token="t" * 32)
        sup.messages.handle_worker_msg(b"w", good, PeerCred(0, 0, NO_SUCH_PID))
        assert signalled == [(NO_SUCH_PID, 15)] and "protocol 99" in (w.kill_reason or "")
        assert w.identity is None   # refused all the same
    finally:
        close(sup)
