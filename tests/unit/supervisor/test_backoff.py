import random

from numaserve.supervisor.backoff import RestartPolicy, RestartState


def state(**kw):
    return RestartState(RestartPolicy(**kw), rng=random.Random(1))


def test_exponential_with_cap_and_no_jitter():
    st = state(initial=0.5, maximum=4.0, jitter=0.0, loop_limit=100)
    delays = [st.record_exit(now=i, uptime=0.1)[0] for i in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_jitter_stays_within_bounds():
    st = state(initial=1.0, maximum=8.0, jitter=0.2, loop_limit=1000, loop_window=1.0)
    for i in range(50):
        d, _ = st.record_exit(now=i * 10.0, uptime=0.1)
        base = min(8.0, 2 ** min(i, 3))
        assert base * 0.8 - 1e-9 <= d <= base * 1.2 + 1e-9


def test_stable_period_resets_backoff():
    st = state(initial=0.5, maximum=30, jitter=0, reset_after=60, loop_limit=100)
    for i in range(4):
        st.record_exit(now=i, uptime=1)
    d, _ = st.record_exit(now=100, uptime=61)
    assert d == 0.5


def test_crash_loop_detected_within_window_only():
    st = state(loop_limit=3, loop_window=10, jitter=0)
    assert st.record_exit(now=0, uptime=1)[1] is False
    assert st.record_exit(now=5, uptime=1)[1] is False
    assert st.record_exit(now=9, uptime=1)[1] is True
    st2 = state(loop_limit=3, loop_window=10, jitter=0)
    for t in (0, 11, 22, 33):
        assert st2.record_exit(now=t, uptime=1)[1] is False


def test_uncounted_exits_do_not_back_off():
    st = state(jitter=0)
    assert st.record_exit(now=0, uptime=1, counted=False) == (0.0, False)
    assert st.consecutive == 0
