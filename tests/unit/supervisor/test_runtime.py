import os
import stat

import pytest

from numaserve.errors import UsageError
from numaserve.runtime import RuntimeDir, ensure_private_dir, resolve_runtime_dir


def test_resolution_order(tmp_path):
    assert str(resolve_runtime_dir("/x", {})) == "/x"
    assert str(resolve_runtime_dir("", {"RUNTIME_DIRECTORY": "/run/a:/run/b"})) == "/run/a"


def test_private_dir_created_0700_and_tightened(tmp_path):
    d = tmp_path / "rt"
    ensure_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o755)
    ensure_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_lock_refuses_second_holder_and_clears_stale_files(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    (d / "ops.sock").write_text("stale")
    a = RuntimeDir(d)
    a.acquire()
    assert not (d / "ops.sock").exists()
    assert (d / "supervisor.pid").read_text().strip() == str(os.getpid())
    with pytest.raises(UsageError, match="another supervisor"):
        RuntimeDir(d).acquire()
    a.release()
    b = RuntimeDir(d)
    b.acquire()
    b.release()


def test_refused_acquire_and_release_touch_nothing_of_the_holder(tmp_path):
    d = tmp_path / "rt"
    holder = RuntimeDir(d)
    holder.acquire()
    for name in ("control.sock", "ops.sock", "ops-ro.sock", "events.sock"):
        (d / name).write_text("live")
    os.chmod(d, 0o710)                      # ops.readonly_group shares the directory on purpose
    second = RuntimeDir(d)
    with pytest.raises(UsageError, match="another supervisor"):
        second.refuse_if_held()
    with pytest.raises(UsageError, match="another supervisor"):
        second.acquire()
    assert not second.held
    second.release()                        # every exit path of `start` calls this
    for name in ("control.sock", "ops.sock", "ops-ro.sock", "events.sock", "supervisor.pid"):
        assert (d / name).exists(), name
    assert stat.S_IMODE(d.stat().st_mode) == 0o710
    holder.release()
    assert not (d / "ops.sock").exists()


def test_refuse_if_held_passes_for_a_free_or_missing_directory(tmp_path):
    RuntimeDir(tmp_path / "nothing-here").refuse_if_held()
    assert not (tmp_path / "nothing-here").exists()
    d = tmp_path / "rt"
    a = RuntimeDir(d)
    a.acquire()
    a.release()                             # lock file left, nobody holds it
    RuntimeDir(d).refuse_if_held()


def test_acquire_tightens_an_open_mode_once_the_lock_is_ours(tmp_path):
    d = tmp_path / "rt"
    d.mkdir()
    os.chmod(d, 0o755)
    r = RuntimeDir(d)
    r.acquire()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    r.release()
