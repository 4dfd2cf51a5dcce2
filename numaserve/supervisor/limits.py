"""The supervisor's limit loop (L2), fed by worker Stats, pushing SetLimits.

Every ``limits.interval_s`` (≥ 3 s) each node's ``LimitsLoop`` gets a window
built from its workers' counters (deltas since the previous window: admitted,
rejected, completed, in-flight peaks, and the exact merge of their latency
histograms), and returns per-slot ceilings/rates with an epoch.  The result
is pushed to the slot's workers as a ``set_limits`` command; the lease is
renewed by every push (same epoch), so a worker that loses its supervisor
falls back to a safe ceiling when the lease runs out, never to "unlimited".
A new worker gets its slot's current limits right after its Hello.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from numaserve.loops.supervisor_limits import (
    LimitsDecision,
    LimitsLoop,
    NodeWindow,
    SlotLimits,
    WorkerWindow,
)
from numaserve.worker.stats import BUCKET_UPPER_MS

from numaserve.supervisor.slotcontrol import SlotControl, WorkerChannel
from numaserve.supervisor.slots import SlotState, WorkerProc

log = structlog.get_logger("numaserve.limits")


def bucket_quantile(counts: list[int], q: float) -> float | None:
    """Upper bound (seconds) of the bucket holding quantile ``q`` of a histogram."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    acc = 0
    for i, c in enumerate(counts):
        acc += c
        if acc >= rank and c:
            ub = BUCKET_UPPER_MS[min(i, len(BUCKET_UPPER_MS) - 1)]
            if ub == float("inf"):
                ub = BUCKET_UPPER_MS[-2]
            return ub / 1000.0
    return None


def _add(into: list[int], counts: list[int]) -> None:
    if len(into) < len(counts):
        into.extend([0] * (len(counts) - len(into)))
    for i, v in enumerate(counts):
        into[i] += v


