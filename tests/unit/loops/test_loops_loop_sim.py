"""The "cpu" limiter on the event-loop simulator (``loop_sim``): real traffic shapes, not only CPU work.

One worker = one loop, 20 ms of CPU per CPU-bound request (capacity 50/s);
client timeout 2 s; SLO 500 ms; measured 5–20 s.  Whole module ≈ 10–20 s.
"""

from __future__ import annotations

import pytest
from loop_sim import Kind, LoopSimConfig, LoopSimResult, simulate_loop

CAP = 50.0   # per second, 20 ms of CPU each


_RUNS: dict[str, LoopSimResult] = {}


def run(kinds: tuple[Kind, ...], **kw: object) -> LoopSimResult:
    """Cached by configuration: several tests read the same runs."""
    key = repr((kinds, sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = simulate_loop(LoopSimConfig(kinds=list(kinds), **kw))  # type: ignore[arg-type]
    return _RUNS[key]


def goodput(r: LoopSimResult, name: str) -> float:
    return sum(1 for x in r.kinds[name].latencies if x <= 0.5) / r.length_s / CAP


def _report(title: str, r: LoopSimResult) -> None:
    for k, kr in r.kinds.items():
        print(f"\n{title} [{k}]: arrivals {kr.arrivals} ok {kr.ok} shed {kr.shed} timeouts {kr.timeouts} "
              f"gone {kr.gone} p50 {r.p(k, .5) * 1e3:.0f} ms p99 {r.p(k, .99) * 1e3:.0f} ms "
              f"shed p99 {r.shed_p(.99) * 1e3:.1f} ms sentinel {r.sentinel_sheds}")


COOP = Kind("cpu", 0.0, shape="coop")
BLOCK = Kind("cpu", 0.0, shape="block")


def at(kind: Kind, load: float) -> tuple[Kind, ...]:
    return (Kind(kind.name, load * CAP, shape=kind.shape),)


@pytest.mark.parametrize("shape", [COOP, BLOCK], ids=["cooperative", "blocking"])
@pytest.mark.parametrize("load", [2.0, 3.0])
def test_cpu_overload_keeps_goodput_and_latency(shape: Kind, load: float) -> None:
    r = run(at(shape, load))
    _report(f"{shape.shape} {load}x", r)
    kr = r.kinds["cpu"]
    assert goodput(r, "cpu") >= 0.9
    assert kr.timeouts == 0 and kr.gone == 0 and r.wasted_cpu_s == 0
    assert r.p("cpu", 0.99) <= 6 * 0.020          # in the simulator: ≤ 6 × the work (the bench asks ≤ 4 × p50)
    assert kr.shed > 0


@pytest.mark.parametrize("shape", [COOP, BLOCK], ids=["cooperative", "blocking"])
def test_without_admission_everything_times_out(shape: Kind) -> None:
    """What the peers do (no gate): the backlog outlives its clients and the CPU burns for nobody."""
    r = run(at(shape, 2.0), gate=False)
    _report(f"{shape.shape} 2x, no gate", r)
    assert goodput(r, "cpu") < 0.1 and r.wasted_cpu_s > 5


def test_blocking_sheds_from_the_accept_queue_while_the_loop_is_stalled() -> None:
    """New connections: the sentinel answers while the handler blocks; its answers are fast."""
    with_s = run(at(BLOCK, 2.0), keepalive=False)
    without = run(at(BLOCK, 2.0), keepalive=False, sentinel=False)
    _report("blocking 2x, sentinel", with_s)
    _report("blocking 2x, no sentinel", without)
    assert with_s.sentinel_sheds > 0.5 * with_s.kinds["cpu"].shed
    assert with_s.shed_p(0.5) < 0.6 * without.shed_p(0.5)
    assert goodput(with_s, "cpu") >= 0.9


@pytest.mark.parametrize("kind", [
    Kind("await", 40.0, shape="await_", wait_s=1.0),
    Kind("sse", 40.0, shape="stream", chunks=20, gap_s=0.05),
    Kind("stream20s", 10.0, shape="stream", chunks=400, gap_s=0.05),
    Kind("upload", 20.0, shape="upload", wait_s=1.5),
], ids=lambda k: k.name)
def test_requests_that_use_no_cpu_are_never_shed(kind: Kind) -> None:
    r = run((kind,), duration_s=25.0, measure=(5.0, 20.0), timeout_s=30.0)
    _report(kind.name, r)
    kr = r.kinds[kind.name]
    assert kr.arrivals > 100 and kr.shed == 0 and kr.timeouts == 0 and kr.ok == kr.arrivals


def test_slow_uploads_beside_ordinary_traffic_refuse_none_of_it() -> None:
    """20 slow uploads always in progress + tiny requests at 200/s (a quarter of the CPU)."""
    tiny = Kind("tiny", 200.0, shape="block", work_s=0.001)
    up = Kind("upload", 20.0 / 5.0, shape="upload", wait_s=5.0)
    r = run((tiny, up), duration_s=25.0, measure=(5.0, 20.0), timeout_s=30.0)
    _report("uploads + tiny", r)
    assert r.kinds["tiny"].shed == 0 and r.kinds["upload"].shed == 0


def test_streams_do_not_make_cpu_work_refused_below_capacity() -> None:
    """200 open streams and CPU work at 0.5 C: (almost) nothing is refused — only a request that
    lands on a momentary burst of queued CPU work (≥ burst_wait_s of it) can be."""
    streams = Kind("stream", 10.0, shape="stream", chunks=400, gap_s=0.05)
    cpu = Kind("cpu", 0.5 * CAP, shape="coop")
    r = run((streams, cpu), duration_s=25.0, measure=(5.0, 20.0), timeout_s=30.0)
    _report("streams + cpu 0.5x", r)
    for k in ("cpu", "stream"):
        assert r.kinds[k].shed <= 0.01 * r.kinds[k].arrivals


@pytest.mark.parametrize("shape", [COOP, BLOCK], ids=["cooperative", "blocking"])
def test_half_load_is_not_shed(shape: Kind) -> None:
    r = run(at(shape, 0.5))
    _report(f"{shape.shape} 0.5x", r)
    kr = r.kinds["cpu"]
    assert kr.shed <= 0.01 * kr.arrivals and kr.timeouts == 0


def test_cpu_overload_sheds_new_streams_too_but_never_breaks_running_ones() -> None:
    """Under real CPU overload a new stream is refused like any request (its cost is unknown in
    advance); one already admitted is never cut: every admitted stream completes."""
    cpu = Kind("cpu", 2 * CAP, shape="coop")
    streams = Kind("stream", 20.0, shape="stream", chunks=20, gap_s=0.05)
    r = run((cpu, streams))
    _report("cpu 2x + streams", r)
    s = r.kinds["stream"]
    assert s.timeouts == 0 and s.ok + s.shed == s.arrivals
    assert goodput(r, "cpu") >= 0.85


def start_of_overload(shape: Kind, load: float = 2.0) -> tuple[Kind, ...]:
    """2 s of a quiet trickle (the gate learns the CPU per request, the loop is not overloaded),
    then ``load`` × capacity: the start of an overload, measured from its first request."""
    return (Kind("warm", 10.0, shape=shape.shape, start=0.0, end=2.0),
            Kind("cpu", load * CAP, shape=shape.shape, start=2.0))


@pytest.mark.parametrize("shape", [COOP, BLOCK], ids=["cooperative", "blocking"])
def test_the_start_of_an_overload_has_no_long_tail(shape: Kind) -> None:
    """The first 1.5 s of a 2x overload (issue 13 § 2a: the tail was the start of each level, while
    the burst bound let every iteration grow to burst_wait_s for ~1.5 s).  Before the burst bound
    started the overload at once, p90 was 160 ms (cooperative) and 170-180 ms (blocking) here."""
    r = run(start_of_overload(shape), duration_s=3.5, measure=(2.0, 3.5))
    _report(f"{shape.shape} start of 2x", r)
    kr = r.kinds["cpu"]
    assert kr.shed > 0 and kr.timeouts == 0
    assert goodput(r, "cpu") >= 0.9
    assert r.p("cpu", 0.9) <= (5 if shape is COOP else 7) * 0.020


@pytest.mark.parametrize("shape", [COOP, BLOCK], ids=["cooperative", "blocking"])
@pytest.mark.parametrize("seed", [1, 2])
def test_near_capacity_a_burst_is_not_taken_for_an_overload(shape: Kind, seed: int) -> None:
    """At 0.8x the queue reaches the burst bound by chance, after a long busy spell: starting the
    overload then (the tight bound) would refuse healthy requests; with every burst refusal taken
    for an overload the cooperative case shed 4.6-5.0 % here, with the arrival-rate rule 2.7-3.1 %
    (as before the rule)."""
    r = run(at(shape, 0.8), seed=seed, duration_s=20.0, measure=(2.0, 20.0))
    _report(f"{shape.shape} 0.8x seed {seed}", r)
    kr = r.kinds["cpu"]
    assert kr.shed <= 0.035 * kr.arrivals and kr.timeouts == 0
