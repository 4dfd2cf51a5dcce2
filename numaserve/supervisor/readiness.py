"""Which slots should serve but do not: what ``/readyz`` and the ready gauge report.

Its own module (no prometheus_client): ``/readyz`` answers from it without
loading the metrics stack, which the supervisor imports at the first scrape.
"""

from __future__ import annotations

from typing import Any, Mapping

from numaserve.supervisor import slots as S

__all__ = ["unready_slots"]


def unready_slots(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Slots that should serve but do not: every non-drained slot not ``ready``.

    Also one pseudo-entry when no slot serves at all (everything drained), so a
    load balancer never sends traffic to an instance that cannot take it.
    """
    slots = [s for s in (snapshot.get("slots") or []) if isinstance(s, Mapping)]
    out = [
        {"slot": s.get("slot"), "node": s.get("node"), "state": s.get("state"),
         "reason": s.get("failed_reason") or s.get("last_exit"),
         **({"loading": s["loading"]} if s.get("loading") else {})}
        for s in slots
        if not s.get("drained") and s.get("state") != S.DRAINED and s.get("state") != S.READY
    ]
    if not out and not any(s.get("state") == S.READY for s in slots):
        out.append({"slot": None, "node": None, "state": "none", "reason": "no slot is serving"})
    return out