class LimitsManager:
    def __init__(self, ctl: SlotControl, channel: WorkerChannel) -> None:
        self.ctl = ctl
        self.channel = channel
        now = time.monotonic()
        nodes = sorted({s.plan.node for s in ctl.slots.values()})
        self.loops = {n: LimitsLoop(ctl.cfg.limits, now) for n in nodes}
        self.current: dict[int, SlotLimits] = {}
        self.epochs: dict[int, int] = {}
        self.acked: dict[int, int | None] = {}   # epoch each slot's worker acknowledged
        # (slot, generation) -> (args, when) of the last periodic push: the same limits are
        # re-sent only to renew the lease (``renew_due``), not every loop interval
        self._pushed: dict[tuple[int, int], tuple[dict[str, Any], float]] = {}
        self.reasons: dict[int, str] = {}
        self.last_decision: dict[int, dict[str, Any]] = {}
        self._prev: dict[tuple[int, int], dict[str, Any]] = {}
        self._last_tick: dict[int, float] = {}

    @property
    def mode(self) -> str:
        return self.ctl.cfg.limits.mode

    # ----------------------------------------------------------------- window

    def _worker_window(self, slot: SlotState, w: WorkerProc) -> tuple[WorkerWindow, dict[str, Any]] | None:
        st = w.stats
        if st is None or not isinstance(st.extra, dict):
            return None
        gate = st.extra.get("admission")
        if not isinstance(gate, dict):
            return None
        cur: dict[str, Any] = {
            "admitted": int(gate.get("admitted", 0)),
            "rejected": sum(int(v) for v in (gate.get("shed") or {}).values()),
            "completed": int(gate.get("ok", 0)),
            "buckets": list(st.extra.get("latency_buckets") or []),
            "sum_ms": float(st.extra.get("latency_sum_ms", 0.0)),
            "count": int(st.extra.get("latency_count", 0)),
        }
        for name in ("delay", "lag"):  # server-side delay signals of the "cpu" limiter
            cur[f"{name}_buckets"] = list(gate.get(f"{name}_buckets") or [])
            cur[f"{name}_sum_ms"] = float(gate.get(f"{name}_sum_ms") or 0.0)
            cur[f"{name}_count"] = int(gate.get(f"{name}_count") or 0)
        key = (slot.plan.slot, w.generation)
        prev = self._prev.get(key) or {}
        self._prev[key] = cur
        delta: dict[str, Any] = {}
        for k, v in cur.items():
            if isinstance(v, list):
                pv = prev.get(k) or []
                if v == pv:   # an idle worker: nothing new in any bucket (compared in C, not per bucket)
                    delta[k] = [0] * len(v)
                    continue
                pb = list(pv) + [0] * max(0, len(v) - len(pv))
                delta[k] = [max(0, a - b) for a, b in zip(v, pb)]
            else:
                delta[k] = v - prev.get(k, 0)
        ww = WorkerWindow(
            slot=slot.plan.slot,
            l1_limit=gate.get("l1_limit"),
            max_inflight=int(gate.get("max_inflight", 0)),
            queued=int(gate.get("queued", 0)),
            arrivals=max(0, delta["admitted"] + delta["rejected"]),
            admitted=max(0, delta["admitted"]),
            codel_overloaded=bool(gate.get("codel_overloaded", False)),
            probing=bool(gate.get("probing", False)),
        )
        return ww, delta

    def _node_window(self, node: int, now: float) -> NodeWindow:
        workers: list[WorkerWindow] = []
        merged: list[int] = []
        hists: dict[str, list[int]] = {"delay": [], "lag": []}
        sums: dict[str, float] = {"delay": 0.0, "lag": 0.0}
        counts: dict[str, int] = {"delay": 0, "lag": 0}
        completed = admitted = count = 0
        sum_ms = 0.0
        for slot in self.ctl.slots.values():
            if slot.plan.node != node or slot.worker is None:
                continue
            got = self._worker_window(slot, slot.worker)
            if got is None:
                continue
            ww, d = got
            workers.append(ww)
            completed += max(0, d["completed"])
            admitted += max(0, d["admitted"])
            count += max(0, d["count"])
            sum_ms += max(0.0, d["sum_ms"])
            if len(merged) < len(d["buckets"]):
                merged.extend([0] * (len(d["buckets"]) - len(merged)))
            for i, v in enumerate(d["buckets"]):
                merged[i] += v
            for name, h in hists.items():
                _add(h, d[f"{name}_buckets"])
                sums[name] += max(0.0, d[f"{name}_sum_ms"])
                counts[name] += max(0, d[f"{name}_count"])
        first = next((i for i, c in enumerate(merged) if c), None)
        p90s = [q for q in (bucket_quantile(hists["delay"], 0.9), bucket_quantile(hists["lag"], 0.9)) if q is not None]
        means = [sums[n] / counts[n] / 1000.0 for n in ("delay", "lag") if counts[n]]
        d_first = next((i for i, c in enumerate(hists["delay"]) if c), None)
        return NodeWindow(
            duration_s=max(0.001, now - self._last_tick.get(node, now - self.ctl.cfg.limits.interval_s)),
            completed=completed,
            admitted=admitted,
            p90_total_s=bucket_quantile(merged, 0.9),
            mean_total_s=(sum_ms / count / 1000.0) if count else None,
            min_total_s=(BUCKET_UPPER_MS[first - 1] / 1000.0 if first else 0.0) if first is not None else None,
            p90_delay_s=max(p90s) if p90s else None,
            mean_delay_s=sum(means) if means else None,
            min_delay_s=(BUCKET_UPPER_MS[d_first - 1] / 1000.0 if d_first else 0.0) if d_first is not None else None,
            workers=workers,
        )

    # ------------------------------------------------------------------- loop

    def tick(self, now: float) -> None:
        if self.mode == "off" or self.ctl.stopping:
            return
        for node, loop in self.loops.items():
            if not loop.due(now):
                continue
            window = self._node_window(node, now)
            self._last_tick[node] = now
            if not window.workers:
                continue
            decision = loop.update(now, window)
            if decision is not None:
                self._apply(node, decision)

    def _apply(self, node: int, d: LimitsDecision, *, push: bool = True) -> list[int]:
        if d.changed:
            log.info(
                "limits",
                node=node, epoch=d.epoch, mode=d.mode, source=d.source, reason=d.reason,
                node_budget=d.node_budget, node_rate=d.node_rate,
                slots={s.slot: {"concurrency": s.concurrency, "rate": s.rate} for s in d.slots},
            )
        self.last_decision[node] = {"epoch": d.epoch, "source": d.source, "reason": d.reason,
                                    "node_budget": d.node_budget, "node_rate": d.node_rate, "slo_cap": d.slo_cap}
        for s in d.slots:
            self.current[s.slot] = s
            self.epochs[s.slot] = d.epoch
            self.reasons[s.slot] = s.reason or d.reason or d.source
            if push:
                self.push(s.slot)
        return [s.slot for s in d.slots]

    async def push_acked(self, slots: list[int], timeout: float = 5.0) -> dict[str, Any]:
        """Push the slots' current limits to their workers at once and wait for every Ack.

        The operator's ``ratelimit set`` returns when each worker has applied
        the new epoch (or says which did not answer), not a stats report later.
        """
        waits: list[tuple[int, Any, dict[str, Any]]] = []
        for slot in slots:
            args = self.args_for(slot)
            st = self.ctl.slots.get(slot)
            if args is None or st is None:
                continue
            for w in (st.worker, st.incoming):
                if w is not None and w.identity is not None and not w.external and w.popen.poll() is None:
                    waits.append((slot, w, args))
                    self._pushed[(slot, w.generation)] = (args, time.monotonic())
        results = await self.channel.command_each(waits, "set_limits", timeout=timeout) if waits else []
        out: dict[str, Any] = {}
        for (slot, w, _), res in zip(waits, results):
            key = str(slot) if w is self.ctl.slots[slot].worker else f"{slot}/incoming"
            out[key] = {"pid": w.pid, "epoch": self.epochs.get(slot), **res}
            if res.get("ok") and w is self.ctl.slots[slot].worker:
                self.acked[slot] = self.epochs.get(slot)
        return out

    def args_for(self, slot: int) -> dict[str, Any] | None:
        s = self.current.get(slot)
        if s is None:
            return None
        return {"epoch": self.epochs[slot], "concurrency": s.concurrency, "rate": s.rate, "burst": s.burst,
                "lease_s": s.lease_s, "safe_concurrency": s.safe_concurrency}

    def push(self, slot: int) -> None:
        """The slot's limits to its workers: at once when they changed, else only to renew the lease.

        The loop decides every ``interval_s`` (3 s) and mostly decides the
        same; re-sending unchanged limits then cost 32 Commands and 32 Acks
        (and 32 worker wake-ups) per interval for nothing but the lease.
        """
        args = self.args_for(slot)
        st = self.ctl.slots.get(slot)
        if args is None or st is None:
            return
        now = time.monotonic()
        for w in (st.worker, st.incoming):
            if w is None:
                continue
            key = (slot, w.generation)
            last = self._pushed.get(key)
            if last is not None and not renew_due(last[0], args, last[1], now):
                continue
            self._pushed[key] = (args, now)
            self.channel.send_command(w, "set_limits", args)
        if len(self._pushed) > 4 * max(1, len(self.ctl.slots)):   # generations come and go
            live = {(n, w.generation) for n, sl in self.ctl.slots.items() for w in sl.workers()}
            self._pushed = {k: v for k, v in self._pushed.items() if k in live}

    def on_hello(self, slot: SlotState, w: WorkerProc) -> None:
        """A new worker starts at its slot's current epoch."""
        args = self.args_for(slot.plan.slot)
        if args is not None:
            self._pushed[(slot.plan.slot, w.generation)] = (args, time.monotonic())
            self.channel.send_command(w, "set_limits", args)

    # --------------------------------------------------------------- operator

    def override(self, slots: list[int], node: int | None, concurrency: int | None, rate: float | None, *,
                 push: bool = True) -> list[int]:
        """Operator override; returns the slots whose limits were recomputed (to ``push_acked``)."""
        now = time.monotonic()
        if node is not None:
            return self._apply(node, self.loops[node].override(now, slot=None, concurrency=concurrency, rate=rate,
                                                               slots=self._slots_of(node)), push=push)
        touched: set[int] = set()
        for s in slots:
            n = self.ctl.slots[s].plan.node
            touched.update(self._apply(n, self.loops[n].override(now, slot=s, concurrency=concurrency, rate=rate,
                                                                 slots=self._slots_of(n)), push=push))
        return sorted(touched)

    def _slots_of(self, node: int) -> list[int]:
        return [s.plan.slot for s in self.ctl.slots.values() if s.plan.node == node]

    def auto(self, slots: list[int] | None, node: int | None, *, push: bool = True) -> list[int]:
        now = time.monotonic()
        touched: set[int] = set()
        if slots is None and node is None:
            for n, loop in self.loops.items():
                touched.update(self._apply(n, loop.clear_override(now, everything=True, slots=self._slots_of(n)),
                                           push=push))
        elif node is not None:
            touched.update(self._apply(node, self.loops[node].clear_override(now, slot=None,
                                                                             slots=self._slots_of(node)), push=push))
        else:
            for s in slots or []:
                n = self.ctl.slots[s].plan.node
                touched.update(self._apply(n, self.loops[n].clear_override(now, slot=s, slots=self._slots_of(n)),
                                           push=push))
        return sorted(touched)

    def status(self, slot: SlotState) -> dict[str, Any]:
        s = self.current.get(slot.plan.slot)
        w = slot.worker
        gate = w.stats.extra.get("admission") if w and w.stats and isinstance(w.stats.extra, dict) else None
        return {
            "mode": self.mode,
            "concurrency": s.concurrency if s else None,
            "rate": round(s.rate, 3) if s and s.rate is not None else None,
            "burst": round(s.burst, 3) if s and s.burst is not None else None,
            "epoch": self.epochs.get(slot.plan.slot),
            "applied_epoch": max((e for e in (gate.get("epoch") if isinstance(gate, dict) else None,
                                             self.acked.get(slot.plan.slot)) if e is not None), default=None),
            "source": s.source if s else None,
            "reason": self.reasons.get(slot.plan.slot),
            "effective_limit": gate.get("limit") if isinstance(gate, dict) else None,
            "gate": _gate_summary(gate) if isinstance(gate, dict) else None,
        }


def _gate_summary(gate: dict[str, Any]) -> dict[str, Any]:
    """What the worker's gate is doing now (status, ``ratelimit show``): the CPU signals and sheds."""
    keys = ("inflight", "max_inflight", "lag_s", "lag_max_s", "short_of_cpu", "overloaded", "shedding",
            "other_threads_cpu", "request_cpu_s",
            "client_gone", "shed", "sentinel")
    return {k: gate[k] for k in keys if k in gate}


def renew_due(sent: dict[str, Any], args: dict[str, Any], sent_at: float, now: float) -> bool:
    """Whether limits ``args`` must be pushed, ``sent`` having gone out at ``sent_at``.

    Changed limits go at once; the same ones when half their lease is gone,
    so a lost push is retried (next loop interval) well before the lease ends.
    """
    if args != sent:
        return True
    lease = args.get("lease_s")
    return not isinstance(lease, (int, float)) or now - sent_at >= lease / 2.0
