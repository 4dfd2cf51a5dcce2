"""``[irq] apply_at_start``: steer NIC IRQs onto their nodes' CPUs at start, restore them at exit.

The plan and the sysfs writes live in ``numaserve.net.irq``; this is the
supervisor's use of them.  A refusal (irqbalance running in refuse mode) or
per-IRQ failures never stop serving: they are logged with the fix and shown
in status (``supervisor.irq``).
"""

from __future__ import annotations

from typing import Any

import structlog

from numaserve.config import Config
from numaserve.errors import NumaserveError
from numaserve.net.irq import IrqbalanceConflict, apply_plan, default_state_file, plan_irqs, restore
from numaserve.bind.placement import Plan
from numaserve.topology.model import Topology

__all__ = ["apply_at_start", "restore_at_exit"]

log = structlog.get_logger("numaserve.supervisor")


def apply_at_start(cfg: Config, topology: Topology | None, slot_plan: Plan) -> tuple[dict[str, Any] | None, str | None]:
    """Apply the IRQ plan when configured; returns (status for ``status``, state file to restore from)."""
    if not cfg.irq.apply_at_start or topology is None:
        return None, None
    settings = cfg.irq
    state_file = default_state_file(settings)
    try:
        plan = plan_irqs(topology, settings, reserved=getattr(slot_plan, "irq_cpus", None) or None)
        result = apply_plan(plan, root=cfg.placement.sysfs_root, state_file=state_file)
    except IrqbalanceConflict as e:
        log.error("irq_steering_refused", reason=str(e))
        return {"applied": False, "reason": str(e)}, None
    except (OSError, NumaserveError) as e:
        log.error("irq_steering_failed", reason=str(e))
        return {"applied": False, "reason": str(e)}, None
    failed = [r.to_json() for r in result.failed]
    status = {
        "applied": True,
        "irqs": len(result.irqs),
        "failed": failed,
        "warnings": list(result.warnings) + list(plan.warnings),
        "state_file": state_file,
        "placement": {str(e.irq): list(e.target) for e in plan.entries},
    }
    (log.warning if failed else log.info)(
        "irq_steering_applied", irqs=len(result.irqs), failed=len(failed), state_file=state_file
    )
    return status, state_file


def restore_at_exit(cfg: Config, state_file: str) -> None:
    """Put back the affinities saved at start (a failure says how to do it by hand)."""
    try:
        res = restore(root=cfg.placement.sysfs_root, state_file=state_file)
        log.info("irq_steering_restored", irqs=len(res.irqs), failed=len(res.failed))
    except (OSError, NumaserveError) as e:
        log.error("irq_restore_failed", reason=str(e), fix="numaserve irq restore --state-file " + state_file)
