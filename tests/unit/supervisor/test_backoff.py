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


def test_external_kills_restart_at_once_and_never_make_a_crash_loop():
    st = state(initial=0.1, maximum=8.0, jitter=0, loop_limit=3, loop_window=60)
    out = [st.record_exit(now=float(i), uptime=5.0, external=True) for i in range(6)]
    assert [d for d, _ in out[:3]] == [0.0, 0.0, 0.0]     # prompt
    assert all(not looping for _, looping in out)         # never a crash loop
    assert [d for d, _ in out[3:]] == [0.1, 0.2, 0.4]     # a storm past the limit is paced
    assert st.consecutive == 0 and not st.crashes          # nothing held against the slot


def test_external_storm_pacing_ends_with_the_window():
    st = state(initial=0.1, jitter=0, loop_limit=2, loop_window=10)
    for t in (0, 1, 2):
        st.record_exit(now=t, uptime=5, external=True)
    assert st.record_exit(now=30, uptime=5, external=True) == (0.0, False)


def test_retry_delay_of_a_failed_slot_is_the_long_interval_with_jitter():
    st = state(failed_retry=300.0, jitter=0.2)
    for _ in range(20):
        assert 240.0 <= st.retry_delay() <= 360.0
    assert state(failed_retry=300.0, jitter=0).retry_delay() == 300.0


def test_reset_clears_external_history():
    st = state(jitter=0, loop_limit=1)
    st.record_exit(now=0, uptime=1, external=True)
    st.reset()
    assert st.record_exit(now=1, uptime=1, external=True) == (0.0, False)
