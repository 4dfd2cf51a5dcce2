"""``status``: the supervisor's state as one JSON document (ops ``status``, /metrics, the stats events).

Assembled from the roles (slot table, routing, ops plane, guards, templates,
operations); reads only.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from numaserve.bind.placement import Plan
from numaserve.net.listeners import accept_queue_depth
from numaserve.runtime import RuntimeDir
from numaserve.supervisor import slots as S
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.channel import WorkerChannel
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.operations import Operations
from numaserve.supervisor.opsplane import OpsPlane
from numaserve.supervisor.reload import Reloader
from numaserve.supervisor.routing import Router
from numaserve.supervisor.slottable import SlotTable
from numaserve.supervisor.stopseq import StopSequence
from numaserve.supervisor.templates import TemplateManager
from numaserve.supervisor.watches import SecondWatches
from numaserve.supervisor.workermsgs import WorkerMessageHandler

__all__ = ["StatusSource", "slot_statuses", "supervisor_status"]


class StatusSource(Protocol):
    """The roles a status is read from (the supervisor)."""

    state: str
    plan: Plan
    runtime: RuntimeDir
    table: SlotTable
    channel: WorkerChannel
    messages: WorkerMessageHandler
    router: Router
    plane: OpsPlane
    audit: AuditLog
    stopper: StopSequence
    reloader: Reloader
    limits: LimitsManager
    watches: SecondWatches
    templates: TemplateManager
    operations: Operations
    irq: tuple[dict[str, Any] | None, str | None]


def slot_statuses(sup: StatusSource, now: float) -> list[dict[str, Any]]:
    out = []
    for slot in sup.table.slots.values():
        d = slot.status(now)
        st = slot.worker.stats if slot.worker else None
        d["queued"] = st.queued if st else 0
        d["shed"] = st.shed if st else 0
        d["limits"] = sup.limits.status(slot)
        d["memory"] = sup.watches.leak.status(slot)
        d["locality"] = sup.watches.locality.status(slot)
        extra = st.extra if st else {}
        d["condition"] = "degraded (fd limit)" if extra.get("fd_limited") else None
        d["fds"] = ({k: extra.get(k) for k in ("fds_open", "fd_limit", "accept_errors", "fd_limit_hits")}
                    if "fd_limit" in extra else None)
        d["control_refused"] = sup.messages.rejected.get(slot.plan.slot, 0)
        d["start"] = TemplateManager.worker_start(slot.worker.popen) if slot.worker else None
        if slot.state == S.STARTING and slot.worker is None:   # waiting on its node's template
            tmpl = sup.templates.loading(slot.plan.node, now)
            if tmpl is not None:
                d["state"], d["loading"] = S.LOADING, tmpl
        out.append(d)
    return out


def supervisor_status(sup: StatusSource) -> dict[str, Any]:
    # what workers (and anyone else) sent is read first: while every slot is settled the channel
    # leaves messages queued until the next tick (``WorkerChannel.hold``), and a status is a snapshot
    # of now (heartbeat ages, counters, bad_messages), not of the last tick
    sup.channel.drain(sup.messages)
    now = time.monotonic()
    cfg = sup.table.cfg
    stopper = sup.stopper
    listeners = sup.router.listeners
    return {
        "supervisor": {
            "pid": os.getpid(),
            "state": sup.state,
            "stop_phase": stopper.phase,
            "lb_grace_left_s": (round(max(0.0, stopper.lb_grace_until - now), 3)
                                if stopper.phase == "lb_grace" and stopper.lb_grace_until else None),
            "uptime_s": round(now - sup.table.started, 3),
            "runtime_dir": str(sup.runtime.path),
            "config_file": sup.reloader.config_path,
            "listeners": listeners.addresses(),
            "accept_queue": {
                str(slot): [accept_queue_depth(lst.sock) for lst in ls]
                for slot, ls in listeners.by_slot.items()
            },
            "bad_messages": sup.messages.bad_messages,
            "control_plane": {**sup.plane.status(), "audit": sup.audit.status()},
            "steering": sup.router.status(),
            "rescue": sup.router.rescuer.status(),
            "locality": sup.watches.locality.summary(),
            "admin": sup.plane.admin.address if sup.plane.admin else None,
            "irq": sup.irq[0],
            "app": cfg.server.app or ("" if cfg.server.cmd else "numaserve.apps.demo:app"),
            "cmd": cfg.server.cmd,
        },
        "plan": {"skipped": [{"node": s.node, "reason": s.reason} for s in sup.plan.skipped],
                 "notes": list(sup.plan.notes)},
        "slots": slot_statuses(sup, now),
        "limits": {str(n): d for n, d in sup.limits.last_decision.items()},
        "templates": sup.templates.status(),
        "operations": sup.operations.recent(),
    }
