"""``server.takeover``: start beside another owner of the port, on purpose.

An upgrade can start the new supervisor while the old one still serves: the
new listeners join the old ones' SO_REUSEPORT groups (same user) and the
kernel spreads new connections over both.  While another owner's sockets are
in a group, this supervisor attaches no program to it (group positions are
not its own, and the program belongs to the whole group: it would replace
the other owner's).  Once they are gone, our sockets sit at positions that
depend on the order the others closed (the last member moves into each
hole), so the positions are *measured*: a probe pinned to position j is
accepted by some worker, and the kernel says which (``supervisor.probe``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Callable

from numaserve.net.listeners import Listener, ListenerSet
from numaserve.net.sockdiag import TcpSocket, find_connection, listening_sockets
from numaserve.net.steering import attach_reuseport_cbpf, build_selection_program
from numaserve.supervisor.rescue import connect_address

__all__ = ["group_peers", "discover_positions"]


def group_peers(listeners: ListenerSet) -> list[TcpSocket]:
    """Foreign listeners in our groups (exactly our address and port, not our sockets)."""
    mine = listeners.inodes()
    ours = {(lst.family, lst.host, lst.port) for lst in listeners.all()}
    out = []
    for port in sorted({p for _, _, p in ours}):
        out.extend(s for s in listening_sockets(port)
                   if (s.family, s.local, s.local_port) in ours and s.inode not in mine)
    return out


async def discover_positions(first: Listener, size: int, slot_of_pid: Callable[[int], int | None], *,
                             timeout: float = 1.0) -> dict[int, int] | None:
    """slot -> group position for the group of ``first``, measured; None when incomplete.

    One probe per position, each pinned by its source port; a position no
    worker accepts for (a slot restarting right now) is inferred when it is
    the only one left.
    """
    loop = asyncio.get_running_loop()
    host, port = connect_address(first)
    found: dict[int, int] = {}
    unknown: list[int] = []
    for j in range(size):
        s = socket.socket(first.family, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((host, 0))
            sport = s.getsockname()[1]
            prog = build_selection_program(healthy=list(range(size)), group_size=size,
                                           ipv6=first.family == socket.AF_INET6, probes={sport: j})
            assert prog is not None
            attach_reuseport_cbpf(first.sock, prog)
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), timeout)
            deadline = time.monotonic() + timeout
            slot = None
            while time.monotonic() < deadline and slot is None:
                srv = find_connection(first.family, host, port, host, sport)
                if srv is not None and srv.inode:
                    from numaserve.net.portowners import owners

                    for o in owners([srv.inode]).get(srv.inode, []):
                        slot = slot_of_pid(o.pid)
                        if slot is not None:
                            break
                    break
                await asyncio.sleep(0.02)
            if slot is None or slot in found:
                unknown.append(j)
            else:
                found[slot] = j
        except (OSError, asyncio.TimeoutError):
            unknown.append(j)
        finally:
            s.close()
    missing = [sl for sl in range(size) if sl not in found]
    if len(unknown) == 1 and len(missing) == 1:
        found[missing[0]] = unknown[0]
    return found if len(found) == size else None

