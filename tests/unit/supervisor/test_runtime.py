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
