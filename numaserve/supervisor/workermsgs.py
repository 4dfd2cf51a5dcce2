"""What a worker's control message means: authenticated, then applied to its slot.

The channel (``channel.py``) only moves frames; this is its message callback.
Hello must carry the spawn token and come from the spawned pid (SO_PEERCRED);
later messages must come on the identity that said Hello, from that pid.
Anything else is counted (``bad_messages``, ``rejected`` per slot) and
dropped; nothing here signals a pid a message names.
"""

from __future__ import annotations

import time
from typing import Callable

import structlog

from numaserve.control import messages as m
from numaserve.control.checks import heartbeat_problem, stats_problem
from numaserve.control.peercred import PeerCred
from numaserve.supervisor import slots as S
from numaserve.control import workerauth
from numaserve.supervisor.channel import WorkerChannel
from numaserve.supervisor.slottable import SlotTable

__all__ = ["WorkerMessageHandler"]

log = structlog.get_logger("numaserve.supervisor")


class WorkerMessageHandler:
    def __init__(self, table: SlotTable, channel: WorkerChannel, *,
                 on_hello: Callable[[S.SlotState, S.WorkerProc], None]) -> None:
        self.table = table
        self.channel = channel
        self.on_hello = on_hello          # a new worker starts at its slot's current limits
        self.bad_messages = 0
        self.rejected: dict[int, int] = {}        # per slot: control messages refused (forged/unverified)
        self._reject_logged: dict[tuple[int, str], float] = {}

    def count_bad(self, channel: str, why: str) -> None:
        """A malformed, unknown or refused message: counted (status: bad_messages) and dropped."""
        self.bad_messages += 1
        log.debug("bad_message", channel=channel, reason=why, total=self.bad_messages)

    def _reject(self, slot: S.SlotState, why: str, peer: PeerCred | None) -> None:
        """A message for ``slot`` that its worker did not send: count, drop, say so (rate-limited)."""
        self.count_bad("control", why)
        n = slot.plan.slot
        self.rejected[n] = self.rejected.get(n, 0) + 1
        now = time.monotonic()
        key = (n, why.split(":")[0][:40])
        if now - self._reject_logged.get(key, -1e9) >= 10.0:
            self._reject_logged[key] = now
            log.warning("control_message_refused", slot=n, reason=why, sender=peer.to_json() if peer else None,
                        refused_for_slot=self.rejected[n])

    def _take_stats(self, w: S.WorkerProc, msg: m.Stats) -> bool:
        problem = stats_problem(msg)
        if problem:
            self.count_bad("control", f"stats: {problem}")
            return False
        w.stats = msg
        if msg.rss_bytes:
            w.rss_bytes = msg.rss_bytes
        return True

    def handle_worker_msg(self, identity: bytes, msg: m.WorkerToSupervisor, peer: PeerCred | None = None) -> None:
        """Apply a worker's message, if it comes from the process spawned for its slot/generation.

        Hello must carry the spawn token and come from the spawned pid (SO_PEERCRED);
        later messages must come on the identity that said Hello, from that pid.
        Anything else is counted and dropped; nothing here signals a pid a message names.
        """
        slot = self.table.slots.get(msg.slot)
        w = slot.find(msg.generation) if slot is not None else None
        if slot is None or w is None:
            self.count_bad("control", f"message for unknown slot/generation {msg.slot}/{msg.generation}")
            return
        now = time.monotonic()
        if isinstance(msg, m.Hello):
            why = workerauth.check_hello(msg, expected_pid=w.pid, expected_token=w.token, peer=peer)
            if why:
                self._reject(slot, f"hello refused: {why}", peer)
                return
            if msg.protocol != m.PROTOCOL:
                reason = f"control protocol {msg.protocol}, the supervisor speaks {m.PROTOCOL}"
                self._reject(slot, f"hello refused: {reason}", peer)
                if peer is not None or w.token is not None:
                    # proven to be the process we spawned (kernel pid or token): end it with the reason,
                    # rather than let it hang until the ready timeout
                    self.table.refuse(w, reason)
                return
            w.identity = identity
            w.hello = now
            w.last_beat = now
            w.placement = msg.placement
            if msg.placement is not None and not msg.placement.ok:
                log.error("worker_binding_problem", slot=slot.plan.slot, problems=msg.placement.problems)
            self.table.wake.set()
            if self.table.stopping and w.stop_sent is None:
                self.table.send_stop(slot, w, now, self.table.cfg.server.graceful_timeout, drain=False)
                return
            self.on_hello(slot, w)
            self.channel.replay_sticky(w)
            return
        if w.identity is None or identity != w.identity:
            self._reject(slot, f"{type(msg).__name__} before hello or from another identity", peer)
            return
        why = workerauth.check_sender(w.pid, peer)
        if why:
            self._reject(slot, f"{type(msg).__name__} {why}", peer)
            return
        if isinstance(msg, m.Heartbeat):
            problem = heartbeat_problem(msg)
            if problem:
                self.count_bad("control", f"heartbeat: {problem}")
                return
            w.last_beat = now
            w.loop_lag = msg.loop_lag
            if msg.stats is not None:   # stats riding on the beat: the beat stands even if they are refused
                if (msg.stats.slot, msg.stats.generation) != (msg.slot, msg.generation):
                    self.count_bad("control", f"heartbeat: stats for {msg.stats.slot}/{msg.stats.generation} "
                                              f"on a beat of {msg.slot}/{msg.generation}")
                else:
                    self._take_stats(w, msg.stats)
            return
        if isinstance(msg, m.Stats):
            if self._take_stats(w, msg):
                w.last_beat = now
            return
        w.last_beat = now
        if isinstance(msg, m.Ready):
            self.table.on_ready(slot, w, now)
            self.table.wake.set()
        elif isinstance(msg, m.Goodbye):
            w.goodbye = msg.reason[:500]
            log.info("goodbye", slot=slot.plan.slot, pid=w.pid, reason=w.goodbye)
            self.table.wake.set()
        elif isinstance(msg, m.Ack):
            log.debug("ack", slot=slot.plan.slot, ref=msg.ref, ok=msg.ok, detail=msg.detail)
            self.channel.resolve(msg)
