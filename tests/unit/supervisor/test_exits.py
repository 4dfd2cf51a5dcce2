import signal

import pytest

from numaserve.supervisor import exits as X


def verdict(code, *, ready=True, stopped=False, killed=False, frozen=False, goodbye=None):
    return X.classify_exit(code=code, was_ready=ready, we_stopped=stopped, we_killed=killed,
                           stopped_from_outside=frozen, goodbye=goodbye)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_outside_signals_while_serving_are_external_and_not_counted(sig):
    v = verdict(-sig)
    assert v.kind == X.EXTERNAL and not v.counted and sig.name in v.why


def test_sigkill_mentions_the_oom_killer():
    assert "OOM" in verdict(-signal.SIGKILL).why


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL])
def test_self_inflicted_signals_are_crashes(sig):
    v = verdict(-sig)
    assert v.kind == X.CRASH and v.counted


def test_exit_codes_while_serving_are_crashes_even_zero():
    assert verdict(7).kind == X.CRASH and verdict(7).counted
    assert verdict(0).kind == X.CRASH and "status 0" in verdict(0).why


def test_the_apps_own_death_before_ready_is_a_boot_failure():
    for code in (3, 1, 0, -signal.SIGSEGV, -signal.SIGABRT):
        v = verdict(code, ready=False)
        assert v.kind == X.BOOT and v.counted, code


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_kill_from_outside_while_loading_is_external_not_a_boot_failure(sig):
    # an OOM kill or an operator's kill -9 during a model load is retried at once, never a crash loop
    v = verdict(-sig, ready=False)
    assert v.kind == X.EXTERNAL and not v.counted and "while loading" in v.why and sig.name in v.why


def test_oom_kill_while_loading_says_so():
    v = X.classify_exit(code=-signal.SIGKILL, was_ready=False, we_stopped=False, we_killed=False, oom_killed=True)
    assert v.kind == X.EXTERNAL and "OOM-killed" in v.why


def test_graceful_sigterm_from_outside_while_loading_is_external():
    v = verdict(0, ready=False, goodbye="stopped: SIGTERM")
    assert v.kind == X.EXTERNAL and "SIGTERM" in v.why


def test_we_stopped_it_is_expected():
    v = verdict(0, stopped=True)
    assert v.kind == X.EXPECTED and not v.counted


def test_watchdog_kill_is_a_hang_unless_frozen_from_outside():
    assert verdict(-signal.SIGKILL, killed=True).kind == X.HANG
    v = verdict(-signal.SIGKILL, killed=True, frozen=True)
    assert v.kind == X.EXTERNAL and not v.counted and "SIGSTOP" in v.why
    # frozen (SIGSTOP) while loading: not the app's fault either
    assert verdict(-signal.SIGKILL, ready=False, killed=True, frozen=True).kind == X.EXTERNAL
    assert verdict(-signal.SIGKILL, ready=False, killed=True).kind == X.HANG


def test_graceful_sigterm_goodbye_from_outside_is_external():
    v = verdict(0, goodbye="stopped: SIGTERM")
    assert v.kind == X.EXTERNAL and "SIGTERM" in v.why


def test_unknown_signal_number_is_a_crash():
    assert verdict(-200).kind == X.CRASH


def test_an_oom_kill_is_named_when_the_kernel_counter_moved(tmp_path):
    v = X.classify_exit(code=-signal.SIGKILL, was_ready=True, we_stopped=False, we_killed=False, oom_killed=True)
    assert v.kind == X.EXTERNAL and "oom_kill count went up" in v.why
    assert "OOM-killed" in X.classify_exit(code=-9, was_ready=False, we_stopped=False, we_killed=False,
                                           oom_killed=True).why
    (tmp_path / "vmstat").write_text("pgfault 1\noom_kill 7\n")
    assert X.oom_kill_count(str(tmp_path)) == 7
    assert X.oom_kill_count(str(tmp_path / "nope")) is None
    assert isinstance(X.oom_kill_count(), (int, type(None)))
