"""The ops handler's audit trail: a mutating verb that starts an operation writes two records
(the request accepted, then how its operation ended); a refused one writes one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from slotfakes import FakeSlots

from numaserve.control.messages import OpsRequest
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.operations import Operations
from numaserve.supervisor.ops import handle_ops_request

WHO = {"uid": 1000, "verified_by": "SO_PEERCRED", "claimed": {}}


class Target:
    """The OpsTarget a verb sees, around a fake slot table and a real audit log."""

    def __init__(self, path: Path) -> None:
        f = FakeSlots(2)
        self.table = f
        self.channel = f
        self.operations = Operations(f, f)
        self.audit = AuditLog(path)
        self.state = "running"

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit.path.read_text().splitlines()]


def test_restart_writes_the_accepted_and_the_finished_record(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Target(tmp_path / "audit.log")
        for slot in sup.table.slots.values():
            sup.table.start_worker(slot, 0.0)
        await asyncio.sleep(0)   # the fakes report Ready on the next loop turn
        req = OpsRequest(verb="restart", args={"slot": 1}, id="req-1")
        reply = await handle_ops_request(sup, req, channel="ipc", who=WHO)  # type: ignore[arg-type]
        assert reply.ok, reply.error
        op_id = reply.result["operation"]["id"]
        assert reply.result["state"] == "running" and reply.result["operation"]["kind"] == "restart"
        accepted = sup.records()
        assert [(r["ok"], r["result"]) for r in accepted] == [(True, "running")]
        op = sup.operations.get(op_id)
        assert op is not None
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded", op.result
        records = sup.records()
        assert len(records) == 2 and records[0] == accepted[0]
        for r in records:
            assert (r["who"], r["channel"], r["verb"], r["args"], r["id"]) == (WHO, "ipc", "restart", {"slot": 1},
                                                                                "req-1")
        assert records[1]["ok"] is True
        assert records[1]["result"] == f"operation {op_id} succeeded: replaced 1 slot(s)"
        assert sup.audit.written == 2 and sup.audit.errors == 0

    asyncio.run(main())


def test_a_failed_operation_is_audited_as_not_ok(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Target(tmp_path / "audit.log")
        for slot in sup.table.slots.values():
            sup.table.start_worker(slot, 0.0)
        await asyncio.sleep(0)
        sup.table.fail_spawn = "no memory"
        reply = await handle_ops_request(sup, OpsRequest(verb="restart", args={"slot": 0}, id="req-2"),  # type: ignore[arg-type]
                                         who=WHO)
        assert reply.ok
        op = sup.operations.get(reply.result["operation"]["id"])
        assert op is not None
        await asyncio.wait_for(op.done.wait(), 5)
        first, last = sup.records()
        assert first["ok"] is True and last["ok"] is False
        assert last["result"].startswith(f"operation {op.id} failed: slot 0: could not spawn the new worker: no memory")

    asyncio.run(main())


def test_refused_requests_write_one_record_and_start_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Target(tmp_path / "audit.log")
        ro = await handle_ops_request(sup, OpsRequest(verb="restart", args={"slot": 0}, id="ro"),  # type: ignore[arg-type]
                                      readonly=True, who=WHO)
        bad = await handle_ops_request(sup, OpsRequest(verb="restart", args={"slot": 9}, id="bad"),  # type: ignore[arg-type]
                                       who=WHO)
        assert not ro.ok and not bad.ok and sup.operations.current is None
        assert [(r["id"], r["ok"], r["result"]) for r in sup.records()] == [
            ("ro", False, "refused: read-only socket"), ("bad", False, bad.error)]

    asyncio.run(main())
