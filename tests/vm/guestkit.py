"""What the guest sides of the VM tests share (imported inside the VM as ``tests.vm.guestkit``;
every guest process has the checkout on ``PYTHONPATH``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ops_status(rt: str | Path) -> dict[str, Any] | None:
    """``status --json`` over the ops socket from this process (a ``numaserve status`` process per
    poll cost 4-10 s of emulated CPU, taken from the workers it waited for); None until it answers."""
    from numaserve.control.client import OpsError, ops_call

    try:
        return ops_call(Path(rt), "status", timeout=30.0)
    except (OpsError, OSError):
        return None
