"""A slot at its open-file limit is steered around until it recovers (issue 34, item 4; real sockets).

Before: with slot 0 at 64/64 fds and slot 1 at 22/64, 21 of 40 new requests
failed although ``status`` already said ``degraded (fd limit)``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
from pathlib import Path

import pytest

from tests.integration.harness import FAST_CONFIG, Running, two_pretend_nodes

pytestmark = pytest.mark.slow

NOFILE = 128
# idle keep-alive connections are what fills slot 0: they must not be closed under the test
KEEP = FAST_CONFIG.replace("keepalive_timeout = 2.0", "keepalive_timeout = 600.0")


def _node_of(conn: http.client.HTTPConnection) -> int | None:
    """One request on a kept-alive connection: the node that served it (None: refused / reset)."""
    try:
        conn.request("GET", "/")
        r = conn.getresponse()
        body = r.read()
        return json.loads(body)["node"] if r.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None


def _limited(st: dict) -> bool:
    return any(s["slot"] == 0 and s.get("condition") == "degraded (fd limit)" for s in st["slots"])


def test_new_connections_avoid_a_slot_at_its_fd_limit(tmp_path: Path) -> None:
    declared, _ = two_pretend_nodes(tmp_path)
    with Running(["--declared", str(declared), "--steering", "hash", "--bind", "127.0.0.1:0"], config=KEEP,
                 nofile=NOFILE) as sup:
        held: list[http.client.HTTPConnection] = []
        try:
            # fill slot 0 (node 0) with idle keep-alive connections; close whatever lands on node 1
            for _ in range(4 * NOFILE):
                c = http.client.HTTPConnection("127.0.0.1", sup.port, timeout=10)
                node = _node_of(c)
                if node == 0:
                    held.append(c)
                else:
                    c.close()
                if len(held) % 16 == 0 and held and _limited(sup.status()):
                    break
            st = sup.wait_for(_limited, 30, "slot 0 degraded (fd limit)")
            failed = 0
            for _ in range(40):
                c = http.client.HTTPConnection("127.0.0.1", sup.port, timeout=10)
                try:
                    c.request("GET", "/", headers={"Connection": "close"})
                    r = c.getresponse()
                    r.read()
                    failed += r.status != 200
                except (OSError, http.client.HTTPException):
                    failed += 1
                finally:
                    c.close()
            assert failed == 0, (failed, [s.get("fds") for s in st["slots"]])
        finally:
            for c in held:
                with contextlib.suppress(OSError):
                    c.close()
        # recovered: the slot's fds are free again and it is steered to once more
        sup.wait_for(lambda st: not _limited(st), 60, "slot 0 recovered")
