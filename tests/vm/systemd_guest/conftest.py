"""Guest side of the systemd VM tests: run only INSIDE the lab VM booted with
``--init systemd`` (tests/vm/test_systemd_in_vm.py boots it).

Anywhere else (the host, a developer's machine, the busybox-init VM) nothing
here is even collected: these tests install a unit, create a system user and
start, stop and SIGSTOP services, which must never touch a real system.
"""

from __future__ import annotations

import os
from pathlib import Path


def _lab_with_systemd() -> bool:
    try:
        pid1 = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return False
    # /run/numa-vm exists only inside run-in-numa-vm.sh guests
    return (os.environ.get("NUMASERVE_IN_VM") == "1" and pid1 == "systemd" and Path("/run/numa-vm").is_dir()
            and Path("/run/systemd/system").is_dir())


if not _lab_with_systemd():
    collect_ignore_glob = ["test_*.py"]
